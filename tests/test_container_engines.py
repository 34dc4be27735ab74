"""What only a real engine shows: isolation, limits and clean-up of the docker backend, driven through
Docker and through Podman (TERMINAL_CONTAINER_CLI=podman), down to the runner killed mid-command.

The engines and the image come from `.ci/container_engine.sh` (see tests/container_backends.py);
without them these tests are skipped, saying how to set them up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    batch_rows,
    batch_runner_command,
    cli_environment,
    default_stop_signals,
    endpoint_args,
    read_jsonl,
    run_cli,
    wait_for,
    write_dataset,
)
from container_backends import ENGINES, UNPULLABLE_IMAGE, EngineBackend, environment, make_backend, make_settings

from batchrun.environments import docker as docker_module
from batchrun.environments import environment_class
from batchrun.environments.base import EnvironmentLostError, EnvironmentSetupError, ToolError, run_identity
from batchrun.environments.limits import ResourceLimits, open_files_per_process


@pytest.fixture(params=ENGINES)
def engine(request, tmp_path, monkeypatch) -> EngineBackend:
    backend = make_backend(request.param, tmp_path, monkeypatch)
    assert isinstance(backend, EngineBackend)
    return backend


def started(engine: EngineBackend, settings, **kwargs: object):
    env = environment(engine, settings, **kwargs)
    asyncio.run(env.start())
    return env


# -- isolation ---------------------------------------------------------------------------------------

def test_the_container_is_labelled_with_the_run_and_prompt_and_has_no_network(engine, tmp_path):
    settings = make_settings(tmp_path)
    env = started(engine, settings, prompt_index=3)
    try:
        [labels] = [json.loads(engine.run("inspect", "--format", "{{json .Config.Labels}}", env.name))]
        interfaces = asyncio.run(env.run("ls /sys/class/net")).output.split()
        working_directory = asyncio.run(env.run("pwd")).output
    finally:
        asyncio.run(env.close())
    assert labels["batch_runner.run"] == settings.run_label and labels["batch_runner.prompt"] == "3"
    assert interfaces == ["lo"]
    assert working_directory == "/workspace\n"


def test_the_users_proxy_settings_and_their_credentials_stay_out_of_the_container(engine, tmp_path, monkeypatch):
    """Podman copies the proxy variables of the environment it runs in into each container it starts;
    Docker's CLI, the proxies of its configuration file."""
    for name in ("HTTPS_PROXY", "http_proxy", "NO_PROXY"):
        monkeypatch.setenv(name, "http://user:proxy-secret@proxy.example:3128")
    docker_config = tmp_path / "docker-config"
    docker_config.mkdir()
    proxy = "http://user:config-secret@proxy.example:3128"
    (docker_config / "config.json").write_text(json.dumps({"proxies": {"default": {
        "httpProxy": proxy, "httpsProxy": proxy, "ftpProxy": proxy, "allProxy": proxy, "noProxy": proxy}}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config))
    env = started(engine, make_settings(tmp_path, allow_network=True))
    try:
        seen = asyncio.run(env.run("env; tr '\\0' '\\n' < /proc/1/environ")).output
    finally:
        asyncio.run(env.close())
    assert "PATH=" in seen
    assert "secret" not in seen


def test_what_a_command_writes_to_the_containers_first_process_is_kept_nowhere(engine, tmp_path):
    """The engines keep a container's first process's output in a log on this machine's disk, where neither
    the workspace limit nor the writable layer's watch counts it, until the container is removed; its
    descriptors are open to root in the container."""
    env = started(engine, make_settings(tmp_path))
    try:
        written = asyncio.run(env.run("echo kept-by-the-engine > /proc/1/fd/1; echo kept-by-the-engine > /proc/1/fd/2"))
        logs = subprocess.run([engine.name, "logs", env.name], capture_output=True, text=True, timeout=60)
    finally:
        asyncio.run(env.close())
    assert written.exit_code == 0
    assert "kept-by-the-engine" not in logs.stdout + logs.stderr


def test_allow_network_gives_the_container_the_engines_network(tmp_path, monkeypatch):
    """Docker only: the test engines give no container a network of its own (see container_engine.sh)."""
    engine = make_backend("docker", tmp_path, monkeypatch)
    env = started(engine, make_settings(tmp_path, allow_network=True))
    try:
        mode = engine.run("inspect", "--format", "{{.HostConfig.NetworkMode}}", env.name).strip()
    finally:
        asyncio.run(env.close())
    assert mode != "none"


# -- limits ------------------------------------------------------------------------------------------

@pytest.fixture
def capped(engine, tmp_path):
    """A container with small limits: 64 MB of memory, 32 processes, 8 MB of /tmp."""
    limits = ResourceLimits(memory_mb=64, processes=32, tmp_mb=8)
    env = started(engine, make_settings(tmp_path, limits=limits))
    yield env
    asyncio.run(env.close())


def test_a_command_going_over_the_memory_limit_is_killed(capped):
    result = asyncio.run(capped.run("head -c 300m /dev/zero | tail > /dev/null; echo status $?"))
    assert "status 137" in result.output          # SIGKILL from the engine's memory control group


def test_a_command_killed_for_its_memory_leaves_nothing_where_the_runner_was_started(engine, tmp_path, monkeypatch):
    """Podman's monitor of a command writes files named for the kill (`oom`, `oomKilled`) into its
    current directory: the user's, had the runner not given the engine's CLI one of the run's own."""
    users_directory = tmp_path / "users-directory"
    users_directory.mkdir()
    monkeypatch.chdir(users_directory)
    env = started(engine, make_settings(tmp_path, limits=ResourceLimits(memory_mb=64)))
    try:
        asyncio.run(env.run("head -c 300m /dev/zero | tail > /dev/null"))
    finally:
        asyncio.run(env.close())
    assert list(users_directory.iterdir()) == []


def test_processes_beyond_the_limit_cannot_start(capped):
    result = asyncio.run(capped.run("for i in $(seq 60); do sleep 1 & done; wait"))
    assert "Cannot fork" in result.output


def test_processes_that_ended_no_longer_count_against_the_limit(capped):
    """Orphans go to the container's first process, which must reap them: a zombie holds its place in
    the process limit for as long as the container lives."""
    asyncio.run(capped.run("for i in $(seq 60); do (sleep 0.01 &); sleep 0.02; done"))
    after = asyncio.run(capped.run("for i in $(seq 8); do sleep 0.1 & done; wait; echo forked"))
    assert after.output == "forked\n"


def test_a_command_killing_every_process_it_may_leaves_the_container_running(engine, tmp_path):
    env = started(engine, make_settings(tmp_path))
    try:
        asyncio.run(env.run("kill -9 -1; kill -TERM -1"))
        after = asyncio.run(env.run("echo alive"))
    finally:
        asyncio.run(env.close())
    assert (after.output, after.exit_code) == ("alive\n", 0)


def test_tmp_is_capped_at_its_size(capped):
    result = asyncio.run(capped.run("head -c 20m /dev/zero > /tmp/big; wc -c < /tmp/big"))
    assert "No space left on device" in result.output
    assert result.output.split()[-1] == str(8 * 1024 * 1024)


def test_root_in_the_container_keeps_only_the_capabilities_ordinary_work_needs(engine, tmp_path):
    """Root in its own container may change owners and drop to other users, but not make device nodes,
    open raw sockets or chroot."""
    env = started(engine, make_settings(tmp_path))
    try:
        owners = asyncio.run(env.run("touch f && chown nobody f && stat -c %U f && setpriv --reuid=65534 "
                                     "--regid=65534 --clear-groups id -u"))
        refused = asyncio.run(env.run("mknod /dev/mem2 c 1 1; chroot / true; echo $?"))
        bounding = asyncio.run(env.run("grep CapBnd /proc/self/status"))
    finally:
        asyncio.run(env.close())
    assert owners.output == "nobody\n65534\n"
    assert "mknod: /dev/mem2: Operation not permitted" in refused.output and refused.output.endswith("125\n")
    capabilities = int(bounding.output.split()[1], 16)
    cap_mknod, cap_net_raw, cap_sys_chroot, cap_setfcap = 27, 13, 18, 31
    assert not capabilities & (1 << cap_mknod | 1 << cap_net_raw | 1 << cap_sys_chroot | 1 << cap_setfcap)


# A package of one file owned by another user, built and installed in the container: what dpkg does as
# root (owners, modes, its database) needs no capability the container lost.
LOCAL_PACKAGE = ("mkdir -p /pkg/DEBIAN /pkg/opt/demo && printf 'Package: demo\\nVersion: 1\\nArchitecture: all\\n"
                 "Maintainer: t <t@example.com>\\nDescription: d\\n' > /pkg/DEBIAN/control && echo hi > /pkg/opt/demo/f "
                 "&& chown 1000:1000 /pkg/opt/demo/f && dpkg-deb --build /pkg /demo.deb > /dev/null && dpkg -i /demo.deb "
                 "> /dev/null && stat -c '%u %n' /opt/demo/f && useradd -m worker && su worker -c 'id -un'")


def test_root_in_the_container_installs_a_package_and_adds_a_user(engine, tmp_path):
    env = started(engine, make_settings(tmp_path))
    try:
        result = asyncio.run(env.run(LOCAL_PACKAGE))
    finally:
        asyncio.run(env.close())
    assert (result.output, result.exit_code) == ("1000 /opt/demo/f\nworker\n", 0)


@pytest.fixture
def small_disk(engine, tmp_path):
    """Settings whose workspace limit is 40 MB, where the container's writable layer can be watched."""
    engine.require_overlay()
    return make_settings(tmp_path, limits=ResourceLimits(workspace_mb=40))


def in_container(engine: EngineBackend, settings, steps):
    """Start an environment, run ``steps(env)`` and close it, all on one event loop: the disk watch
    runs on the loop the container was started on."""
    async def scenario():
        env = environment(engine, settings)
        await env.start()
        try:
            return await steps(env)
        finally:
            await env.close()
    return asyncio.run(scenario())


def test_a_container_writing_past_the_workspace_limit_is_stopped_while_it_writes(engine, small_disk):
    """Files of 30 MB each (each under the limit), written one after another: the watch on the
    container's writable layer kills its processes as it passes 40 MB, long before the tenth."""
    async def steps(env):
        writer = await env.run("for i in $(seq 10); do head -c 30m /dev/zero > /f$i; done; echo wrote all")
        left = await env.run("du -cm /f* | tail -1")
        return writer, left
    writer, left = in_container(engine, small_disk, steps)
    assert "wrote all" not in writer.output
    assert "went over its limit of 40 MB" in writer.error
    assert int(left.output.split()[0]) < 200


def test_a_writer_left_in_the_background_is_stopped_between_commands(engine, small_disk):
    async def steps(env):
        await env.run("(while :; do head -c 5m /dev/zero >> /grow; sleep 0.05; done) > /dev/null 2>&1 &")
        await asyncio.sleep(4)
        return await env.run("echo next; du -m /grow")
    after = in_container(engine, small_disk, steps)
    assert after.output.startswith("next\n") and int(after.output.split()[1]) < 100
    assert "went over its limit of 40 MB" in after.error


def test_a_container_stopped_for_its_size_runs_the_next_command_with_its_files(engine, small_disk):
    async def steps(env):
        stopped = await env.run("echo kept > notes.txt; head -c 30m /dev/zero > /a; head -c 30m /dev/zero > /b; "
                                "sleep 5")
        after = await env.run("rm /a /b; cat notes.txt")
        written = await env.write_file("more.txt", b"room again")
        return stopped, after, written
    stopped, after, written = in_container(engine, small_disk, steps)
    assert "went over its limit of 40 MB" in stopped.error
    assert (after.output, after.exit_code, after.error) == ("kept\n", 0, None)
    assert written == "more.txt"


def test_a_file_the_container_holds_open_after_deleting_it_counts_towards_the_limit(engine, small_disk):
    """No walk of the layer sees a deleted file that a process still holds: its space is found through
    the container's processes."""
    async def steps(env):
        return await env.run("(exec 3> /held; head -c 30m /dev/zero >&3; rm /held; sleep 30) & sleep 1; "
                             "head -c 30m /dev/zero > /named; sleep 5; echo slept")
    result = in_container(engine, small_disk, steps)
    assert "slept" not in result.output
    assert "went over its limit of 40 MB" in result.error


def test_empty_files_in_the_container_count_towards_the_workspace_limit(engine, small_disk):
    """Each takes an inode of the engine's disk and no block: it counts the disk's space per inode."""
    if os.statvfs(engine.storage()).f_files == 0:
        pytest.skip("the engine's disk makes inodes as it needs them: none can run out")

    async def steps(env):
        return await env.run("mkdir /e && cd /e && seq 20000 | xargs touch; sleep 5; echo finished")
    result = in_container(engine, small_disk, steps)
    assert "finished" not in result.output
    assert "went over its limit of 40 MB" in result.error


def test_a_container_cannot_take_the_disks_reserve(engine, tmp_path):
    engine.require_overlay()
    free_mb = shutil.disk_usage(engine.storage()).free // 2**20
    # A reserve just below what is free now: the first 64 MB or so of writing reaches it.
    settings = make_settings(tmp_path, limits=ResourceLimits(workspace_mb=10_000, disk_reserve_mb=max(free_mb - 64, 1)))

    async def steps(env):
        return await env.run("for i in $(seq 40); do head -c 25m /dev/zero > /f$i; done; echo finished")
    result = in_container(engine, settings, steps)
    assert "finished" not in result.output
    assert "almost full" in result.error


def test_a_stop_gives_back_the_space_a_file_reserved_past_its_end(engine, tmp_path):
    """`fallocate --keep-size` reserves space past a file's end in one call, which no file size limit
    bounds and the engines' system-call filters allow: the stop that follows frees it at once, and the
    file keeps every byte it had."""
    engine.require_overlay()
    storage = engine.storage()
    free_mb = shutil.disk_usage(storage).free // 2**20
    reserve_mb = max(free_mb - 64, 1)
    settings = make_settings(tmp_path, limits=ResourceLimits(workspace_mb=10_000, disk_reserve_mb=reserve_mb))

    async def steps(env):
        taken = await env.run("printf kept > /k; fallocate --keep-size -o 0 -l 400m /k; sleep 5; echo finished")
        free_after_stop = shutil.disk_usage(storage).free // 2**20
        return taken, free_after_stop, await env.run("cat /k; stat -c ' %s' /k")
    taken, free_after_stop, after = in_container(engine, settings, steps)
    assert "finished" not in taken.output and "almost full" in taken.error
    assert free_after_stop > reserve_mb
    assert after.output == "kept 4\n"


def test_the_files_the_engine_mounts_into_the_container_count_towards_the_workspace_limit(engine, small_disk):
    """/etc/hosts and /etc/hostname are files of the engine's on this machine's disk, outside the writable
    layer, and root in the container may write them."""
    async def steps(env):
        return await env.run("for f in /etc/hosts /etc/hostname; do head -c 30m /dev/zero > $f; done; sleep 5; "
                             "echo slept")
    result = in_container(engine, small_disk, steps)
    assert "slept" not in result.output
    assert "went over its limit of 40 MB" in result.error


def test_podmans_containerenv_counts_towards_the_workspace_limit(engine, small_disk):
    """Podman mounts /run/.containerenv, a file of its own beside the hosts file, into every container;
    its inspect does not name it. (Under Docker the file is the layer's.)"""
    async def steps(env):
        return await env.run("head -c 30m /dev/zero > /run/.containerenv; head -c 30m /dev/zero > /f; sleep 5; "
                             "echo slept")
    result = in_container(engine, small_disk, steps)
    assert "slept" not in result.output
    assert "went over its limit of 40 MB" in result.error


def test_a_stop_gives_back_the_space_reserved_past_the_end_of_a_file_the_engine_mounts(engine, tmp_path):
    engine.require_overlay()
    storage = engine.storage()
    reserve_mb = max(shutil.disk_usage(storage).free // 2**20 - 64, 1)
    settings = make_settings(tmp_path, limits=ResourceLimits(workspace_mb=10_000, disk_reserve_mb=reserve_mb))

    async def steps(env):
        taken = await env.run("fallocate --keep-size -o 0 -l 400m /etc/hosts; sleep 5; echo finished")
        return taken, shutil.disk_usage(storage).free // 2**20
    taken, free_after_stop = in_container(engine, settings, steps)
    assert "finished" not in taken.output and "almost full" in taken.error
    assert free_after_stop > reserve_mb


def test_no_file_in_the_container_can_outgrow_the_workspace_limit(engine, tmp_path):
    """`fallocate` reserves space in one call, faster than any look at the disk: the file size limit
    refuses it at once."""
    async def steps(env):
        return await env.run("fallocate -l 100m /big; echo $?; du -k /big")
    result = in_container(engine, make_settings(tmp_path, limits=ResourceLimits(workspace_mb=40)), steps)
    assert result.output.splitlines() == ["File size limit exceeded", "153", "0\t/big"]


# Stands in for the image's `sh`: run as our command wrapper (`sh -c SCRIPT sh BLOCKS OPEN_FILES DIRECTORY timeout
# ...`), it skips the script, and so the `ulimit` lines in it; any other use it hands to dash.
SHELL_SKIPPING_ULIMIT = ("printf '#!/bin/bash\\nif [ \"$1\" = -c ] && [ \"$3\" = sh ]; then shift 6; exec \"$@\"; fi\\n"
                         "exec /bin/dash \"$@\"\\n' > /sh.new && chmod +x /sh.new && mv /sh.new /bin/sh")


def test_a_containers_commands_cannot_hold_more_than_a_quarter_of_the_machines_open_files(engine, tmp_path):
    """The kernel's table of open files is the host's, shared with every other prompt: an engine's default
    (a million per process under Docker) let one prompt fill it."""
    async def steps(env):
        return await env.run("ulimit -Sn; ulimit -Hn")
    result = in_container(engine, make_settings(tmp_path, limits=ResourceLimits(processes=200)), steps)
    assert result.output.split() == [str(open_files_per_process(200))] * 2


def test_a_command_replacing_the_images_shell_cannot_lift_dockers_file_limits(tmp_path, monkeypatch):
    """Docker only: Podman's file limits are those each command's `sh` sets (see _file_limits)."""
    engine = make_backend("docker", tmp_path, monkeypatch)

    async def steps(env):
        await env.run(SHELL_SKIPPING_ULIMIT)
        unlimited = await env.run("ulimit -f; ulimit -n")
        return unlimited, await env.run("fallocate -l 100m /big; echo $?")
    limits = ResourceLimits(workspace_mb=40, processes=200)
    unlimited, result = in_container(engine, make_settings(tmp_path, limits=limits), steps)
    # Docker's limits, the first in the shell's 512-byte blocks
    assert unlimited.output.split() == [str(40 * 2048), str(open_files_per_process(200))]
    # Without the wrapper the two streams come apart (see container._MERGED), in either order.
    assert sorted(result.output.splitlines()) == ["153", "File size limit exceeded"]


def test_the_file_tools_refuse_a_write_that_would_pass_the_workspace_limit(engine, small_disk):
    async def steps(env):
        await env.run("head -c 30m /dev/zero > /a")
        with pytest.raises(ToolError, match="over its limit of 40 MB"):
            await env.write_file("big.txt", b"x" * 15 * 1024 * 1024)
    in_container(engine, small_disk, steps)


# -- time-outs ---------------------------------------------------------------------------------------

DETACHED_WRITER = "setsid sh -c 'while :; do date >> /workspace/ticks; sleep 0.2; done' > /dev/null 2>&1 &"


def test_a_time_out_ends_the_processes_the_command_detached(engine, tmp_path):
    """`timeout` in the container kills the command's process group; a `setsid` child is in none of it."""
    env = started(engine, make_settings(tmp_path))
    try:
        result = asyncio.run(env.run(f"{DETACHED_WRITER}\nsleep 30", timeout=1))
        processes = engine.run("top", env.name)
    finally:
        asyncio.run(env.close())
    assert result.timed_out
    assert "/workspace/ticks" not in processes


def test_a_time_out_keeps_the_workspace_and_the_next_command_runs(engine, tmp_path):
    env = started(engine, make_settings(tmp_path))
    try:
        asyncio.run(env.run("echo kept > notes.txt; sleep 30", timeout=1))
        after = asyncio.run(env.run("cat notes.txt"))
    finally:
        asyncio.run(env.close())
    assert (after.output, after.exit_code) == ("kept\n", 0)


def test_a_time_out_that_left_nothing_running_keeps_tmp(engine, tmp_path):
    env = started(engine, make_settings(tmp_path))
    try:
        asyncio.run(env.run("echo kept > /tmp/notes; sleep 30", timeout=1))
        after = asyncio.run(env.run("cat /tmp/notes"))
    finally:
        asyncio.run(env.close())
    assert after.output == "kept\n"


# -- the engine lost mid-prompt ----------------------------------------------------------------------

def test_a_command_whose_container_was_removed_behind_the_runners_back_loses_the_environment(engine, tmp_path):
    """The CLI says why it could not run the command with an exit status a command may also have (1, 125):
    read as the command's own, its complaint would pass into the row as what the command printed."""
    env = started(engine, make_settings(tmp_path))
    try:
        engine.run("rm", "-f", env.name)
        with pytest.raises(EnvironmentLostError, match="^the command could not run to its end in the container: "):
            asyncio.run(env.run("echo ran"))
    finally:
        asyncio.run(env.close())


def test_a_command_the_unreachable_docker_engine_could_not_run_loses_the_environment(tmp_path, monkeypatch):
    engine = make_backend("docker", tmp_path, monkeypatch)
    env = started(engine, make_settings(tmp_path))
    engine_host = os.environ["DOCKER_HOST"]
    try:
        monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")     # as if the engine had died
        with pytest.raises(EnvironmentLostError, match="^the command could not run to its end in the container: "
                                                       ".*Is the docker daemon running\\?$"):   # the client's own words
            asyncio.run(env.run("echo ran"))
    finally:
        monkeypatch.setenv("DOCKER_HOST", engine_host)
        asyncio.run(env.close())


# -- what is read from the container ----------------------------------------------------------------

ENDLESS_HEAD = "printf '#!/bin/sh\\nexec yes\\n' > /usr/bin/head; chmod +x /usr/bin/head; echo short > small.txt"


def test_a_file_read_by_a_program_the_prompt_replaced_stops_at_the_file_size_limit(engine, tmp_path):
    """The file tools run the container's own programs, which a command can replace: one that never
    stops writing must not fill the worker's memory (about 90 MB a second through `exec`) until the
    call's time-out."""
    env = started(engine, make_settings(tmp_path, max_file_bytes=1_000_000))
    try:
        asyncio.run(env.run(ENDLESS_HEAD))
        began = time.monotonic()
        with pytest.raises(ToolError, match="larger than the file tools' limit of 1000000 bytes"):
            asyncio.run(env.read_file("small.txt"))
        took = time.monotonic() - began
    finally:
        asyncio.run(env.close())
    assert took < 10


# -- removal -----------------------------------------------------------------------------------------

def test_closing_is_quick_though_the_containers_first_process_ignores_sigterm(engine, tmp_path):
    """`sleep` as PID 1 ignores SIGTERM; without a zero stop time-out Podman waits 10 s for it."""
    settings = make_settings(tmp_path)
    env = started(engine, settings)
    began = time.monotonic()
    asyncio.run(env.close())
    assert time.monotonic() - began < 8      # well short of Podman's 10 s wait, whatever the machine's load
    assert engine.live(settings.run_label) == []


@pytest.fixture
def volume_image(engine) -> Iterator[str]:
    """The test image with a VOLUME, as many published images declare (databases, data directories)."""
    image = f"{engine.image}-volume"
    builder = f"batch_runner-test-volume-{os.getpid()}"
    engine.run("create", "--name", builder, engine.image, "true")
    try:
        engine.run("commit", "--change", 'VOLUME ["/data"]', builder, image)
    finally:
        engine.run("rm", builder)
    yield image
    engine.run("rmi", image)


def test_closing_removes_the_volumes_the_image_gave_the_container(engine, volume_image, tmp_path):
    """An anonymous volume outlives its container unless removed with it: what the prompt wrote there
    would stay on the engine's disk for good."""
    env = started(engine, make_settings(tmp_path), image=volume_image)
    try:
        asyncio.run(env.run("head -c 1m /dev/zero > /data/left"))
        [volume] = engine.run("inspect", "--format", "{{range .Mounts}}{{.Name}}{{end}}", env.name).split()
    finally:
        asyncio.run(env.close())
    assert volume not in engine.run("volume", "ls", "--quiet").split()


def test_docker_engine_down_fails_the_start_with_the_daemons_message(tmp_path, monkeypatch):
    engine = make_backend("docker", tmp_path, monkeypatch)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-engine.sock")
    monkeypatch.setattr(docker_module, "_reachable_engines", set())
    env = environment(engine, make_settings(tmp_path))
    with pytest.raises(EnvironmentSetupError) as failure:
        asyncio.run(env.start())
    message = str(failure.value)
    assert message.startswith("the docker engine is not reachable (start it, or choose another TERMINAL_ENV): ")
    assert message.endswith("Is the docker daemon running?")        # the client's own words
    environment_class("docker").remove_leftovers(make_settings(tmp_path))      # nothing to reach, no error


# -- through the real CLI ----------------------------------------------------------------------------

def run_label_of(tmp_path: Path, run_name: str) -> str:
    return run_identity(tmp_path / "data" / run_name)


def test_cli_fails_a_prompt_whose_image_cannot_be_pulled_without_a_model_call_and_runs_the_other_inside(
        engine, tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", [
        {"prompt": '[[call terminal {"command": "echo inside > proof.txt; cat proof.txt; pwd"}]] works',
         "image": engine.image, "cwd": "/srv/app"},
        {"prompt": "never sent", "image": UNPULLABLE_IMAGE},
    ])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=5", "--run_name=enginerun",
                     "--distribution=terminal_only", *endpoint_args(endpoint),
                     env={"TERMINAL_ENV": "docker", **engine.variables})
    assert result.returncode == 2, result.stderr      # the failed pull: --resume retries it
    rows = {row["prompt_index"]: row for row in batch_rows(tmp_path / "data" / "enginerun")}
    failed = rows[1]
    assert failed["failed"] and failed["error_type"] == "environment"
    assert failed["error"].startswith(f"image {UNPULLABLE_IMAGE!r} is not here and pulling it failed: ")
    assert "connection refused" in failed["error"]
    assert endpoint.chat_requests_for("never sent") == []
    console = " ".join(result.stdout.split())
    assert f"environment: {failed['error']}" in console and "environment: environment:" not in console
    [completed] = read_jsonl(tmp_path / "data" / "enginerun" / "trajectories.jsonl")
    assert '"output": "inside\\n/srv/app\\n"' in completed["conversations"][3]["value"]
    assert engine.live(run_label_of(tmp_path, "enginerun")) == []
    assert not list(tmp_path.glob("proof.txt"))


