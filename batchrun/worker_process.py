"""The worker side: many agent sessions on one asyncio loop, in a worker process (``main``) or a Ray actor
(``make_services`` and ``outcome``), and each finished session turned into the row the parent writes.

The pool imports it just before forking, so worker processes share one loaded copy of the model
client. The parent calls only ``lost_task``, for the failure row of a task whose worker died.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import math
import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Collection
from datetime import datetime
from multiprocessing.connection import Connection
from typing import Any

from batchrun import rows, stop_signals
from batchrun.config import RunConfig
from batchrun.endpoint import OpenAIEndpoint
from batchrun.environments.base import EnvironmentSettings
from batchrun.environments.seccomp import leave_session_keyring
from batchrun.messages import Fatal, Finished, Spent, Task
from batchrun.model import RunFatalError
from batchrun.rate_limit import Gate, RateGate
from batchrun.registry import tear_down_process, toolsets_offering
from batchrun.security import Redactor
from batchrun.session import Session, SessionServices

SESSIONS_PER_CLIENT = 16
# A parent that stopped reading is stopping too; the last rows wait this long to be taken.
_OUTBOX_CLOSE_SECONDS = 10.0
_CANNOT_REPORT = 70         # the exit status of a worker whose messages can no longer reach the parent
MAX_CALL_PREVIEWS = 20      # a prompt's tool calls --verbose shows; a session may make hundreds


def _finished(task: Task, result: rows.SessionResult, config: RunConfig) -> Finished:
    batch_num = task.unit // config.output.batch_size
    # The model is sent the prompt as the dataset has it; the row, the report and the console get it
    # redacted, as everything else (a dataset made from logs or tickets may hold a pasted key).
    result = dataclasses.replace(result, prompt=Redactor.of_run(config.endpoint.api_key)(result.prompt))
    line = rows.encode_finished(result, batch_num=batch_num, model=config.endpoint.model,
                                timestamp=datetime.now().isoformat(timespec="seconds"),
                                discard_no_reasoning=config.output.discard_no_reasoning)
    stored = rows.read_stored_row(line)
    assert stored is not None       # a row just encoded is always complete
    return Finished(prompt_index=result.prompt_index, unit=task.unit, sample_index=result.sample_index,
                    batch_num=batch_num, status=stored.status,
                    row=line, api_calls=result.api_calls, usage=result.usage.as_dict(),
                    wall_time=result.wall_time, end_reason=result.end_reason, error=result.error,
                    error_type=result.error_type, prompt_preview=result.prompt[:config.console.log_prefix_chars],
                    toolsets=tuple(toolsets_offering(result.toolsets, result.offered_tools)),
                    tool_calls=tuple((name, count, failure) for name, count, _, failure in stored.tool_counts()),
                    call_previews=(call_previews(result.turns, config.console.log_prefix_chars)
                                   if config.console.verbose else ()), unpriced_replies=result.unpriced_replies)


def call_previews(turns: list[rows.Turn], chars: int) -> tuple[str, ...]:
    """Each tool call of a session as --verbose shows it, as the reference runner logs it: the tool, the
    start of its arguments and of its result, ``chars`` (--log_prefix_chars) of each; at most
    MAX_CALL_PREVIEWS of them, then how many more. Cut here, so that a worker never sends the parent a
    session's tool output twice."""
    calls = list(rows.calls_of(turns))
    previews = [f"{call.name} {_start(call.arguments, chars)} → {_start(call.result or '', chars)}"
                for call in calls[:MAX_CALL_PREVIEWS]]
    if len(calls) > MAX_CALL_PREVIEWS:
        previews.append(f"… and {len(calls) - MAX_CALL_PREVIEWS:,} more tool calls")
    return tuple(previews)


