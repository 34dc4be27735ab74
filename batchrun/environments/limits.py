"""What one prompt may consume, and how the limits are made to hold.

Over 400 lines, on purpose: each limit and the mechanisms that make it hold (a control group's files in
either hierarchy, the ulimit line for the same numbers where there is none) are read together, and a
change to one limit is a change to both.

A prompt's commands are the model's, so one bad prompt must not take the machine down: memory,
number of processes, the size of its private ``/tmp`` and of its workspace are capped.

Two mechanisms, the stronger where this process may use it:

* a control group per prompt (cgroup v2, or the memory and pids hierarchies of cgroup v1), which
  a root process can create on most Linux machines. It caps memory (``/tmp`` is RAM and counts too)
  and processes for the prompt as a whole, and it holds every process the prompt started, so
  closing the prompt kills all of them, ``setsid`` and double-forked ones included. Where the cpu
  controller is there too, the prompt's processes share one weight on the CPU, as every other prompt's:
  outside a group of their own, each process a command detaches with ``setsid`` is a scheduling group of
  its own (the kernel's autogroups), and a prompt that started hundreds of busy ones left the prompts
  beside it a few hundredths of the machine, so that their commands timed out;
* process resource limits (the shell's ``ulimit``) otherwise: address space per process, largest
  file, and processes per sandbox. The kernel exempts root from the process limit, so a root run
  without control groups has no process cap, and the start-up summary says so.

Every mechanism caps the size of one file at the workspace limit, and the environments check the
workspace's total after each command. Every mechanism also caps the files each process may have open
(:func:`open_files_per_process`): the kernel's table of open files is one for the whole machine, and no
control group counts them.
"""

from __future__ import annotations

import functools
import itertools
import os
import resource
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from batchrun import kernel_files

MIB = 1024 * 1024
# The most a limit may be: what the kernel takes. A size's bytes must fit a signed 64-bit number (a control
# group's memory.max, bwrap's tmpfs --size, ulimit's KiB); a control group refuses a pids.max above the
# kernel's PID_MAX_LIMIT. Past these every sandbox fails to start, or the limit silently does not hold.
MOST_MB = 2 ** 43 - 1
MOST_PROCESSES = 4 * 1024 * 1024
# Shell code that moves the shell running it into control groups: its arguments are the groups'
# cgroup.procs files up to a "--", which it consumes; what follows "--" is left in "$@". A shell's own
# message for a failed write names neither the file nor what it was for ("echo: I/O error").
ENTER_GROUPS = ('while [ "$1" != -- ]; do echo $$ 2>/dev/null > "$1" '
                '|| { echo "cannot join the control group of $1" >&2; exit 126; }; shift; done; shift')
_CGROUP_ROOT = Path("/sys/fs/cgroup")
# Open files per process: the usual soft limit, which programs are written for; and the least any command gets.
_MOST_OPEN_FILES = 1024
_FEWEST_OPEN_FILES = 64
# The share of the machine's table of open files that one prompt's processes may hold together.
_OPEN_FILES_SHARE = 4
# Our directory in each hierarchy; one sub-directory per run, one per prompt below that.
_OWN_DIRECTORY = "batch_runner"
# Killing a prompt's processes races with those still forking; the pids cap bounds how many rounds.
_KILL_ROUNDS = 50
_REMOVE_ATTEMPTS = 20
_REMOVE_PAUSE_SECONDS = 0.01
# A prompt's group is kept for the next prompt of its process once nothing of the prompt is left in it:
# making and removing a memory control group is kernel work that grows with every filesystem mounted
# on the machine, and each sandbox mounts five (docs/performance.md, thousands of sessions). A prompt
# that left more memory charged to its group than this (page cache of files it read, kernel objects of
# its files) has its group removed instead, so the next prompt never starts with much less room before
# its limit than a new group would give it.
_REUSED_MAX_CHARGED_BYTES = 16 * 1024 * 1024
# Dead processes a kept group may still count against its process limit: an orphan (a sandbox's init
# once its bwrap is killed) is reaped by the machine's init, which may take a second to do it.
_REUSED_MAX_UNREAPED = 2


