"""Drop-in compatibility with the Hermes agent's batch runner, as its users call it: what SPEC.md promises
a command line, a run directory and a row of the reference hold, checked against the real program."""

from __future__ import annotations

import inspect

from conftest import read_jsonl, run_cli, write_dataset
from scripted_endpoint import ScriptedEndpoint

import batch_runner

# The reference runner's `main(...)` parameters in its order: the places fire gives words without a flag.
REFERENCE_PLACES = ("dataset_file", "batch_size", "run_name", "distribution", "model", "api_key", "base_url",
                    "max_turns", "num_workers", "resume", "verbose", "list_distributions", "ephemeral_system_prompt",
                    "log_prefix_chars", "providers_allowed", "providers_ignored", "providers_order", "provider_sort",
                    "max_tokens", "reasoning_effort", "reasoning_disabled", "prefill_messages_file", "max_samples")


def test_main_takes_the_reference_runners_flags_by_place_in_its_order() -> None:
    places = list(inspect.signature(batch_runner.main).parameters)[:len(REFERENCE_PLACES)]
    assert tuple(places) == REFERENCE_PLACES


def test_a_key_and_url_given_by_place_as_the_reference_takes_them_reach_the_endpoint(tmp_path) -> None:
    key = "sk-compat-0123456789abcdef"
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["q"])
    with ScriptedEndpoint(api_key=key) as endpoint:
        result = run_cli(tmp_path, str(dataset), "2", "run", "terminal_only", "scripted-model", key, endpoint.base_url)
        assert result.returncode == 0, result.stderr
        assert endpoint.requests
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 1
    assert key not in result.stdout + result.stderr
