"""--backend=ray: agent sessions in Ray actors, on one machine or spread over a cluster.

The parent stays the only writer of data/<run_name>/: an actor returns each prompt's row already
encoded (a :class:`~batchrun.messages.Finished`, exactly what a worker process sends), and
:class:`RayWorkerPool` is a :class:`~batchrun.workers.WorkerPool` as the local one is, so scheduling, rows,
checkpoint, merge and resume are those of a local run.

* Actors: one per CPU the run may use (at most ``--num_workers``), spread over the nodes, each running
  its share of the sessions on its asyncio loop with the same code as a worker process
  (:func:`batchrun.worker_process.outcome`).
* Scheduling is per prompt, as locally: the parent counts each actor's free slots, hands one task to
  the least loaded actor and ``ray.wait``\\s on the outstanding results, so a slow prompt holds one slot.
  (``ray.util.multiprocessing.Pool`` would deal tasks round-robin and let them pile up behind a slow one.)
* Rate limits stay run-wide: a small :class:`GateKeeper` actor holds the limit on model requests at
  once (adaptive, see batchrun.concurrency: every request asks it for a slot and reports how it went),
  the 429 pause and the requests-per-minute pace; every actor's :class:`RayRateGate` learns of a pause
  at once (a long poll) and reserves paced slots from it. Pauses and paced slots are wall-clock times,
  so nodes' clocks should agree (NTP) to well under the pace.
* Without ``RAY_ADDRESS`` the runner starts a private Ray on this machine, on 127.0.0.1 only, and
  stops it at the end; a small watcher process ends that Ray's processes even after ``kill -9``.
  With ``RAY_ADDRESS`` it joins that cluster and leaves it running.
  A ``RAY_ADDRESS`` where nothing answers stops the run at once (Ray alone would retry for minutes).
* Each actor first checks that the run's TERMINAL_ENV, and every tool the run may offer, work on its
  node; the run stops with one message naming the node otherwise, before any model call.
* A lost actor (its node gone, its process killed) does not stop the run: its prompts in flight go to
  the actors that remain, once more each (a prompt whose actor is lost again gets a failure row, which
  resume retries: a prompt that kills its worker cannot take every actor down), and a replacement
  actor is started where the cluster has room. Only losing every actor, with none to replace it,
  stops the run.

Ray is imported here only, and only when a run asks for it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import secrets
import signal
import socket
import sys
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from batchrun import concurrency
from batchrun.concurrency import ConcurrencyFigures, Outcome, Ticket
from batchrun.config import RunConfig
from batchrun.environments.base import EnvironmentSettings
from batchrun.environments.seccomp import leave_session_keyring
from batchrun.install_hint import install_hint
from batchrun.messages import Fatal, Finished, Spent, Task
from batchrun.proc import children
from batchrun.rate_limit import Gate, pace_interval, take_pace_slot
from batchrun.workers import PoolStartError, process_count, raise_open_file_limit, split_slots

INSTALL_HINT = install_hint("ray")
ACTOR_START_TIMEOUT = 180.0     # seconds for every actor to be placed, import the worker code and check its node
STOP_GRACE_SECONDS = 15.0
SPARE_CONCURRENCY = 4           # actor calls beyond the session slots: probe, stop
# Set in the environment of a Ray this runner starts: the watcher finds that Ray's processes by it
# (and by having seen them below the parent).
OWNER_VARIABLE = "BATCH_RUNNER_RAY_OWNER"
# A private Ray stays on the loopback interface: with this, Ray takes 127.0.0.1 as the node's address
# (otherwise it binds every interface and advertises the external address), and it reports nothing.
LOCAL_RAY_ENVIRONMENT = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
LOOPBACK_PREFIXES = ("127.", "::1", "::ffff:127.")
# Ray's socket paths ($TMPDIR/ray/session_<date>_<pid>/sockets/plasma_store) must fit in 107 bytes.
MAX_TMPDIR_LENGTH = 36
WATCH_INTERVAL = 0.5            # seconds between the watcher's looks at the parent's descendants
FIGURES_INTERVAL = 0.5          # seconds between questions to the gate actor for the live display
SPENT_INTERVAL = 1.0            # seconds between collections of each actor's replies' usage (drain_spent)
PROBE_TIMEOUT = 5.0             # seconds for a TCP connection to RAY_ADDRESS's head before Ray is asked
# Ray retries an unreachable head for many minutes by default. One attempt with a short connection
# timeout bounds a head that accepts connections but does not answer as Ray (docs/performance.md has
# the figures); a user's own setting of either variable wins.
JOIN_ENVIRONMENT = {"RAY_NUM_REDIS_GET_RETRIES": "1", "RAY_py_gcs_connect_timeout_s": "10"}
LOST_ACTOR_ERROR_TYPE = "worker_died"      # as for a local worker process that died under its prompts
_FORK = multiprocessing.get_context("fork")


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise PoolStartError(f"--backend=ray needs Ray, an optional extra: {INSTALL_HINT}") from None
    return ray


def head_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of a RAY_ADDRESS such as ``10.0.0.5:6379`` or ``ray://head:10001``; None for the
    forms Ray resolves itself (``auto``)."""
    host, separator, port = address.split("://", 1)[-1].rpartition(":")
    if not separator or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def unreachable(host: str, port: int) -> str | None:
    """Why no TCP connection to host:port opens within PROBE_TIMEOUT, or None when one does."""
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT).close()
    except TimeoutError:
        return f"no answer within {PROBE_TIMEOUT:.0f} s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