@dataclass(frozen=True)
class ResourceLimits:
    """The caps of one prompt's environment; the defaults are far above what a normal task uses."""

    memory_mb: int = 4096
    processes: int = 1024
    tmp_mb: int = 1024
    workspace_mb: int = 5120
    # Free space the workspaces never take from the filesystem holding them, which by default also holds
    # the run directory: a prompt that fills the disk must not stop the run's own writes.
    disk_reserve_mb: int = 1024

    def ulimit_command(self, *, memory: bool) -> str:
        """The bash ``ulimit`` line that applies these limits to a shell and all it starts.

        Without -H or -S bash sets the soft and the hard limit, so an unprivileged command cannot
        raise them again. ``memory`` is False where a control group caps memory as a whole: a cap on
        each process's address space breaks programs that reserve much and use little (Go, Java).
        """
        parts = [f"-f {_at_most_hard(resource.RLIMIT_FSIZE, self.workspace_mb * 1024, unit=1024)}",
                 f"-u {_at_most_hard(resource.RLIMIT_NPROC, self.processes, unit=1)}",
                 f"-n {_at_most_hard(resource.RLIMIT_NOFILE, open_files_per_process(self.processes), unit=1)}",
                 "-c 0"]
        if memory:
            parts.insert(0, f"-v {_at_most_hard(resource.RLIMIT_AS, self.memory_mb * 1024, unit=1024)}")
        return f"ulimit {' '.join(parts)}"

    def exceeded(self, events: LimitEvents) -> str | None:
        """A line for the model when a command ran into a limit, else None."""
        notes = []
        if events.memory:
            notes.append(f"a process was killed for going over the memory limit of {self.memory_mb} MB")
        if events.processes:
            notes.append(f"starting a process failed at the limit of {self.processes} processes")
        return "; ".join(notes) or None


