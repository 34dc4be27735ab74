"""Worker processes: each runs many agent sessions concurrently on one asyncio loop.

Sessions mostly wait on the network, so a process holds many of them; there are two processes per
core at most (see PROCESSES_PER_CORE). The parent hands out tasks one prompt at a time (a slow prompt
holds one session slot, never a batch) and receives finished rows already encoded, so its own work per
row is a write. Each process also holds a few tasks waiting for a slot (see waiting_places), so that a
session that ends is followed at once, not after a round trip to the parent.

A worker process can die under a prompt (a model command that kills its parent, the kernel's OOM
killer): the prompts it was running get failure rows that say so, which resume retries, the ones
still waiting go to the new process that takes its place, and the run goes on.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import signal
import time
from dataclasses import asdict, replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, Protocol, cast

from batchrun.concurrency import ConcurrencyFigures
from batchrun.config import RunConfig
from batchrun.environments.base import EnvironmentSettings
from batchrun.messages import Fatal, Finished, Spent, Task
from batchrun.rate_limit import RateGate
from batchrun.stop_signals import STOP_SIGNALS

_FORK = multiprocessing.get_context("fork")
STOP_GRACE_SECONDS = 15.0


def _worker_entry(*args: Any) -> None:
    from batchrun import worker_process

    worker_process.main(*args)


def _death(process: BaseProcess) -> str:
    process.join(1.0)
    code = process.exitcode
    if code is not None and code < 0:
        try:
            how = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"killed by signal {-code}"
    else:
        how = f"exit code {code}"
    return (f"the worker process running this prompt (pid {process.pid}) died ({how}), together with "
            "the prompts it was running; --resume runs them again")


def _ready(conns: list[Connection], timeout: float) -> list[Connection]:
    """The pipe ends among ``conns`` with something to read (or closed), waiting at most ``timeout``."""
    return cast("list[Connection]", wait(conns, timeout))


class PoolStartError(RuntimeError):
    """The workers could not start (a backend's own failure, e.g. Ray); the message says why."""


# A worker's loop is busy for a while when many of its sessions come back at once; a second process
# per core keeps the core busy meanwhile. More per core only adds switching and memory (the figures,
# from benchmarks/throughput.py, are in docs/performance.md).
PROCESSES_PER_CORE = 2


def raise_open_file_limit() -> None:
    """Lift this process's soft limit on open descriptors to its hard limit. A worker's sessions each
    hold a connection, pipes and pidfds, so a few hundred of them outgrow the common soft limit of
    1024 long before the hard limit; forked workers inherit the raised one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and hard != resource.RLIM_INFINITY:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def process_count(num_workers: int) -> int:
    return max(1, min(num_workers, PROCESSES_PER_CORE * (os.cpu_count() or 1)))


def waiting_places(slots: int) -> int:
    """Tasks a worker process holds beyond its ``slots`` sessions: one per eight, so that sessions that
    end together (their replies come back together) find their next task there. None for a process of
    few slots, where a task waiting behind one slow prompt would wait long while other processes idle."""
    return slots // 8


class Places:
    """How many tasks each worker process holds, and may hold: its session slots, and while more tasks
    are to come than the run has sessions, its waiting places beyond them."""

    def __init__(self, capacity: list[int]) -> None:
        self.capacity = capacity
        self._places = [slots + waiting_places(slots) for slots in capacity]
        self._free = list(self._places)    # below 0 after the last round: tasks still waiting for a slot

    @property
    def free(self) -> int:
        return sum(max(0, free) for free in self._free)

    @property
    def held(self) -> int:
        return sum(self._places) - sum(self._free)

    def take(self) -> int:
        """A place in the least loaded process (one is free): that process's number."""
        worker = max(range(len(self._free)), key=self._free.__getitem__)
        self._free[worker] -= 1
        return worker

    def take_in(self, worker: int) -> None:
        self._free[worker] -= 1

    def give_back(self, worker: int) -> None:
        self._free[worker] += 1

    def empty(self, worker: int) -> None:
        """The process was replaced: it holds nothing."""
        self._free[worker] = self._places[worker]

    def last_round(self) -> None:
        """Session slots only from now on (see WorkerPool.last_round)."""
        held = [places - free for places, free in zip(self._places, self._free, strict=True)]
        self._places = list(self.capacity)
        self._free = [slots - tasks for slots, tasks in zip(self.capacity, held, strict=True)]


def split_slots(sessions: int, workers: int) -> list[int]:
    """Each worker's share of the run's session slots: as even as it goes, the first ones one more."""
    return [sessions // workers + (1 if worker < sessions % workers else 0) for worker in range(workers)]


class WorkerPool(Protocol):
    """Where sessions run (local worker processes, Ray actors): the parent hands out one task per free
    slot and receives each prompt's finished row, already encoded."""

    @property
    def free_slots(self) -> int:
        """Tasks :meth:`submit` may be given now."""
        ...

    @property
    def in_flight(self) -> int:
        """Tasks handed out whose message has not come back yet (0: the pool is idle)."""
        ...

    @property
    def concurrency(self) -> ConcurrencyFigures | None:
        """The run-wide limit on model requests at once, as last known (None: not known yet)."""
        ...

    def describe(self) -> str | None:
        """A start-up line on where the sessions run, where the start-up summary does not say it."""
        ...

    def submit(self, task: Task) -> None: ...

    def last_round(self) -> None:
        """The runner has fewer tasks left than the pool has sessions: from now on a task goes only to a
        free session, never to wait behind a running one, where it could wait a whole session while
        other sessions, with nothing left to run, idle."""
        ...

    def receive(self, timeout: float) -> list[Finished | Fatal | Spent]:
        """What came back, waiting at most ``timeout`` seconds for the first message. Called where a stop
        signal is held back until what is received is written (see runner._feed): a stop signal may interrupt
        the wait for the first message, never what follows it, so nothing received is dropped."""
        ...

    def stop(self) -> list[Finished | Spent]:
        """Cancel what runs and end the workers; the rows that finished meanwhile, to be kept, and
        what the sessions cut off spent."""
        ...


class ProcessPool:
    """The local :class:`WorkerPool`: a fixed set of worker processes with a known number of free
    session slots each."""

    def __init__(self, config: RunConfig, env_settings: EnvironmentSettings, available_tools: frozenset[str]) -> None:
        # The model client (half a second of imports) loads once, here, before the fork: workers
        # share it instead of each importing it again while competing for the same cores.
        from batchrun import endpoint, worker_process  # noqa: F401

        endpoint.preload_http_stack()

        count = process_count(config.pool.num_workers)
        self.gate = RateGate(config.pool.requests_per_minute, ceiling=config.pool.num_workers,
                             adaptive=config.pool.adaptive_concurrency, workers=count)
        self._config, self._env_settings, self._available_tools = config, env_settings, available_tools
        self._capacity = split_slots(config.pool.num_workers, count)     # sessions at once, per process
        self._places = Places(self._capacity)
        self._conns: list[Connection] = []
        self._processes: list[BaseProcess] = []
        self._running: list[dict[int, Task]] = [{} for _ in self._capacity]   # per worker, by prompt index
        for worker, capacity in enumerate(self._capacity):
            conn, process = self._spawn(worker, capacity, self._conns)
            self._conns.append(conn)
            self._processes.append(process)

    def _spawn(self, worker: int, capacity: int,
               others: list[Connection]) -> tuple[Connection, BaseProcess]:
        """Worker process number ``worker``, with ``capacity`` session slots; ``others`` are the parent's
        ends of the other workers' pipes, which the child must close."""
        parent_end, child_end = _FORK.Pipe(duplex=True)
        process = _FORK.Process(target=_worker_entry, daemon=True,
                                args=(child_end, [*others, parent_end], worker, capacity, self._config,
                                      self.gate, self._env_settings, self._available_tools))
        process.start()
        child_end.close()
        return parent_end, process

    def describe(self) -> str | None:
        return None     # the start-up summary names the worker processes already

    @property
    def free_slots(self) -> int:
        return self._places.free

    @property
    def in_flight(self) -> int:
        return self._places.held

    @property
    def concurrency(self) -> ConcurrencyFigures:
        """The model requests allowed at once now, how it went so far, and the run's pause."""
        return replace(self.gate.limit.figures(), pause_left=self.gate.pause_left())

    def submit(self, task: Task) -> None:
        self._send(self._places.take(), task)

    def last_round(self) -> None:
        self._places.last_round()

    def _send(self, worker: int, task: Task) -> None:
        self._running[worker][task.unit] = task
        try:
            self._conns[worker].send(asdict(task))
        except OSError:
            pass    # the worker is gone; receive() notices and fails its prompts, this one included

    def receive(self, timeout: float) -> list[Finished | Fatal | Spent]:
        """Everything the workers have sent, waiting at most ``timeout`` for the first message; a
        worker that died is replaced and its prompts come back as failure rows."""
        messages: list[Finished | Fatal | Spent] = []
        with STOP_SIGNALS.interruptible():
            ready = _ready(self._conns, timeout)
        while ready:
            for conn in ready:
                worker = self._conns.index(conn)
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    messages += self._replace(worker)
                    continue
                if isinstance(message, Finished):
                    self._places.give_back(worker)
                    self._running[worker].pop(message.unit, None)
                messages.append(message)
            ready = _ready(self._conns, 0)
        return messages

    def _replace(self, worker: int) -> list[Finished]:
        """Failure rows for the prompts a worker that died was running, and a new worker in its place,
        given the tasks that were still waiting for a slot."""
        from batchrun.worker_process import lost_task

        dead = self._processes[worker]
        why = _death(dead)
        self._conns[worker].close()
        # A worker starts its tasks in the order they came (a first-come semaphore), so those still
        # waiting are the ones handed out last.
        tasks = list(self._running[worker].values())
        running, waiting = tasks[:self._capacity[worker]], tasks[self._capacity[worker]:]
        lost = [lost_task(task, self._config, why, "worker_died") for task in running]
        self._running[worker].clear()
        self._places.empty(worker)
        self.gate.limit.reclaim(worker)      # the model requests it had in flight are over
        others = [conn for i, conn in enumerate(self._conns) if i != worker]
        self._conns[worker], self._processes[worker] = self._spawn(worker, self._capacity[worker], others)
        for task in waiting:
            self._places.take_in(worker)
            self._send(worker, task)
        return lost

    def stop(self) -> list[Finished | Spent]:
        """Cancel in-flight sessions (their environments are cleaned up) and end the processes.

        Returns the rows that finished meanwhile, to be persisted like any other: a session that
        ended just before the stop has been paid for; and what the sessions' replies meanwhile cost."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        finished: list[Finished | Spent] = []
        open_conns = list(self._conns)
        while open_conns and time.monotonic() < deadline:
            for conn in _ready(open_conns, max(0.0, deadline - time.monotonic())):
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    open_conns.remove(conn)
                    continue
                if isinstance(message, (Finished, Spent)):
                    finished.append(message)
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._conns:
            conn.close()
        return finished
