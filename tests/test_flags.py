"""The flag table (batchrun/flags.py) is the one declaration of the command line: main's signature, the
--help page, the reference page and the run's config all follow it, and a flag the table declares is never
dropped on its way to the config."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, made_a_fifo_once_checked

import batch_runner
from batchrun import flags
from batchrun.config import LIMIT_LEAST, build_config
from batchrun.flag_values import UsageError, load_prefill

# A valid value other than the default for every flag a run reads. A new flag without one here fails
# test_every_flag_a_run_reads_is_declared_with_a_value_to_try.
OTHER_VALUES: dict[str, Any] = {
    "dataset_file": "other.jsonl", "batch_size": 7, "run_name": "other", "distribution": "minimal",
    "model": "other-model", "base_url": "http://127.0.0.1:9/v2", "api_key": "sk-other", "max_turns": 3,
    "num_workers": 9, "resume": True, "verbose": True, "max_samples": 5, "max_tokens": 100,
    "providers_allowed": "a", "providers_ignored": "b", "providers_order": "c", "provider_sort": "price",
    "reasoning_effort": "low", "reasoning_disabled": True, "ephemeral_system_prompt": "be brief",
    "log_prefix_chars": 5, "prefill_messages_file": "PREFILL", "seed": 3, "discard_no_reasoning": False,
    "rerun_corrupted": True, "max_retries": 2, "request_timeout": 5, "prompt_timeout": 5, "tool_timeout": 5,
    "command_timeout": 5, "keep_workdirs": True, "requests_per_minute": 60, "max_cost": 1.0,
    "max_total_tokens": 1000, "backend": "ray", "adaptive_concurrency": False, "samples_per_prompt": 2,
    "price_per_mtok": "3,4", "estimate": 5,
}
BASE = {"dataset_file": "d.jsonl", "batch_size": 1, "run_name": "r", "base_url": "http://127.0.0.1:9/v1",
        "api_key": "sk-test", "price_per_mtok": "1,2"}


def documented_flags(path: Path) -> list[str]:
    """The flags a page's flag table names, in its order (a row may name several)."""
    found: list[str] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("| `--"):
            first_cell = line.split("|")[1]
            found += re.findall(r"`--([a-z_]+)`", first_cell)
    return found


def test_main_takes_every_flag_of_the_table_in_its_order_with_its_default() -> None:
    parameters = inspect.signature(batch_runner.main).parameters
    assert [name for name in parameters if name != "unknown_flags"] == list(flags.NAMES)
    assert all(parameters[flag.name].default == flag.default for flag in flags.FLAGS)


def test_the_reference_page_lists_every_flag_and_no_other() -> None:
    listed = documented_flags(REPO / "docs" / "command-line.md")
    assert set(listed) == set(flags.NAMES)


def test_the_readme_names_only_flags_that_exist() -> None:
    listed = documented_flags(REPO / "README.md")
    assert listed and set(listed) <= set(flags.NAMES)


def test_a_number_default_on_the_reference_page_is_the_tables() -> None:
    for line in (REPO / "docs" / "command-line.md").read_text(encoding="utf-8").splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        names = re.findall(r"`--([a-z_]+)`", cells[1]) if line.startswith("| `--") else []
        if len(names) == 1 and re.fullmatch(r"\d+", cells[2]):
            assert flags.BY_NAME[names[0]].default == int(cells[2]), names[0]


def test_the_help_page_shows_every_flag_the_table_puts_on_it() -> None:
    choices = {"formats": "a|b", "kinds": "x|y", "reasoning_modes": "r|s", "best_of_rules": "b|c"}
    page = flags.help_page(program="batch_runner", choices=choices)
    for flag in flags.FLAGS:
        if flag.usage:
            assert flag.usage.format(**choices) in page, flag.name
    assert all(len(line) <= 110 for line in page.splitlines())


