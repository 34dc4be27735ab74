"""The file tools against a hostile tree: what a prompt's own processes can put in its directory.

The races: a process inside a real bubblewrap sandbox exchanges a name in the workspace with a
symlink to the host (renameat2 RENAME_EXCHANGE, in a loop) while the host makes hundreds of
file-tool calls through that name. Whatever the interleaving, no call may read or write outside.
Then FIFOs, sockets, devices, hard links and symlinks. Every test runs twice: with openat2 doing the
lookups, and with the component walk alone, as on kernels without openat2.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from conftest import wait_for

from batchrun.environments import confined_files
from batchrun.environments.base import EnvironmentSettings, ToolError
from batchrun.environments.bubblewrap import BubblewrapEnvironment
from batchrun.environments.local import LocalEnvironment

CALLS = 300
# After CALLS calls, calls go on until both outcomes were seen (the race was on), at most this long.
RACE_SECONDS = 20.0
# A call that blocks is released after this long, so that it fails the test instead of hanging it.
UNBLOCK_SECONDS = 5.0
SECRET = b"host secret\n"
INSIDE = b"workspace file\n"

# Exchanges two names until a stop file appears (or 60 s pass, should the test die first). It says
# it is running by creating ``swapping``, so the calls start only once the race is on.
SWAPPER = r"""
import ctypes, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
first, second = sys.argv[1].encode(), sys.argv[2].encode()
RENAME_EXCHANGE, AT_FDCWD = 2, -100
open("swapping", "w").close()
deadline = time.monotonic() + 60
while not os.path.exists("stop") and time.monotonic() < deadline:
    for _ in range(1000):
        if libc.renameat2(AT_FDCWD, first, AT_FDCWD, second, RENAME_EXCHANGE) != 0:
            sys.exit("renameat2: " + os.strerror(ctypes.get_errno()))
"""


@pytest.fixture(autouse=True, params=["openat2", "walk"])
def resolver(request, monkeypatch) -> str:
    """Which lookup the test exercises: openat2 (falling back to the walk when it refuses), or the
    walk alone, which kernels without openat2 (or a seccomp filter forbidding it) get."""
    if request.param == "walk":
        monkeypatch.setattr(confined_files, "_openat2_usable", False)
    elif not confined_files._openat2_usable:
        pytest.skip("this kernel has no openat2")
    return request.param


@pytest.fixture
def local(tmp_path) -> Iterator[LocalEnvironment]:
    env = LocalEnvironment(EnvironmentSettings(work_root=tmp_path / "work", run_label="test",
                                               max_file_bytes=10_000), prompt_index=0)
    asyncio.run(env.start())
    yield env
    asyncio.run(env.close())


@contextlib.asynccontextmanager
async def sandbox(tmp_path: Path) -> AsyncIterator[BubblewrapEnvironment]:
    env = BubblewrapEnvironment(EnvironmentSettings(work_root=tmp_path / "work", run_label="race"),
                                prompt_index=0)
    await env.start()
    try:
        yield env
    finally:
        await env.close()


def hand_to_sandbox(workspace: Path) -> None:
    """What the test made in the workspace as the host's user, given to the workspace's owner: the
    sandbox's own user when the tests run as root."""
    owner = workspace.stat()
    for path in [workspace, *workspace.rglob("*")]:
        os.chown(path, owner.st_uid, owner.st_gid, follow_symlinks=False)


