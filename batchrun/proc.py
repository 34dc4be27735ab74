"""The process tree, as /proc shows it."""

from __future__ import annotations

import os

from batchrun import kernel_files


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (whichever of its threads started them); none for a process
    that is gone."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            found.extend(int(child) for child in kernel_files.read(f"/proc/{pid}/task/{task}/children").split())
        except (OSError, ValueError):
            continue
    return found


def descendants(pids: list[int]) -> list[int]:
    """``pids`` and every process below them."""
    found, frontier = [], list(pids)
    while frontier:
        pid = frontier.pop()
        found.append(pid)
        frontier.extend(children(pid))
    return found
