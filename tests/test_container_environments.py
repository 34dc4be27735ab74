"""What every container backend (docker and podman engines, singularity, modal) keeps beyond the
environment contract, which test_environment_contract.py holds them to with the other backends: images
pulled or refused, a start failing once the container exists, the row's cwd as a path in the container,
the file tools reaching any path in it; and what only a stand-in can show: pulls that are slow or fail on
demand, an engine that hangs.

Real engines: tests/container_backends.py says how they are set up, and the tests that need one are
skipped where none is. Engine-only behaviour (limits, the runner killed) is in test_container_engines.py,
Modal's own in test_modal_environment.py.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from container_backends import (
    BACKENDS,
    STAND_IN_IMAGE,
    UNPULLABLE_IMAGE,
    Backend,
    StandInBackend,
    environment,
    install_stand_in_clis,
    make_backend,
    make_settings,
)

from batchrun.environments import container as container_module
from batchrun.environments import create_environment, environment_class
from batchrun.environments import docker as docker_module
from batchrun.environments.base import EnvironmentSettings, EnvironmentSetupError
from batchrun.environments.container import CliContainerEnvironment, ContainerEnvironment
from batchrun.environments.container_layer import LayerWatch, free_past_ends, parse_layer, root_upper_dir
from batchrun.environments.image_lock import image_file_stem
from batchrun.environments.limits import ResourceLimits
from batchrun.environments.singularity import sif_cache
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.files import read_file, write_file


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path, monkeypatch) -> Backend:
    return make_backend(request.param, tmp_path, monkeypatch)


def started(backend: Backend, settings: EnvironmentSettings, **kwargs: object) -> ContainerEnvironment:
    """An environment started in its own event loop (each tool call below runs in another)."""
    env = environment(backend, settings, **kwargs)
    asyncio.run(env.start())
    return env


def call(env: ContainerEnvironment, handler, **args: object) -> dict:
    return asyncio.run(handler(args, ToolContext(env=env, settings=env.settings)))


def close(env: ContainerEnvironment) -> None:
    asyncio.run(env.close())


# -- the container's life ------------------------------------------------------------------------

def test_an_image_that_cannot_be_pulled_fails_the_start_naming_it_and_creates_nothing(backend, tmp_path,
                                                                                    monkeypatch):
    settings = make_settings(tmp_path)
    explanation = backend.fail_pulls_of(UNPULLABLE_IMAGE, monkeypatch)
    env = environment(backend, settings, image=UNPULLABLE_IMAGE)
    with pytest.raises(EnvironmentSetupError) as failure:
        asyncio.run(env.start())
    message = str(failure.value)
    assert UNPULLABLE_IMAGE in message and explanation in message       # the runtime's own reason
    assert len(message) <= container_module.SETUP_MESSAGE_CHARS        # one console line, whole
    assert backend.live(settings.run_label) == []


def test_a_prompt_without_an_image_gets_the_default_image(backend, tmp_path):
    settings = make_settings(tmp_path, default_image=backend.image)
    env = started(backend, settings, image=None)
    close(env)
    assert env.image == backend.image


def test_a_start_failing_after_the_container_exists_removes_it(backend, tmp_path, monkeypatch):
    """The row's cwd cannot be made, a file stands in its way: the container must go."""
    settings = make_settings(tmp_path)
    env = environment(backend, settings, cwd="/blocked/sub")
    original_create = type(env)._create

    async def create_then_block(self) -> None:
        await original_create(self)
        await self._exec(["mkdir", "-p", "/blocked"], workdir="/")
        await self._exec(["touch", "/blocked/sub"], workdir="/")
    monkeypatch.setattr(type(env), "_create", create_then_block)
    with pytest.raises(EnvironmentSetupError, match="/blocked/sub"):
        asyncio.run(env.start())
    assert backend.live(settings.run_label) == []


def test_a_container_is_removed_when_the_runs_directory_goes_between_the_look_and_the_removal(
        backend, tmp_path, monkeypatch):
    """The engine CLIs run in the run's directory while it exists; its clean-up may remove it just after
    a close looked (the look is made to find it there, below)."""
    if not issubclass(environment_class(backend.kind), CliContainerEnvironment):
        pytest.skip("no CLI: the backend's calls have no working directory")
    settings = make_settings(tmp_path)
    env = started(backend, settings)
    monkeypatch.setattr(CliContainerEnvironment, "_cli_directory", lambda self: self.settings.work_root)
    shutil.rmtree(settings.work_root)
    close(env)
    assert backend.live(settings.run_label) == []


