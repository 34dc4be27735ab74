"""Each limit of a prompt's environment, hit for real, and every process of a prompt gone with it."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import multiprocessing
import os
import platform
import resource
import secrets
import shutil
import subprocess
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
from conftest import live_processes_mentioning, mounted_tmpfs, wait_for

from batchrun.environments import create_environment, environment_class, limits
from batchrun.environments.base import Environment, EnvironmentSettings, ToolError
from batchrun.environments.disk_usage import disk_usage
from batchrun.environments.limits import (
    ENTER_GROUPS,
    MIB,
    PromptCgroup,
    ResourceLimits,
    cgroups_available,
    process_limit_note,
    remove_run_leftovers,
    user_process_limit,
)
from batchrun.tools import ToolContext
from batchrun.tools.terminal import terminal

BACKENDS = ["local", pytest.param("bubblewrap", marks=pytest.mark.bubblewrap)]
needs_cgroups = pytest.mark.skipif(not cgroups_available(),
                                   reason="no control group can be created here (needs root and cgroupfs)")

# Starts processes until one is refused; prints how many it got.
SPAWN = ("python3 -c \"import subprocess\nps=[]\ntry:\n for _ in range(200): "
         "ps.append(subprocess.Popen(['sleep','30']))\nexcept OSError: pass\nprint('started', len(ps))\"")


RUN_LABEL = f"limits-test-{secrets.token_hex(4)}"


@pytest.fixture(autouse=True, scope="module")
def _remove_control_groups() -> Iterator[None]:
    yield
    remove_run_leftovers(RUN_LABEL)


def settings(tmp_path: Path, **limits: int) -> EnvironmentSettings:
    return EnvironmentSettings(work_root=tmp_path / "work", run_label=RUN_LABEL, limits=ResourceLimits(**limits))


@contextlib.asynccontextmanager
async def environment(kind: str, env_settings: EnvironmentSettings) -> AsyncIterator[Environment]:
    env = create_environment(kind, env_settings, prompt_index=0)
    await env.start()
    try:
        yield env
    finally:
        await env.close()


def run(kind: str, env_settings: EnvironmentSettings, *commands: str, timeout: float | None = None) -> list:
    async def scenario() -> list:
        async with environment(kind, env_settings) as env:
            return [await env.run(command, timeout=timeout) for command in commands]
    return asyncio.run(scenario())


@pytest.mark.parametrize("kind", BACKENDS)
@needs_cgroups
def test_memory_limit_kills_the_process_and_says_so(tmp_path: Path, kind: str) -> None:
    [result] = run(kind, settings(tmp_path, memory_mb=64), "python3 -c 'x = bytearray(256 * 1024 * 1024)'")
    assert result.exit_code != 0
    assert "memory limit of 64 MB" in (result.error or "")


@pytest.mark.parametrize("kind", BACKENDS)
@needs_cgroups
def test_a_limit_a_command_hit_before_its_time_out_is_still_named(tmp_path: Path, kind: str) -> None:
    async def scenario() -> dict:
        async with environment(kind, settings(tmp_path, memory_mb=64)) as env:
            command = "python3 -c 'x = bytearray(256 * 1024 * 1024)'; sleep 30"
            return await terminal({"command": command, "timeout": 2}, ToolContext(env=env, settings=env.settings))
    result = asyncio.run(scenario())
    assert result["exit_code"] is None
    assert result["error"].startswith("Command timed out after 2s and was killed; ")
    assert "memory limit of 64 MB" in result["error"]


@pytest.mark.parametrize("kind", BACKENDS)
def test_memory_limit_holds_without_control_groups_per_process(tmp_path: Path, kind: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(limits, "_hierarchy", lambda: None)
    [result] = run(kind, settings(tmp_path, memory_mb=64), "python3 -c 'x = bytearray(256 * 1024 * 1024)'")
    assert result.exit_code != 0
    assert "MemoryError" in result.output


@pytest.mark.parametrize("kind", BACKENDS)
@needs_cgroups
def test_process_limit_refuses_more_processes_and_says_so(tmp_path: Path, kind: str) -> None:
    [result] = run(kind, settings(tmp_path, processes=40), SPAWN)
    started = int(result.output.split("started")[1].split()[0])
    assert started < 40
    assert "limit of 40 processes" in (result.error or "")


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_prompt_cannot_hold_more_than_a_quarter_of_the_machines_open_files(tmp_path: Path, kind: str) -> None:
    # The kernel's table of open files is one for the whole machine: with the runner's own limit (raised to
    # its hard one) each of a prompt's processes could open 20,000 files here, and one prompt filled the
    # table, so that every other prompt's commands failed with "Too many open files in system".
    file_max = int(Path("/proc/sys/fs/file-max").read_text())
    [result] = run(kind, settings(tmp_path, processes=200), "ulimit -Sn; ulimit -Hn; python3 -c \""
                   "import os\nfds = []\ntry:\n while True: fds.append(os.open('/dev/null', os.O_RDONLY))\n"
                   "except OSError as exc: print('opened', len(fds), exc.strerror)\"")
    soft, hard, opened = result.output.splitlines()
    assert soft == hard and 64 <= int(hard) <= 1024 and 200 * int(hard) <= max(file_max // 4, 200 * 64), result.output
    assert opened == f"opened {int(hard) - 3} Too many open files", result.output


# Busy for two seconds of wall time; prints the CPU seconds it got meanwhile.
CPU_SHARE = ("python3 -c \"import time\nend = time.monotonic() + 2\nwhile time.monotonic() < end: pass\n"
             "print('cpu', time.process_time())\"")


@pytest.mark.parametrize("kind", BACKENDS)
@needs_cgroups
def test_a_prompt_starting_hundreds_of_busy_processes_leaves_another_its_share_of_the_cpu(
        tmp_path: Path, kind: str) -> None:
    # Each process a command detached with setsid was a scheduling group of its own (the kernel's autogroups):
    # 200 of them left a command of another prompt a 200th of the machine, and its commands timed out.
    async def scenario() -> float:
        async with environment(kind, settings(tmp_path)) as hog, environment(kind, settings(tmp_path)) as other:
            started = await hog.run("for i in $(seq 200); do setsid -f sh -c 'sleep 1; while :; do :; done' "
                                    ">/dev/null 2>&1; done; echo started", timeout=30)
            assert started.output == "started\n", started
            result = await other.run(f"sleep 1.5; {CPU_SHARE}", timeout=30)
            return float(result.output.split()[-1])
    assert asyncio.run(scenario()) >= 0.2       # of 2 s; about 0.02 when every busy process counted as a prompt


@pytest.mark.bubblewrap
def test_tmp_is_capped_in_the_sandbox(tmp_path: Path) -> None:
    [result] = run("bubblewrap", settings(tmp_path, tmp_mb=8), "head -c 20000000 /dev/zero > /tmp/big")
    assert result.exit_code != 0
    assert "No space left on device" in result.output


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_file_larger_than_the_workspace_limit_cannot_be_written(tmp_path: Path, kind: str) -> None:
    [result] = run(kind, settings(tmp_path, workspace_mb=4), "head -c 8000000 /dev/zero > big; ls -l big")
    assert result.exit_code != 0 or "File size limit exceeded" in result.output
    assert " 4194304 " in result.output


def hard_limits_seen_under_lower_hard_limits(kind: str, tmp_path: Path, conn) -> None:
    """In a child process (a hard limit once lowered stays lowered): what a command sees when the
    runner itself runs under hard limits lower than the environment's own."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (100 * MIB, 100 * MIB))
    resource.setrlimit(resource.RLIMIT_NPROC, (512, 512))
    try:
        [result] = run(kind, settings(tmp_path), "ulimit -H -f; ulimit -H -u")
    except Exception as exc:
        conn.send((f"{type(exc).__name__}: {exc}", "raised"))
    else:
        conn.send((result.output, result.error))
    finally:
        asyncio.run(environment_class(kind).close_idle())     # as a worker does when it ends


