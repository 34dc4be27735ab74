"""Holding a workspace to its limit while the prompt's processes write, and keeping the disk from filling.

A size check after each command is only a note: one command can write gigabytes before it ends, and a
process left in the background writes between commands. So each worker process watches its workspaces
for as long as their environments live, and stops every process of a workspace that is over its limit and
still growing (the environment then says so to the model). Two things make a look due:

* time: each workspace is walked again after half the time it would take to fill the room it has left at
  WRITE_RATE (never sooner than a tick, never later than MAX_WALK_INTERVAL, and not more than about 5%
  of a core for a workspace with very many files). Space goes only as fast as it can be written: the
  sandbox's system-call filter refuses ``fallocate``, which reserves gigabytes in one call;
* the filesystem: one ``statvfs`` per tick tells how much free space went since the last walk; more than
  half the room of the fullest workspace walks them all at once. (Other prompts deleting files at the
  same time can hide a writer from this look, never from the first.)

A count is the workspace's files and the files with no name left (deleted while open, or made by
O_TMPFILE) that the prompt's processes hold open or mapped, which take space no walk can see. Those are
looked for (through /proc) only when the filesystem's free space says so (the second kind of look, and
below the reserve): with thousands of sandboxes, doing it at every walk cost a quarter of a core, and
space held that way is space the filesystem no longer has, so it makes that look due.

The same ``statvfs`` keeps a reserve free on that filesystem (``ResourceLimits.disk_reserve_mb``): where
the run's own files share it (the default layout), a prompt filling the disk would otherwise stop the
run's writes. Below the reserve, the processes of every workspace that grew since its last walk are
stopped.

Inodes run out as well as blocks: on a filesystem with a fixed number of them (ext4, tmpfs), empty
files take no block and a prompt could make files until no one can create one, the run's rows
included. So each file counts at least its share of the disk (its size divided by its number of
inodes, 16 KB on an ext4 made with the defaults), and free inodes count as free space at that share:
a workspace at its limit holds no more of the inodes than of the space, and the reserve keeps both.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from batchrun.environments.disk_usage import FULL, INLINE_WALK_ENTRIES, DiskUsageWalk, disk_usage, unnamed_usage
from batchrun.environments.limits import MIB

TICK_SECONDS = 0.02
# How fast one prompt can take disk space by writing, through the page cache (the sustained rate of a
# local disk is far lower; a burst into memory is what the schedule must keep up with).
WRITE_RATE = 2048 * MIB
MAX_WALK_INTERVAL = 2.0
# A walk of a workspace waits at least this many times as long as the last one took.
_WALK_COST_FACTOR = 20
# What a file of a few bytes takes on most filesystems: a share of the inodes no larger is not worth a word.
_BLOCK_BYTES = 4096
# Walks at once in a worker process: the guard's own, and those after commands of several sessions.
_WALK_THREADS = 4
# A workspace with no room left still counts this much, so that its walks come a tick apart, not at once.
_MIN_ROOM_BYTES = MIB


class WorkspaceWatch:
    """One workspace under watch: its limit, what it held at the last walk, when the next is due, and why
    its processes were last stopped (until the environment reports it)."""

    def __init__(self, guard: DiskGuard, directory: Path, limit_bytes: int, stop: Callable[[], None],
                 holders: Callable[[], list[int]], files: tuple[Path, ...]) -> None:
        self._guard = guard
        self.directory = directory
        self.limit_bytes = limit_bytes
        self.stop = stop
        self.holders = holders
        self.device = os.stat(directory).st_dev     # where the holders' unnamed files count (see unnamed_usage)
        self.files = files          # outside the directory, written by its processes: counted with it
        self.least_per_file = free_space(directory).file_share
        self.unnamed = 0        # what the holders' files with no name took when last counted
        self.used = 0
        self.stopped_at = -_MIN_ROOM_BYTES      # what it held when its processes were last stopped
        self.stopped_when = -math.inf           # when the last stop had killed them (monotonic)
        self.baseline_due = False               # the next walk begun after that stop sets stopped_at
        self.reason: str | None = None
        self.due = time.monotonic()

    def room(self) -> int:
        return max(self.limit_bytes - self.used, _MIN_ROOM_BYTES)

    def counted(self, used: int, seconds: float, began: float) -> None:
        """A walk begun at ``began`` (monotonic) found ``used`` bytes and took ``seconds``: stop the
        processes if over, and say when to look again.

        What the processes of a stop wrote just before they died can land after the walk that stopped
        them, and counted as growth it would stop whatever runs next, a command the model started after
        the stop. So a walk begun before the last stop is stale and changes nothing, and the first one
        begun after it only takes what the stopped processes left as the new baseline."""
        if began >= self.stopped_when:
            if self.baseline_due:
                self.baseline_due = False
                self.used = self.stopped_at = used
            else:
                self._judge(used)
        interval = min(max(self.room() / WRITE_RATE / 2, TICK_SECONDS), MAX_WALK_INTERVAL)
        self.due = time.monotonic() + max(interval, _WALK_COST_FACTOR * seconds)

    def _judge(self, used: int) -> None:
        grew = used > self.used
        self.used = used
        # What the stop left that went since (deleted, or space reserved past a file's end given back) is
        # room the prompt may not take again past the limit.
        self.stopped_at = min(self.stopped_at, used)
        # Over the limit and grown since the last stop, by more than the allocation the filesystem may
        # still add to what was written then (delayed allocation, metadata).
        if used > self.limit_bytes and used > self.stopped_at + _MIN_ROOM_BYTES:
            self.stopped(f"the workspace went over its limit of {self.limit_bytes // MIB} MB (it holds "
                         f"{used // MIB} MB{self._counting_note()})")
        elif grew and self._guard.low_on_space(self.directory):
            self.stopped(self._guard.low_on_space_note(self.directory))

    def _counting_note(self) -> str:
        """How files were counted, where that is more than their blocks say (see the module)."""
        if self.least_per_file <= _BLOCK_BYTES:
            return ""
        return f", each file counted as at least {self.least_per_file // 1024} KB, its share of the disk's inodes"

    def stopped(self, why: str) -> None:
        self.stopped_at = self.used
        self.reason = f"{why}: every process of the prompt was stopped; delete files before writing more"
        self.stop()
        self.stopped_when = time.monotonic()
        self.baseline_due = True

    async def settle(self) -> None:
        """Before a command starts: after a stop, walk now for the baseline, so that nothing this command
        writes is taken for what the stopped processes left."""
        if self.baseline_due:
            await self.look()

    async def look(self) -> None:
        """Walk the workspace now (a command just ended): on the event loop while it is small, since a hop
        to a thread waits behind the walks of the other sessions of the process, in a thread beyond that."""
        started = time.monotonic()
        walk = DiskUsageWalk(self.directory, FULL, self.least_per_file)
        given_up = walk.run(max_entries=INLINE_WALK_ENTRIES)
        if given_up is None:
            given_up = await asyncio.get_running_loop().run_in_executor(self._guard.threads, walk.run)
        # The files with no name are as they were last counted (see the module): a command that ended
        # closed its own, and looking through /proc on the event loop after every command costs a tenth
        # of a command.
        used = walk.used + self.unnamed + files_usage(self.files)
        self.counted(FULL if given_up else min(FULL, used), time.monotonic() - started, started)

    def refuses(self, size: int) -> str | None:
        """Why a file tool may not add ``size`` bytes to the workspace now, if it may not."""
        if self.used + size > self.limit_bytes:
            return (f"writing {size} bytes would take the workspace over its limit of {self.limit_bytes // MIB} "
                    f"MB (it holds {self.used // MIB} MB); delete files first")
        if free_space(self.directory).bytes - size < self._guard.reserve_bytes:
            return self._guard.low_on_space_note(self.directory)
        return None

    async def note_after_command(self) -> str | None:
        """Look now (a command just ended: one that wrote past the limit just before it ended is caught here
        rather than at the next tick), and say why the processes were stopped since the last call, or that
        the workspace is still over its limit; None when there is nothing to say."""
        await self.look()
        if reason := self.take_reason():
            return reason
        if self.used > self.limit_bytes:
            return (f"the workspace holds more than its limit of {self.limit_bytes // MIB} MB; "
                    "delete files before writing more")
        return None

    def take_reason(self) -> str | None:
        """Why the prompt's processes were stopped since the last call, if they were."""
        reason, self.reason = self.reason, None
        return reason

    def close(self) -> None:
        self._guard.forget(self)