# -- the worker side: session actors and the shared rate gate -----------------------------------------


def node_environment_problem(kind: str) -> str | None:
    """None when TERMINAL_ENV=kind can work on this node, else why not (cheap, once per actor)."""
    from batchrun.environments import environment_class

    return environment_class(kind).node_problem()


def node_tools_problem(distribution: str, available_tools: frozenset[str]) -> str | None:
    """None when every tool the run may offer (available to the parent, in the distribution) works on
    this node too; tools read their configuration from the node's own environment."""
    from batchrun import distributions, registry

    entries = distributions.get_distribution(distribution)["toolsets"]
    toolsets = sorted({member for entry in entries for member in distributions.entry_members(entry)})
    offered = set(registry.tools_for_toolsets(toolsets)) & available_tools
    missing = {name: reason for name, reason in registry.unavailable_tools().items() if name in offered}
    if not missing:
        return None
    return ("tools that work where the runner started do not work here: "
            + "; ".join(f"{name} ({reason})" for name, reason in missing.items()))


class SessionActor:
    """One Ray actor: many agent sessions at once on its asyncio loop, one call of :meth:`run` each."""

    def __init__(self, slots: int, config: RunConfig, gate: RayRateGate, env_settings: EnvironmentSettings,
                 available_tools: frozenset[str]) -> None:
        from batchrun import worker_process  # the model client is imported on the worker side only

        raise_open_file_limit()     # an actor is not forked from the parent: it lifts its own
        self._worker = worker_process
        self._gate = gate
        leave_session_keyring()    # before any sandbox or browser starts: see seccomp.leave_session_keyring
        self._services = worker_process.make_services(slots, config, gate, env_settings, available_tools)
        self._running: set[asyncio.Future] = set()
        # Each reply's usage waits here until the parent collects it (drain_spent) or it goes back with
        # its prompt's row: a session cut off by a kill of the parent was paid for all the same.
        self._spent: list[Spent] = []
        self._services.on_spent = lambda unit, usage, source: self._spent.append(Spent(unit, usage.as_dict(), source))

    async def probe(self) -> dict:
        """Where this actor runs, and what keeps its node from running this run's sessions (None: nothing)."""
        import ray

        self._worker.use_pidfd_child_watcher(asyncio.get_running_loop())
        config = self._services.config

        def problems() -> str | None:
            found = []
            if environment := node_environment_problem(config.terminal_env):
                found.append(f"TERMINAL_ENV={config.terminal_env} does not work there ({environment})")
            if tools := node_tools_problem(config.distribution, self._services.available_tools):
                found.append(tools)
            return "; ".join(found) or None

        problem = await asyncio.to_thread(problems)
        return {"node_id": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "problem": problem, "gate": self._gate.limit.holder}

    def remove_leftovers(self) -> None:
        """What a crashed earlier run under this run name left on this node (once per node, before work)."""
        from batchrun.environments import environment_class

        settings = self._services.env_settings
        environment_class(self._services.config.terminal_env).remove_leftovers(settings)

    async def run(self, task: Task) -> list[Spent | Finished | Fatal]:
        """The prompt's row (or the run's Fatal), after what its replies spent that drain_spent has not
        taken yet: the parent must see a session's spending before its row."""
        session = asyncio.ensure_future(self._worker.outcome(task, self._services))
        self._running.add(session)
        try:
            message = await session
        finally:
            self._running.discard(session)
        own = [event for event in self._spent if event.unit == task.unit]
        self._spent = [event for event in self._spent if event.unit != task.unit]
        return [*own, message]

    async def drain_spent(self) -> list[Spent]:
        """What the replies of this actor's sessions spent since the last call."""
        spent, self._spent = self._spent, []
        return spent

    async def stop(self) -> None:
        """Cancel the sessions in flight; each closes its environment before this returns."""
        await self._worker.shut_down(set(self._running), self._services)