@pytest.mark.parametrize("kind", BACKENDS)
def test_the_runners_lower_hard_limits_hold_in_the_environment_and_do_not_stop_it(tmp_path: Path, kind: str) -> None:
    parent_end, child_end = multiprocessing.get_context("fork").Pipe()
    child = multiprocessing.get_context("fork").Process(target=hard_limits_seen_under_lower_hard_limits,
                                                        args=(kind, tmp_path, child_end))
    child.start()
    output, error = parent_end.recv()
    child.join()
    assert (output.split(), error) == (["102400", "512"], None)


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_workspace_over_its_limit_is_reported_to_the_model(tmp_path: Path, kind: str) -> None:
    commands = "for f in a b c; do head -c 3000000 /dev/urandom > $f; done"
    [result] = run(kind, settings(tmp_path, workspace_mb=4), commands)
    assert "workspace went over its limit of 4 MB" in (result.error or "")


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_workspace_over_its_limit_is_reported_when_its_many_files_come_first(tmp_path: Path, kind: str) -> None:
    # More entries than the walk takes on the event loop, so the part over the limit is found by the
    # rest of the walk, in a thread.
    commands = ("mkdir -p many/deeper && for i in $(seq 300); do : > many/f$i; : > many/deeper/g$i; done; "
                "head -c 5000000 /dev/urandom > many/deeper/big")
    [result] = run(kind, settings(tmp_path, workspace_mb=4), commands)
    assert "workspace went over its limit of 4 MB" in (result.error or "")


DETACHED = {"setsid": "setsid sleep {marker} > /dev/null 2>&1 &",
            "double fork": "( (sleep {marker} > /dev/null 2>&1 &) & )"}


