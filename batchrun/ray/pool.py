"""RayWorkerPool, the parent's side of --backend=ray: a :class:`~batchrun.workers.WorkerPool` over Ray
session actors.

Apart from the actors, the gate and the cluster because this is the one object that runs in the parent
through the whole run: it starts the actors, hands each task to the least loaded one, collects the rows
and what the replies spent, notices lost actors and starts their replacements, and stops it all.
A little over 400 lines: every part reads and updates the same per-actor bookkeeping (slots, the
references on their way, the lost indexes), which a further split would have to pass back and forth.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from batchrun.concurrency import ConcurrencyFigures
from batchrun.config import RunConfig
from batchrun.console.layout import bounded, shown
from batchrun.environments import environment_class
from batchrun.environments.base import EnvironmentSettings
from batchrun.environments.limits import process_limit_note
from batchrun.messages import Fatal, Finished, Spent, Task
from batchrun.ray import cluster
from batchrun.ray.actor import SessionActor
from batchrun.ray.gate import GateKeeper, RayRateGate
from batchrun.ray.node_loss import Attempt, Replacement, share_out
from batchrun.ray.watcher import Watcher
from batchrun.stop_signals import STOP_SIGNALS, Interrupted
from batchrun.workers import STOP_GRACE_SECONDS, PoolStartError, process_count, split_slots

ACTOR_START_TIMEOUT = 180.0     # seconds for every actor to be placed, import the worker code and check its node
HEAD_CHECK_INTERVAL = 2.0       # seconds between looks at the head while the actors start
SPARE_CONCURRENCY = 4           # actor calls beyond the session slots: probe, stop
FIGURES_INTERVAL = 0.5          # seconds between questions to the gate actor for the live display
SPENT_INTERVAL = 1.0            # seconds between collections of each actor's replies' usage (drain_spent)


@contextlib.contextmanager
def _stop_signal_raised_as_interrupted() -> Iterator[None]:
    """Ray's waits turn what the stop signal's handler raised (Interrupted) into a plain
    KeyboardInterrupt, which the runner would not take for the stop it is."""
    try:
        yield
    except KeyboardInterrupt as exc:
        if isinstance(exc, Interrupted) or STOP_SIGNALS.received is None:
            raise
        raise Interrupted(STOP_SIGNALS.received) from None


def process_limit_warnings(nodes: Sequence[dict], capacity: Sequence[int], labels: dict[str, str],
                           processes: int) -> list[str]:
    """One warning for each node whose sessions' process caps add up past the limit of the user there (the
    ``process_limit`` of its actors' probes): each node's kernel counts only its own sandboxes, so the
    driver's limit against every session says nothing of any node."""
    sessions: Counter = Counter()
    limits: dict[str, int | None] = {}
    for node, slots in zip(nodes, capacity, strict=True):
        sessions[node["node_id"]] += slots
        limits[node["node_id"]] = node["process_limit"]
    return [f"on Ray node {labels[node_id]}, {note}" for node_id, count in sessions.items()
            if (note := process_limit_note(count, processes, limits[node_id]))]


def warn(text: str) -> None:
    """A warning line on stderr, as the console writes one (the pool has no console of its own): what
    Ray's exceptions say may quote a node's or a task's words, shown escaped and bounded."""
    print(bounded(shown(f"warning: {text}")), file=sys.stderr, flush=True)