# Its time limit keeps each container up long enough for all three to be up at once on a slow machine.
LONG_COMMAND = '[[call terminal {"command": "sleep 30", "timeout": 12}]] long'


@contextlib.contextmanager
def runner(engine: EngineBackend, tmp_path: Path, endpoint, run_name: str) -> Iterator[subprocess.Popen]:
    """The runner on three long commands, in a process group of its own (killed at the end if still
    there), taking SIGINT as from a terminal."""
    dataset = write_dataset(tmp_path / "dataset.jsonl",
                            [{"prompt": f"{LONG_COMMAND} {i}", "image": engine.image} for i in range(3)])
    process = subprocess.Popen(
        batch_runner_command(f"--dataset_file={dataset}", "--batch_size=5", f"--run_name={run_name}",
                             "--distribution=terminal_only", *endpoint_args(endpoint)),
        cwd=tmp_path, env=cli_environment(tmp_path, {"TERMINAL_ENV": "docker", **engine.variables}),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=default_stop_signals, start_new_session=True)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()


def wait_for_containers(engine: EngineBackend, label: str, count: int, process: subprocess.Popen) -> None:
    def up() -> bool:
        assert process.poll() is None, process.communicate()
        return len(engine.live(label)) >= count
    wait_for(up, timeout=60, what=f"{count} containers")


