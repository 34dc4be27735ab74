"""The local environment and the terminal tool, with real bash processes under tmp_path, beyond the
environment contract (test_environment_contract.py holds it to that with the other backends)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from conftest import live_processes_mentioning, wait_for

from batchrun.environments import ENVIRONMENT_KINDS, create_environment
from batchrun.environments.base import EnvironmentSettings
from batchrun.environments.disk_usage import DiskUsageWalk
from batchrun.environments.local import LocalEnvironment
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.terminal import terminal


def make_settings(tmp_path: Path, **overrides: object) -> EnvironmentSettings:
    return EnvironmentSettings(work_root=tmp_path / "work", run_label="test", **overrides)


async def started(settings: EnvironmentSettings, cwd: str | None = None) -> LocalEnvironment:
    env = LocalEnvironment(settings, prompt_index=7, cwd=cwd)
    await env.start()
    return env


def run_command(settings: EnvironmentSettings, command: str, timeout: float | None = None,
                cwd: str | None = None):
    """Start an environment, run one command, close it; returns (result, env)."""
    async def scenario():
        env = await started(settings, cwd)
        try:
            return await env.run(command, timeout=timeout), env
        finally:
            await env.close()
    return asyncio.run(scenario())


def process_alive(pid: int) -> bool:
    """False once the process is gone or only a zombie waiting for a parent that never reaps it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def wait_until_dead(pid: int, seconds: float = 3.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not process_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_command_runs_in_the_prompt_directory_not_the_callers_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result, env = run_command(make_settings(tmp_path), "pwd -P")
    assert result.output.strip() == str(env.prompt_dir)
    assert env.prompt_dir.parent == (tmp_path / "work").resolve()
    assert env.prompt_dir.name.startswith("prompt-7-")


def test_rows_cwd_is_created_inside_the_prompt_directory(tmp_path):
    result, env = run_command(make_settings(tmp_path, keep_workdirs=True), "pwd -P", cwd="/repo/src")
    assert result.output.strip() == str(env.prompt_dir / "repo" / "src")


def test_home_is_the_prompt_directory(tmp_path):
    result, env = run_command(make_settings(tmp_path), "env")
    assert f"HOME={env.prompt_dir}" in result.output.splitlines()


def test_time_out_kills_the_command_and_its_background_child(tmp_path):
    result, env = run_command(make_settings(tmp_path, keep_workdirs=True),
                              "echo begun; sleep 60 & echo $! > child.pid; wait", timeout=1)
    assert result.timed_out and result.exit_code is None
    assert result.output == "begun\n"
    child = int((env.prompt_dir / "child.pid").read_text())
    assert wait_until_dead(child)


def test_background_process_holding_the_output_does_not_hang_the_call(tmp_path):
    # The child outlives the time limit: a call that waited for it would time out.
    result, _ = run_command(make_settings(tmp_path), "sleep 1000 & echo started", timeout=20)
    assert (result.output, result.exit_code, result.timed_out) == ("started\n", 0, False)


def test_a_command_cancelled_while_it_starts_is_killed_once_it_exists(tmp_path):
    marker = f"{os.getpid()}.{time.monotonic_ns() % 10**6}"     # sleep's argument, unique to this test

    async def scenario():
        env = await started(make_settings(tmp_path))
        command = asyncio.ensure_future(env.run(f"sleep {marker}"))
        await asyncio.sleep(0)                  # the start is under way in its thread
        command.cancel()
        with pytest.raises(asyncio.CancelledError):
            await command
        await asyncio.sleep(0.5)
        await env.close()
    asyncio.run(scenario())
    wait_for(lambda: live_processes_mentioning(f"sleep {marker}") == [], timeout=3, what="the command to be killed")


def test_a_command_left_starting_when_its_loop_ends_is_killed_and_later_commands_still_start(tmp_path):
    marker = f"{os.getpid()}.{time.monotonic_ns() % 10**6 + 1}"
    settings = make_settings(tmp_path)

    async def abandon():
        env = await started(settings)
        asyncio.ensure_future(env.run(f"sleep {marker}"))
        await asyncio.sleep(0)          # asyncio.run cancels the command and closes the loop
        return env
    abandoned = asyncio.run(abandon())
    wait_for(lambda: live_processes_mentioning(f"sleep {marker}") == [], timeout=3, what="the command to be killed")
    result, _ = run_command(settings, "echo still here")
    assert result.output == "still here\n"
    asyncio.run(abandoned.close())      # its control group, which a run's end would remove


def test_a_command_that_cannot_start_is_an_error_result(tmp_path):
    async def scenario():
        env = await started(make_settings(tmp_path))
        env.prompt_dir.rmdir()          # bash cannot start in a directory that is gone
        try:
            return await env.run("echo never")
        finally:
            await env.close()
    result = asyncio.run(scenario())
    assert result.exit_code is None and result.output == ""
    assert result.error.startswith("could not start bash:")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_close_removes_read_only_directories_a_command_left(tmp_path):
    async def scenario():
        env = await started(make_settings(tmp_path))
        await env.run("mkdir -p cache/a/b && touch cache/a/b/f && chmod -R a-w cache && chmod 000 cache/a/b")
        await env.close()
        return env
    assert not asyncio.run(scenario()).prompt_dir.exists()


def test_keep_workdirs_leaves_the_directory(tmp_path):
    result, env = run_command(make_settings(tmp_path, keep_workdirs=True), "echo kept > note.txt")
    assert (env.prompt_dir / "note.txt").read_text() == "kept\n"


def test_create_environment_builds_a_local_environment(tmp_path):
    env = create_environment("local", make_settings(tmp_path), prompt_index=2, cwd="/app")
    assert isinstance(env, LocalEnvironment) and env.cwd == "/app" and env.prompt_index == 2
    assert "local" in ENVIRONMENT_KINDS


def test_create_environment_rejects_an_unknown_kind_naming_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="'podman'.*known kinds: .*local"):
        create_environment("podman", make_settings(tmp_path), prompt_index=0)


def run_terminal(tmp_path: Path, args: dict, **overrides: object) -> dict:
    async def scenario():
        settings = make_settings(tmp_path, **overrides)
        env = await started(settings)
        try:
            return await terminal(args, ToolContext(env=env, settings=settings))
        finally:
            await env.close()
    return asyncio.run(scenario())


def test_terminal_tool_timeout_is_capped_by_the_run_limit(tmp_path):
    result = run_terminal(tmp_path, {"command": "sleep 30", "timeout": 600}, command_timeout=0.5)
    assert result["error"] == "Command timed out after 0.5s and was killed"


@pytest.mark.parametrize("args", [{}, {"command": ""}, {"command": 5},
                                  {"command": "ls", "timeout": 0}, {"command": "ls", "timeout": "9"},
                                  {"command": "ls", "timeout": True}])
def test_terminal_tool_rejects_invalid_arguments(tmp_path, args):
    with pytest.raises(ToolError):
        run_terminal(tmp_path, args)


def test_the_workspace_walk_goes_on_where_it_paused(tmp_path):
    for number in range(30):
        directory = tmp_path / f"d{number % 3}"
        directory.mkdir(exist_ok=True)
        (directory / f"f{number}").write_bytes(os.urandom(8192))
    total = sum(os.stat(path).st_blocks * 512 for path in tmp_path.rglob("*"))
    paused = DiskUsageWalk(tmp_path, total - 1)
    assert paused.run(max_entries=5) is None
    assert paused.run() is True
    assert DiskUsageWalk(tmp_path, total).run(max_entries=5) is None
    assert DiskUsageWalk(tmp_path, total).run() is False