def test_the_help_page_shows_each_flag_with_a_usage_line_once() -> None:
    shown = [name for _, names in flags.HELP_PAGE for name in names]
    assert sorted(shown) == sorted(flag.name for flag in flags.FLAGS if flag.usage)


def test_every_flag_a_run_reads_is_declared_with_a_value_to_try() -> None:
    assert set(OTHER_VALUES) == {flag.name for flag in flags.FLAGS if flag.parse is not None}


@pytest.mark.parametrize("name", sorted(OTHER_VALUES))
def test_every_flag_a_run_reads_changes_its_config(name: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if name == "backend" and importlib.util.find_spec("ray") is None:
        pytest.skip("--backend=ray needs the ray extra")
    monkeypatch.setenv("TERMINAL_ENV", "local")
    prefill = tmp_path / "prefill.json"
    prefill.write_text('[{"role": "user", "content": "hi"}]', encoding="utf-8")
    value = str(prefill) if OTHER_VALUES[name] == "PREFILL" else OTHER_VALUES[name]
    assert dataclasses.asdict(build_config(**{**BASE, name: value})) != dataclasses.asdict(build_config(**BASE))


def test_a_flag_the_table_does_not_declare_is_refused_not_dropped() -> None:
    with pytest.raises(UsageError, match="--max_turnz"):
        build_config(**BASE, max_turnz=3)


def test_export_options_are_the_tables_export_only_flags() -> None:
    assert flags.EXPORT_OPTIONS[0] == "export"
    assert set(flags.EXPORT_OPTIONS[1:]) == {flag.name for flag in flags.FLAGS if flag.export_only}
    assert flags.options_set_without_export({"min_tool_calls": 2}) == ["min_tool_calls"]
    assert flags.options_set_without_export({"min_tool_calls": 0}) == []


def test_a_python_caller_passes_flags_by_name_as_the_signature_says(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def recorded(given: dict[str, Any], unknown: dict[str, Any]) -> int:
        seen.update(given=given, unknown=unknown)
        return 0

    monkeypatch.setattr(batch_runner, "run_cli", recorded)
    monkeypatch.setattr(batch_runner, "exit_without_teardown", lambda code: None)
    monkeypatch.setattr("sys.argv", ["batch_runner.py"])
    batch_runner.main("d.jsonl", 3, run_name="r", max_turnz=1)
    assert seen["given"] == {**flags.defaults(), "dataset_file": "d.jsonl", "batch_size": 3, "run_name": "r"}
    assert seen["unknown"] == {"max_turnz": 1}


# A host that merely ends in "openrouter.ai" (notopenrouter.ai) was taken for OpenRouter and sent its key.
@pytest.mark.parametrize("base_url", ["https://notopenrouter.ai/v1", "https://openrouter.ai.example.com/v1"])
def test_the_openrouter_key_goes_to_no_other_host(monkeypatch: pytest.MonkeyPatch, base_url: str) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or-secret")
    monkeypatch.setenv("TERMINAL_ENV", "local")
    config = build_config(**{**BASE, "api_key": None, "base_url": base_url})
    assert config.endpoint.api_key == "no-key"
    assert "usage" not in config.endpoint.extra_body


def test_the_openrouter_key_goes_to_openrouter_and_its_subdomains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or-secret")
    monkeypatch.setenv("TERMINAL_ENV", "local")
    for base_url in ("https://openrouter.ai/api/v1", "https://eu.OpenRouter.ai/api/v1"):
        assert build_config(**{**BASE, "api_key": None, "base_url": base_url}).endpoint.api_key == "sk-or-secret"


# "y", "enable" or "2" read as no: the network stayed closed, or the address refused, without a word.
@pytest.mark.parametrize("name", ["TERMINAL_ALLOW_NETWORK", "WEB_ALLOW_PRIVATE", "WEB_ALLOW_LINK_LOCAL"])
def test_a_switch_variable_that_is_neither_yes_nor_no_is_one_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                                         name: str) -> None:
    monkeypatch.setenv("TERMINAL_ENV", "local")
    monkeypatch.setenv(name, "y")
    with pytest.raises(UsageError, match=f"{name} is a switch: 1 to allow, 0 or unset not to; got 'y'"):
        build_config(**BASE)


@pytest.mark.parametrize("value", ["1", "TRUE", "yes", "on", "0", "False", "no", "OFF", " "])
def test_a_switch_variable_takes_the_usual_words_for_yes_and_no(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("TERMINAL_ENV", "local")
    monkeypatch.setenv("TERMINAL_ALLOW_NETWORK", value)
    assert build_config(**BASE).environment.allow_network is (value.strip().lower() in ("1", "true", "yes", "on"))


# Read as the HTTP client reads them: a lower-case variable over its upper-case one, a blank one unsetting it.
@pytest.mark.parametrize(("variables", "refused"), [
    ({"HTTP_PROXY": "ftp://proxy.example"}, "HTTP_PROXY"),
    ({"HTTP_PROXY": "ftp://proxy.example", "http_proxy": "http://proxy.example:3128"}, None),
    ({"HTTP_PROXY": "ftp://proxy.example", "http_proxy": ""}, None),
    ({"HTTP_PROXY": "http://proxy.example:3128", "http_proxy": "ftp://proxy.example"}, "http_proxy"),
    ({"ALL_PROXY": "proxy.example:3128"}, None),                 # no scheme: an http:// proxy
    ({"ALL_PROXY": "socks5://proxy.example:1080"}, None),
    ({"FTP_PROXY": "ftp://proxy.example"}, None),                # not read by the client
], ids=["upper", "lower-over-upper", "blank-lower-unsets", "lower-bad", "no-scheme", "socks5", "not-read"])
def test_only_a_proxy_variable_the_client_reads_is_checked(monkeypatch: pytest.MonkeyPatch,
                                                             variables: dict[str, str], refused: str | None) -> None:
    monkeypatch.setenv("TERMINAL_ENV", "local")
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    if refused is None:
        build_config(**BASE)
    else:
        with pytest.raises(UsageError, match=f"the proxy variable {refused} is not a proxy URL"):
            build_config(**BASE)


# A container engine read it as one of its options: every prompt's container failed to start, each a
# failure row that every --resume ran again.
def test_a_default_image_that_starts_with_a_dash_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERMINAL_ENV", "local")
    monkeypatch.setenv("TERMINAL_DEFAULT_IMAGE", "--privileged")
    with pytest.raises(UsageError, match="TERMINAL_DEFAULT_IMAGE must name an image; got '--privileged'"):
        build_config(**BASE)


def test_a_bad_limit_variable_is_named_before_the_missing_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OPENROUTER_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TERMINAL_ENV", "local")
    monkeypatch.setenv("TERMINAL_MEMORY_MB", "abc")
    with pytest.raises(UsageError, match="TERMINAL_MEMORY_MB must be a whole number from 16 to "):
        build_config(dataset_file="d.jsonl", batch_size=1, run_name="r")


@pytest.mark.parametrize("raw", ["²", "¹²"])
def test_a_limit_variable_of_digits_that_are_not_decimal_is_one_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                                          raw: str) -> None:
    monkeypatch.setenv("TERMINAL_ENV", "local")
    monkeypatch.setenv("TERMINAL_TMP_MB", raw)
    with pytest.raises(UsageError, match="TERMINAL_TMP_MB must be a whole number from 1 to "):
        build_config(**BASE)


@pytest.mark.parametrize(("name", "raw", "most"), [("TERMINAL_TMP_MB", "99999999999999999999999999", "8796093022207"),
                                                   ("TERMINAL_WORKSPACE_MB", "8796093022208", "8796093022207"),
                                                   ("TERMINAL_MAX_PROCESSES", "4194305", "4194304")])
def test_a_limit_variable_beyond_what_the_kernel_can_hold_is_one_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                                           name: str, raw: str, most: str) -> None:
    monkeypatch.setenv("TERMINAL_ENV", "local")
    monkeypatch.setenv(name, raw)
    with pytest.raises(UsageError, match=f"{name} must be a whole number from {LIMIT_LEAST[name]} to {most}, "
                                         f"got '{raw}'"):
        build_config(**BASE)


