"""Holding a container's writable layer to the workspace limit while its commands write.

An engine's storage has no size limit of its own on most hosts (``--storage-opt size`` needs overlay on
XFS with project quotas), and it usually shares a disk with the run directory. Where the engine keeps a
container's writable layer as a directory of this machine (Docker's and Podman's overlay drivers, run by
the runner's user), everything the container writes outside its /tmp (a tmpfs, capped on its own) lands
in that directory, so the worker's disk guard watches it as it watches a sandbox's workspace: walked
while commands run, its holders' unnamed files counted, the disk reserve kept.

Over the limit, the container's first process is killed: the kernel kills every other process of its
PID namespace with it, whatever those processes were changed to do. The container is started again
before its next command, its files as they were. The first process is held by a pidfd, so a kill never
reaches a process that took its number after it ended.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

from batchrun.environments.disk_guard import WorkspaceWatch, guard_for
from batchrun.environments.limits import MIB, ResourceLimits

#: The ``inspect --format`` template whose answer :func:`parse_layer` reads.
LAYER_FORMAT = "{{.State.Pid}}\t{{.GraphDriver.Data.UpperDir}}\t{{.GraphDriver.Data.MergedDir}}"


def parse_layer(answer: str) -> tuple[int, Path] | None:
    """(the first process's pid on this machine, the writable layer's directory) from an answer to
    LAYER_FORMAT; None where the layer cannot be watched from here: another storage driver, an engine on
    another machine or behind another user's permissions, or a pid that names another process here (a
    runner in a PID namespace of its own), told apart by its root being the container's."""
    fields = answer.strip().split("\t")
    if len(fields) != 3 or not fields[0].isdigit() or int(fields[0]) <= 0:
        return None
    pid, upper, merged = int(fields[0]), Path(fields[1]), fields[2]
    try:
        if not os.path.isdir(upper) or not os.access(upper, os.R_OK | os.X_OK):
            return None
        root, container_root = os.stat(f"/proc/{pid}/root"), os.stat(merged)
    except (OSError, ValueError):
        return None
    if (root.st_dev, root.st_ino) != (container_root.st_dev, container_root.st_ino):
        return None
    return pid, upper


class LayerWatch:
    """The watch over one container's writable layer, and the handle on its first process."""

    def __init__(self, directory: Path, first_pid: int, limits: ResourceLimits) -> None:
        self._first = -1
        self._namespace = ""
        #: Set when the watch killed the container's processes: it must be started again before use.
        self.killed = False
        self.watch: WorkspaceWatch = guard_for(limits.disk_reserve_mb * MIB).watch(
            directory, limits.workspace_mb * MIB, self._kill, self.holders)
        try:
            self.restarted(first_pid)
        except OSError:
            self.close()
            raise

    def restarted(self, first_pid: int) -> None:
        """The container was started again (its first process is new). Where that process is gone
        already, OSError, and the watch holds no process until the next start: a closed descriptor's
        number, soon another's, must never be signalled."""
        previous, self._first = self._first, -1
        if previous >= 0:
            os.close(previous)
        self._first = os.pidfd_open(first_pid)
        self._namespace = os.readlink(f"/proc/{first_pid}/ns/pid")
        # The container's processes see its files on the overlay's own device, made anew by each start,
        # not on the layer's: the files they hold with no name left are found by it.
        self.watch.device = os.stat(f"/proc/{first_pid}/root").st_dev
        self.killed = False

    def _kill(self) -> None:
        """Called by the disk guard's task, which watches every container of the worker: never raises."""
        if self._first >= 0:
            try:
                signal.pidfd_send_signal(self._first, signal.SIGKILL)
            except OSError:
                pass            # already gone: a time-out's stop, or the engine
        self.killed = True

    def holders(self) -> list[int]:
        """Every process of the container's PID namespace: ``exec`` starts programs in it from outside,
        so they are not below its first process."""
        found = []
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    if os.readlink(f"/proc/{entry.name}/ns/pid") == self._namespace:
                        found.append(int(entry.name))
                except OSError:
                    continue
        return found

    def close(self) -> None:
        self.watch.close()
        if self._first >= 0:
            os.close(self._first)
            self._first = -1