def detached_marker(kind: str) -> str:
    """A sleep duration no other process uses, to find the detached child by; skips where the
    backend cannot reach detached children."""
    if kind == "local" and not cgroups_available():
        pytest.skip("local kills detached children through a control group")
    return f"{1000 + secrets.randbelow(1000)}.{secrets.randbelow(10**6)}"


@pytest.mark.parametrize("how", DETACHED)
@pytest.mark.parametrize("kind", BACKENDS)
def test_detached_children_die_with_the_prompt(tmp_path: Path, kind: str, how: str) -> None:
    marker = detached_marker(kind)

    async def scenario() -> None:
        async with environment(kind, settings(tmp_path)) as env:
            await env.run(DETACHED[how].format(marker=marker))
            await asyncio.to_thread(wait_for, lambda: live_processes_mentioning(f"sleep {marker}"),
                                    10, "the detached child to start")
    asyncio.run(scenario())
    wait_for(lambda: not live_processes_mentioning(f"sleep {marker}"), 10, "the detached child to die")


@pytest.mark.parametrize("how", DETACHED)
@pytest.mark.parametrize("kind", BACKENDS)
def test_detached_children_die_when_their_command_times_out(tmp_path: Path, kind: str, how: str) -> None:
    marker = detached_marker(kind)

    async def scenario() -> None:
        async with environment(kind, settings(tmp_path)) as env:
            result = await env.run(DETACHED[how].format(marker=marker) + "\nsleep 30", timeout=1)
            assert result.timed_out
            await asyncio.to_thread(wait_for, lambda: not live_processes_mentioning(f"sleep {marker}"),
                                    10, "the detached child to die")
            assert (await env.run("echo still works")).output.strip() == "still works"
    asyncio.run(scenario())


# --- the workspace limit holds while the prompt's processes write, and the disk keeps its reserve ----------------

def workspace_bytes(env: Environment) -> int:
    return disk_usage(env.prompt_dir)    # type: ignore[attr-defined]  # local and bubblewrap have one


@pytest.mark.bubblewrap
def test_fallocate_cannot_reserve_space_in_the_sandbox(tmp_path: Path) -> None:
    [result] = run("bubblewrap", settings(tmp_path, workspace_mb=100),
                   "fallocate -l 4G big; ls -s big; python3 -c 'import os; fd = os.open(\"slow\", os.O_CREAT | "
                   "os.O_WRONLY); os.posix_fallocate(fd, 0, 1 << 20); print(os.fstat(fd).st_blocks)'")
    assert "Operation not supported" in result.output
    assert result.output.split()[-1] == "2048"       # the C library writes instead, as the limit expects


def system_calls(*calls: str) -> str:
    """A command that makes each of ``calls`` (Python expressions on ``libc``, the C library, and ``ctypes``)
    and prints what it returned and its errno, one line per call."""
    printed = "; ".join(f"print({call}, errno.errorcode.get(ctypes.get_errno()))" for call in calls)
    return f'python3 -c "import ctypes, errno; libc = ctypes.CDLL(None, use_errno=True); {printed}"'


@pytest.mark.bubblewrap
def test_io_uring_cannot_reserve_space_in_the_sandbox_either(tmp_path: Path) -> None:
    # Its IORING_OP_FALLOCATE reserves space without the fallocate system call: no ring can be made.
    [result] = run("bubblewrap", settings(tmp_path), system_calls("libc.syscall(425, 8, ctypes.create_string_buffer(120))"))
    assert result.output.split() == ["-1", "ENOSYS"], result.output


@pytest.mark.bubblewrap
def test_a_command_cannot_take_the_machines_asynchronous_io_events(tmp_path: Path) -> None:
    # fs.aio-max-nr is one count for the whole machine: a prompt that took it whole left every other
    # prompt (and the host's programs) without AIO.
    [result] = run("bubblewrap", settings(tmp_path),
                   system_calls("libc.syscall(206, 65536, ctypes.byref(ctypes.c_ulong(0)))"))
    assert result.output.split() == ["-1", "ENOSYS"], result.output


@pytest.mark.bubblewrap
def test_a_command_cannot_watch_the_files_every_sandbox_shares(tmp_path: Path) -> None:
    # A watch on the read-only /etc or /usr that every sandbox shares saw the files other prompts, the runner
    # and the host's programs opened. Watchers poll instead, as on a kernel without inotify.
    watch = system_calls("libc.inotify_init1(0)", "libc.syscall(253)",
                         "libc.syscall(300, 0x200, 0)")         # inotify_init, fanotify_init(FAN_REPORT_FID)
    [result] = run("bubblewrap", settings(tmp_path), f"{watch}; echo x > f; tail -f f & "
                   "sleep 0.5; echo y >> f; sleep 1.5; kill %1")
    assert result.output.splitlines()[:3] == ["-1 ENOSYS"] * 3, result.output
    followed = [line for line in result.output.splitlines()[3:] if not line.startswith("tail:")]
    assert followed == ["x", "y"], result.output      # tail -f follows by polling