@pytest.mark.parametrize(("name", "raw", "least"), [("TERMINAL_MAX_PROCESSES", "7", 8), ("TERMINAL_MEMORY_MB", "15", 16),
                                                    ("TERMINAL_TMP_MB", "0", 1)])
def test_a_limit_variable_below_what_a_sandbox_needs_to_start_is_one_clear_error(monkeypatch: pytest.MonkeyPatch,
                                                                                name: str, raw: str, least: int) -> None:
    # A sandbox starts inside its prompt's limits: under 4 processes none started, and every prompt failed.
    monkeypatch.setenv("TERMINAL_ENV", "local")
    monkeypatch.setenv(name, raw)
    with pytest.raises(UsageError, match=f"{name} must be a whole number from {least} to "):
        build_config(**BASE)


def test_a_limit_variable_at_the_most_the_kernel_can_hold_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERMINAL_ENV", "local")
    monkeypatch.setenv("TERMINAL_MEMORY_MB", "8796093022207")
    monkeypatch.setenv("TERMINAL_MAX_PROCESSES", "4194304")
    limits = build_config(**BASE).environment.limits
    assert (limits.memory_mb, limits.processes) == (8796093022207, 4194304)


# The prefill file is read whole once it is known to be a regular file; one made a FIFO after it was looked at
# was opened, and waited on for a writer for ever. Its last look before the open is whether it exists.
@pytest.mark.timeout(10)
def test_a_prefill_file_made_a_fifo_after_it_was_looked_at_is_never_waited_on(tmp_path, monkeypatch):
    prefill = tmp_path / "prefill.json"
    prefill.write_text('[{"role": "user", "content": "hi"}]', encoding="utf-8")
    made_a_fifo_once_checked(monkeypatch, prefill, "exists")
    try:
        messages = load_prefill("prefill_messages_file", str(prefill))
    except UsageError as exc:       # what it held, or the refusal of a FIFO: never a wait
        assert "must be a regular file" in str(exc)
    else:
        assert messages == ({"role": "user", "content": "hi"},)
    assert stat.S_ISFIFO(os.lstat(prefill).st_mode)     # the look came before the open: the race was run


