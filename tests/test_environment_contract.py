"""The environment contract (the docstrings of batchrun/environments/base.py's Environment), held against
every backend present here.

Each test is one promise of the protocol, run once per entry of BACKENDS: local; bubblewrap with each
bwrap this machine has (the system's and the bundled one); the docker backend through real Docker and
Podman engines where they are set up (tests/container_backends.py says how; skipped elsewhere);
singularity and apptainer through their stand-in CLI (fake_singularity.py); modal through the stand-in
SDK (fake_modal/). A new backend is one module, one line in ENVIRONMENT_KINDS and one entry here.

What a backend does beyond the contract is tested in its own file: test_local_environment.py,
test_bubblewrap_environment.py, test_sandbox_conformance.py and test_sandbox_limits.py,
test_container_environments.py and test_container_engines.py, test_modal_environment.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from conftest import live_processes_mentioning, wait_for
from container_backends import StandInBackend, make_backend, make_settings

from batchrun.config import terminal_environment
from batchrun.environments import create_environment, environment_class
from batchrun.environments.base import Environment, EnvironmentSettings, EnvironmentSetupError
from batchrun.environments.bubblewrap import bwrap_candidates
from batchrun.environments.bubblewrap import environment as bubblewrap_environment
from batchrun.environments.bubblewrap import program as bubblewrap_program
from batchrun.environments.bubblewrap import sandbox as sandbox_module
from batchrun.environments.bubblewrap.program import candidate_problem
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.files import patch, read_file, search_files, write_file
from batchrun.tools.terminal import terminal


@dataclass
class Subject:
    """One backend as these tests drive it: its kind, the image a row names (container backends), what
    of a run still exists (its prompt directories, containers or sandboxes), and whether a test can see
    it end what a command left running. A stand-in runtime cannot show that: it keeps a container as a
    directory and forgets a command's processes once the command returns."""

    kind: str
    image: str | None
    leftovers: Callable[[EnvironmentSettings], list[str]]
    ends_processes: bool = True


def prompt_directories(settings: EnvironmentSettings) -> list[str]:
    """What is left under the run's work root but the read-only roots bubblewrap makes once per run."""
    if not settings.work_root.is_dir():
        return []
    return sorted(path.name for path in settings.work_root.iterdir() if not path.name.startswith(".root"))


def local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Subject:
    return Subject("local", None, prompt_directories)


@functools.cache
def bwrap_problem(path: str) -> str | None:
    return candidate_problem(path)


def bubblewrap(origin: str) -> Callable[[Path, pytest.MonkeyPatch], Subject]:
    """The bubblewrap backend with the bwrap of this origin ("system", "bundled"), not the one it picks."""
    def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Subject:
        found = [candidate for candidate in bwrap_candidates() if candidate.origin.startswith(origin)]
        if not found:
            pytest.skip(f"no {origin} bwrap here")
        if (problem := bwrap_problem(found[0].path)) is not None:
            pytest.skip(f"the {origin} bwrap cannot sandbox here: {problem}")
        chosen = functools.cache(lambda: found[0])
        monkeypatch.setattr(sandbox_module, "working_bwrap", chosen)
        monkeypatch.setattr(bubblewrap_environment, "working_bwrap", chosen)
        monkeypatch.setattr(bubblewrap_program, "working_bwrap", chosen)
        return Subject("bubblewrap", None, prompt_directories)
    return setup


def container(name: str) -> Callable[[Path, pytest.MonkeyPatch], Subject]:
    """A container backend as container_backends.py readies it (skipped where it cannot run)."""
    def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Subject:
        backend = make_backend(name, tmp_path, monkeypatch)
        return Subject(backend.kind, backend.image, lambda settings: backend.live(settings.run_label),
                       ends_processes=not isinstance(backend, StandInBackend))
    return setup


BACKENDS = [
    pytest.param(local, id="local"),
    pytest.param(bubblewrap("system"), id="bubblewrap-system", marks=pytest.mark.bubblewrap),
    pytest.param(bubblewrap("bundled"), id="bubblewrap-bundled", marks=pytest.mark.bubblewrap),
    pytest.param(container("docker"), id="docker"),
    pytest.param(container("podman"), id="podman"),
    pytest.param(container("singularity"), id="singularity"),
    pytest.param(container("apptainer"), id="apptainer"),
    pytest.param(container("modal"), id="modal"),
]