@contextlib.asynccontextmanager
async def swapping(tmp_path: Path, first: str, second: str,
                   link_to: str = "outside") -> AsyncIterator[BubblewrapEnvironment]:
    """A sandbox whose workspace holds ``d/f`` (a file) and ``l``, a symlink to ``tmp_path/link_to``
    on the host (``outside`` is a directory holding a secret ``f``), with ``first`` and ``second``
    being swapped."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(SECRET)
    async with sandbox(tmp_path) as env:
        workspace = env.prompt_dir
        (workspace / "d").mkdir()
        (workspace / "d" / "f").write_bytes(INSIDE)
        (workspace / "l").symlink_to(tmp_path / link_to)
        (workspace / "swap.py").write_text(SWAPPER)
        hand_to_sandbox(workspace)
        started = await env.run(f"python3 swap.py {first} {second} >swap.log 2>&1 &")
        assert started.exit_code == 0, started
        await asyncio.to_thread(wait_for, (workspace / "swapping").exists, 10.0, "the swapper to start")
        yield env
        (workspace / "stop").touch()
        assert (workspace / "swap.log").read_text() == ""     # it swapped until told to stop


def both_seen(results: list[object], refusals: list[str]) -> bool:
    return bool(results and refusals)


async def outcomes(call: Callable[[int], Awaitable[object]],
                   raced: Callable[[list[object], list[str]], bool] = both_seen,
                   ) -> tuple[list[object], list[str]]:
    """What ``call(i)`` returned, and the messages of the calls refused: at least CALLS calls, then
    on until ``raced`` says the race was on (by default: some calls succeeded and some were
    refused), so a swapper starved of CPU cannot make the test vacuous."""
    results: list[object] = []
    refusals: list[str] = []
    deadline = time.monotonic() + RACE_SECONDS
    calls = 0
    while calls < CALLS or (not raced(results, refusals) and time.monotonic() < deadline):
        try:
            results.append(await call(calls))
        except ToolError as exc:
            refusals.append(str(exc))
        calls += 1
    return results, refusals


def unblocked_after(fifo: Path) -> threading.Timer:
    """Opens both ends of ``fifo`` after UNBLOCK_SECONDS, releasing whatever blocks on it."""
    def release() -> None:
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(writer)
        os.close(reader)
    timer = threading.Timer(UNBLOCK_SECONDS, release)
    timer.start()
    return timer


# --- races ----------------------------------------------------------------------------------------

@pytest.mark.bubblewrap
def test_reads_through_a_directory_swapped_with_an_outside_symlink_never_return_the_outside_file(tmp_path):
    async def scenario():
        async with swapping(tmp_path, "d", "l") as env:
            return await outcomes(lambda _: env.read_file("d/f"))
    results, refusals = asyncio.run(scenario())
    assert SECRET not in results
    assert set(results) == {INSIDE} and refusals


@pytest.mark.bubblewrap
def test_writes_through_a_directory_swapped_with_an_outside_symlink_never_land_outside(tmp_path):
    async def scenario():
        async with swapping(tmp_path, "d", "l") as env:
            return await outcomes(lambda i: env.write_file(f"d/planted-{i}", b"x"))
    results, refusals = asyncio.run(scenario())
    assert sorted(path.name for path in (tmp_path / "outside").iterdir()) == ["f"]
    assert results and refusals


@pytest.mark.bubblewrap
def test_reads_of_a_file_swapped_with_an_outside_symlink_never_return_the_outside_file(tmp_path):
    async def scenario():
        async with swapping(tmp_path, "d/f", "l", link_to="outside/f") as env:
            return await outcomes(lambda _: env.read_file("d/f"))
    results, refusals = asyncio.run(scenario())
    assert SECRET not in results
    assert set(results) == {INSIDE} and refusals


@pytest.mark.bubblewrap
def test_writes_to_a_file_swapped_with_an_outside_symlink_never_change_the_outside_file(tmp_path):
    async def scenario():
        async with swapping(tmp_path, "d/f", "l", link_to="outside/f") as env:
            names = (env.prompt_dir / "d" / "f", env.prompt_dir / "l")

            def symlink_replaced(*_: object) -> bool:
                """A write met the symlink at d/f (and replaced it rather than writing through it)."""
                return not any(name.is_symlink() for name in names)
            await outcomes(lambda _: env.write_file("d/f", b"overwritten\n"), symlink_replaced)
            return symlink_replaced()
    assert asyncio.run(scenario())
    assert (tmp_path / "outside" / "f").read_bytes() == SECRET


# --- FIFOs, sockets, devices ----------------------------------------------------------------------

@pytest.mark.parametrize("tool", ["read", "write"])
def test_a_fifo_is_refused_without_blocking(local, tool):
    fifo = local.prompt_dir / "p"
    os.mkfifo(fifo)
    call = local.read_file("p") if tool == "read" else local.write_file("p", b"x")
    timer = unblocked_after(fifo)
    try:
        with pytest.raises(ToolError, match="not a regular file"):
            asyncio.run(call)
    finally:
        timer.cancel()
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("tool", ["read", "write"])
def test_a_socket_is_refused(local, tool):
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(local.prompt_dir / "s"))
        listening.listen()
        call = local.read_file("s") if tool == "read" else local.write_file("s", b"x")
        with pytest.raises(ToolError, match="not a regular file"):
            asyncio.run(call)


@pytest.mark.parametrize("tool", ["read", "write"])
def test_a_device_node_is_refused(local, tool):
    node = local.prompt_dir / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))     # /dev/null's numbers
        os.close(os.open(node, os.O_RDONLY))
    except PermissionError:
        pytest.skip("creating and opening a device node needs root and a filesystem without nodev")
    call = local.read_file("null") if tool == "read" else local.write_file("null", b"x")
    with pytest.raises(ToolError, match="not a regular file"):
        asyncio.run(call)
    assert stat.S_ISCHR(os.lstat(node).st_mode)


@pytest.mark.parametrize("tool", ["read", "write"])
def test_a_symlink_to_dev_null_is_refused(local, tool):
    (local.prompt_dir / "null").symlink_to("/dev/null")
    call = local.read_file("null") if tool == "read" else local.write_file("null", b"x")
    with pytest.raises(ToolError, match="outside the working directory"):
        asyncio.run(call)


# --- hard links -----------------------------------------------------------------------------------

def test_local_refuses_to_read_a_file_hard_linked_from_outside(local, tmp_path):
    secret = tmp_path / "id_rsa"
    secret.write_bytes(SECRET)
    os.link(secret, local.prompt_dir / "hl")
    with pytest.raises(ToolError, match="other hard links"):
        asyncio.run(local.read_file("hl"))


def test_local_refuses_to_write_a_file_hard_linked_from_outside(local, tmp_path):
    secret = tmp_path / "id_rsa"
    secret.write_bytes(SECRET)
    os.link(secret, local.prompt_dir / "hl")
    with pytest.raises(ToolError, match="other hard links"):
        asyncio.run(local.write_file("hl", b"x"))
    assert secret.read_bytes() == SECRET and os.path.samefile(secret, local.prompt_dir / "hl")


@pytest.mark.bubblewrap
def test_bubblewrap_reads_a_file_hard_linked_inside_the_workspace(tmp_path):
    async def scenario():
        async with sandbox(tmp_path) as env:
            await env.run("echo shared > a && ln a b")
            return await env.read_file("b")
    assert asyncio.run(scenario()) == b"shared\n"


# --- symlinks -------------------------------------------------------------------------------------

def test_a_symlink_inside_the_tree_is_followed_for_reading_and_writing(local):
    (local.prompt_dir / "src").mkdir()
    (local.prompt_dir / "src" / "x.py").write_text("old\n")
    (local.prompt_dir / "x.py").symlink_to("src/x.py")
    assert asyncio.run(local.read_file("x.py")) == b"old\n"
    asyncio.run(local.write_file("x.py", b"new\n"))
    assert (local.prompt_dir / "src" / "x.py").read_text() == "new\n"
    assert (local.prompt_dir / "x.py").is_symlink()


def test_a_symlink_climbing_out_of_the_tree_is_refused(local, tmp_path):
    (tmp_path / "outside.txt").write_bytes(SECRET)
    (local.prompt_dir / "sub").mkdir()
    (local.prompt_dir / "sub" / "up").symlink_to("../../../outside.txt")
    with pytest.raises(ToolError, match="outside the working directory"):
        asyncio.run(local.read_file("sub/up"))
    with pytest.raises(ToolError, match="outside the working directory"):
        asyncio.run(local.write_file("sub/up", b"x"))
    assert (tmp_path / "outside.txt").read_bytes() == SECRET


def test_a_symlink_loop_is_an_error(local):
    (local.prompt_dir / "a").symlink_to("b")
    (local.prompt_dir / "b").symlink_to("a")
    with pytest.raises(ToolError, match="symbolic links"):
        asyncio.run(local.read_file("a"))
    with pytest.raises(ToolError, match="symbolic links"):
        asyncio.run(local.write_file("a/x", b"x"))


def test_local_follows_an_absolute_symlink_into_its_own_directory(local):
    (local.prompt_dir / "real.txt").write_text("here\n")
    (local.prompt_dir / "link.txt").symlink_to(local.prompt_dir / "real.txt")
    assert asyncio.run(local.read_file("link.txt")) == b"here\n"


@pytest.mark.bubblewrap
def test_bubblewrap_follows_a_symlink_to_an_absolute_workspace_path(tmp_path):
    async def scenario():
        async with sandbox(tmp_path) as env:
            await env.run("mkdir src && echo old > src/x.py && ln -s /workspace/src/x.py x.py")
            before = await env.read_file("x.py")
            await env.write_file("x.py", b"new\n")
            after = await env.run("cat src/x.py && test -L x.py")
            return before, after
    before, after = asyncio.run(scenario())
    assert before == b"old\n" and (after.output, after.exit_code) == ("new\n", 0)


def test_a_read_stops_at_the_size_limit_however_much_the_file_grows_while_it_is_read():
    """security.md: reads stop at the size limit even if the file grows. A file that a command keeps
    writing has no end to read to; a pipe fed without end stands for it (its size said 0 at the look)."""
    reader, writer = os.pipe()
    stop = threading.Event()

    def feed() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                os.write(writer, b"x" * 65536)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        assert len(confined_files._read_at_most(reader, 10_001, 0)) == 10_001
    finally:
        stop.set()
        os.close(reader)
        feeder.join(timeout=5)
        os.close(writer)


# --- deep and long paths --------------------------------------------------------------------------

def test_a_path_longer_than_any_path_may_be_is_refused_before_a_directory_is_made(local):
    # Before, a write to "a/" * 30000 + "x.txt" made about 20,000 directories, holding a descriptor for each,
    # until the worker (every prompt in it) ran out of descriptors.
    with pytest.raises(ToolError, match="longer than 4,096 bytes"):
        asyncio.run(local.write_file("a/" * 30_000 + "x.txt", b"x"))
    assert not (local.prompt_dir / "a").exists()


def test_a_write_makes_a_bounded_number_of_missing_directories(local):
    # Before, 2,000 directories under the length limit took a 20 MB workspace past its limit with a
    # one-byte write: only the content's bytes were counted.
    limit = confined_files.MOST_DIRECTORIES_MADE
    with pytest.raises(ToolError, match=f"would make more than {limit} missing directories"):
        asyncio.run(local.write_file("d/" * (limit + 1) + "x.txt", b"x"))
    made = [path for path in local.prompt_dir.rglob("*") if path.is_dir()]
    assert len(made) <= limit
    assert asyncio.run(local.write_file("e/" * limit + "x.txt", b"x")) == "e/" * limit + "x.txt"


def test_the_walk_holds_a_bounded_number_of_directories_open(local, resolver):
    if resolver == "openat2":
        pytest.skip("openat2 looks a path up in one call, holding no descriptor per directory")
    depth = confined_files.MOST_DIRECTORIES_DEEP
    deep = local.prompt_dir.joinpath(*["d"] * (depth + 1))
    deep.mkdir(parents=True)
    (deep / "f").write_bytes(INSIDE)
    (deep.parent / "g").write_bytes(INSIDE)
    with pytest.raises(ToolError, match=f"more than {depth} directories deep"):
        asyncio.run(local.read_file("d/" * (depth + 1) + "f"))
    assert asyncio.run(local.read_file("d/" * depth + "g")) == INSIDE


@pytest.mark.parametrize("tool", ["read", "write"])
def test_a_path_holding_a_lone_surrogate_is_refused_as_not_text(local, tool):
    # Before: "read_file failed: UnicodeEncodeError: ... surrogates not allowed", from the session's catch-all.
    call = local.read_file("a\ud800") if tool == "read" else local.write_file("a\ud800", b"x")
    with pytest.raises(ToolError, match="lone surrogate"):
        asyncio.run(call)