class GateKeeper:
    """The run-wide rate limits (see :class:`batchrun.rate_limit.Gate`) as a tiny actor.

    Request slots are counted per holder (one per session actor), so that a lost actor's slots can be
    given back (:meth:`forget`); requests wait for a slot here, in arrival order."""

    def __init__(self, requests_per_minute: int | None, ceiling: int, adaptive: bool) -> None:
        self._resume_at = 0.0           # wall clock: nodes' monotonic clocks are unrelated
        self._next_slot = 0.0
        self._interval = pace_interval(requests_per_minute)
        self._changed = asyncio.Event()
        self._limit = concurrency.new_state(ceiling, adaptive)
        self._held: Counter[str] = Counter()
        self._lost: set[str] = set()
        self._waiting: deque[tuple[str, asyncio.Future[Ticket]]] = deque()
        self._growth: asyncio.TimerHandle | None = None

    async def admit(self, holder: str) -> Ticket:
        if not self._waiting and concurrency.has_room(self._limit):
            return self._take(holder)
        waiter: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self._waiting.append((holder, waiter))
        if self._growth is None:
            self._grow_with_time()
        return await waiter

    def _grow_with_time(self) -> None:
        """At the start of the run, time raises the limit while requests wait (concurrency.grow_with_time)."""
        self._growth = None
        self._limit.waiting = len(self._waiting)
        delay = concurrency.grow_with_time(self._limit, time.monotonic())
        self._serve()
        if delay is not None and self._waiting:
            self._growth = asyncio.get_running_loop().call_later(delay, self._grow_with_time)

    async def finish(self, holder: str, ticket: Ticket, outcome: Outcome, latency: float) -> None:
        if holder in self._lost:
            return      # its slots were given back when it was lost
        self._held[holder] -= 1
        self._limit.waiting = len(self._waiting)
        concurrency.finish(self._limit, ticket, outcome, latency)
        self._serve()

    async def forget(self, holder: str) -> None:
        """A session actor was lost: the requests it had in flight are over, and it waits for none."""
        self._lost.add(holder)
        self._limit.in_flight -= self._held.pop(holder, 0)
        self._serve()

    async def figures(self) -> ConcurrencyFigures:
        return concurrency.figures(self._limit)

    def _take(self, holder: str) -> Ticket:
        self._held[holder] += 1
        concurrency.note_sent(self._limit, time.monotonic())     # see KeeperLimit.sent
        return concurrency.admit(self._limit)

    def _serve(self) -> None:
        while self._waiting and concurrency.has_room(self._limit):
            holder, waiter = self._waiting.popleft()
            if holder in self._lost:
                waiter.cancel()
            elif not waiter.cancelled():
                waiter.set_result(self._take(holder))

    async def pause(self, until: float) -> None:
        if until > self._resume_at:
            self._resume_at = until
            self._changed.set()
            self._changed = asyncio.Event()

    async def next_pause(self, known: float) -> float:
        """The pause end, as soon as it is later than ``known`` (a long poll)."""
        while self._resume_at <= known:
            await self._changed.wait()
        return self._resume_at

    async def reserve(self) -> float:
        slot, self._next_slot = take_pace_slot(self._next_slot, time.time(), self._interval)
        return slot


class KeeperLimit:
    """One actor's side of the run-wide request slots the GateKeeper holds (concurrency.Limit)."""

    def __init__(self, keeper: Any) -> None:
        self._keeper = keeper
        self.holder = secrets.token_hex(8)     # this actor's name at the keeper: one per unpickled copy

    async def admit(self) -> Ticket:
        admitted = self._keeper.admit.remote(self.holder)
        try:
            return await admitted
        except asyncio.CancelledError:
            # The keeper hands the slot out all the same once one is free: give it back then.
            asyncio.ensure_future(self._give_back(admitted))
            raise

    def sent(self) -> None:
        """The keeper counts a request as gone when it hands out its slot: one more call to it per
        request, to say so a moment later, would cost more than the difference."""

    def finish(self, ticket: Ticket, outcome: Outcome, latency: float = 0.0) -> None:
        self._keeper.finish.remote(self.holder, ticket, outcome, latency)

    async def _give_back(self, admitted: Any) -> None:
        try:
            ticket = await admitted
        except Exception:
            return
        self.finish(ticket, Outcome.UNSENT)


