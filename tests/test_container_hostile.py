"""The docker backend (Docker and Podman) against what goes wrong while a command runs: its container
ended from outside (an operator, the engine) in the middle of the command.

The engines and the image come from `.ci/container_engine.sh` (see tests/container_backends.py);
without them these tests are skipped, saying how to set them up.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from container_backends import ENGINES, EngineBackend, environment, make_backend, make_settings

from batchrun.environments.base import CommandResult, EnvironmentLostError
from batchrun.environments.container import ContainerEnvironment
from batchrun.environments.docker import CLI_VARIABLE
from batchrun.environments.limits import ResourceLimits
from batchrun.tools import ToolError

# What a command sleeps while its container is ended from outside.
SLEEPING_COMMAND = "echo started; sleep 30"
# How long the outside waits for it to be running in the container.
RUNNING_DEADLINE_SECONDS = 60.0


@pytest.fixture(params=ENGINES)
def engine(request, tmp_path, monkeypatch) -> EngineBackend:
    backend = make_backend(request.param, tmp_path, monkeypatch)
    assert isinstance(backend, EngineBackend)
    return backend


async def run_while_outside(env: ContainerEnvironment, engine: EngineBackend, *action: str,
                            at_once: bool = False) -> CommandResult:
    """SLEEPING_COMMAND in ``env``, with ``engine``'s ``action`` done to its container once the engine lists
    the command's `sleep` (a slow engine's command may still be starting seconds after it was asked for),
    or ``at_once``, while the command is being started."""
    async def act() -> None:
        deadline = time.monotonic() + RUNNING_DEADLINE_SECONDS
        while not at_once and "sleep 30" not in await asyncio.to_thread(engine.run, "top", env.name):
            assert time.monotonic() < deadline, "the command never ran in the container"
            await asyncio.sleep(0.1)
        await asyncio.to_thread(engine.run, *action, env.name)

    acting = asyncio.ensure_future(act())
    try:
        return await env.run(SLEEPING_COMMAND)
    finally:
        await acting


@pytest.mark.parametrize("action", [("rm", "-f"), ("kill",), ("stop", "--time", "0")], ids=["rm", "kill", "stop"])
def test_a_command_whose_container_is_ended_from_outside_while_it_runs_loses_the_environment(
        engine, tmp_path, action):
    """The engine kills the command with its container (exit status 137, as the memory limit's kill): taken
    for the command's own, the model would be told it was killed and the row could be kept as finished."""
    env = environment(engine, make_settings(tmp_path))
    try:
        asyncio.run(env.start())
        with pytest.raises(EnvironmentLostError, match="^the command could not run to its end in the container: "):
            asyncio.run(run_while_outside(env, engine, *action))
    finally:
        asyncio.run(env.close())


@pytest.mark.parametrize("action", [("rm", "-f"), ("kill",), ("stop", "--time", "0")], ids=["rm", "kill", "stop"])
def test_a_command_whose_container_is_ended_from_outside_as_it_starts_loses_the_environment(
        engine, tmp_path, action):
    """The engine then fails to start the command in the container (exit status 126, as a command's own
    "cannot execute"): a slow engine's command is still starting when a moment has passed."""
    env = environment(engine, make_settings(tmp_path))
    try:
        asyncio.run(env.start())
        with pytest.raises(EnvironmentLostError, match="^the command could not run to its end in the container: "):
            asyncio.run(run_while_outside(env, engine, *action, at_once=True))
    finally:
        asyncio.run(env.close())


def lagging_engine(engine: EngineBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Drive ``engine`` through a CLI that shows every container running: the state an engine shows for a
    moment after it told of a command killed with its container (it learns of the command's end first)."""
    cli = tmp_path / "lagging-cli"
    cli.write_text(f'#!/bin/sh\nif [ "$1" = inspect ] && [ "$3" = "{{{{.State.Running}}}}" ]; then echo true; exit 0; fi\n'
                   f'exec {shutil.which(engine.name)} "$@"\n')
    cli.chmod(0o755)
    monkeypatch.setenv(CLI_VARIABLE, str(cli))


def test_a_command_killed_with_its_container_loses_the_environment_while_the_engine_still_shows_it_running(
        engine, tmp_path, monkeypatch):
    """Only a command run in it tells: one of its own is killed as the memory limit's kill would."""
    lagging_engine(engine, tmp_path, monkeypatch)
    env = environment(engine, make_settings(tmp_path))
    try:
        asyncio.run(env.start())
        with pytest.raises(EnvironmentLostError, match="^the command could not run to its end in the container: "):
            asyncio.run(run_while_outside(env, engine, "kill"))
    finally:
        asyncio.run(env.close())


def run_in_64_mb(engine: EngineBackend, tmp_path: Path, *commands: str) -> list[CommandResult]:
    """The commands' results, run in turn in one new container held to 64 MB of memory."""
    env = environment(engine, make_settings(tmp_path, limits=ResourceLimits(memory_mb=64)))
    try:
        asyncio.run(env.start())
        return [asyncio.run(env.run(command)) for command in commands]
    finally:
        asyncio.run(env.close())


def test_a_command_is_the_first_the_kernel_kills_for_memory_not_the_containers_first_process(engine, tmp_path):
    # Before, all had an oom_score_adj of 0: a second kill, while the first victim's memory was being freed,
    # once took the first process (CI, 2026-12-06), and the container ended with the command.
    command, first = run_in_64_mb(engine, tmp_path, "cat /proc/self/oom_score_adj", "cat /proc/1/oom_score_adj")
    assert (command.output, first.output) == ("1000\n", "0\n")


@pytest.mark.parametrize("lagging", [False, True], ids=["engine", "engine-shown-running"])
def test_a_command_killed_for_its_memory_keeps_the_environment(engine, tmp_path, monkeypatch, lagging):
    """Its exit status is the one a container ended from outside gives: only the container's state tells
    them apart, and where the engine shows it running whatever happened, a command run in it."""
    if lagging:
        lagging_engine(engine, tmp_path, monkeypatch)
    killed, after = run_in_64_mb(engine, tmp_path, "head -c 300m /dev/zero | tail", "echo still here")
    assert killed.exit_code == 137
    assert after.output == "still here\n"


# -- the file tools against what a command leaves -------------------------------------------------------------


Step = Callable[[ContainerEnvironment], Awaitable[object]]


def in_container(engine: EngineBackend, tmp_path: Path, steps: list[Step], **limits: int) -> list[object]:
    """What each of ``steps`` gave (or the ToolError it raised), run in turn in one new container with
    ``limits``."""
    async def outcome(step: Step, env: ContainerEnvironment) -> object:
        try:
            return await step(env)
        except ToolError as exc:
            return exc

    env = environment(engine, make_settings(tmp_path, limits=ResourceLimits(**limits)))
    try:
        asyncio.run(env.start())
        return [asyncio.run(outcome(step, env)) for step in steps]
    finally:
        asyncio.run(env.close())


def test_a_write_replaces_the_file_whole_and_its_hard_links_keep_their_content(engine, tmp_path):
    # Written in place, a reader saw the file half written, and the write reached every other name of it.
    results = in_container(engine, tmp_path, [
        lambda env: env.run("echo old > a; chmod 751 a; ln a elsewhere"),
        lambda env: env.write_file("a", b"new"),
        lambda env: env.run("cat a; echo; cat elsewhere; stat -c %a a; ls -A")])
    assert results[-1].output == "new\nold\n751\na\nelsewhere\n"


def test_a_write_cut_short_by_a_full_disk_keeps_the_old_content(engine, tmp_path):
    # Written in place, the failed write left 4 MiB of a half-written file where the old one was.
    results = in_container(engine, tmp_path, [
        lambda env: env.run("echo old > /tmp/f"),
        lambda env: env.write_file("/tmp/f", b"x" * (3 << 20)),
        lambda env: env.run("cat /tmp/f; ls -A /tmp")], tmp_mb=2)
    assert isinstance(results[1], ToolError)
    assert results[-1].output == "old\nf\n"


def test_a_directory_whose_name_ends_in_a_newline_is_written_in(engine, tmp_path):
    # $(dirname) dropped the newline: the write failed, and left a directory named without it.
    results = in_container(engine, tmp_path, [
        lambda env: env.write_file("dir\n/f.txt", b"here"),
        lambda env: env.read_file("dir\n/f.txt"),
        lambda env: env.run("ls -A | wc -l")])      # one name, of two lines
    assert results[1:] == [b"here", CommandResult(output="2\n", exit_code=0)]


def test_a_write_through_a_symbolic_link_writes_its_target(engine, tmp_path):
    # As the other backends' file tools do; renamed over, the link itself would have become the file.
    results = in_container(engine, tmp_path, [
        lambda env: env.run("mkdir real; echo old > real/f; ln -s real/f link"),
        lambda env: env.write_file("link", b"new"),
        lambda env: env.run("cat real/f; echo; readlink link; ls -A real")])
    assert results[-1].output == "new\nreal/f\nf\n"


def test_a_file_the_engine_mounted_into_the_container_is_written_in_place(engine, tmp_path):
    # Renamed over, /etc/hosts (a file the engine bind-mounts) could not be written: "Device or resource busy".
    results = in_container(engine, tmp_path, [lambda env: env.write_file("/etc/hosts", b"127.0.0.1 here\n"),
                                              lambda env: env.run("cat /etc/hosts")])
    assert results[-1].output == "127.0.0.1 here\n"


def test_a_write_keeps_the_files_permission_bits_but_not_setuid(engine, tmp_path):
    # As the other backends' file tools do: a model's new content never runs with the owner's rights.
    results = in_container(engine, tmp_path, [lambda env: env.run("echo old > f; chmod 4751 f"),
                                              lambda env: env.write_file("f", b"new"),
                                              lambda env: env.run("stat -c %a f")])
    assert results[-1].output == "751\n"