# -- paths in the container -------------------------------------------------------------------------

@pytest.mark.parametrize(("cwd", "workdir"), [(None, "/workspace"), ("/app/src", "/app/src"),
                                              ("proj", "/workspace/proj")])
def test_commands_start_in_the_rows_cwd_made_in_the_container(backend, tmp_path, cwd, workdir):
    env = started(backend, make_settings(tmp_path), cwd=cwd)
    try:
        made = asyncio.run(env.run("echo here > marker"))
        assert made.exit_code == 0, made
        assert asyncio.run(env.read_file(f"{workdir}/marker")) == b"here\n"
    finally:
        close(env)


def test_a_command_removing_its_working_directory_leaves_the_later_commands_and_file_tools_working(backend, tmp_path):
    """Every later call failed where the runtime was told to start in a directory no longer there."""
    env = started(backend, make_settings(tmp_path), cwd="proj")
    try:
        assert asyncio.run(env.run("cd .. && rm -rf proj")).exit_code == 0
        after = asyncio.run(env.run("echo back > here.txt"))
        written = asyncio.run(env.write_file("notes.txt", b"again"))
        read = asyncio.run(env.read_file("/workspace/proj/here.txt"))
    finally:
        close(env)
    assert (after.output, after.exit_code, written, read) == ("", 0, "notes.txt", b"back\n")


def test_file_tools_reach_absolute_paths_inside_the_container_only(backend, tmp_path):
    env = started(backend, make_settings(tmp_path))
    try:
        assert call(env, write_file, path="/opt/notes.txt", content="hi")["path"] == "/opt/notes.txt"
        assert call(env, read_file, path="../opt/notes.txt")["content"] == "hi"
        with pytest.raises(ToolError, match="climbs above"):
            call(env, read_file, path="../../../etc/passwd")
    finally:
        close(env)


def test_writing_over_a_fifo_in_the_container_is_refused_as_not_a_regular_file(backend, tmp_path):
    """A FIFO with no reader held the write (and the process writing in the container) for minutes."""
    env = started(backend, make_settings(tmp_path))
    try:
        assert asyncio.run(env.run("mkfifo pipe")).exit_code == 0
        with pytest.raises(ToolError, match="'pipe' is not a regular file"):
            asyncio.run(env.write_file("pipe", b"data"))
    finally:
        close(env)


# -- a missing program -------------------------------------------------------------------------------

@pytest.mark.parametrize(("kind", "hint"), [("docker", "install Docker"), ("singularity", "install SingularityCE"),
                                            ("apptainer", "install Apptainer")])
def test_a_missing_program_fails_the_start_with_an_install_hint(tmp_path, monkeypatch, kind, hint):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    env = create_environment(kind, make_settings(tmp_path), prompt_index=0, image=STAND_IN_IMAGE)
    with pytest.raises(EnvironmentSetupError, match=hint):
        asyncio.run(env.start())
    asyncio.run(env.close())        # nothing to remove, and no error for it