def _start(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[:chars] + "…"


def _failed(task: Task, error: str, error_type: str, *, api_calls: int = 0,
            usage: rows.Usage | None = None) -> rows.SessionResult:
    """A task whose session left nothing usable (a bug, a worker that died) fails visibly, and
    resume runs it again, instead of vanishing; with what its session spent, where that is known."""
    return rows.SessionResult(
        prompt_index=task.prompt_index, content_key=task.content_key, prompt=task.prompt,
        toolsets=list(task.toolsets), offered_tools=[], turns=[], api_calls=api_calls, usage=usage or rows.Usage(),
        wall_time=0.0, end_reason=rows.EndReason.ERROR, error=error, error_type=error_type,
        sample_index=task.sample_index)


def _outlive_stop_signals() -> None:
    """Ctrl-C reaches the whole process group, as does the SIGHUP of a terminal closed, and a job
    scheduler's SIGTERM often every process of the job; the parent decides how to stop, workers follow
    it (see stop_signals). The signals are caught and dropped rather than ignored: an ignored signal
    stays ignored in every program the commands start (a sleep, a test runner, ``timeout -s INT``),
    which then cannot be interrupted; a caught one is back to its default in them."""
    for signum in stop_signals.HANDLED:
        signal.signal(signum, _drop_signal)


def _drop_signal(signum: int, frame: object) -> None:
    pass


def use_pidfd_child_watcher(loop: asyncio.AbstractEventLoop) -> None:
    """Python 3.11 watches each of asyncio's subprocesses (a sandbox's bwrap, a container CLI call)
    with a new thread; a pidfd costs a file descriptor. (3.12+ chooses pidfds by itself and
    deprecates watchers.) Terminal commands are watched by environments.command_output itself."""
    if sys.version_info < (3, 12) and hasattr(asyncio, "PidfdChildWatcher"):
        watcher = asyncio.PidfdChildWatcher()
        watcher.attach_loop(loop)
        asyncio.set_child_watcher(watcher)


def make_services(slots: int, config: RunConfig, gate: Gate, env_settings: EnvironmentSettings,
                  available_tools: frozenset[str]) -> SessionServices:
    """What one worker (process or Ray actor) shares between its ``slots`` concurrent sessions."""
    models = OpenAIEndpoint(config.endpoint, gate, clients=max(1, math.ceil(slots / SESSIONS_PER_CLIENT)))
    return SessionServices(config=config.session, endpoint=config.endpoint, environment_kind=config.environment.kind,
                           models=models, env_settings=env_settings, available_tools=available_tools,
                           redact=Redactor.of_run(config.endpoint.api_key))


async def outcome(task: Task, services: SessionServices, config: RunConfig) -> Finished | Fatal:
    """Run one prompt's session to the message the parent receives, whatever the transport
    (a pipe to a worker process here, a Ray actor's return value in batchrun/ray/actor.py).

    Every task ends in a message, whatever raises, here or while its row is encoded: the parent
    waits for one answer per task it handed out."""
    session: Session | None = None
    try:
        session = Session(task, services)
        result = await session.run()
    except RunFatalError as exc:
        return Fatal(services.redact(str(exc)))
    except asyncio.CancelledError:
        raise
    except Exception:
        # The replies it was billed for count in the row, as in the run's ledger they already do.
        result = _failed(task, services.redact(traceback.format_exc(limit=5)), "internal_error",
                         api_calls=session.api_calls if session else 0, usage=session.usage if session else None)
    try:
        return _finished(task, result, config)
    except Exception:
        return lost_task(task, config, f"internal error while recording the row: "
                                                f"{services.redact(traceback.format_exc(limit=3))}")


def lost_task(task: Task, config: RunConfig, error: str, error_type: str = "internal_error") -> Finished:
    """The failure row of a task whose session left nothing usable, ready to send."""
    return _finished(task, _failed(task, error, error_type), config)


async def shut_down(sessions: Collection[asyncio.Future[Any]], services: SessionServices) -> None:
    """End a worker: cancel its sessions (each closes its environment), then end what the tools
    started in the process (the shared browser...) and close the model clients."""
    for session in sessions:
        session.cancel()
    await asyncio.gather(*sessions, return_exceptions=True)
    await tear_down_process()
    await services.close()


async def _serve(conn: Connection, services: SessionServices, config: RunConfig, slots: int) -> None:
    loop = asyncio.get_running_loop()
    use_pidfd_child_watcher(loop)
    inbox: asyncio.Queue = asyncio.Queue()

    def read_parent() -> None:
        try:
            while (message := conn.recv()) is not None:
                loop.call_soon_threadsafe(inbox.put_nowait, message)
        except (EOFError, OSError):
            pass   # the parent is gone (even kill -9): shut down and clean up environments
        loop.call_soon_threadsafe(inbox.put_nowait, None)

    threading.Thread(target=read_parent, daemon=True).start()
    outbox = _Outbox(conn)
    # Each reply's usage goes to the parent on the rows' own path, before the row that adds it up.
    services.on_spent = lambda unit, usage, source: outbox.put(Spent(unit, usage.as_dict(), source))
    fatal = asyncio.Event()

    # The parent hands out a few tasks more than there are slots; they wait here, first come first served.
    free_slot = asyncio.Semaphore(slots)

    async def run_one(task: Task) -> None:
        async with free_slot:
            if fatal.is_set():      # the run is stopping: a task still waiting never starts
                return
            message = await outcome(task, services, config)
        if not fatal.is_set():     # after a run-wide failure the parent stops: one Fatal, nothing more
            if isinstance(message, Fatal):
                fatal.set()
            outbox.put(message)

    running: set[asyncio.Task] = set()
    while (message := await inbox.get()) is not None:
        session = asyncio.create_task(run_one(Task(**message)))
        running.add(session)
        session.add_done_callback(running.discard)
    await shut_down(running, services)
    outbox.close()


class _Outbox:
    """Sends messages to the parent from a thread of its own: a large row waits in the pipe while the
    parent writes and syncs, and the sessions on this loop go on meanwhile."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[Finished | Fatal | Spent | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send_all, daemon=True)
        self._thread.start()

    def put(self, message: Finished | Fatal | Spent) -> None:
        self._queue.put(message)

    def close(self) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join(_OUTBOX_CLOSE_SECONDS)

    def _send_all(self) -> None:
        while (message := self._queue.get()) is not None:
            try:
                self._conn.send(message)
            except OSError:
                return      # the parent is gone; the reader thread ends the worker
            except BaseException:
                # A message that cannot be sent (no memory left to pickle a row): a worker that can no
                # longer report must end, so that the parent fails its prompts (resume runs them again)
                # and goes on, instead of waiting for their rows for ever.
                os._exit(_CANNOT_REPORT)


def main(conn: Connection, siblings: list[Connection], worker: int, slots: int, config: RunConfig, gate: RateGate,
         env_settings: EnvironmentSettings, available_tools: frozenset[str]) -> None:
    # Fork copied the parent's ends of this worker's pipe and of earlier workers' pipes; they must
    # close here, or a killed parent would never produce the end-of-file by which workers notice.
    for inherited in siblings:
        inherited.close()
    gate.limit.bind(worker)     # the parent gives back this process's request slots if it dies
    _outlive_stop_signals()
    leave_session_keyring()
    # What the fork brought (every module, the config) lives as long as the process: the collector
    # need not walk it again in each full collection. The move relinks only the ends of the
    # collector's lists, so the pages shared with the parent stay shared.
    gc.freeze()
    asyncio.run(_serve(conn, make_services(slots, config, gate, env_settings, available_tools), config, slots))
