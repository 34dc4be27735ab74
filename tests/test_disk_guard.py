"""The workspace watch's judgement of its walks: what processes it stopped leave behind is never held
against what runs after them (seen as the model's next command killed right after a stop)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from batchrun.environments import disk_guard
from batchrun.environments.disk_guard import DiskGuard, WorkspaceWatch
from batchrun.environments.limits import MIB

LIMIT = 10 * MIB


def watch_over(directory: Path) -> tuple[WorkspaceWatch, list[str]]:
    stops: list[str] = []
    watch = WorkspaceWatch(DiskGuard(reserve_bytes=0), directory, LIMIT, lambda: stops.append("stop"), lambda: [], ())
    return watch, stops


def test_a_workspace_over_its_limit_and_growing_is_stopped(tmp_path):
    watch, stops = watch_over(tmp_path)
    watch.counted(20 * MIB, 0.0, time.monotonic())
    assert stops == ["stop"] and watch.take_reason() is not None


def test_what_the_stopped_processes_wrote_last_does_not_stop_the_next_command(tmp_path):
    watch, stops = watch_over(tmp_path)
    watch.counted(20 * MIB, 0.0, time.monotonic())
    # Their last writes land after the walk that stopped them: the first walk after the stop sees them.
    watch.counted(45 * MIB, 0.0, time.monotonic())
    assert stops == ["stop"]


def test_growth_beyond_what_the_stopped_processes_left_is_stopped_again(tmp_path):
    watch, stops = watch_over(tmp_path)
    watch.counted(20 * MIB, 0.0, time.monotonic())
    watch.counted(45 * MIB, 0.0, time.monotonic())
    watch.counted(60 * MIB, 0.0, time.monotonic())
    assert stops == ["stop", "stop"]


def test_a_walk_begun_before_the_stop_changes_nothing(tmp_path):
    watch, stops = watch_over(tmp_path)
    before = time.monotonic()
    watch.counted(20 * MIB, 0.0, time.monotonic())
    watch.counted(45 * MIB, 0.0, before)
    assert stops == ["stop"] and watch.used == 20 * MIB and watch.baseline_due


def test_growth_past_the_limit_after_the_workspace_shrank_below_what_a_stop_left_is_stopped(tmp_path):
    # What a stop left can go (deleted, or a reservation past a file's end given back): growing again
    # from there past the limit must be stopped, not only growth past what the stop once left.
    watch, stops = watch_over(tmp_path)
    watch.counted(10_000 * MIB, 0.0, time.monotonic())
    watch.counted(10_000 * MIB, 0.0, time.monotonic())      # the baseline after the stop
    watch.counted(1 * MIB, 0.0, time.monotonic())
    watch.counted(5_000 * MIB, 0.0, time.monotonic())
    assert stops == ["stop", "stop"]


def test_a_command_after_a_stop_starts_from_a_walk_of_the_workspace_as_it_is(tmp_path):
    watch, stops = watch_over(tmp_path)
    watch.counted(20 * MIB, 0.0, time.monotonic())
    (tmp_path / "left").write_bytes(b"x" * (3 * MIB))
    asyncio.run(watch.settle())
    assert not watch.baseline_due and watch.stopped_at == watch.used >= 3 * MIB
    assert stops == ["stop"]


def disk(monkeypatch, *, gib: int, inodes: int, free_gib: int, free_inodes: int) -> None:
    """The filesystem under every watch, as statvfs tells it: ``gib`` GiB and ``inodes`` inodes, of which
    ``free_gib`` and ``free_inodes`` are free."""
    block = 4096
    status = os.statvfs_result((block, block, gib * 2**30 // block, free_gib * 2**30 // block,
                                free_gib * 2**30 // block, inodes, free_inodes, free_inodes, 0, 255))
    monkeypatch.setattr(disk_guard.os, "statvfs", lambda _: status)


def test_each_file_counts_at_least_its_share_of_the_disks_inodes(tmp_path, monkeypatch):
    disk(monkeypatch, gib=16, inodes=2**20, free_gib=8, free_inodes=2**19)      # 16 KiB a file
    for number in range(10):
        (tmp_path / f"empty{number}").touch()
    watch, _ = watch_over(tmp_path)
    asyncio.run(watch.look())
    assert watch.used == 10 * 16 * 1024


def test_a_disk_short_of_inodes_is_short_of_space_and_says_which(tmp_path, monkeypatch):
    disk(monkeypatch, gib=16, inodes=2**20, free_gib=8, free_inodes=1000)
    guard = DiskGuard(reserve_bytes=64 * MIB)       # 4,096 files' share
    assert guard.low_on_space(tmp_path)
    assert guard.low_on_space_note(tmp_path).startswith(
        "the disk holding the workspace is almost out of room for new files (1000 more fit, 4096 of them kept")


def test_a_disk_that_makes_inodes_as_it_needs_them_counts_blocks_alone(tmp_path, monkeypatch):
    disk(monkeypatch, gib=16, inodes=0, free_gib=8, free_inodes=0)
    (tmp_path / "empty").touch()
    watch, _ = watch_over(tmp_path)
    asyncio.run(watch.look())
    assert watch.used == 0 and not watch._guard.low_on_space(tmp_path)


def test_a_walk_never_waits_behind_the_other_work_of_the_workers_threads(tmp_path):
    # Long replies are taken apart in the event loop's threads, and the endpoint chooses how long: a walk
    # queued behind them would let a writer run past its limit for as long.
    for number in range(1000):          # more than a walk does on the event loop
        (tmp_path / f"file{number}").touch()
    watch, _ = watch_over(tmp_path)

    async def scenario() -> bool:
        release = asyncio.Event()
        loop = asyncio.get_running_loop()
        busy = [asyncio.ensure_future(asyncio.to_thread(lambda: asyncio.run_coroutine_threadsafe(
            release.wait(), loop).result())) for _ in range(64)]
        try:
            await asyncio.wait_for(watch.look(), timeout=30)
            return True
        except TimeoutError:
            return False
        finally:
            release.set()
            await asyncio.gather(*busy)
    assert asyncio.run(scenario())