@pytest.mark.bubblewrap
@pytest.mark.parametrize("number", [40, 42, 57], ids=["RESVSP", "RESVSP64", "ZERO_RANGE"])
def test_the_preallocating_ioctls_cannot_reserve_space_in_the_sandbox_either(tmp_path: Path, number: int) -> None:
    # FS_IOC_RESVSP, FS_IOC_RESVSP64 and FS_IOC_ZERO_RANGE reserve space as fallocate does, on any
    # filesystem that has it, without that system call.
    request = (1 << 30) | (48 << 16) | (ord("X") << 8) | number       # _IOW('X', number, struct space_resv)
    [result] = run("bubblewrap", settings(tmp_path, workspace_mb=100), textwrap.dedent(f"""\
        python3 - <<'EOF'
        import fcntl, os, struct
        fd = os.open("big", os.O_CREAT | os.O_RDWR)
        space = struct.pack("=hhxxxxqqiI16x", 0, 0, 0, 1 << 30, 0, 0)
        try:
            fcntl.ioctl(fd, {request}, space)
        except OSError as exc:
            print(exc.strerror)
        print("blocks", os.fstat(fd).st_blocks)
        EOF"""))
    assert result.output.splitlines() == ["Operation not supported", "blocks 0"], result.output


@pytest.mark.bubblewrap
def test_a_command_cannot_make_a_user_namespace(tmp_path: Path) -> None:
    # In one it has every capability: it could mount a /tmp past its limit and reach the kernel code only
    # root may (nf_tables, new filesystems). Before, a root run's commands could (`unshare -Urm`).
    clone = ("import ctypes, errno, os, struct; libc = ctypes.CDLL(None, use_errno=True)\n"
             "args = struct.pack('=11Q', 0x10000000, 0, 0, 0, 17, 0, 0, 0, 0, 0, 0)\n"
             "pid = libc.syscall(435, args, len(args))\n"
             "pid == 0 and os._exit(0)\n"
             "print('clone3', pid, errno.errorcode.get(ctypes.get_errno()))\n"
             "pid = libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)\n"
             "pid == 0 and os._exit(0)\n"
             "print('clone', pid, errno.errorcode.get(ctypes.get_errno()))")
    [result] = run("bubblewrap", settings(tmp_path),
                   f"unshare -Ur true; echo unshare $?; python3 -c \"{clone}\"")
    lines = result.output.splitlines()
    assert "unshare 1" in lines and "clone3 -1 ENOSYS" in lines, result.output
    assert platform.machine() != "x86_64" or "clone -1 EPERM" in lines, result.output


@pytest.mark.bubblewrap
def test_threads_and_started_programs_work_under_the_filter(tmp_path: Path) -> None:
    # The C library makes them with clone3 first, and falls back to clone where the kernel has no clone3.
    spawn = ("import os, threading; t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
             "pid = os.posix_spawn('/bin/true', ['true'], {}); print('spawned', os.waitpid(pid, 0)[1])")
    [result] = run("bubblewrap", settings(tmp_path), f"python3 -c \"{spawn}\"")
    assert result.output.splitlines() == ["thread", "spawned 0"], result.output


# --- the kernel's shared state: the host's clock and the CPU are no prompt's to take ------------------------------

@pytest.mark.bubblewrap
def test_a_command_cannot_set_the_hosts_clock(tmp_path: Path) -> None:
    # settimeofday with neither time nor zone changes nothing, but is refused as any setting of the clock
    # is (clock_settime, adjtimex) without CAP_SYS_TIME; with it, it succeeds.
    number = {"x86_64": 164, "aarch64": 170}[os.uname().machine]
    [result] = run("bubblewrap", settings(tmp_path), textwrap.dedent(f"""\
        python3 - <<'EOF'
        import ctypes, errno
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.syscall({number}, None, None), errno.errorcode.get(ctypes.get_errno()))
        EOF"""))
    assert result.output.split() == ["-1", "EPERM"], result.output