def test_cli_interrupted_mid_command_removes_the_containers(engine, tmp_path, endpoint):
    label = run_label_of(tmp_path, "stopped")
    with runner(engine, tmp_path, endpoint, "stopped") as process:
        wait_for_containers(engine, label, 3, process)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    assert engine.live(label) == []


def test_cli_killed_hard_has_its_workers_remove_the_containers(engine, tmp_path, endpoint):
    label = run_label_of(tmp_path, "killed")
    with runner(engine, tmp_path, endpoint, "killed") as process:
        wait_for_containers(engine, label, 3, process)
        process.kill()              # the runner only: its workers notice and clean up
        wait_for(lambda: engine.live(label) == [], timeout=30, what="the containers removed")


def test_cli_killed_with_its_workers_leaves_containers_that_the_resumed_run_removes(engine, tmp_path, endpoint):
    label = run_label_of(tmp_path, "crashed")
    with runner(engine, tmp_path, endpoint, "crashed") as process:
        wait_for_containers(engine, label, 3, process)
        os.killpg(process.pid, signal.SIGKILL)     # the whole group: nobody is left to clean up
        process.wait(timeout=60)
    assert len(engine.live(label)) == 3
    resumed = run_cli(tmp_path, "--dataset_file=dataset.jsonl", "--batch_size=5", "--run_name=crashed", "--resume",
                      "--distribution=terminal_only", *endpoint_args(endpoint),
                      env={"TERMINAL_ENV": "docker", **engine.variables})
    assert resumed.returncode == 0, resumed.stderr
    assert len(read_jsonl(tmp_path / "data" / "crashed" / "trajectories.jsonl")) == 3
    assert engine.live(label) == []
