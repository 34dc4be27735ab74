"""The workspace watch's judgement of its walks: what processes it stopped leave behind is never held
against what runs after them (seen as the model's next command killed right after a stop)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from batchrun.environments.disk_guard import DiskGuard, WorkspaceWatch, free_space
from batchrun.environments.limits import MIB

LIMIT = 10 * MIB


def watch_over(directory: Path) -> tuple[WorkspaceWatch, list[str]]:
    stops: list[str] = []
    watch = WorkspaceWatch(DiskGuard(reserve_bytes=0), directory, LIMIT, lambda: stops.append("stop"), lambda: [])
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


def test_a_command_after_a_stop_starts_from_a_walk_of_the_workspace_as_it_is(tmp_path):
    watch, stops = watch_over(tmp_path)
    watch.counted(20 * MIB, 0.0, time.monotonic())
    (tmp_path / "left").write_bytes(b"x" * (3 * MIB))
    asyncio.run(watch.settle())
    assert not watch.baseline_due and watch.stopped_at == watch.used >= 3 * MIB
    assert stops == ["stop"]


def test_a_workspace_on_a_disk_with_a_fixed_number_of_inodes_counts_each_file_at_their_share(tmp_path):
    status = os.statvfs(tmp_path)
    if status.f_files == 0:
        pytest.skip("this filesystem makes inodes as it needs them")
    watch, _ = watch_over(tmp_path)
    assert watch.least_per_file == status.f_blocks * status.f_frsize // status.f_files


def test_free_inodes_count_as_free_space_at_their_share_of_the_disk(tmp_path):
    status = os.statvfs(tmp_path)
    if status.f_files == 0:
        pytest.skip("this filesystem makes inodes as it needs them")
    share = status.f_blocks * status.f_frsize // status.f_files
    free = free_space(tmp_path)
    assert free.bytes == min(status.f_bavail * status.f_frsize, status.f_favail * share)
    assert free.files == status.f_favail