class RayRateGate(Gate):
    """The gate inside an actor: one limit on model requests at once across every actor, a 429
    anywhere pauses every actor's new requests, and the requests-per-minute pace is one sequence of
    slots for the whole run, all kept by the :class:`GateKeeper`."""

    def __init__(self, keeper: Any, requests_per_minute: int | None, adaptive: bool) -> None:
        super().__init__(requests_per_minute)
        self._keeper = keeper
        self._requests_per_minute = requests_per_minute
        self._resume = 0.0
        self._follower: asyncio.Future[None] | None = None
        self.adaptive = adaptive
        self.limit: KeeperLimit = KeeperLimit(keeper)

    def __reduce__(self) -> tuple[Any, ...]:
        return RayRateGate, (self._keeper, self._requests_per_minute, self.adaptive)

    def _now(self) -> float:
        return time.time()        # wall clock: nodes' monotonic clocks are unrelated

    def _resume_at(self) -> float:
        if self._follower is None:
            self._follower = asyncio.ensure_future(self._follow())
        return self._resume

    def _pause_until(self, until: float) -> None:
        self._resume = max(self._resume, until)
        self._keeper.pause.remote(until)

    async def _reserve(self) -> float:
        return float(await self._keeper.reserve.remote())

    async def _follow(self) -> None:
        """Learn of other actors' pauses as they happen."""
        try:
            while True:
                self._resume = max(self._resume, await self._keeper.next_pause.remote(self._resume))
        except Exception:
            return