@pytest.mark.bubblewrap
@pytest.mark.parametrize("policy", ["SCHED_FIFO", "SCHED_RR"])
def test_a_command_cannot_make_itself_real_time(tmp_path: Path, policy: str) -> None:
    # A real-time busy loop would starve every other prompt, and the host; a success is undone at once.
    [result] = run("bubblewrap", settings(tmp_path), textwrap.dedent(f"""\
        python3 - <<'EOF'
        import os
        try:
            os.sched_setscheduler(0, os.{policy}, os.sched_param(1))
        except PermissionError:
            print("refused")
        else:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            print("real-time")
        EOF"""))
    assert result.output.strip() == "refused", result.output


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_command_writing_past_the_workspace_limit_is_stopped_while_it_runs(tmp_path: Path, kind: str) -> None:
    async def scenario() -> tuple:
        async with environment(kind, settings(tmp_path, workspace_mb=50)) as env:
            # Twenty files, each under the largest-file limit, 1 GB in all: only a watch stops it.
            result = await env.run("for i in $(seq 20); do head -c 50000000 /dev/zero > f$i; done; echo finished")
            return result, workspace_bytes(env)
    result, used = asyncio.run(scenario())
    assert "finished" not in result.output
    assert "workspace went over its limit of 50 MB" in (result.error or "")
    assert used < 250 * 2**20


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_writer_left_in_the_background_is_stopped_between_commands(tmp_path: Path, kind: str) -> None:
    async def scenario() -> tuple:
        async with environment(kind, settings(tmp_path, workspace_mb=50)) as env:
            await env.run("(for i in $(seq 40); do head -c 25000000 /dev/zero > f$i; done) > /dev/null 2>&1 &")
            watch = env.workspace.watch   # type: ignore[attr-defined]  # local and bubblewrap have one
            await wait_until(lambda: watch.reason is not None)
            return await env.run("echo next"), workspace_bytes(env)
    after, used = asyncio.run(scenario())
    assert after.output == "next\n" and "workspace went over its limit of 50 MB" in (after.error or "")
    assert used < 250 * 2**20


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_prompt_cannot_take_the_disks_reserve(tmp_path: Path, kind: str) -> None:
    free_mb = shutil.disk_usage(tmp_path).free // 2**20
    # A reserve just below what is free now: the first 64 MB or so of writing reaches it.
    limits = settings(tmp_path, workspace_mb=10_000, disk_reserve_mb=max(free_mb - 64, 1))

    async def scenario() -> tuple:
        async with environment(kind, limits) as env:
            result = await env.run("for i in $(seq 40); do head -c 25000000 /dev/zero > f$i; done; echo finished")
            return result, workspace_bytes(env)
    result, used = asyncio.run(scenario())
    assert "finished" not in result.output and "almost full" in (result.error or "")
    assert used < 500 * 2**20


# Empty files, made as fast as one process can: they take no block, only the disk's inodes.
EMPTY_FILES = ("python3 -c 'import os\nfor n in range({files}):\n os.close(os.open(f\"e{{n}}\", os.O_CREAT | os.O_WRONLY))'"
               "; echo finished")


@pytest.mark.parametrize("kind", BACKENDS)
def test_empty_files_count_towards_the_workspace_limit(tmp_path: Path, kind: str) -> None:
    if os.statvfs(tmp_path).f_files == 0:
        pytest.skip("this filesystem makes inodes as it needs them: none can run out")
    # 20,000 inodes are 320 MB of the disk's share on an ext4 made with the defaults, 40 MB on XFS.
    [result] = run(kind, settings(tmp_path, workspace_mb=10), EMPTY_FILES.format(files=20_000))
    assert "finished" not in result.output
    assert "workspace went over its limit of 10 MB" in (result.error or ""), result
    assert "each file counted as at least" in (result.error or "")


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_prompt_cannot_take_the_disks_last_inodes(tmp_path: Path, kind: str) -> None:
    # 100,000 inodes (100 KB of the disk each) and room for far more bytes than the prompt writes: only
    # the inodes run out. 90% of them are kept for the run, so the watch has 90,000 files' time to act.
    with mounted_tmpfs(tmp_path / "disk", "size=10000m,nr_inodes=100000") as disk:
        limits = EnvironmentSettings(work_root=disk / "work", run_label=RUN_LABEL,
                                     limits=ResourceLimits(workspace_mb=100_000, disk_reserve_mb=9_000))
        [result] = run(kind, limits, EMPTY_FILES.format(files=99_000))
        asyncio.run(environment_class(kind).close_idle())      # as a worker ends: nothing left on the disk
    assert "finished" not in result.output
    assert "almost out of room for new files" in (result.error or ""), result


# Files the command deletes while it keeps them open: no walk of the workspace sees them, the disk does.
HIDDEN_WRITES = ("for i in $(seq {files}); do exec {{fd}}>hidden$i; rm hidden$i; "
                 "head -c {size} /dev/zero >&$fd; done; echo finished")


@pytest.mark.parametrize("kind", BACKENDS)
@needs_cgroups
def test_files_deleted_while_open_count_towards_the_workspace_limit(tmp_path: Path, kind: str) -> None:
    [result] = run(kind, settings(tmp_path, workspace_mb=50), HIDDEN_WRITES.format(files=20, size=40_000_000))
    assert "finished" not in result.output
    assert "workspace went over its limit of 50 MB" in (result.error or ""), result