def test_a_prefill_file_nested_too_deeply_to_read_is_refused_in_one_line(tmp_path):
    # Before: json's RecursionError ended the run's start in a traceback.
    prefill = tmp_path / "prefill.json"
    prefill.write_text("[" * 100_000 + "]" * 100_000, encoding="utf-8")
    with pytest.raises(UsageError, match=r"^--prefill_messages_file: .*prefill\.json is nested too deeply to read; "
                                         r"it must hold a JSON array of \{role, content\} messages$"):
        load_prefill("prefill_messages_file", str(prefill))


# Scripts written for the Hermes runner (fire, then `if resume:`) pass switches as 1, true or yes: they
# were refused. Fire's `if` took "false" for true; here it means what it says.
@pytest.mark.parametrize(("value", "meant"), [(1, True), ("true", True), ("YES", True), ("on", True),
                                              (0, False), ("false", False), ("No", False), ("off", False)])
def test_a_switch_takes_the_usual_words_for_yes_and_no(value: object, meant: bool) -> None:
    assert build_config(**{**BASE, "resume": value, "verbose": value}).output.resume is meant


@pytest.mark.parametrize("value", [2, "maybe", "y", None])
def test_a_switch_given_neither_yes_nor_no_is_one_clear_error(value: object) -> None:
    with pytest.raises(UsageError, match=r"--resume is a switch: pass --resume or --resume=False"):
        build_config(**{**BASE, "resume": value})