# -- the parent side ----------------------------------------------------------------------------------


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
    still there that started after it. Ray's own agents would otherwise outlive a killed parent by
    minutes."""
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


@dataclass(frozen=True)
class Attempt:
    """A prompt on its way to an actor, with the actors lost while it ran on them before."""

    task: Task
    losses: tuple[str, ...] = ()


@dataclass(frozen=True)
class Replacement:
    """An actor started in place of a lost one, usable once its probe answers."""

    actor: Any
    slots: int
    deadline: float       # time.monotonic() after which it is given up


def warn(text: str) -> None:
    """A warning line on stderr, as the console writes one (the pool has no console of its own)."""
    print(f"warning: {text}", file=sys.stderr, flush=True)


class RayWorkerPool:
    """A :class:`~batchrun.workers.WorkerPool` over Ray actors."""

    def __init__(self, config: RunConfig, env_settings: EnvironmentSettings, available_tools: frozenset[str]) -> None:
        self._address = os.environ.get("RAY_ADDRESS", "").strip() or None
        self._config = config
        self._actors: list[Any] = []              # by actor index; a lost actor keeps its index
        self._capacity: list[int] = []
        self._free: list[int] = []
        self._nodes: list[dict] = []              # each actor's probe() answer
        self._lost: set[int] = set()
        self._pending: dict[Any, tuple[int, Attempt]] = {}   # ObjectRef of a run() call -> (actor index, attempt)
        self._retries: deque[Attempt] = deque()   # prompts of lost actors, waiting for a free slot
        self._starting: dict[Any, Replacement] = {}          # ObjectRef of a replacement's probe() -> it
        self._new_actor: Callable[[int], Any] | None = None
        self._keeper: Any = None
        self._figures: ConcurrencyFigures | None = None    # the keeper's, as last heard
        self._figures_asked: Any = None                     # ObjectRef of the question on its way
        self._figures_asked_at = 0.0
        self._draining: dict[int, Any] = {}       # actor index -> ObjectRef of its drain_spent() on its way
        self._drained_at = 0.0
        self._watcher: tuple[Connection, BaseProcess] | None = None
        self._stopped = False
        self.ray: Any = None
        try:
            self._connect()
            self._start_actors(config, env_settings, available_tools)
        except BaseException:
            self.stop()
            raise

    # -- start ---------------------------------------------------------------------------------------

    def _connect(self) -> None:
        if self._address is None:
            os.environ.update(LOCAL_RAY_ENVIRONMENT)     # read by Ray when it is imported
            if "RAY_TMPDIR" not in os.environ and len(os.environ.get("TMPDIR", "")) > MAX_TMPDIR_LENGTH:
                os.environ["RAY_TMPDIR"] = "/tmp"   # Ray's session sockets live under $TMPDIR/ray/session_*/
            owner = f"{os.getpid()}-{secrets.token_hex(8)}"
            os.environ[OWNER_VARIABLE] = owner
            reader, writer = _FORK.Pipe(duplex=False)
            watcher = _FORK.Process(target=_watch, args=(reader, writer, owner), daemon=True)
            watcher.start()
            reader.close()
            self._watcher = (writer, watcher)
            self.ray = import_ray()
        else:
            for name, value in JOIN_ENVIRONMENT.items():
                os.environ.setdefault(name, value)       # read by Ray when it is imported
            self.ray = import_ray()
            self._check_head_answers(self._address)
        ray = self.ray
        logging.getLogger("ray").setLevel(logging.ERROR)   # "started a local instance", token notices
        # Ray's processes must outlive a Ctrl-C, which reaches the whole process group: the parent
        # stops the run and then Ray. They inherit an ignored SIGINT from here.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            if self._address is None:
                ray.init(address="local", num_cpus=os.cpu_count() or 1, num_gpus=0, include_dashboard=False,
                         logging_level=logging.ERROR, namespace="batch_runner")
                address = ray.util.get_node_ip_address()
                if not address.startswith(LOOPBACK_PREFIXES):
                    raise PoolStartError(f"the local Ray took the address {address} instead of 127.0.0.1 (was "
                                         "Ray imported before the runner set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0?)")
            else:
                ray.init(address=self._address, logging_level=logging.ERROR, namespace="batch_runner")
        except PoolStartError:
            raise
        except Exception as exc:
            where = f"the Ray cluster at RAY_ADDRESS={self._address}" if self._address else "a local Ray"
            raise PoolStartError(f"could not start {where}: {type(exc).__name__}: {exc}") from None
        finally:
            signal.signal(signal.SIGINT, previous)

    @staticmethod
    def _check_head_answers(address: str) -> None:
        """A plain TCP connection first: where nothing listens, Ray would retry for 13 minutes."""
        endpoint = head_endpoint(address)
        if endpoint is not None and (why := unreachable(*endpoint)) is not None:
            raise PoolStartError(f"nothing answers at RAY_ADDRESS={address} ({why}): start the cluster's head node "
                                 f"there (ray start --head --port={endpoint[1]}) or unset RAY_ADDRESS to run on a "
                                 "private local Ray")

    def _start_actors(self, config: RunConfig, env_settings: EnvironmentSettings,
                      available_tools: frozenset[str]) -> None:
        ray = self.ray
        cpus = int(ray.available_resources().get("CPU", 0))
        if cpus < 1:
            raise PoolStartError("the Ray cluster has no free CPU for the session actors "
                                 f"({ray.cluster_resources().get('CPU', 0):g} in all)")
        count = min(process_count(config.num_workers) if self._address is None else config.num_workers, cpus)
        capacity = split_slots(config.num_workers, count)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # The rate limits live beside the driver: every session needs them, and they must outlive
        # any other node.
        beside_driver = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self._keeper = (ray.remote(num_cpus=0, max_concurrency=10_000)(GateKeeper)
                        .options(scheduling_strategy=beside_driver)
                        .remote(config.requests_per_minute, config.num_workers, config.adaptive_concurrency))
        gate = RayRateGate(self._keeper, config.requests_per_minute, config.adaptive_concurrency)
        actor_class = ray.remote(SessionActor)

        def new_actor(slots: int) -> Any:
            return (actor_class.options(num_cpus=1, max_concurrency=slots + SPARE_CONCURRENCY,
                                        scheduling_strategy="SPREAD")
                    .remote(slots, config, gate, env_settings, available_tools))

        self._new_actor = new_actor
        self._actors = [new_actor(slots) for slots in capacity]
        try:
            self._nodes = ray.get([actor.probe.remote() for actor in self._actors], timeout=ACTOR_START_TIMEOUT)
        except ray.exceptions.GetTimeoutError:
            raise PoolStartError(f"Ray did not start {count} session actors (1 CPU each) within "
                                 f"{ACTOR_START_TIMEOUT:.0f} s; are the cluster's CPUs taken?") from None
        except ray.exceptions.RayError as exc:
            raise PoolStartError(f"a session actor failed to start: {_last_lines(exc)}") from None
        self._capacity, self._free = capacity, list(capacity)
        labels = self._node_labels()
        problems = {labels[node["node_id"]]: node["problem"] for node in self._nodes if node["problem"]}
        if problems:
            raise PoolStartError("\n".join(f"Ray node {label} cannot run this run's sessions: {problem}"
                                           for label, problem in problems.items()))
        self._clean_other_nodes()

    def _clean_other_nodes(self) -> None:
        """Environments' leftovers on the nodes other than this one (the parent cleans its own), by one
        actor per node: before the first session and after the last."""
        ray = self.ray
        here, cleaners = ray.get_runtime_context().get_node_id(), dict[str, Any]()
        for index, (actor, node) in enumerate(zip(self._actors, self._nodes, strict=False)):
            if index not in self._lost and node["node_id"] != here:
                cleaners.setdefault(node["node_id"], actor)
        if cleaners:
            ray.get([actor.remove_leftovers.remote() for actor in cleaners.values()], timeout=ACTOR_START_TIMEOUT)

    def _node_labels(self) -> dict[str, str]:
        """Node id -> the node's name in output: its address, with the start of its id where several
        nodes share one address (several raylets on one host are several nodes)."""
        addresses = Counter({node["node_id"]: node["address"] for node in self._nodes}.values())
        return {node["node_id"]: node["address"] if addresses[node["address"]] == 1
                else f"{node['address']} ({node['node_id'][:6]})" for node in self._nodes}

    def describe(self) -> str | None:
        """One start-up line: where the sessions run."""
        actors: Counter = Counter()
        sessions: Counter = Counter()
        for node, slots in zip(self._nodes, self._capacity, strict=False):
            actors[node["node_id"]] += 1
            sessions[node["node_id"]] += slots
        labels = self._node_labels()
        where = (f"cluster at RAY_ADDRESS={self._address}" if self._address else "local Ray on 127.0.0.1")
        nodes = ", ".join(f"{labels[node]}: {actors[node]} actor{'s' if actors[node] > 1 else ''} · "
                          f"{sessions[node]} sessions" for node in actors)
        return f"backend ray · {where} · {len(actors)} node{'s' if len(actors) > 1 else ''} ({nodes})"

    # -- the WorkerPool protocol ----------------------------------------------------------------------

    @property
    def free_slots(self) -> int:
        return max(0, sum(self._free) - len(self._retries))

    @property
    def in_flight(self) -> int:
        """Prompts the parent still waits for: running, or waiting for a slot since their actor was lost.
        While no actor is left, a replacement that is starting counts too: the run waits for it."""
        waiting = len(self._pending) + len(self._retries)
        return waiting if self._live_actors() else waiting + len(self._starting)

    @property
    def concurrency(self) -> ConcurrencyFigures | None:
        """The keeper's figures as last heard (asked again in the background: never waits for Ray);
        after the stop, the keeper's last."""
        if self._stopped:
            return self._figures
        ray = self.ray
        if self._figures_asked is not None and ray.wait([self._figures_asked], timeout=0)[0]:
            try:
                self._figures = ray.get(self._figures_asked)
            except ray.exceptions.RayError:
                pass        # the keeper is gone; keep what was last heard
            self._figures_asked = None
        now = time.monotonic()
        if self._figures_asked is None and now - self._figures_asked_at >= FIGURES_INTERVAL:
            self._figures_asked, self._figures_asked_at = self._keeper.figures.remote(), now
        return self._figures

    def submit(self, task: Task) -> None:
        self._dispatch(Attempt(task))

    def last_round(self) -> None:
        pass    # an actor is handed tasks only for its free slots

    def receive(self, timeout: float) -> list[Finished | Fatal | Spent]:
        """Every finished result, waiting at most ``timeout`` for the first one. A lost actor's prompts
        are sent again (or get failure rows); only losing every actor ends the run (a Fatal, after the
        rows that arrived with it)."""
        ray = self.ray
        watched = [*self._pending, *self._starting]
        if not watched:
            time.sleep(timeout)
            return []
        ready, _ = ray.wait(watched, num_returns=1, timeout=timeout)
        if ready and len(watched) > 1:
            ready, _ = ray.wait(watched, num_returns=len(watched), timeout=0)
        rows_from = {self._pending[ref][0] for ref in ready if ref in self._pending}
        messages: list[Finished | Fatal | Spent] = [*self._spending_answers(rows_from)]
        self._ask_for_spending()
        for ref in ready:
            if ref in self._starting:
                self._replacement_started(ref, self._starting.pop(ref))
            elif ref in self._pending:       # an actor lost earlier in this loop may have taken it already
                messages.extend(self._outcome(ref))
        self._give_up_late_replacements()
        if not self._live_actors() and not self._starting:
            messages.append(Fatal("every Ray session actor was lost and none could be replaced; the prompts "
                                  "that were running have no row yet"))
        while self._retries and sum(self._free) > 0:
            self._dispatch(self._retries.popleft())
        return messages

    def _spending_answers(self, rows_from: set[int]) -> list[Spent]:
        """The replies' usage the actors have answered with (see _ask_for_spending). An actor in
        ``rows_from`` has rows about to be read: its answer is waited for, since a question asked before
        those rows came back may hold replies of theirs, which must reach the parent first."""
        ray = self.ray
        collected: list[Spent] = []
        asked = list(self._draining.values())
        answered = set(ray.wait(asked, num_returns=len(asked), timeout=0)[0]) if asked else set()
        for actor, ref in list(self._draining.items()):
            if actor not in rows_from and ref not in answered:
                continue
            del self._draining[actor]
            try:
                collected.extend(ray.get(ref, timeout=STOP_GRACE_SECONDS))
            except Exception:
                pass        # its actor is gone: what it spent since its last answer is not known
        return collected

    def _ask_for_spending(self) -> None:
        """Every SPENT_INTERVAL, ask each actor without a question on its way what its replies spent."""
        now = time.monotonic()
        if now - self._drained_at >= SPENT_INTERVAL:
            self._drained_at = now
            for index, actor in enumerate(self._actors):
                if index not in self._lost and index not in self._draining:
                    self._draining[index] = actor.drain_spent.remote()

    def _dispatch(self, attempt: Attempt) -> None:
        actor = max(range(len(self._free)), key=self._free.__getitem__)   # the least loaded actor
        self._free[actor] -= 1
        self._pending[self._actors[actor].run.remote(attempt.task)] = (actor, attempt)

    def _live_actors(self) -> int:
        return len(self._actors) - len(self._lost)

    def _outcome(self, ref: Any) -> list[Spent | Finished | Fatal]:
        ray = self.ray
        actor, attempt = self._pending.pop(ref)
        try:
            messages = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError) as exc:
            return self._lose(actor, exc, attempt)
        except ray.exceptions.RayError as exc:   # the call itself failed (not its prompt): a bug, stop
            return [Fatal(f"Ray session actor {self._actor_name(actor)} failed: {_last_lines(exc)}")]
        self._free[actor] += 1
        return messages

    # -- lost actors ---------------------------------------------------------------------------------

    def _lose(self, actor: int, exc: BaseException, attempt: Attempt) -> list[Spent | Finished | Fatal]:
        """The actor is gone (its node or its process): each prompt it ran goes to the actors that
        remain once more, or, lost for the second time, becomes a failure row; a replacement starts."""
        name = self._actor_name(actor)
        victims = [attempt]
        for ref, (index, other) in list(self._pending.items()):
            if index == actor:
                # Not read even if it finished: the prompt runs again, and only what is read becomes a row.
                del self._pending[ref]
                victims.append(other)
        self._lost.add(actor)
        self._free[actor] = 0
        self._keeper.forget.remote(self._nodes[actor]["gate"])    # the model requests it had in flight are over
        self._discard(self._actors[actor])
        self._start_replacement(self._capacity[actor])
        failed: list[Spent | Finished | Fatal] = [self._lost_twice(victim.task, (*victim.losses, name))
                                          for victim in victims if victim.losses]
        again = [Attempt(victim.task, (name,)) for victim in victims if not victim.losses]
        self._retries.extend(again)
        sessions = sum(slots for index, slots in enumerate(self._capacity) if index not in self._lost)
        fates = ([f"{len(again)} prompt(s) it was running go once more to the actors that remain"] if again else [])
        fates += [f"{len(failed)} lost for the second time get a failure row (--resume retries it)"] if failed else []
        warn(f"lost Ray session actor {name}: {type(exc).__name__}. {'; '.join(fates)}. {self._live_actors()} "
             f"actor(s) with {sessions} sessions remain; a replacement is starting")
        return failed

    def _lost_twice(self, task: Task, losses: tuple[str, ...]) -> Finished:
        """The failure row of a prompt whose actor was lost twice: perhaps the prompt kills its worker,
        and it must not take every actor down. It is retried on resume, like every failure."""
        from batchrun.worker_process import lost_task  # the model client's imports, only when needed

        error = ("the Ray session actors running this prompt were lost twice: "
                 + "; ".join(f"actor {name}" for name in losses) + "; --resume runs it again")
        return lost_task(task, self._config, error, LOST_ACTOR_ERROR_TYPE)

    def _start_replacement(self, slots: int) -> None:
        """A new actor where the cluster has a free CPU (after a crash, the lost actor's own); a lost
        node's CPUs are gone with it, and then the replacement waits for room until its deadline."""
        assert self._new_actor is not None
        actor = self._new_actor(slots)
        self._starting[actor.probe.remote()] = Replacement(actor, slots, time.monotonic() + ACTOR_START_TIMEOUT)

    def _replacement_started(self, ref: Any, replacement: Replacement) -> None:
        try:
            node = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            self._discard(replacement.actor)
            warn(f"a replacement Ray session actor failed to start: {_last_lines(exc, 1)}")
            return
        if node["problem"]:
            self._discard(replacement.actor)
            warn(f"a replacement Ray session actor landed on node {node['address']}, which cannot run this "
                 f"run's sessions: {node['problem']}")
            return
        self._actors.append(replacement.actor)
        self._capacity.append(replacement.slots)
        self._free.append(replacement.slots)
        self._nodes.append(node)

    def _give_up_late_replacements(self) -> None:
        now = time.monotonic()
        for ref, replacement in list(self._starting.items()):
            if now > replacement.deadline:
                del self._starting[ref]
                self._discard(replacement.actor)
                warn(f"no replacement Ray session actor found a free CPU within {ACTOR_START_TIMEOUT:.0f} s")

    def _discard(self, actor: Any) -> None:
        try:
            self.ray.kill(actor, no_restart=True)
        except Exception:
            pass

    def _actor_name(self, actor: int) -> str:
        node = self._nodes[actor]
        return f"{actor} (pid {node['pid']} on node {self._node_labels()[node['node_id']]})"

    # -- stop ----------------------------------------------------------------------------------------

    def stop(self) -> list[Finished | Spent]:
        """Cancel in-flight sessions (their environments are cleaned up), end the actors, and stop the
        Ray this runner started (or leave the cluster).

        Returns the rows that finished meanwhile, to be persisted like any other (a session that
        ended just before the stop has been paid for), and what the stopped sessions spent."""
        if self._stopped:
            return []
        self._stopped = True
        ray = self.ray
        finished: list[Finished | Spent] = []
        try:
            if ray is not None and ray.is_initialized():
                if self._pending:
                    live = [actor for index, actor in enumerate(self._actors) if index not in self._lost]
                    try:
                        ray.get([actor.stop.remote() for actor in live], timeout=STOP_GRACE_SECONDS)
                    except Exception:
                        pass
                    finished = self._finished_meanwhile()
                finished += self._spent_at_stop()
                try:
                    self._clean_other_nodes()
                except Exception:
                    pass
                if self._keeper is not None:
                    try:
                        self._figures = ray.get(self._keeper.figures.remote(), timeout=STOP_GRACE_SECONDS)
                    except Exception:
                        pass
                for actor in [*self._actors, *(replacement.actor for replacement in self._starting.values()),
                              self._keeper]:
                    if actor is not None:
                        self._discard(actor)
                ray.shutdown()
        finally:
            self._pending.clear()
            self._retries.clear()
            self._starting.clear()
            if self._watcher is not None:
                writer, watcher = self._watcher
                writer.close()           # the watcher ends whatever of the local Ray is still there
                watcher.join(10)
        return finished

    def _finished_meanwhile(self) -> list[Finished | Spent]:
        """The rows of the sessions that ended before the stop reached them, each after its spending
        (and after what the actors' earlier answers hold, which may be theirs too)."""
        ray = self.ray
        ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
        finished: list[Finished | Spent] = [*self._spending_answers(set(self._draining))]
        for ref in ready:
            try:
                messages = ray.get(ref)
            except ray.exceptions.RayError:
                continue         # cancelled by the stop, or its actor is gone: resume runs it
            finished += [message for message in messages if isinstance(message, (Finished, Spent))]
        return finished

    def _spent_at_stop(self) -> list[Spent]:
        """What the stopped sessions spent that the parent has not heard of yet: they leave no row."""
        ray = self.ray
        spent = self._spending_answers(set(self._draining))
        asked = [actor.drain_spent.remote() for index, actor in enumerate(self._actors) if index not in self._lost]
        for ref in asked:
            try:
                spent.extend(ray.get(ref, timeout=STOP_GRACE_SECONDS))
            except Exception:
                pass        # its actor is gone
        return spent


def _last_lines(exc: BaseException, lines: int = 6) -> str:
    text = str(exc).strip().splitlines()
    return "\n".join(text[-lines:]) if text else type(exc).__name__