class DiskGuard:
    """The watch over one worker process's workspaces (see the module's docstring)."""

    def __init__(self, reserve_bytes: int) -> None:
        self.reserve_bytes = reserve_bytes
        # The walks' own threads: the event loop's are shared with work whose length a prompt or the
        # endpoint chooses (a long reply taken apart), and a walk queued behind it would let a writer run
        # past its limit for as long.
        self.threads = ThreadPoolExecutor(max_workers=_WALK_THREADS, thread_name_prefix="disk-guard")
        self._watches: list[WorkspaceWatch] = []
        self._task: asyncio.Task | None = None
        self._most_free = 0         # the most free space seen since the last walk of every workspace

    def watch(self, directory: Path, limit_bytes: int, stop: Callable[[], None],
              holders: Callable[[], list[int]], files: tuple[Path, ...] = ()) -> WorkspaceWatch:
        """Keep ``directory``, with ``files`` outside it, under ``limit_bytes`` until the watch is closed;
        ``stop`` kills every process writing it, ``holders`` names them (for the files they hold with no
        name left)."""
        watch = WorkspaceWatch(self, directory, limit_bytes, stop, holders, files)
        if not self._watches:
            self._most_free = free_space(directory).bytes
        self._watches.append(watch)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return watch

    def forget(self, watch: WorkspaceWatch) -> None:
        if watch in self._watches:
            self._watches.remove(watch)

    def low_on_space(self, directory: Path) -> bool:
        return free_space(directory).bytes < self.reserve_bytes

    def low_on_space_note(self, directory: Path) -> str:
        free = free_space(directory)
        if free.files_run_out_first:
            return (f"the disk holding the workspace is almost out of room for new files ({free.files} more "
                    f"fit, {self.reserve_bytes // free.file_share} of them kept for the run's own files)")
        return (f"the disk holding the workspace is almost full ({free.blocks // MIB} MB free, "
                f"{self.reserve_bytes // MIB} MB of it kept for the run's own files)")

    async def _run(self) -> None:
        while self._watches:
            await asyncio.sleep(TICK_SECONDS)
            if self._watches:
                await self._tick()

    async def _tick(self) -> None:
        watches = list(self._watches)
        free = free_space(watches[0].directory).bytes
        self._most_free = max(self._most_free, free)
        everything = (free < self.reserve_bytes
                      or (self._most_free - free) * 2 >= min(watch.room() for watch in watches))
        now = time.monotonic()
        due = watches if everything else [watch for watch in watches if watch.due <= now]
        if not due:
            return
        counts = await asyncio.get_running_loop().run_in_executor(self.threads, _count, due, everything)
        for watch, (named, unnamed, seconds, began) in zip(due, counts, strict=True):
            if watch in self._watches:
                if unnamed is not None:
                    watch.unnamed = unnamed
                watch.counted(min(FULL, named + watch.unnamed), seconds, began)
        if everything:
            self._most_free = free_space(watches[0].directory).bytes