class RayWorkerPool:
    """A :class:`~batchrun.workers.WorkerPool` over Ray actors."""

    def __init__(self, config: RunConfig, env_settings: EnvironmentSettings, available_tools: frozenset[str]) -> None:
        self._address = cluster.cluster_address()
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
        self._watcher: Watcher | None = None
        self._head: tuple[str, int] | None = None      # the GCS's (host, port), once connected
        self._head_lost = False
        self._clean_up_failed = False
        self._stopped = False
        self.ray: Any = None
        try:
            with _stop_signal_raised_as_interrupted():
                self._connect()
                self._start_actors(config, env_settings, available_tools)
        except BaseException:
            self.stop()
            raise

    # -- start ---------------------------------------------------------------------------------------

    def _connect(self) -> None:
        cluster.set_output_environment()
        if self._address is None:
            cluster.set_local_environment()
            self._watcher = Watcher()     # before Ray starts, so that Ray's processes carry its mark
            self.ray = cluster.import_ray()
        else:
            cluster.set_join_environment()
            self.ray = cluster.import_ray()
            cluster.check_head_answers(self._address)
        cluster.init(self.ray, self._address)
        self._head = cluster.head_endpoint(self.ray.get_runtime_context().gcs_address)

    def _start_actors(self, config: RunConfig, env_settings: EnvironmentSettings,
                      available_tools: frozenset[str]) -> None:
        ray = self.ray
        cpus = int(ray.available_resources().get("CPU", 0))
        if cpus < 1:
            raise PoolStartError("the Ray cluster has no free CPU for the session actors "
                                 f"({ray.cluster_resources().get('CPU', 0):g} in all)")
        pool = config.pool
        count = min(process_count(pool.num_workers) if self._address is None else pool.num_workers, cpus)
        capacity = split_slots(pool.num_workers, count)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # The rate limits live beside the driver: every session needs them, and they must outlive
        # any other node.
        beside_driver = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        self._keeper = (ray.remote(num_cpus=0, max_concurrency=10_000)(GateKeeper)
                        .options(scheduling_strategy=beside_driver)
                        .remote(pool.requests_per_minute, pool.num_workers, pool.adaptive_concurrency))
        gate = RayRateGate(self._keeper, pool.requests_per_minute, pool.adaptive_concurrency)
        actor_class = ray.remote(SessionActor)

        def new_actor(slots: int) -> Any:
            return (actor_class.options(num_cpus=1, max_concurrency=slots + SPARE_CONCURRENCY,
                                        scheduling_strategy="SPREAD")
                    .remote(slots, config, gate, env_settings, available_tools))

        self._new_actor = new_actor
        actors = [new_actor(slots) for slots in capacity]
        probes = [actor.probe.remote() for actor in actors]
        self._wait_for_probes(probes, count)
        lost = self._take_started(actors, capacity, probes)
        if lost:      # perhaps with the head, which no replacement would outlive
            self._stop_if_head_gone()
        labels = self._node_labels()
        problems = {labels[node["node_id"]]: node["problem"] for node in self._nodes if node["problem"]}
        if problems:
            raise PoolStartError("\n".join(f"Ray node {label} cannot run this run's sessions: {problem}"
                                           for label, problem in problems.items()))
        if environment_class(config.environment.kind).shares_user_process_limit:
            processes = config.environment.limits.processes
            for line in process_limit_warnings(self._nodes, self._capacity, labels, processes):
                warn(line)
        for slots, exc in lost:
            self._start_replacement(slots)
            warn(f"a Ray session actor was lost while it started ({_ray_said(exc)}); {self._live_actors()} "
                 f"actor(s) with {sum(self._capacity)} sessions go on; a replacement is starting")
        self._clean_before_work()

    def _take_started(self, actors: list[Any], capacity: list[int],
                      probes: list[Any]) -> list[tuple[int, BaseException]]:
        """The actors whose probe answered become the pool's; the others' slots, each with what Ray said,
        are returned: their node died as they were placed (Ray counts a node killed a moment ago alive
        until its heartbeats are missed), a node lost as during the run."""
        ray = self.ray
        lost: list[tuple[int, BaseException]] = []
        for actor, slots, probe in zip(actors, capacity, probes, strict=True):
            try:
                node = ray.get(probe)
            except ray.exceptions.RayActorError as exc:
                if exc.actor_init_failed:     # the actor's own code failed: so would every replacement's
                    raise PoolStartError(f"a session actor failed to start: {_ray_said(exc)}") from None
                self._discard(actor)
                lost.append((slots, exc))
                continue
            except ray.exceptions.RayError as exc:
                raise PoolStartError(f"a session actor failed to start: {_ray_said(exc)}") from None
            self._actors.append(actor)
            self._capacity.append(slots)
            self._free.append(slots)
            self._nodes.append(node)
        return lost

    def _wait_for_probes(self, probes: list[Any], count: int) -> None:
        """Until every new actor's probe has answered (or failed). A head gone meanwhile stops the start at
        once: Ray would wait for it 60 s and then end this process with a line of its own."""
        ray = self.ray
        deadline = time.monotonic() + ACTOR_START_TIMEOUT
        while probes:
            if time.monotonic() > deadline:
                raise PoolStartError(f"Ray did not start {count} session actors (1 CPU each) within "
                                     f"{ACTOR_START_TIMEOUT:.0f} s; are the cluster's CPUs taken?")
            _, probes = ray.wait(probes, num_returns=len(probes), timeout=HEAD_CHECK_INTERVAL)
            if probes:
                self._stop_if_head_gone()

    def _stop_if_head_gone(self) -> None:
        """While the actors start: see _head_gone."""
        if (head_gone := self._head_gone()) is not None:
            raise PoolStartError(f"{head_gone}; no prompt has started")

    def _clean_other_nodes(self, timeout: float = ACTOR_START_TIMEOUT, among: set[int] | None = None) -> None:
        """Environments' leftovers on the nodes other than this one (the parent cleans its own), by one
        actor per node (of those ``among``, where given): before the first session and after the last."""
        ray = self.ray
        here, cleaners = ray.get_runtime_context().get_node_id(), dict[str, Any]()
        for index, (actor, node) in enumerate(zip(self._actors, self._nodes, strict=False)):
            if index not in self._lost and node["node_id"] != here and (among is None or index in among):
                cleaners.setdefault(node["node_id"], actor)
        if cleaners:
            ray.get([actor.remove_leftovers.remote() for actor in cleaners.values()], timeout=timeout)

    def _clean_before_work(self) -> None:
        """_clean_other_nodes before the first session: a node lost since its probe, a clean-up that raised
        or hung stops the start with one line."""
        try:
            self._clean_other_nodes()
        except self.ray.exceptions.RayError as exc:
            self._clean_up_failed = True        # the stop does not wait for it once more
            raise PoolStartError(f"removing what an earlier run left on the other Ray nodes failed: "
                                 f"{_ray_said(exc)}; no prompt has started") from None

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
        with _stop_signal_raised_as_interrupted():
            return self._receive(timeout)

    def _receive(self, timeout: float) -> list[Finished | Fatal | Spent]:
        ray = self.ray
        watched = [*self._pending, *self._starting]
        with STOP_SIGNALS.interruptible():    # see WorkerPool.receive
            if not watched:
                time.sleep(timeout)
                return []
            ready, _ = ray.wait(watched, num_returns=1, timeout=timeout)
        if ready and len(watched) > 1:
            ready, _ = ray.wait(watched, num_returns=len(watched), timeout=0)
        rows_from = {self._pending[ref][0] for ref in ready if ref in self._pending}
        lost_before = len(self._lost)
        messages: list[Finished | Fatal | Spent] = [*self._spending_answers(rows_from)]
        self._ask_for_spending()
        for ref in ready:
            if ref in self._starting:
                self._replacement_started(ref, self._starting.pop(ref))
            elif ref in self._pending:       # an actor lost earlier in this loop may have taken it already
                messages.extend(self._outcome(ref))
        # An actor's Fatal may be the head's loss too, seen from its node: the rate-limit keeper went with it.
        if ((len(self._lost) > lost_before or any(isinstance(message, Fatal) for message in messages))
                and (head_gone := self._head_gone()) is not None):
            return [*(message for message in messages if not isinstance(message, Fatal)),
                    Fatal(f"{head_gone}; the prompts that were running have no row yet (--resume runs them once "
                          "the cluster is back)")]
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

    def _outcome(self, ref: Any) -> Sequence[Spent | Finished | Fatal]:
        ray = self.ray
        actor, attempt = self._pending.pop(ref)
        errors = ray.exceptions
        try:
            messages = ray.get(ref)
        except (errors.RayActorError, errors.WorkerCrashedError, errors.NodeDiedError) as exc:
            return self._lose(actor, exc, attempt)
        except errors.RayError as exc:
            # A large row waits in its node's object store, and goes with the node: lost as its actor is. Not a
            # fetch that timed out from a node still there, nor an object Ray freed or miscounted.
            if isinstance(exc, errors.ObjectLostError) and not isinstance(exc, (
                    errors.ObjectFetchTimedOutError, errors.ObjectFreedError, errors.ReferenceCountingAssertionError)):
                return self._lose(actor, exc, attempt)
            # The call itself failed (not its prompt): a bug, stop
            return [Fatal(f"Ray session actor {self._actor_name(actor)} failed: {_ray_said(exc)}")]
        self._free[actor] += 1
        return messages

    # -- lost actors ---------------------------------------------------------------------------------

    def _lose(self, actor: int, exc: BaseException, attempt: Attempt) -> list[Finished]:
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
        failed, again = share_out(victims, name, self._config)
        self._retries.extend(again)
        sessions = sum(slots for index, slots in enumerate(self._capacity) if index not in self._lost)
        fates = ([f"{len(again)} prompt(s) it was running go once more to the actors that remain"] if again else [])
        fates += [f"{len(failed)} lost for the second time get a failure row (--resume retries it)"] if failed else []
        warn(f"lost Ray session actor {name}: {type(exc).__name__}. {'; '.join(fates)}. {self._live_actors()} "
             f"actor(s) with {sessions} sessions remain; a replacement is starting")
        return failed

    def _head_gone(self) -> str | None:
        """Why the run must end, when the cluster's head (its GCS) no longer answers; asked when actors are
        lost, fail, or are slow to start: no actor can be started then, and Ray itself ends this process
        about 60 s later with a line of its own. Stopping at once keeps the run's own stop (rows saved, one
        clear line)."""
        if self._head is None or (why := cluster.unreachable(*self._head)) is None:
            return None
        self._head_lost = True
        host, port = self._head
        return f"the Ray cluster's head at {host}:{port} no longer answers ({why})"

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
            warn(f"a replacement Ray session actor failed to start: {_ray_said(exc)}")
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
        ended just before the stop has been paid for), and what the stopped sessions spent.

        The actors get STOP_GRACE_SECONDS in all to stop their sessions, as worker processes do; only those that
        answered are then asked what their sessions spent, and then to clean their nodes, each step with that
        much time again: a node that answers nothing (stopped, cut off) held a SIGTERM's stop for a minute
        (each wait on it ran to its end, the clean-up's for 180 s), past the grace a scheduler gives before it
        kills (30 s under Kubernetes and Slurm), and the merge with it. What such a node spent since its last
        answer is not counted; what it left stays for the next start of this run, which removes it."""
        if self._stopped:
            return []
        self._stopped = True
        ray = self.ray
        finished: list[Finished | Spent] = []
        try:
            if ray is not None and ray.is_initialized() and not self._head_lost:
                live = {index for index in range(len(self._actors)) if index not in self._lost}
                if self._pending:
                    stops = {self._actors[index].stop.remote(): index for index in live}
                    stopped, _ = ray.wait(list(stops), num_returns=len(stops), timeout=STOP_GRACE_SECONDS)
                    live = {stops[ref] for ref in stopped}
                    finished = self._finished_meanwhile(live)
                spent, live = self._spent_at_stop(live)
                finished += spent
                try:
                    if not self._clean_up_failed:
                        self._clean_other_nodes(STOP_GRACE_SECONDS, among=live)
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
                self._watcher.close()
        return finished

    def _finished_meanwhile(self, answering: set[int]) -> list[Finished | Spent]:
        """The rows of the sessions that ended before the stop reached them, each after its spending
        (and after what the actors' earlier answers hold, which may be theirs too: waited for from the
        ``answering`` actors)."""
        ray = self.ray
        ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
        finished: list[Finished | Spent] = [*self._spending_answers(answering)]
        for ref in ready:
            try:
                messages = ray.get(ref)
            except ray.exceptions.RayError:
                continue         # cancelled by the stop, or its actor is gone: resume runs it
            finished += [message for message in messages if isinstance(message, (Finished, Spent))]
        return finished

    def _spent_at_stop(self, answering: set[int]) -> tuple[list[Spent], set[int]]:
        """What the stopped sessions of the ``answering`` actors spent that the parent has not heard of yet
        (they leave no row), asked of all at once and waited for at most STOP_GRACE_SECONDS; and those that
        answered."""
        ray = self.ray
        spent = self._spending_answers(answering)
        asked = {self._actors[index].drain_spent.remote(): index for index in answering}
        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=STOP_GRACE_SECONDS) if asked else ([], [])
        answered = set()
        for ref in ready:
            try:
                spent.extend(ray.get(ref, timeout=0))
            except Exception:
                continue    # its actor is gone
            answered.add(asked[ref])
        return spent, answered


def _ray_said(exc: BaseException) -> str:
    """One line for a Ray exception: its type and the first line of its message, which starts the sentence
    (the lines below list ids and addresses), and for a longer message its last line, where a traceback
    names the exception raised."""
    text = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    said = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    return f"{said} … {text[-1]}" if len(text) > 1 else said
