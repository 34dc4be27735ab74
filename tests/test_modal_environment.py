"""What is Modal's own in the modal backend (TERMINAL_ENV=modal): the sandbox's settings, the extra and
the credentials, and a whole run through the CLI. The contract it shares with the other backends is
in test_environment_contract.py and test_container_environments.py. No Modal service is reachable from here: the SDK is
the stand-in in fake_modal/modal.py, and where the real package is installed a test checks that every
call the backend makes fits the real SDK's signatures.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
import threading
import time

import pytest
from conftest import batch_rows, endpoint_args, read_jsonl, run_cli, write_dataset
from container_backends import FAKE_MODAL, StandInBackend, environment, make_settings, use_fake_modal

from batchrun.config import terminal_environment
from batchrun.environments import environment_class
from batchrun.environments import modal as modal_backend
from batchrun.environments.base import (
    CommandResult,
    EnvironmentLostError,
    EnvironmentSetupError,
    ToolError,
    run_identity,
)
from batchrun.environments.modal import RUN_TAG, SANDBOX_LIFETIME
from batchrun.flag_values import UsageError


@pytest.fixture
def modal_fake(tmp_path, monkeypatch) -> StandInBackend:
    return use_fake_modal(tmp_path, monkeypatch)


def test_the_sandbox_is_tagged_idle_without_network_memory_capped_and_lives_at_most_a_day(modal_fake, tmp_path):
    settings = make_settings(tmp_path)
    env = environment(modal_fake, settings, prompt_index=4)
    asyncio.run(env.start())
    [sandbox] = modal_fake.containers()
    asyncio.run(env.close())
    assert sandbox["tags"] == {RUN_TAG: settings.run_label, "batch_runner.prompt": "4"}
    assert sandbox["image"] == modal_fake.image and sandbox["command"] == ["sleep", "infinity"]
    assert sandbox["block_network"] is True
    assert sandbox["memory"] == [1024, settings.limits.memory_mb]          # reserved, and the cap
    assert sandbox["timeout"] == SANDBOX_LIFETIME
    assert modal_fake.containers() == []


def test_allow_network_lets_the_sandbox_reach_the_network(modal_fake, tmp_path):
    env = environment(modal_fake, make_settings(tmp_path, allow_network=True))
    asyncio.run(env.start())
    [sandbox] = modal_fake.containers()
    asyncio.run(env.close())
    assert sandbox["block_network"] is False


def test_without_the_modal_package_the_start_says_how_to_install_the_extra(modal_fake, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "modal", None)         # what an installation without it finds
    env = environment(modal_fake, make_settings(tmp_path))
    with pytest.raises(EnvironmentSetupError, match=r"needs the modal package.*pip install .*\[modal\]"):
        asyncio.run(env.start())


def test_without_credentials_the_start_says_how_to_log_in(modal_fake, tmp_path, monkeypatch):
    monkeypatch.delenv("MODAL_TOKEN_SECRET")
    env = environment(modal_fake, make_settings(tmp_path))
    with pytest.raises(EnvironmentSetupError, match="no Modal credentials: run `modal token new`"):
        asyncio.run(env.start())
    assert modal_fake.calls("modal") == []


def test_credentials_the_service_refuses_fail_the_start_with_its_reason(modal_fake, tmp_path, monkeypatch):
    monkeypatch.setenv("MODAL_TOKEN_ID", "rejected")
    env = environment(modal_fake, make_settings(tmp_path))
    with pytest.raises(EnvironmentSetupError) as failure:
        asyncio.run(env.start())
    assert str(failure.value) == ("Modal refused the credentials (run `modal token new`): "
                                  "Token ID is malformed or invalid")
    assert modal_fake.containers() == []


@pytest.mark.parametrize(("change", "expected"), [
    ({"modal": None}, "needs the modal package"),
    ({"MODAL_TOKEN_ID": None}, "no Modal credentials"),
])
def test_the_run_stops_at_start_up_without_the_extra_or_credentials(modal_fake, monkeypatch, change, expected):
    for name, value in change.items():
        if name == "modal":
            monkeypatch.setitem(sys.modules, name, value)
        else:
            monkeypatch.delenv(name)
    monkeypatch.setenv("TERMINAL_ENV", "modal")
    with pytest.raises(UsageError, match=expected):
        terminal_environment("terminal_only")


def test_remove_leftovers_terminates_the_sandboxes_of_a_crashed_run_only(modal_fake, tmp_path):
    crashed, other = make_settings(tmp_path, run_label="crashed"), make_settings(tmp_path, run_label="other")
    for settings in (crashed, crashed, other):
        asyncio.run(environment(modal_fake, settings).start())      # never closed
    environment_class("modal").remove_leftovers(crashed)
    assert modal_fake.live("crashed") == [] and len(modal_fake.live("other")) == 1


@pytest.mark.parametrize("fault", ["FAKE_MODAL_HANG", "FAKE_MODAL_RAISE"])
@pytest.mark.parametrize(("call", "left"), [
    ("App.lookup", "could not look for Modal sandboxes left under this run's tag"),
    ("Sandbox.list", "could not look for Modal sandboxes left under this run's tag"),
    ("Sandbox.terminate", "1 of 1 Modal sandboxes left under this run's tag could not be terminated"),
])
def test_a_clean_up_modal_cannot_do_is_given_up_with_a_warning_saying_what_was_left(modal_fake, tmp_path, monkeypatch,
                                                                                  capsys, fault, call, left):
    # The clean-up runs at the run's start and, shielded from stop signals, at its end: a call that never answered
    # hung the run there for good (no merge, deaf to Ctrl-C), and grpclib's StreamTerminatedError, which the SDK
    # raises as it is, ended the run with a traceback. Either way the rest of the clean-up must still happen.
    monkeypatch.setattr(modal_backend, "LEFTOVERS_SECONDS", 1.0)
    settings = make_settings(tmp_path)
    asyncio.run(environment(modal_fake, settings).start())      # a crashed run's sandbox, never closed
    (settings.work_root / "prompt-0").mkdir(parents=True)         # and a directory of its own
    monkeypatch.setenv(fault, call)
    outcome: list[BaseException | None] = []

    def clean_up() -> None:
        try:
            environment_class("modal").remove_leftovers(settings)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)
    worker = threading.Thread(target=clean_up, daemon=True)     # the unbounded clean-up would hang the test
    worker.start()
    worker.join(30)
    assert outcome == [None]
    [warning] = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"warning: {left} (Modal")
    assert warning.endswith("until Modal ends them, 24 hours after their start")
    assert not settings.work_root.exists()


def test_a_ray_nodes_clean_up_leaves_the_services_sandboxes_to_the_runner(modal_fake, tmp_path, monkeypatch,
                                                                        capsys):
    # Each Ray node looked for the run's sandboxes too: with Modal silent, the run's start and end waited for
    # it once more per node, deaf to Ctrl-C at the end, and each node printed the same warning.
    settings = make_settings(tmp_path)
    asyncio.run(environment(modal_fake, settings).start())      # a crashed run's sandbox, never closed
    (settings.work_root / "prompt-0").mkdir(parents=True)
    monkeypatch.setenv("FAKE_MODAL_HANG", "App.lookup,Sandbox.list")
    began = time.monotonic()
    environment_class("modal").remove_node_leftovers(settings)
    assert time.monotonic() - began < 5
    assert capsys.readouterr().err == "" and not settings.work_root.exists()


@pytest.mark.parametrize(("call", "expected"), [
    ("App.lookup", "Modal is not reachable: Connection lost"),
    ("Sandbox.create", "cannot start a Modal sandbox from example/tools:1: Connection lost"),
])
def test_an_error_of_the_service_that_is_no_modal_error_fails_the_start_with_its_reason(modal_fake, tmp_path,
                                                                                      monkeypatch, call, expected):
    # The SDK raises grpclib's StreamTerminatedError as it is: it failed the prompt with a traceback, as a bug.
    monkeypatch.setenv("FAKE_MODAL_RAISE", call)
    env = environment(modal_fake, make_settings(tmp_path))
    with pytest.raises(EnvironmentSetupError) as failure:
        asyncio.run(env.start())
    assert str(failure.value) == expected
    assert modal_fake.containers() == []


@pytest.mark.parametrize("tool", ["run", "read_file"])
def test_an_error_of_the_service_that_is_no_modal_error_mid_prompt_fails_only_that_call(modal_fake, tmp_path,
                                                                                      monkeypatch, tool):
    # The model was handed "terminal failed: StreamTerminatedError", the session's word for a bug of the tool's;
    # it is Modal's connection failing, and the sandbox may well answer the next call.
    env = environment(modal_fake, make_settings(tmp_path))

    async def scenario() -> str:
        await env.start()
        try:
            monkeypatch.setenv("FAKE_MODAL_RAISE", "Sandbox.exec")
            if tool == "run":
                failed = await env.run("echo hi")
                assert failed.exit_code is None and not failed.timed_out
                error = failed.error or ""
            else:
                with pytest.raises(ToolError) as refused:
                    await env.read_file("a.txt")
                error = str(refused.value)
            monkeypatch.delenv("FAKE_MODAL_RAISE")
            assert (await env.run("echo back")).output == "back\n"
            return error
        finally:
            await env.close()
    assert asyncio.run(scenario()).endswith("Modal: Connection lost")


@pytest.mark.parametrize("tool", ["run", "read_file", "write_file"])
@pytest.mark.parametrize("loss", ["terminated", "NotFoundError", "SandboxTimeoutError"])
def test_a_sandbox_gone_mid_prompt_loses_the_environment(modal_fake, tmp_path, monkeypatch, tool, loss):
    # Modal ends a sandbox at its lifetime, on a preemption or at someone's `modal sandbox terminate`; every later
    # call then fails, and as tool errors the prompt went on to a completed row that --resume never ran again.
    settings = make_settings(tmp_path)
    env = environment(modal_fake, settings)
    modal = importlib.import_module("modal")        # the stand-in, as the fixture arranged

    async def scenario() -> None:
        await env.start()
        try:
            if loss == "terminated":
                for sandbox in modal.Sandbox.list(tags={RUN_TAG: settings.run_label}):     # from outside
                    sandbox.terminate()
            else:
                monkeypatch.setenv("FAKE_MODAL_RAISE", f"Sandbox.exec:{loss}")
            with pytest.raises(EnvironmentLostError, match="^the Modal sandbox is gone: "):
                if tool == "run":
                    await env.run("echo hi")
                elif tool == "read_file":
                    await env.read_file("a.txt")
                else:
                    await env.write_file("a.txt", b"data")
        finally:
            await env.close()
    asyncio.run(scenario())


def test_a_command_that_leaves_a_child_holding_its_output_ends_when_the_command_exits(modal_fake, tmp_path):
    # The output was read to its end before the exit was awaited, so a command that exited at once but left a
    # background child holding its stdout was reported "timed out" after its whole limit.
    env = environment(modal_fake, make_settings(tmp_path))

    async def scenario() -> tuple[float, CommandResult]:
        await env.start()
        try:
            began = time.monotonic()
            result = await env.run("sleep 30 & echo hi", timeout=5)
            return time.monotonic() - began, result
        finally:
            await env.close()
    took, result = asyncio.run(scenario())
    assert result.exit_code == 0 and not result.timed_out and result.output == "hi\n"
    assert took < 3


def test_output_that_comes_after_the_exit_is_kept(modal_fake, tmp_path, monkeypatch):
    # The service sends the output and the exit over calls of their own: read for 0.2 s after the exit, output
    # half a second late was lost, and the command said exit 0 with no output.
    monkeypatch.setenv("FAKE_MODAL_OUTPUT_LAG", "0.5")
    env = environment(modal_fake, make_settings(tmp_path))

    async def scenario() -> CommandResult:
        await env.start()
        try:
            return await env.run("echo hello; sleep 0.1; echo world", timeout=10)
        finally:
            await env.close()
    result = asyncio.run(scenario())
    assert (result.output, result.exit_code, result.truncated) == ("hello\nworld\n", 0, False)


def test_every_call_fits_the_real_sdks_signatures(modal_fake, tmp_path, monkeypatch):
    env = environment(modal_fake, make_settings(tmp_path), cwd="src")

    async def scenario():
        await env.start()
        await env.write_file("a.txt", b"data")
        assert await env.read_file("a.txt") == b"data"
        assert (await env.run("cat a.txt")).output == "data"
        await env.close()
    asyncio.run(scenario())
    environment_class("modal").remove_leftovers(make_settings(tmp_path))
    calls = modal_fake.calls("modal")
    sys.path.remove(str(FAKE_MODAL))                    # monkeypatch puts sys.path back as it was
    monkeypatch.delitem(sys.modules, "modal")
    real = pytest.importorskip("modal", reason="the real modal package is not installed (the `modal` extra)")
    assert not real.__file__.startswith(str(FAKE_MODAL))
    functions = {"App.lookup": real.App.lookup, "Image.from_registry": real.Image.from_registry,
                 "Sandbox.create": real.Sandbox.create, "Sandbox.list": real.Sandbox.list,
                 "Sandbox.exec": real.Sandbox.exec, "Sandbox.terminate": real.Sandbox.terminate}
    methods = {"Sandbox.exec", "Sandbox.terminate"}
    assert {name for name, _ in calls} == set(functions)
    for name, arguments in calls:
        positional = arguments.pop("args", [])
        if name == "Sandbox.terminate":
            arguments.pop("object_id")          # the stand-in's note of which sandbox, not an argument
        receiver = [None] if name in methods else []
        inspect.signature(functions[name]).bind(*receiver, *positional, **arguments)


# -- through the real CLI ------------------------------------------------------------------------------

def test_cli_runs_a_prompt_in_a_sandbox_and_terminates_a_crashed_runs_sandboxes_first(modal_fake, tmp_path,
                                                                                     endpoint):
    label = run_identity(tmp_path / "data" / "modalrun")
    asyncio.run(environment(modal_fake, make_settings(tmp_path, run_label=label), prompt_index=9).start())
    dataset = write_dataset(tmp_path / "dataset.jsonl", [
        {"prompt": '[[call terminal {"command": "echo inside > proof.txt; cat proof.txt"}]] works',
         "image": "python:3.12-slim", "cwd": "/srv/app"},
        {"prompt": "never sent", "image": "ghost/image:9"},
    ])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=5", "--run_name=modalrun",
                     "--distribution=terminal_only", *endpoint_args(endpoint),
                     env={"TERMINAL_ENV": "modal", "FAKE_PULL_FAIL": "ghost/image:9", **modal_fake.variables})
    assert result.returncode == 2, result.stderr      # the failed image: --resume retries it
    rows = {row["prompt_index"]: row for row in batch_rows(tmp_path / "data" / "modalrun")}
    assert rows[1]["error"].startswith("cannot start a Modal sandbox from ghost/image:9: Image build failed")
    assert endpoint.chat_requests_for("never sent") == []
    [completed] = read_jsonl(tmp_path / "data" / "modalrun" / "trajectories.jsonl")
    assert '"output": "inside\\n"' in completed["conversations"][3]["value"]
    tags = [arguments["tags"] for name, arguments in modal_fake.calls("modal") if name == "Sandbox.create"]
    assert {RUN_TAG: label, "batch_runner.prompt": "0"} in tags
    assert modal_fake.live(label) == []             # the crashed run's sandbox, and this run's
    assert not list(tmp_path.glob("proof.txt"))


def test_what_a_program_in_the_sandbox_writes_for_the_file_tools_stops_past_their_limit(modal_fake, tmp_path):
    # The file tools run the sandbox's own sh and head, which a command may replace with a program that
    # writes without end: all of it was read into the worker.
    env = environment(modal_fake, make_settings(tmp_path, max_file_bytes=10_000))

    async def scenario():
        await env.start()
        try:
            return await env._exec(["sh", "-c", "head -c 50000000 /dev/zero"], workdir="/")
        finally:
            await env.close()
    result = asyncio.run(scenario())
    assert len(result.stdout) == 10_001 and not result.ok