def _count(watches: list[WorkspaceWatch], with_unnamed: bool) -> list[tuple[int, int | None, float, float]]:
    """(bytes of its files, bytes of the files its processes hold with no name left, or None where not
    counted, seconds the count took, when it began) of each workspace (see the module)."""
    counts: list[tuple[int, int | None, float, float]] = []
    for watch in watches:
        started = time.monotonic()
        unnamed = None
        if with_unnamed:
            unnamed = unnamed_usage(watch.holders(), watch.device)
            unnamed = FULL if unnamed is None else unnamed
        named = disk_usage(watch.directory, watch.least_per_file) + files_usage(watch.files)
        counts.append((named, unnamed, time.monotonic() - started, started))
    return counts


def files_usage(files: tuple[Path, ...]) -> int:
    """The bytes of disk the files take, the space they hold past their ends included; one gone takes none."""
    used = 0
    for path in files:
        try:
            used += os.lstat(path).st_blocks * 512
        except OSError:
            continue
    return used


@dataclass(frozen=True)
class FreeSpace:
    """What an unprivileged writer can still take on a filesystem."""

    blocks: int         # bytes
    files: int          # inodes (0 with file_share where the filesystem makes them as it needs them)
    file_share: int     # the disk's bytes per inode, 0 where it has no fixed number of them

    @property
    def files_run_out_first(self) -> bool:
        return self.file_share > 0 and self.files * self.file_share < self.blocks

    @property
    def bytes(self) -> int:
        """The free space, free inodes counted at their share of the disk: whichever runs out first."""
        return self.files * self.file_share if self.files_run_out_first else self.blocks


def free_space(directory: Path) -> FreeSpace:
    """What is left on the filesystem holding ``directory``."""
    try:
        status = os.statvfs(directory)
    except OSError:
        return FreeSpace(1 << 62, 0, 0)     # gone (the prompt is ending): nothing to guard
    share = status.f_blocks * status.f_frsize // status.f_files if status.f_files else 0
    return FreeSpace(status.f_bavail * status.f_frsize, status.f_favail, share)


_guards: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, DiskGuard]] = weakref.WeakKeyDictionary()


def guard_for(reserve_bytes: int) -> DiskGuard:
    """This event loop's guard (one per worker process in a run)."""
    guards = _guards.setdefault(asyncio.get_running_loop(), {})
    if reserve_bytes not in guards:
        guards[reserve_bytes] = DiskGuard(reserve_bytes)
    return guards[reserve_bytes]