@pytest.fixture(params=BACKENDS)
def subject(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Subject:
    return request.param(tmp_path, monkeypatch)


def environment(subject: Subject, settings: EnvironmentSettings, *, prompt_index: int = 0,
                cwd: str | None = None) -> Environment:
    return create_environment(subject.kind, settings, prompt_index=prompt_index, image=subject.image, cwd=cwd)


def in_environment(subject: Subject, settings: EnvironmentSettings,
                   scenario: Callable[[Environment], Awaitable[Any]], cwd: str | None = None) -> Any:
    """``scenario`` run in a started environment, closed afterwards whatever happened."""
    async def main() -> Any:
        env = environment(subject, settings, cwd=cwd)
        await env.start()
        try:
            return await scenario(env)
        finally:
            await env.close()
    return asyncio.run(main())


def tool(env: Environment, handler: Callable[[dict, ToolContext], Awaitable[dict]],
         **args: object) -> Awaitable[dict]:
    return handler(args, ToolContext(env=env, settings=env.settings))


def unique_sleep() -> str:
    """A ``sleep`` command no other process runs, to find it among the host's processes."""
    return f"sleep {1000 + os.getpid() % 1000}.{time.monotonic_ns() % 10**9}"


def wait_until_ended(command: str) -> None:
    wait_for(lambda: live_processes_mentioning(command) == [], timeout=5, what=f"`{command}` to end")


def left_running(subject: Subject) -> tuple[str, Callable[[], None]]:
    """A command that leaves a process running, and the check that it was ended (where a test can see it)."""
    if not subject.ends_processes:
        return "true", lambda: None
    sleep = unique_sleep()
    return f"{sleep} > /dev/null 2>&1 &", lambda: wait_until_ended(sleep)


# -- the backend as a whole ------------------------------------------------------------------------------

def test_where_the_backend_works_its_start_up_and_node_checks_pass_and_the_run_asks_them(subject, monkeypatch):
    backend = environment_class(subject.kind)
    line = backend.startup_check()
    assert line.startswith("chosen by TERMINAL_ENV")
    assert backend.node_problem() is None
    monkeypatch.setenv("TERMINAL_ENV", subject.kind)
    assert terminal_environment("terminal_only") == (subject.kind, line)


def test_remove_leftovers_removes_what_a_crashed_run_left_and_nothing_of_another_run(subject, tmp_path):
    crashed = make_settings(tmp_path, run_label=f"crashed-{tmp_path.name}")
    other = replace(make_settings(tmp_path, run_label=f"crashed-{tmp_path.name}-2"), work_root=tmp_path / "other")

    async def scenario() -> tuple:
        survivor = environment(subject, other)
        await survivor.start()
        abandoned = [environment(subject, crashed, prompt_index=index) for index in range(2)]
        try:
            for env in abandoned:
                await env.start()       # and never closed: the run "crashed"
            before = subject.leftovers(crashed)
            environment_class(subject.kind).remove_leftovers(crashed)
            return before, subject.leftovers(crashed), subject.leftovers(other)
        finally:
            for env in [*abandoned, survivor]:
                await env.close()       # never raises, whatever is gone already
    before, after, others = asyncio.run(scenario())
    assert len(before) == 2 and after == [] and len(others) == 1
    assert not crashed.work_root.exists()


# -- commands ----------------------------------------------------------------------------------------------

def test_a_command_gives_its_merged_output_and_exit_code_and_writes_where_it_runs(subject, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = in_environment(subject, make_settings(tmp_path), lambda env: tool(
        env, terminal, command="echo made > here.txt; cat here.txt; echo oops >&2; exit 3"))
    assert result == {"output": "made\noops\n", "exit_code": 3, "error": None}
    assert not (tmp_path / "here.txt").exists()


def test_undecodable_output_is_replaced_not_fatal(subject, tmp_path):
    result = in_environment(subject, make_settings(tmp_path), lambda env: env.run("printf 'a\\377b'"))
    assert (result.output, result.exit_code) == ("a\ufffdb", 0)


def test_output_over_the_cap_is_cut_with_a_note(subject, tmp_path):
    result = in_environment(subject, make_settings(tmp_path, max_output_chars=100),
                            lambda env: env.run("head -c 300000 /dev/zero | tr '\\0' x"))
    assert result.truncated and result.exit_code == 0
    assert result.output == "x" * 100 + "\n[output truncated: 299900 more characters not shown]"


def test_a_command_reading_its_input_gets_end_of_file(subject, tmp_path):
    result = in_environment(subject, make_settings(tmp_path), lambda env: env.run("cat; echo after", timeout=5))
    assert (result.output, result.exit_code) == ("after\n", 0)


def test_commands_do_not_see_the_users_secrets(subject, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-openai-123")
    monkeypatch.setenv("GITHUB_TOKEN", "ghp-secret-github")
    monkeypatch.setenv("MY_SECRET", "hunter2")
    result = in_environment(subject, make_settings(tmp_path), lambda env: env.run("env"))
    assert "PATH=" in result.output
    for secret in ("sk-secret-openai-123", "ghp-secret-github", "hunter2", "OPENAI_API_KEY", "GITHUB_TOKEN",
                   "MY_SECRET"):
        assert secret not in result.output


def test_commands_see_none_of_the_users_proxy_settings_nor_variables_meant_for_containers(subject, tmp_path,
                                                                                          monkeypatch):
    """Proxy URLs may carry a password; Singularity and Apptainer pass the proxy variables, what
    SINGULARITYENV_/APPTAINERENV_ name and what is in the file SINGULARITY_ENV_FILE/APPTAINER_ENV_FILE
    name into their containers even when told to clean the environment."""
    for name in ("HTTPS_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://user:proxy-secret@proxy.example:3128")
    monkeypatch.setenv("APPTAINERENV_SHARED", "apptainer-secret")
    monkeypatch.setenv("SINGULARITYENV_SHARED_TOO", "singularity-secret")
    secrets_file = tmp_path / "secrets.env"
    secrets_file.write_text("SHARED_FROM_FILE=env-file-secret\n")
    for name in ("APPTAINER_ENV_FILE", "SINGULARITY_ENV_FILE"):
        monkeypatch.setenv(name, str(secrets_file))
    result = in_environment(subject, make_settings(tmp_path), lambda env: env.run("env"))
    assert "PATH=" in result.output
    assert "secret" not in result.output and "SHARED" not in result.output


def test_no_host_directory_the_users_container_settings_bind_is_in_the_sandbox(subject, tmp_path, monkeypatch):
    """Singularity and Apptainer bind what SINGULARITY_BIND/APPTAINER_BIND and the mounts that
    SINGULARITY_MOUNT/APPTAINER_MOUNT name (often set for every container on a cluster) into each
    container they start, beside the backend's own binds."""
    host = tmp_path / "host-only"
    host.mkdir()
    (host / "secret.txt").write_text("host-secret")
    for name in ("APPTAINER_BIND", "APPTAINER_BINDPATH", "SINGULARITY_BIND", "SINGULARITY_BINDPATH"):
        monkeypatch.setenv(name, f"{host}:/bound")
    for name in ("APPTAINER_MOUNT", "SINGULARITY_MOUNT"):
        monkeypatch.setenv(name, f"type=bind,source={host},destination=/mounted")

    async def scenario(env: Environment) -> None:
        for bound in ("/bound/secret.txt", "/mounted/secret.txt"):
            with pytest.raises(ToolError):      # not there, or out of the file tools' reach
                await env.read_file(bound)
    in_environment(subject, make_settings(tmp_path), scenario)


def test_a_command_past_its_time_limit_is_killed_and_the_next_one_runs(subject, tmp_path):
    async def scenario(env: Environment) -> tuple:
        began = time.monotonic()
        timed_out = await tool(env, terminal, command="echo begun; sleep 2; echo late > late.txt", timeout=1)
        elapsed = time.monotonic() - began
        await asyncio.sleep(2.5)        # the command, had it lived on, would have written by now
        with pytest.raises(ToolError, match="does not exist"):
            await env.read_file("late.txt")
        return timed_out, elapsed, await env.run("echo next")
    timed_out, elapsed, after = in_environment(subject, make_settings(tmp_path), scenario)
    assert timed_out == {"output": "begun\n", "exit_code": None, "error": "Command timed out after 1s and was killed"}
    assert elapsed < 10
    assert (after.output, after.exit_code, after.timed_out) == ("next\n", 0, False)


@pytest.mark.parametrize("cwd", [None, "/app/src", "proj"])
def test_commands_and_the_file_tools_share_the_rows_working_directory(subject, tmp_path, cwd):
    async def scenario(env: Environment) -> tuple:
        made = await env.run("echo here > marker")
        written = await env.write_file("tool.txt", b"from the tool\n")
        return made, await env.read_file("marker"), written, await env.run("cat tool.txt")
    made, marker, written, seen = in_environment(subject, make_settings(tmp_path), scenario, cwd=cwd)
    assert made.exit_code == 0, made
    assert marker == b"here\n" and written == "tool.txt" and seen.output == "from the tool\n"


def test_a_rows_cwd_leading_outside_fails_the_start_and_leaves_nothing(subject, tmp_path):
    settings = make_settings(tmp_path)
    env = environment(subject, settings, cwd="../../..")
    with pytest.raises(EnvironmentSetupError, match="cwd"):
        asyncio.run(env.start())
    assert subject.leftovers(settings) == []


# -- the file tools ----------------------------------------------------------------------------------------

def test_the_file_tools_write_read_patch_and_search_what_commands_see(subject, tmp_path):
    async def scenario(env: Environment) -> None:
        assert await tool(env, write_file, path="src/app.py", content="x = 1\ny = 2\n") == \
            {"path": "src/app.py", "bytes_written": 12}
        assert (await tool(env, read_file, path="src/app.py"))["content"] == "x = 1\ny = 2\n"
        assert (await tool(env, patch, path="src/app.py", old_string="y = 2", new_string="y = 3"))["replacements"] == 1
        assert (await tool(env, terminal, command="cat src/app.py"))["output"] == "x = 1\ny = 3\n"
        found = await tool(env, search_files, pattern="y = [0-9]")
        assert found["matches"] == [{"path": "src/app.py", "line": 2, "text": "y = 3"}]
        assert (await tool(env, search_files, pattern="*.py", target="files"))["files"] == ["src/app.py"]
    in_environment(subject, make_settings(tmp_path), scenario)


def test_read_file_tells_missing_files_and_directories_apart(subject, tmp_path):
    async def scenario(env: Environment) -> None:
        with pytest.raises(ToolError, match="does not exist"):
            await env.read_file("nothing.txt")
        await env.run("mkdir folder")
        with pytest.raises(ToolError, match="is a directory"):
            await env.read_file("folder")
        with pytest.raises(ToolError, match="is a directory"):
            await env.write_file("folder", b"x")
    in_environment(subject, make_settings(tmp_path), scenario)


def test_the_file_tools_size_limit_holds_both_ways(subject, tmp_path):
    async def scenario(env: Environment) -> None:
        with pytest.raises(ToolError, match="11 bytes is more than the file tools' limit of 10 bytes"):
            await env.write_file("big.txt", b"x" * 11)
        await env.run("printf '%020d' 0 > big.txt")
        with pytest.raises(ToolError, match="larger than the file tools' limit of 10 bytes"):
            await env.read_file("big.txt")
    in_environment(subject, make_settings(tmp_path, max_file_bytes=10), scenario)


def test_the_file_tools_never_reach_the_hosts_files(subject, tmp_path):
    host_file = tmp_path / "host.txt"
    host_file.write_text("the host's\n")

    async def scenario(env: Environment) -> None:
        for path in (str(host_file), "../" * 20 + str(host_file).lstrip("/")):
            with pytest.raises(ToolError):
                await env.read_file(path)
            # Refused here, or written in a container's own file system: the host's stays as it was.
            with contextlib.suppress(ToolError):
                await env.write_file(path, b"changed\n")
            with contextlib.suppress(ToolError):
                await env.write_file(path + ".new", b"new\n")
    in_environment(subject, make_settings(tmp_path), scenario)
    assert host_file.read_text() == "the host's\n"
    assert not (tmp_path / "host.txt.new").exists()


# -- the end of a prompt -----------------------------------------------------------------------------------

def test_close_ends_every_process_and_removes_everything_and_a_second_close_does_nothing(subject, tmp_path):
    settings = make_settings(tmp_path)
    background, ended = left_running(subject)

    async def scenario() -> None:
        env = environment(subject, settings)
        await env.start()
        await env.write_file("note.txt", b"left\n")
        await env.run(background)
        assert len(subject.leftovers(settings)) == 1
        await env.close()
        await env.close()
    asyncio.run(scenario())
    assert subject.leftovers(settings) == []
    ended()


def test_closing_while_a_command_runs_ends_it_and_removes_everything(subject, tmp_path):
    settings = make_settings(tmp_path)
    sleep = unique_sleep()

    async def scenario() -> None:
        env = environment(subject, settings)
        await env.start()
        task = asyncio.create_task(env.run(f"touch begun; {sleep}"))
        for _ in range(200):
            try:
                await env.read_file("begun")
                break
            except ToolError:
                await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await env.close()
    began = time.monotonic()
    asyncio.run(scenario())
    assert time.monotonic() - began < 20
    assert subject.leftovers(settings) == []
    wait_until_ended(sleep)


def test_the_next_prompt_finds_nothing_the_released_one_left(subject, tmp_path):
    settings = make_settings(tmp_path, spare_sandboxes=2)      # backends that keep spares use them
    background, ended = left_running(subject)
    backend = environment_class(subject.kind)

    async def scenario() -> tuple:
        try:
            first = environment(subject, settings, prompt_index=0)
            await first.start()
            await first.write_file("mine.txt", b"private\n")
            await first.run(background)
            await first.release()
            second = environment(subject, settings, prompt_index=1)
            await second.start()
            try:
                with pytest.raises(ToolError, match="does not exist"):
                    await second.read_file("mine.txt")
                return await second.run("ls -A")
            finally:
                await second.close()
        finally:
            await backend.close_idle()
    listing = asyncio.run(scenario())
    assert (listing.output, listing.exit_code) == ("", 0)
    assert subject.leftovers(settings) == []
    ended()
