"""The Ray session actor: many agent sessions at once on one asyncio loop, on whatever node Ray puts it.

Apart from the pool because this code runs in the actor's process, on a node, while the pool runs in the
parent; it is the Ray counterpart of batchrun.worker_process and runs the same session code.
"""

from __future__ import annotations

import asyncio
import os

from batchrun.config import RunConfig
from batchrun.environments.base import EnvironmentSettings, WorkRootError, claim_work_root
from batchrun.environments.limits import user_process_limit
from batchrun.environments.seccomp import leave_session_keyring
from batchrun.messages import Fatal, Finished, Spent, Task
from batchrun.ray.gate import RayRateGate
from batchrun.ray.node_checks import node_environment_problem, node_tools_problem
from batchrun.workers import raise_open_file_limit


class SessionActor:
    """One Ray actor: many agent sessions at once on its asyncio loop, one call of :meth:`run` each."""

    def __init__(self, slots: int, config: RunConfig, gate: RayRateGate, env_settings: EnvironmentSettings,
                 available_tools: frozenset[str]) -> None:
        from batchrun import worker_process  # the model client is imported on the worker side only

        raise_open_file_limit()     # an actor is not forked from the parent: it lifts its own
        self._worker = worker_process
        self._gate = gate
        self._config = config
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
        config = self._config

        def problems() -> str | None:
            found = []
            if environment := node_environment_problem(config.environment.kind):
                found.append(f"TERMINAL_ENV={config.environment.kind} does not work there ({environment})")
            if tools := node_tools_problem(config.distribution, self._services.available_tools):
                found.append(tools)
            try:
                claim_work_root(self._services.env_settings.work_root)
            except WorkRootError as exc:
                found.append(str(exc))
            return "; ".join(found) or None

        problem = await asyncio.to_thread(problems)
        return {"node_id": ray.get_runtime_context().get_node_id(), "address": ray.util.get_node_ip_address(),
                "pid": os.getpid(), "problem": problem, "gate": self._gate.limit.holder,
                "process_limit": user_process_limit()}

    def remove_leftovers(self) -> None:
        """What a crashed earlier run under this run name left on this node (once per node, before work)."""
        from batchrun.environments import environment_class
        from batchrun.tools.browser.directories import remove_abandoned_browser_directories

        settings = self._services.env_settings
        environment_class(self._config.environment.kind).remove_node_leftovers(settings)
        remove_abandoned_browser_directories()

    async def run(self, task: Task) -> list[Spent | Finished | Fatal]:
        """The prompt's row (or the run's Fatal), after what its replies spent that drain_spent has not
        taken yet: the parent must see a session's spending before its row."""
        session = asyncio.ensure_future(self._worker.outcome(task, self._services, self._config))
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