def open_files_per_process(processes: int) -> int:
    """The files each process of a prompt may have open: 1024 (the usual soft limit), fewer where that
    many in each of ``processes`` would take more than a quarter of the machine's table of open files
    (fs.file-max), which every process shares: a prompt that filled it made every other prompt's commands,
    and an unprivileged runner's own writes, fail with "Too many open files in system". Never fewer than
    64. Without this a command would have the runner's own limit, raised at its start to the hard one."""
    try:
        table = int(kernel_files.read("/proc/sys/fs/file-max"))
    except (OSError, ValueError):
        return _MOST_OPEN_FILES
    return max(_FEWEST_OPEN_FILES, min(_MOST_OPEN_FILES, table // _OPEN_FILES_SHARE // max(processes, 1)))


def _at_most_hard(limit: int, value: int, *, unit: int) -> int:
    """``value`` (in the ulimit's units), or this process's hard limit where that is lower. The
    environment inherits the runner's limits, and an unprivileged shell may only lower a hard limit:
    asking for more fails every sandbox's start (a run under ``ulimit -H -f``), and where it is
    allowed (as root) it would loosen a limit the user set."""
    hard = resource.getrlimit(limit)[1]
    return value if hard == resource.RLIM_INFINITY else min(value, hard // unit)


@dataclass(frozen=True)
class LimitEvents:
    memory: int = 0         # processes killed for memory
    processes: int = 0      # forks refused at the process cap

    def __sub__(self, other: LimitEvents) -> LimitEvents:
        return LimitEvents(self.memory - other.memory, self.processes - other.processes)


@dataclass(frozen=True)
class _Hierarchy:
    """Where this machine lets us make control groups, and which files set what."""

    version: int
    memory_root: Path           # .../batch_runner in the hierarchy holding the memory controller
    pids_root: Path             # the same directory on cgroup v2
    cpu_root: Path | None       # the same again on cgroup v2; None where the cpu controller cannot be had

    def roots(self) -> list[Path]:
        """Memory's, then pids', then cpu's, each once."""
        return list(dict.fromkeys(root for root in (self.memory_root, self.pids_root, self.cpu_root) if root))


@functools.cache
def _hierarchy() -> _Hierarchy | None:
    """The writable control-group hierarchy with memory and pids controllers, if there is one."""
    try:
        if (_CGROUP_ROOT / "cgroup.controllers").exists():       # unified (v2) hierarchy
            controllers = kernel_files.read(_CGROUP_ROOT / "cgroup.controllers").split()
            if not {b"memory", b"pids"} <= set(controllers):
                return None
            own = _CGROUP_ROOT / _OWN_DIRECTORY
            own.mkdir(exist_ok=True)
            _enable_controllers(_CGROUP_ROOT, _V2_CONTROLLERS)
            _enable_controllers(own, _V2_CONTROLLERS)
            return _Hierarchy(2, own, own, own if _has_cpu(_CGROUP_ROOT, own) else None)
        memory, pids, cpu = _CGROUP_ROOT / "memory", _CGROUP_ROOT / "pids", _CGROUP_ROOT / "cpu"
        if not _own_directory(memory) or not _own_directory(pids):
            return None
        return _Hierarchy(1, memory / _OWN_DIRECTORY, pids / _OWN_DIRECTORY,
                          cpu / _OWN_DIRECTORY if _own_directory(cpu) else None)
    except OSError:
        return None


def _own_directory(root: Path) -> bool:
    """Whether the v1 hierarchy at ``root`` is there and has our directory (made if need be), into which we
    may place processes."""
    if not (root / "cgroup.procs").exists():
        return False
    try:
        (root / _OWN_DIRECTORY).mkdir(exist_ok=True)
    except OSError:
        return False
    return os.access(root / _OWN_DIRECTORY / "cgroup.procs", os.W_OK)


# The v2 controllers the prompts' groups use: memory and pids, and cpu where the machine lets us have it.
_V2_CONTROLLERS = ("memory", "pids", "cpu")


def _enable_controllers(directory: Path, names: Sequence[str]) -> None:
    """Let the children of ``directory`` (v2) have limits of their own: of memory and pids, which a group
    must have, and of cpu, which it may go without (where it is not delegated to a container, say)."""
    enabled = kernel_files.read(directory / "cgroup.subtree_control").split()
    missing = [name for name in names if name.encode() not in enabled]
    if not missing:
        return
    try:
        kernel_files.write(directory / "cgroup.subtree_control", " ".join(f"+{name}" for name in missing))
    except OSError:
        if "cpu" not in missing:
            raise
        _enable_controllers(directory, [name for name in missing if name != "cpu"])


def _has_cpu(*directories: Path) -> bool:
    return all(b"cpu" in kernel_files.read(directory / "cgroup.subtree_control").split()
               for directory in directories)


def mechanism() -> str:
    """How the limits hold on this machine, for the start-up summary."""
    hierarchy = _hierarchy()
    if hierarchy is not None:
        return f"per-prompt control groups (cgroup v{hierarchy.version})"
    if os.geteuid() == 0:
        return ("per-process limits; no process cap (the kernel exempts root and no control group "
                "could be created)")
    return "per-process limits"


def user_process_limit() -> int | None:
    """The number of processes the kernel lets this user have (RLIMIT_NPROC's soft limit), which every
    sandbox of an ordinary user's run counts against (their user namespaces map to the runner's uid); None
    where it holds nothing back: unlimited, or a root run, whose sandboxes each have a uid of their own."""
    if os.geteuid() == 0:
        return None
    limit = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    return None if limit == resource.RLIM_INFINITY else limit


def process_limit_note(sessions: int, processes: int, user_limit: int | None) -> str | None:
    """What the start-up summary warns of where ``sessions`` sandboxes of ``processes`` each add up past
    ``user_limit`` (:func:`user_process_limit`): a prompt that starts many processes takes them from the
    prompts running beside it."""
    if user_limit is None or sessions * processes <= user_limit:
        return None
    return (f"your process limit (ulimit -u: {user_limit}) is below what {sessions} sessions may start "
            f"({processes} each, TERMINAL_MAX_PROCESSES): the kernel counts every sandbox of yours against it, "
            "so a prompt that starts many processes can make another's fail. Raise ulimit -u, or lower "
            "TERMINAL_MAX_PROCESSES or --num_workers")


def cgroups_available() -> bool:
    return _hierarchy() is not None


class PromptCgroup:
    """One prompt's control group: its limits, and a way to kill everything in it."""

    def __init__(self, hierarchy: _Hierarchy, directories: list[Path]) -> None:
        """``directories``: the group's own in each of the hierarchy's roots(), in that order."""
        self._hierarchy = hierarchy
        self.directories = directories
        self._memory = directories[0]
        self._pids = directories[1 if hierarchy.pids_root != hierarchy.memory_root else 0]

    @classmethod
    def create(cls, run_id: str, limits: ResourceLimits) -> PromptCgroup | None:
        """A group with ``limits`` under the run's directory, empty (an earlier prompt's of this process
        if one is kept, see release(), else a new one); None where none can be made."""
        hierarchy = _hierarchy()
        if hierarchy is None:
            return None
        with _kept_lock:
            kept = _kept.get(run_id)
            group = kept.pop() if kept else None
        if group is not None:
            try:
                group._apply(limits)
                return group
            except OSError:
                group.destroy()
        name = f"prompt-{os.getpid()}-{next(_group_numbers)}"
        group = cls(hierarchy, [root / run_id / name for root in hierarchy.roots()])
        try:
            for directory in group.directories:
                directory.mkdir(parents=True, exist_ok=True)
                if hierarchy.version == 2:
                    _enable_controllers(directory.parent,
                                        _V2_CONTROLLERS if hierarchy.cpu_root else _V2_CONTROLLERS[:2])
            group._apply(limits)
        except OSError:
            group.destroy()
            return None
        return group

    def _apply(self, limits: ResourceLimits) -> None:
        memory = str(limits.memory_mb * MIB)
        if self._hierarchy.version == 2:
            _write(self._memory / "memory.max", memory)
            _write(self._memory / "memory.swap.max", "0", missing_ok=True)
            _write(self._pids / "pids.max", str(limits.processes))
        else:
            # The kernel keeps memory's limit at or below memory and swap's: a kept group's earlier,
            # lower one would refuse a higher memory limit.
            _write(self._memory / "memory.memsw.limit_in_bytes", "-1", missing_ok=True)
            _write(self._memory / "memory.limit_in_bytes", memory)
            # Swap would let a prompt hold more than its memory; where swap is accounted, no more.
            _write(self._memory / "memory.memsw.limit_in_bytes", memory, missing_ok=True)
            _write(self._pids / "pids.max", str(limits.processes))

    def set_limits(self, limits: ResourceLimits) -> None:
        """Change the limits of a group whose processes run on: its memory limit no lower than the memory
        they hold now, for a lower one would make the kernel reclaim or kill in it at once."""
        held_mb = -(-self._charged_bytes() // MIB)
        self._apply(replace(limits, memory_mb=max(limits.memory_mb, held_mb)))

    def _charged_bytes(self) -> int:
        memory = "memory.current" if self._hierarchy.version == 2 else "memory.usage_in_bytes"
        return int(kernel_files.read(self._memory / memory))

    def procs_files(self) -> list[str]:
        """The files a process writes its pid into to join this group, as ENTER_GROUPS takes them."""
        return [str(directory / "cgroup.procs") for directory in self.directories]

    def process_count(self) -> int:
        """How many processes are in the group now."""
        return len(self.pids())

    def pids(self) -> list[int]:
        """The processes in the group now."""
        try:
            return [int(pid) for pid in kernel_files.read(self._pids / "cgroup.procs").split()]
        except (OSError, ValueError):
            return []

    def events(self) -> LimitEvents:
        """How often the limits struck so far (the counters only grow)."""
        memory_file = "memory.events" if self._hierarchy.version == 2 else "memory.oom_control"
        return LimitEvents(memory=_counter(self._memory / memory_file, "oom_kill"),
                           processes=_counter(self._pids / "pids.events", "max"))

    def kill(self) -> None:
        """SIGKILL every process in the group, however it detached from its parent."""
        procs = self._pids / "cgroup.procs"
        kill_file = self._pids / "cgroup.kill"
        if self._hierarchy.version == 2 and kill_file.exists():
            try:
                kernel_files.write(kill_file, "1")
                return
            except OSError:
                pass
        for _ in range(_KILL_ROUNDS):
            try:
                pids = [int(line) for line in kernel_files.read(procs).split()]
            except (OSError, ValueError):
                return
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def release(self) -> None:
        """The prompt is done with the group. Kill what is left, then keep the group for the next prompt
        of this process if it is as good as new: no live process in it, at most _REUSED_MAX_UNREAPED
        dead ones not yet reaped (the pids controller counts a process until then), and little memory
        still charged to it. The limit counters need no reset: a command's notes come from the
        counters' growth while it ran. A sandbox cannot reach the group's files, so nothing else of it
        is the prompt's doing (the local backend's commands, which run on the host as the runner, can
        change its settings as they can anything of the runner's). Otherwise the group is removed; one
        still held by a dying process is retried briefly, and anything left is removed with the run's
        leftovers."""
        self.kill()
        if self._as_good_as_new():
            with _kept_lock:
                _kept.setdefault(self._memory.parent.name, []).append(self)
            return
        self._remove_directories()

    def _as_good_as_new(self) -> bool:
        try:
            for attempt in range(_REMOVE_ATTEMPTS):
                if not any(kernel_files.read(directory / "cgroup.procs").split() for directory in self.directories):
                    break
                if attempt == _REMOVE_ATTEMPTS - 1:
                    return False
                time.sleep(_REMOVE_PAUSE_SECONDS)    # processes just killed are still exiting
            return (int(kernel_files.read(self._pids / "pids.current")) <= _REUSED_MAX_UNREAPED
                    and self._charged_bytes() <= _REUSED_MAX_CHARGED_BYTES)
        except (OSError, ValueError):
            return False

    def destroy(self) -> None:
        """Kill what is left and remove the group, however good it still is."""
        self.kill()
        self._remove_directories()

    def _remove_directories(self) -> None:
        for directory in self.directories:
            _remove_directory(directory)


# The groups kept for the next prompt, by run; a process's own, made by it (each name carries its pid).
_kept: dict[str, list[PromptCgroup]] = {}
_kept_lock = threading.Lock()      # groups are removed in threads, and taken on the event loop
_group_numbers = itertools.count()


def _forget_kept_groups() -> None:
    """In a forked child: the parent's kept groups stay the parent's, or two processes could hand one
    group to two prompts at once."""
    global _kept_lock
    _kept.clear()
    _kept_lock = threading.Lock()      # another thread may have held it at the fork


os.register_at_fork(after_in_child=_forget_kept_groups)


def remove_kept_groups() -> None:
    """Remove the groups this process kept for its next prompts: it has none left to run."""
    with _kept_lock:
        groups = [group for kept in _kept.values() for group in kept]
        _kept.clear()
    for group in groups:
        group.destroy()


def remove_run_leftovers(run_id: str) -> None:
    """Kill and remove the control groups an earlier invocation of this run left behind (the run
    directory's lock makes sure that invocation is gone), and those this process kept for its next
    prompts."""
    with _kept_lock:
        _kept.pop(run_id, None)
    hierarchy = _hierarchy()
    if hierarchy is None:
        return
    for root in hierarchy.roots():
        run_directory = root / run_id
        if not run_directory.is_dir():
            continue
        for directory in [path for path in run_directory.iterdir() if path.is_dir()]:
            PromptCgroup(hierarchy, [r / run_id / directory.name for r in hierarchy.roots()]).destroy()
        _remove_directory(run_directory)


def _remove_directory(directory: Path) -> None:
    for _ in range(_REMOVE_ATTEMPTS):
        try:
            directory.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(_REMOVE_PAUSE_SECONDS)    # processes just killed are still being reaped


def _write(path: Path, value: str, *, missing_ok: bool = False) -> None:
    """Write a control file; ``missing_ok`` for files that exist only where a feature is enabled
    (swap accounting), which the kernel then refuses or lacks."""
    try:
        kernel_files.write(path, value)
    except OSError:
        if not missing_ok:
            raise


def _counter(path: Path, name: str) -> int:
    """A ``name value`` line of a cgroup events file; 0 where the file or line is missing."""
    wanted = name.encode()
    try:
        for line in kernel_files.read(path).splitlines():
            key, _, value = line.partition(b" ")
            if key == wanted:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