def test_the_container_cli_variable_names_the_program_the_docker_backend_drives(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv(docker_module.CLI_VARIABLE, "podman")
    env = create_environment("docker", make_settings(tmp_path), prompt_index=0, image=STAND_IN_IMAGE)
    with pytest.raises(EnvironmentSetupError, match="`podman` was not found on PATH"):
        asyncio.run(env.start())


# -- only a stand-in can: slow and failing pulls, a hung engine ----------------------------------------

@pytest.fixture(params=["docker", "singularity"])
def stand_in(request, tmp_path, monkeypatch) -> StandInBackend:
    return install_stand_in_clis(tmp_path, monkeypatch, request.param)


@pytest.fixture
def docker_stand_in(tmp_path, monkeypatch) -> StandInBackend:
    return install_stand_in_clis(tmp_path, monkeypatch, "docker")


@pytest.fixture
def singularity_stand_in(tmp_path, monkeypatch) -> StandInBackend:
    return install_stand_in_clis(tmp_path, monkeypatch, "singularity")


@pytest.fixture(autouse=True)
def fresh_engine_answers(monkeypatch):
    """Each test asks the engine afresh: the answers a process keeps would hide one test's engine
    from the next."""
    monkeypatch.setattr(docker_module, "_reachable_engines", set())
    monkeypatch.setattr(docker_module, "_present_images", set())


def creations(stand_in: StandInBackend) -> list[list]:
    return stand_in.calls(stand_in.kind, *(("run",) if stand_in.kind == "docker" else ("instance", "start")))


def test_docker_checks_the_engine_then_pulls_a_missing_image_before_creating_the_container(docker_stand_in,
                                                                                          tmp_path):
    close(started(docker_stand_in, make_settings(tmp_path)))
    commands = [argv[0] if argv[0] != "image" else "image inspect" for argv in docker_stand_in.calls("docker")]
    assert commands[:5] == ["version", "--version", "image inspect", "image inspect", "pull"]
    assert commands.index("pull") < commands.index("run")
    assert docker_stand_in.calls("docker", "pull") == [["pull", STAND_IN_IMAGE]]


def test_many_prompts_starting_together_pull_their_image_once(stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PULL_SECONDS", "0.3")
    settings = make_settings(tmp_path)

    async def scenario():
        envs = [environment(stand_in, settings, prompt_index=i) for i in range(6)]
        await asyncio.gather(*(env.start() for env in envs))
        await asyncio.gather(*(env.close() for env in envs))
    asyncio.run(scenario())
    assert len(stand_in.calls(stand_in.kind, "pull")) == 1
    assert len(creations(stand_in)) == 6


def _start_three_and_close(kind: str, settings: EnvironmentSettings, first_index: int) -> None:
    async def scenario():
        envs = [create_environment(kind, settings, prompt_index=first_index + i, image=STAND_IN_IMAGE)
                for i in range(3)]
        await asyncio.gather(*(env.start() for env in envs))
        await asyncio.gather(*(env.close() for env in envs))
    asyncio.run(scenario())


def test_worker_processes_starting_together_pull_their_image_once(stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PULL_SECONDS", "0.3")
    settings = make_settings(tmp_path)
    fork = multiprocessing.get_context("fork")     # how the runner starts its workers
    workers = [fork.Process(target=_start_three_and_close, args=(stand_in.kind, settings, 3 * n))
               for n in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert len(stand_in.calls(stand_in.kind, "pull")) == 1
    assert len(creations(stand_in)) == 6


def test_prompts_waiting_for_a_pull_that_fails_fail_with_it_rather_than_pull_again(stand_in, tmp_path, monkeypatch):
    """Each waiter pulled again once it got the image's lock, one after another: a run of many prompts
    naming an image that cannot be pulled spent a pull's time per prompt, its other prompts waiting."""
    monkeypatch.setenv("FAKE_PULL_SECONDS", "0.3")
    stand_in.fail_pulls_of(STAND_IN_IMAGE, monkeypatch)
    settings = make_settings(tmp_path)

    async def scenario():
        envs = [environment(stand_in, settings, prompt_index=i) for i in range(6)]
        outcomes = await asyncio.gather(*(env.start() for env in envs), return_exceptions=True)
        await asyncio.gather(*(env.close() for env in envs))
        return outcomes
    outcomes = asyncio.run(scenario())
    assert len(stand_in.calls(stand_in.kind, "pull")) == 1
    assert all(isinstance(outcome, EnvironmentSetupError) and "denied" in str(outcome) for outcome in outcomes)


def test_cancelling_a_start_during_the_pull_leaves_nothing_and_frees_the_image(stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PULL_SECONDS", "1")
    settings = make_settings(tmp_path)

    async def scenario():
        first = environment(stand_in, settings, prompt_index=0)
        task = asyncio.create_task(first.start())
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await first.close()
        assert creations(stand_in) == []
        second = environment(stand_in, settings, prompt_index=1)
        await asyncio.wait_for(second.start(), 30)      # the image's lock was not left taken
        await second.close()
    asyncio.run(scenario())
    assert stand_in.live(settings.run_label) == []


def test_cancelling_a_start_while_the_container_is_created_lets_the_creation_finish_then_removes_it(
        docker_stand_in, tmp_path, monkeypatch):
    """A container CLI killed half-way through creating leaves what no listing shows (Podman)."""
    settings = make_settings(tmp_path)
    close(started(docker_stand_in, settings))          # the image is there now
    monkeypatch.setenv("FAKE_RUN_SECONDS", "1")

    async def scenario():
        env = environment(docker_stand_in, settings, prompt_index=1)
        task = asyncio.create_task(env.start())
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(scenario())
    [_, (_, second)] = docker_stand_in.calls("docker", "created")
    assert docker_stand_in.calls("docker", "rm")[-1] == ["rm", "-f", "-v", second]
    assert docker_stand_in.live(settings.run_label) == []


def test_docker_engine_is_asked_once_per_process_even_by_prompts_starting_together(docker_stand_in, tmp_path):
    settings = make_settings(tmp_path)

    async def scenario():
        for wave in range(2):
            envs = [environment(docker_stand_in, settings, prompt_index=4 * wave + i) for i in range(4)]
            await asyncio.gather(*(env.start() for env in envs))
            await asyncio.gather(*(env.close() for env in envs))
    asyncio.run(scenario())
    assert len(docker_stand_in.calls("docker", "version")) == 1
    assert len(docker_stand_in.calls("docker", "pull")) == 1


def test_a_hung_container_cli_is_given_up_on(docker_stand_in, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_EXEC_IGNORES_TIMEOUT", "1")
    monkeypatch.setattr(container_module, "_CLI_GRACE_SECONDS", 0.5)
    env = started(docker_stand_in, make_settings(tmp_path))
    began = time.monotonic()
    result = asyncio.run(env.run("sleep 30", timeout=1))
    close(env)
    assert result.timed_out and result.exit_code is None
    assert time.monotonic() - began < 10


def test_remove_leftovers_without_an_engine_does_nothing_and_raises_nothing(docker_stand_in, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("FAKE_DOCKER_ENGINE", "down")
    environment_class("docker").remove_leftovers(make_settings(tmp_path))
    assert docker_stand_in.calls("docker", "rm") == []


# -- singularity / apptainer ---------------------------------------------------------------------------

def test_singularity_keeps_one_sif_per_image_in_the_users_cache_shared_by_runs(singularity_stand_in, tmp_path):
    for run in ("first", "second"):
        settings = EnvironmentSettings(work_root=tmp_path / run, run_label=f"{run}-{tmp_path.name}")
        close(started(singularity_stand_in, settings))
    [pull] = singularity_stand_in.calls("singularity", "pull")
    assert pull[2] == f"docker://{STAND_IN_IMAGE}"
    cache = tmp_path / "cache" / "batch_runner" / "sif"
    assert sif_cache() == cache
    assert sorted(path.name for path in cache.iterdir() if path.suffix != ".lock") == \
        [f"{image_file_stem(STAND_IN_IMAGE)}.sif"]          # no partial file left
    assert len(singularity_stand_in.calls("singularity", "instance", "start")) == 2


def test_singularity_pull_removes_the_partial_file_of_a_pull_that_died(singularity_stand_in, tmp_path):
    stem = image_file_stem(STAND_IN_IMAGE)
    sif_cache().mkdir(parents=True)
    (sif_cache() / f"{stem}.dead0000.partial").write_text("half an image")
    close(started(singularity_stand_in, make_settings(tmp_path)))
    assert not (sif_cache() / f"{stem}.dead0000.partial").exists()
    assert (sif_cache() / f"{stem}.sif").is_file()


def test_singularity_instance_is_contained_without_network_with_the_prompt_dir_at_workspace(
        singularity_stand_in, tmp_path):
    env = started(singularity_stand_in, make_settings(tmp_path))
    [instance] = singularity_stand_in.containers()
    close(env)
    assert {"--containall", "--cleanenv", "--no-home", "--net", "--no-privs"} <= set(instance["options"])
    assert instance["network"] == "none"
    assert instance["binds"] == [[str(env.prompt_dir), "/workspace"]]
    assert not env.prompt_dir.exists()


def test_singularity_commands_run_without_root_privileges(singularity_stand_in, tmp_path):
    # As root, the runtimes give the container's root every capability unless told not to.
    env = started(singularity_stand_in, make_settings(tmp_path))

    async def scenario() -> None:
        await env.run("true")
        await env.write_file("f", b"x")
    asyncio.run(scenario())
    close(env)
    execs = singularity_stand_in.calls("singularity", "exec")
    assert execs and all("--no-privs" in call[:call.index(f"instance://{env.name}")] for call in execs)


def test_allow_network_leaves_the_singularity_network_alone(singularity_stand_in, tmp_path):
    close(started(singularity_stand_in, make_settings(tmp_path, allow_network=True)))
    [created] = singularity_stand_in.calls("singularity", "instance", "start")
    assert "--network" not in created


def test_apptainer_kind_drives_the_apptainer_program(tmp_path, monkeypatch):
    stand_in = install_stand_in_clis(tmp_path, monkeypatch, "apptainer")
    env = started(stand_in, make_settings(tmp_path))
    result = asyncio.run(env.run("echo hello"))
    close(env)
    assert result.output == "hello\n"
    assert stand_in.calls("apptainer", "instance", "start") and stand_in.calls("apptainer", "instance", "stop")


# -- the watch on a container's writable layer ------------------------------------------------------

OVERLAY_ROOT = (b"99 75 0:40 / / rw,relatime master:40 - overlay overlay rw,lowerdir=/s/l/A:/s/l/B,"
                b"upperdir=/s/overlay/with\\040space/diff,workdir=/s/overlay/with\\040space/work\n"
                b"100 99 0:42 / /proc rw,nosuid - proc proc rw\n")


def test_the_layer_is_the_upper_directory_of_the_overlay_at_the_root():
    assert root_upper_dir(OVERLAY_ROOT) == b"/s/overlay/with space/diff"


def test_a_root_that_is_not_an_overlay_has_no_layer():
    assert root_upper_dir(b"22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n") is None


def test_the_last_mount_at_the_root_is_the_one_seen():
    covered = b"23 22 0:50 / / rw - tmpfs tmpfs rw\n"
    assert root_upper_dir(OVERLAY_ROOT + covered) is None


def test_a_layer_is_not_watched_where_the_pid_names_a_process_whose_root_is_not_that_layer(tmp_path):
    """A runner in a PID namespace of its own sees another process under the engine's pid: killing it
    for the container's size would hit a stranger."""
    assert parse_layer(f"{os.getpid()}\t{tmp_path}\n") is None


@pytest.mark.parametrize("answer", ["0\t/x", "\t", "<no value>\t<no value>", "12", f"{os.getpid()}\trelative"])
def test_a_layer_is_not_watched_without_a_running_container_or_an_overlay_directory(answer):
    assert parse_layer(answer) is None


def test_a_layer_watch_whose_new_first_process_was_gone_signals_no_other_process(tmp_path):
    """The descriptor on the old first process is closed before the new one is opened; its number, soon
    another descriptor's (here one on an unrelated process), must not be what a kill for the size hits."""
    async def scenario():
        first = subprocess.Popen(["sleep", "60"])
        gone = subprocess.Popen(["true"])
        gone.wait()
        layer = LayerWatch(tmp_path, first.pid, ResourceLimits())
        try:
            with pytest.raises(OSError):
                layer.restarted(gone.pid)
            bystander = subprocess.Popen(["sleep", "60"])
            held = os.pidfd_open(bystander.pid)       # takes the number the layer's descriptor had
            layer.watch.stop()
            await asyncio.sleep(0.2)
            alive = bystander.poll() is None
            os.close(held)
            bystander.kill()
            return alive
        finally:
            layer.close()
            first.kill()
    assert asyncio.run(scenario())


def reserved_past_end(path: Path, content: bytes, reserved: int) -> os.stat_result:
    """``path`` holding ``content`` and ``reserved`` bytes of disk past its end (fallocate --keep-size)."""
    path.write_bytes(content)
    done = subprocess.run(["fallocate", "--keep-size", "-o", "0", "-l", str(reserved), str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"this filesystem cannot reserve space past a file's end: {done.stderr.strip()}")
    os.utime(path, ns=(1_000_000_000, 2_000_000_000))
    return path.stat()


def test_the_space_files_of_a_layer_reserved_past_their_ends_is_given_back_and_nothing_else_changes(tmp_path):
    layer = tmp_path / "layer"
    (layer / "deep" / "er").mkdir(parents=True)
    before = reserved_past_end(layer / "deep" / "er" / "log", b"kept", 64 << 20)
    free_past_ends(layer)
    after = (layer / "deep" / "er" / "log").stat()
    assert before.st_blocks * 512 >= 64 << 20 and after.st_blocks * 512 <= after.st_blksize
    assert (layer / "deep" / "er" / "log").read_bytes() == b"kept"
    assert (after.st_mtime_ns, after.st_atime_ns) == (2_000_000_000, 1_000_000_000)


def test_giving_back_space_follows_no_link_out_of_the_layer(tmp_path):
    outside = reserved_past_end(tmp_path / "outside", b"theirs", 64 << 20)
    layer = tmp_path / "layer"
    layer.mkdir()
    (layer / "link").symlink_to(tmp_path / "outside")
    (layer / "up").symlink_to(tmp_path)
    free_past_ends(layer)
    assert (tmp_path / "outside").stat().st_blocks == outside.st_blocks