@pytest.mark.parametrize("kind", BACKENDS)
@needs_cgroups
def test_files_deleted_while_open_cannot_take_the_disks_reserve(tmp_path: Path, kind: str) -> None:
    free_mb = shutil.disk_usage(tmp_path).free // 2**20
    limits = settings(tmp_path, workspace_mb=10_000, disk_reserve_mb=max(free_mb - 64, 1))
    [result] = run(kind, limits, HIDDEN_WRITES.format(files=40, size=25_000_000))
    assert "finished" not in result.output and "almost full" in (result.error or ""), result


# Writes files, deletes each while open and sends its descriptor into a Unix socket, where it waits:
# no process has it open any more, so /proc shows it nowhere, yet its space stays taken. Past the
# workspace limit nothing sees them (docs/environments.md, note 6); below the disk's reserve every look
# counts the file being written, which the writer holds, and its growth stops the prompt.
FILES_HIDDEN_IN_A_SOCKET = """python3 -c '
import os, socket
kept, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
block = bytes(1 << 20)
for i in range(40):
    fd = os.open(f"hidden{i}", os.O_CREAT | os.O_WRONLY)
    for _ in range(25):
        os.write(fd, block)
    os.unlink(f"hidden{i}")
    socket.send_fds(kept, [b"x"], [fd])
    os.close(fd)
print("finished")
'"""


@pytest.mark.parametrize("kind", BACKENDS)
def test_files_hidden_in_a_socket_cannot_take_the_disks_reserve(tmp_path: Path, kind: str) -> None:
    free_mb = shutil.disk_usage(tmp_path).free // 2**20
    limits = settings(tmp_path, workspace_mb=10_000, disk_reserve_mb=max(free_mb - 64, 1))
    [result] = run(kind, limits, FILES_HIDDEN_IN_A_SOCKET)
    assert "finished" not in result.output and "almost full" in (result.error or ""), result


@pytest.mark.parametrize("kind", BACKENDS)
def test_the_file_tools_refuse_a_write_past_the_workspace_limit(tmp_path: Path, kind: str) -> None:
    async def scenario() -> None:
        async with environment(kind, settings(tmp_path, workspace_mb=4)) as env:
            await env.run("head -c 3500000 /dev/zero > big")
            await env.run("true")       # the walk after this command counts the 3.5 MB
            with pytest.raises(ToolError, match="over its limit of 4 MB"):
                await env.write_file("more.bin", b"x" * 1_000_000)
    asyncio.run(scenario())


async def wait_until(condition: Callable[[], bool], seconds: float = 30) -> None:
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.01)


# --- a prompt's control group serves the next prompt of its process only as good as new ---------------------

def run_in_group(group: PromptCgroup, command: str) -> None:
    """Run ``command`` in a shell that joins ``group`` before anything else, to its end."""
    subprocess.run(["bash", "-c", f"{ENTER_GROUPS}; {command}", "bash", *group.procs_files(), "--"], check=True)


def group_memory_bytes(group: PromptCgroup) -> int:
    usage = group.directories[0] / "memory.usage_in_bytes"
    return int((usage if usage.exists() else group.directories[0] / "memory.current").read_text())


def group_process_limit(group: PromptCgroup) -> str:
    [limit] = [directory / "pids.max" for directory in group.directories if (directory / "pids.max").exists()]
    return limit.read_text().strip()


def group_memory_limit_bytes(group: PromptCgroup) -> int:
    limit = group.directories[0] / "memory.limit_in_bytes"
    return int((limit if limit.exists() else group.directories[0] / "memory.max").read_text())


@needs_cgroups
def test_an_emptied_control_group_serves_the_next_prompt_with_that_prompts_limits() -> None:
    first = PromptCgroup.create(RUN_LABEL, ResourceLimits(memory_mb=64, processes=64))
    assert first is not None
    run_in_group(first, "true")
    first.release()
    second = PromptCgroup.create(RUN_LABEL, ResourceLimits(memory_mb=128, processes=32))
    assert second is not None
    assert second.directories == first.directories
    assert second.pids() == []
    assert group_memory_limit_bytes(second) == 128 * MIB
    assert group_process_limit(second) == "32"
    second.release()


