"""The watcher process: ends a private Ray's processes once the runner is gone, even after ``kill -9``.

Apart from the pool because it is a process of its own that shares nothing with the pool but a pipe:
the pool starts it before the private Ray and closes the pipe after stopping Ray, and the watcher reads
/proc to find what Ray left. Ray's own agents would otherwise outlive a killed runner by minutes.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import signal
import time
from multiprocessing.connection import Connection

from batchrun.proc import children

# Set in the environment of a Ray this runner starts: the watcher finds that Ray's processes by it
# (and by having seen them below the parent).
OWNER_VARIABLE = "BATCH_RUNNER_RAY_OWNER"
WATCH_INTERVAL = 0.5            # seconds between the watcher's looks at the parent's descendants
_FORK = multiprocessing.get_context("fork")


class Watcher:
    """The parent's end: started before the private Ray (whose processes inherit the owner mark), closed
    once Ray is stopped."""

    def __init__(self) -> None:
        owner = f"{os.getpid()}-{secrets.token_hex(8)}"
        os.environ[OWNER_VARIABLE] = owner
        reader, self._writer = _FORK.Pipe(duplex=False)
        self._process = _FORK.Process(target=_watch, args=(reader, self._writer, owner), daemon=True)
        self._process.start()
        reader.close()

    def close(self) -> None:
        """The watcher ends whatever of the local Ray is still there."""
        self._writer.close()
        self._process.join(10)


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[19]   # field 22: start time, tells reused pids apart
    except (OSError, IndexError):
        return None


def _descendants(root: int) -> dict[int, str]:
    """pid -> start time of every process below ``root``."""
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child in children(pid):
            if child not in found and (started := _start_time(child)) is not None:
                found[child] = started
                frontier.append(child)
    return found


def _marked_processes(marker: bytes) -> dict[int, str]:
    """Processes whose environment holds ``marker`` (Ray's processes set their title over the start of
    it, so this misses some: the descendants recorded while the parent lived cover those)."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as handle:
                    if marker in handle.read() and (started := _start_time(int(entry))) is not None:
                        found[int(entry)] = started
            except OSError:
                pass
    return found


def _watch(reader: Connection, writer: Connection, owner: str) -> None:
    """The watcher process: notes the parent's descendants (Ray's processes, the actors) while the
    parent lives; once the parent's end of the pipe closes (normal stop or kill -9) it ends every one
    still there that started after it."""
    writer.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    for stream in (0, 1, 2):      # hold no pipe of whoever started the runner
        os.dup2(devnull, stream)
    parent, me = os.getppid(), os.getpid()
    # What already runs is not Ray's (the runner's report process): Ray starts after the watcher.
    not_ray = _descendants(parent).items()
    seen: dict[int, str] = {}
    while True:
        try:
            if reader.poll(WATCH_INTERVAL):
                break             # EOF (poll is true then too): the parent stopped or died
        except OSError:
            break
        seen.update(_descendants(parent))
    seen.update(_descendants(parent))   # after a normal stop the parent is still there: its stragglers
    marker = f"{OWNER_VARIABLE}={owner}\0".encode()
    for _ in range(2):            # a second pass for anything a dying process had just started
        for pid, started in {**seen, **_marked_processes(marker)}.items() - not_ray:
            if pid != me and _start_time(pid) == started:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(0.2)