@needs_cgroups
def test_a_groups_limits_changed_while_it_runs_never_take_memory_its_processes_hold() -> None:
    group = PromptCgroup.create(RUN_LABEL, ResourceLimits(memory_mb=256, processes=64))
    assert group is not None
    holder = subprocess.Popen(["bash", "-c", f"{ENTER_GROUPS}; exec python3 -c \"held = bytearray(96 * 2**20);"
                               " held[::4096] = b'x' * len(held[::4096]); print(flush=True); input()\"",
                               "bash", *group.procs_files(), "--"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()        # type: ignore[union-attr]
        held = group_memory_bytes(group)
        group.set_limits(ResourceLimits(memory_mb=32, processes=8))
        assert group_memory_limit_bytes(group) >= held > 96 * MIB
        assert group_process_limit(group) == "8"
        assert holder.poll() is None and group.events().memory == 0
        group.set_limits(ResourceLimits(memory_mb=512, processes=64))
        assert group_memory_limit_bytes(group) == 512 * MIB
    finally:
        holder.kill()
        holder.wait()
        group.destroy()


@needs_cgroups
def test_a_control_group_still_counting_dead_processes_is_not_reused() -> None:
    first = PromptCgroup.create(RUN_LABEL, ResourceLimits())
    assert first is not None
    # Children never waited for stay zombies: dead, but counted against the group's process limit
    # until they are reaped (as orphans are by the machine's init, in its own time).
    unreaped = [subprocess.Popen(["bash", "-c", f"{ENTER_GROUPS}; exec sleep 60", "bash", *first.procs_files(), "--"])
                for _ in range(5)]
    wait_for(lambda: len(first.pids()) == len(unreaped), 10, "the processes to join their group")
    try:
        first.release()
        second = PromptCgroup.create(RUN_LABEL, ResourceLimits())
        assert second is not None
        assert second.directories != first.directories
        second.release()
    finally:
        for process in unreaped:
            process.wait()


@needs_cgroups
def test_a_control_group_left_holding_much_memory_is_not_reused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.write_bytes(os.urandom(48 * MIB))
    with data.open("rb") as file:       # out of the page cache, so that reading it charges the group
        os.fsync(file.fileno())
        os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    first = PromptCgroup.create(RUN_LABEL, ResourceLimits())
    assert first is not None
    run_in_group(first, f"cat {data} > /dev/null")
    assert group_memory_bytes(first) > 32 * MIB     # the page cache the prompt read is the group's
    first.release()
    second = PromptCgroup.create(RUN_LABEL, ResourceLimits())
    assert second is not None
    assert second.directories != first.directories
    assert group_memory_bytes(second) < MIB
    second.release()


@pytest.mark.parametrize("kind", BACKENDS)
@needs_cgroups
def test_a_limit_the_last_prompt_hit_is_not_reported_to_the_next(tmp_path: Path, kind: str) -> None:
    env_settings = settings(tmp_path, processes=16)
    [hit] = run(kind, env_settings, SPAWN)
    assert hit.error and "limit of 16 processes" in hit.error
    [clean] = run(kind, env_settings, "echo fine")
    assert clean.output.strip() == "fine" and clean.error is None


@pytest.mark.parametrize("kind", BACKENDS)
@needs_cgroups
def test_a_process_that_has_no_prompt_left_removes_the_control_groups_it_kept(tmp_path: Path, kind: str) -> None:
    run(kind, settings(tmp_path), "echo done")
    asyncio.run(environment_class(kind).close_idle())
    hierarchy_roots = [Path("/sys/fs/cgroup"), *Path("/sys/fs/cgroup").iterdir()]
    left = [group for root in hierarchy_roots if (root / "batch_runner" / RUN_LABEL).is_dir()
            for group in (root / "batch_runner" / RUN_LABEL).iterdir() if group.is_dir()]
    assert left == []


def group_made_in_a_forked_process(conn) -> None:
    group = PromptCgroup.create(RUN_LABEL, ResourceLimits())
    conn.send(group.directories if group is not None else None)


@needs_cgroups
def test_a_forked_process_never_takes_a_group_its_parent_kept() -> None:
    kept = PromptCgroup.create(RUN_LABEL, ResourceLimits())
    assert kept is not None
    kept.release()
    fork = multiprocessing.get_context("fork")
    parent_end, child_end = fork.Pipe()
    child = fork.Process(target=group_made_in_a_forked_process, args=(child_end,))
    child.start()
    childs_directories = parent_end.recv()
    child.join()
    assert childs_directories is not None and childs_directories != kept.directories
    assert PromptCgroup.create(RUN_LABEL, ResourceLimits()).directories == kept.directories  # type: ignore[union-attr]


@pytest.fixture
def unified_hierarchy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cgroup v2 root as the kernel lays it out, in plain files (this machine may mount v1)."""
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    monkeypatch.setattr(limits, "_CGROUP_ROOT", tmp_path)
    limits._hierarchy.cache_clear()
    yield tmp_path
    limits._hierarchy.cache_clear()


def test_a_unified_hierarchy_with_memory_and_pids_gives_prompts_their_controllers(unified_hierarchy: Path):
    (unified_hierarchy / "batch_runner").mkdir()
    (unified_hierarchy / "batch_runner" / "cgroup.subtree_control").write_text("pids\n")
    hierarchy = limits._hierarchy()
    assert hierarchy is not None and hierarchy.version == 2
    assert (unified_hierarchy / "cgroup.subtree_control").read_text() == "+memory +pids +cpu"
    assert (unified_hierarchy / "batch_runner" / "cgroup.subtree_control").read_text().startswith("+memory")


def test_a_unified_hierarchy_gives_prompts_the_cpu_controller_where_it_is_enabled(unified_hierarchy: Path):
    for directory in (unified_hierarchy, unified_hierarchy / "batch_runner"):
        directory.mkdir(exist_ok=True)
        (directory / "cgroup.subtree_control").write_text("memory pids cpu\n")     # as the kernel lists them
    hierarchy = limits._hierarchy()
    assert hierarchy is not None and hierarchy.cpu_root == unified_hierarchy / "batch_runner"


def test_a_unified_hierarchy_that_refuses_the_cpu_controller_still_gives_memory_and_pids(
        unified_hierarchy: Path, monkeypatch: pytest.MonkeyPatch):
    # Where cpu is not delegated (a container's), asking for it with the others made the kernel refuse all three.
    write = limits.kernel_files.write

    def refusing_cpu(path: Path, value: str) -> None:
        if "+cpu" in value:
            raise OSError(errno.ENOENT, "No such file or directory")
        write(path, value)
    monkeypatch.setattr(limits.kernel_files, "write", refusing_cpu)
    (unified_hierarchy / "batch_runner").mkdir()
    (unified_hierarchy / "batch_runner" / "cgroup.subtree_control").write_text("")
    hierarchy = limits._hierarchy()
    assert hierarchy is not None and hierarchy.cpu_root is None
    assert (unified_hierarchy / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_a_unified_hierarchy_without_the_memory_controller_is_not_used(unified_hierarchy: Path):
    (unified_hierarchy / "cgroup.controllers").write_text("cpuset cpu io pids\n")
    assert limits._hierarchy() is None


@pytest.mark.bubblewrap
def test_a_command_holds_no_capability_in_any_set(tmp_path: Path) -> None:
    # The bounding and inheritable sets too: a root run's shell drops to its uid from a bwrap that kept
    # CAP_SETUID and CAP_SETGID, and no_new_privs alone stood between a command and what those sets allow.
    [result] = run("bubblewrap", settings(tmp_path), "grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb):' /proc/self/status")
    sets = dict(line.split(":") for line in result.output.splitlines())
    assert {name: int(value, 16) for name, value in sets.items()} == dict.fromkeys(
        ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"), 0), result.output


@pytest.mark.bubblewrap
@needs_cgroups
def test_a_command_cannot_see_its_control_group(sandbox_home: Path) -> None:
    # The sandbox was moved into its group once started, and the root of its cgroup namespace was the
    # worker's group: /proc/self/cgroup named the prompt's group (the worker's pid, the run's name), and
    # whether an earlier prompt had used it, which that prompt could decide.
    [result] = run("bubblewrap", settings(sandbox_home), "cat /proc/self/cgroup")
    assert result.output.strip() and all(line.endswith(":/") for line in result.output.splitlines()), result.output


@pytest.mark.bubblewrap
@needs_cgroups
def test_the_sandbox_is_not_told_the_workers_directory(sandbox_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What starts bwrap in the prompt's group is a shell, which names its working directory in PWD.
    monkeypatch.chdir(sandbox_home)
    [result] = run("bubblewrap", settings(sandbox_home), "env; cat /proc/1/environ")
    assert str(sandbox_home) not in result.output, result.output


def test_a_process_that_cannot_join_its_control_group_says_which_and_runs_nothing(tmp_path: Path) -> None:
    procs = tmp_path / "gone" / "cgroup.procs"
    joined = subprocess.run(["/bin/sh", "-c", f'{ENTER_GROUPS}; echo ran', "sh", str(procs), "--"],
                            capture_output=True, text=True)
    assert (joined.returncode, joined.stdout) == (126, "")
    assert joined.stderr == f"cannot join the control group of {procs}\n"


# An ordinary user's sandboxes map to the runner's uid, and the kernel counts all their processes against
# that uid's one RLIMIT_NPROC: under `ulimit -u 420`, one prompt's 300 processes made another's fork fail.
@pytest.mark.parametrize(("euid", "soft_limit", "counted"), [(1000, 4096, 4096), (1000, resource.RLIM_INFINITY, None),
                                                             (0, 4096, None)])
def test_the_process_limit_counted_is_an_ordinary_users_own(monkeypatch: pytest.MonkeyPatch, euid: int,
                                                            soft_limit: int, counted: int | None) -> None:
    # A root run's sandboxes each have a uid of their own, which its limit does not hold.
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft_limit, resource.RLIM_INFINITY))
    assert user_process_limit() == counted


@pytest.mark.parametrize(("sessions", "user_limit", "warned"), [(4, 4096, False), (5, 4096, True),
                                                                (100_000, None, False)])
def test_sessions_whose_process_limits_add_up_past_the_users_are_warned_of(sessions: int, user_limit: int | None,
                                                                           warned: bool) -> None:
    note = process_limit_note(sessions, 1024, user_limit)
    assert (note is not None) == warned
    if note is not None:
        assert f"ulimit -u: {user_limit}" in note and f"{sessions} sessions" in note and "TERMINAL_MAX_PROCESSES" in note
