"""The Modal backend (TERMINAL_ENV=modal): one Modal Sandbox per prompt, built from the row's image.

The sandbox idles (``sleep infinity``) while commands and the file tools run in it through
``Sandbox.exec``, exactly as the other container backends run them. Credentials come from Modal's own
configuration: ``modal token new`` (which writes ``~/.modal.toml``), or MODAL_TOKEN_ID and
MODAL_TOKEN_SECRET. Sandboxes belong to the Modal app ``batch_runner`` and are tagged with the run and
the prompt: they are terminated when their prompt ends, those of a crashed run before the next run
under the same name starts, and Modal itself ends any sandbox after SANDBOX_LIFETIME seconds.

Whatever an SDK call raises is the service failing: Modal's own errors, and its transport's, which the SDK
passes on as they are once its retries are spent (grpclib's StreamTerminatedError is neither a modal error
nor an OSError). A start fails with it, a tool call reports it, and a sandbox Modal ended or no longer knows
is the prompt's environment lost.

Limits: memory is capped by Modal (the sandbox's memory limit); Modal has no process or ``/tmp`` size
limit to set, so those two are not enforced here.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import sys
import threading
from collections.abc import AsyncIterable, AsyncIterator, Coroutine, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

from batchrun.console.layout import bounded, shown
from batchrun.environments.base import (
    CommandResult,
    EnvironmentLostError,
    EnvironmentSettings,
    EnvironmentSetupError,
)
from batchrun.environments.command_output import OutputCollector
from batchrun.environments.container import (
    HOUSEKEEPING_TIMEOUT,
    PULL_TIMEOUT,
    ContainerEnvironment,
    setup_error,
)
from batchrun.environments.container_cli import STDERR_BYTES, CliResult
from batchrun.environments.single_flight import SingleFlight
from batchrun.install_hint import install_hint
from batchrun.time_limit import within

if TYPE_CHECKING:   # an optional extra: imported where a prompt needs it (modal_sdk)
    from modal import App, Sandbox

APP_NAME = "batch_runner"
RUN_TAG = "batch_runner.run"
PROMPT_TAG = "batch_runner.prompt"
# Modal's longest sandbox lifetime: the last resort that ends a sandbox whatever happened to us.
SANDBOX_LIFETIME = 24 * 3600
# What a sandbox reserves of its memory limit: Modal bills the reservation, and few commands need much.
MEMORY_REQUEST_MB = 1024
# The whole clean-up of a run's leftover sandboxes, at its start and at its end, where stop signals wait for it:
# a service that never answers must hold neither. What is not done by then is left, with a warning.
LEFTOVERS_SECONDS = HOUSEKEEPING_TIMEOUT
# After a command's exit, how long its output may be silent before the rest is no longer waited for (a
# background child it left may hold its stdout open, writing nothing).
OUTPUT_QUIET_SECONDS = 1.0
# Leftover sandboxes terminated at once: hundreds one after the other would not fit in LEFTOVERS_SECONDS.
_TERMINATIONS_AT_ONCE = 16
# How much longer than LEFTOVERS_SECONDS the clean-up's thread is waited for, should an SDK call ignore its
# cancellation.
_CANCEL_GRACE_SECONDS = 5.0
# What becomes of the sandboxes a clean-up could not terminate.
_LEFT_TO_MODAL = f"until Modal ends them, {SANDBOX_LIFETIME // 3600} hours after their start"

# Per process: the app, looked up once and shared by the sessions that ask together.
_apps: dict[str, App] = {}
_questions = SingleFlight()


def modal_sdk() -> ModuleType:
    """The ``modal`` package, or EnvironmentSetupError saying how to install it or log in."""
    try:
        modal = importlib.import_module("modal")
    except ImportError:
        raise EnvironmentSetupError(f"TERMINAL_ENV=modal needs the modal package, an optional extra: "
                                    f"{install_hint('modal')}") from None
    if not (modal.config.config.get("token_id") and modal.config.config.get("token_secret")):
        raise EnvironmentSetupError("no Modal credentials: run `modal token new` (it writes ~/.modal.toml) or "
                                    "set MODAL_TOKEN_ID and MODAL_TOKEN_SECRET")
    return modal


class ModalEnvironment(ContainerEnvironment):
    kind = "modal"

    def __init__(self, settings: EnvironmentSettings, *, prompt_index: int,
                 image: str | None = None, cwd: str | None = None) -> None:
        super().__init__(settings, prompt_index=prompt_index, image=image, cwd=cwd)
        self._modal: ModuleType     # from _find_runtime, start()'s first step, on
        self._app: App | None = None
        self._sandbox: Sandbox | None = None

    @classmethod
    def startup_check(cls) -> str:
        """The extra and the credentials, before any prompt starts; whether Modal accepts them is the
        first prompt's to find out."""
        modal_sdk()
        return super().startup_check()

    def _find_runtime(self) -> None:
        self._modal = modal_sdk()

    async def _check_runtime(self) -> None:
        self._app = _apps.get(APP_NAME) or await _questions.run("app", self._lookup_app)

    async def _lookup_app(self) -> App:
        modal = self._modal
        try:
            app = await within(HOUSEKEEPING_TIMEOUT, modal.App.lookup.aio(APP_NAME, create_if_missing=True))
        except modal.exception.AuthError as exc:
            raise setup_error("Modal refused the credentials (run `modal token new`)", str(exc)) from None
        except Exception as exc:    # the service failing, whatever the SDK raised for it (see the module's words)
            raise setup_error("Modal is not reachable", _reason(exc)) from None
        _apps[APP_NAME] = app
        return app

    async def _ensure_image(self) -> None:
        """Nothing to do here: Modal pulls the image when the first sandbox needs it, and keeps it."""

    async def _create(self) -> None:
        modal = self._modal
        caps = self.settings.limits
        tags = {RUN_TAG: self.settings.run_label, PROMPT_TAG: str(self.prompt_index)}
        memory = (min(MEMORY_REQUEST_MB, caps.memory_mb), caps.memory_mb)
        try:
            self._sandbox = await within(PULL_TIMEOUT, modal.Sandbox.create.aio(
                "sleep", "infinity", app=self._app, image=modal.Image.from_registry(self.image), tags=tags,
                timeout=SANDBOX_LIFETIME, workdir="/", block_network=not self.settings.allow_network, memory=memory))
        except Exception as exc:    # the service failing, whatever the SDK raised for it
            raise setup_error(f"cannot start a Modal sandbox from {self.image}", _reason(exc)) from None

    async def _remove(self) -> None:
        if self._sandbox is not None:
            await within(HOUSEKEEPING_TIMEOUT, self._sandbox.terminate.aio())

    def _created(self) -> Sandbox:
        """The prompt's sandbox; running anything in it before start() made it is a bug."""
        if self._sandbox is None:
            raise RuntimeError("the Modal sandbox is not running (start() not called, or it failed)")
        return self._sandbox

    async def _exec(self, argv: list[str], *, workdir: str, stdin: bytes | None = None) -> CliResult:
        try:
            return await within(HOUSEKEEPING_TIMEOUT, self._exec_captured(argv, workdir, stdin or b""))
        except TimeoutError:
            return CliResult(returncode=None, stdout=b"", stderr="")
        except _ServiceFailed as failure:
            self._raise_if_lost(failure)
            return CliResult(returncode=127, stdout=b"", stderr=f"Modal: {failure.reason}")

    async def _exec_captured(self, argv: list[str], workdir: str, stdin: bytes) -> CliResult:
        """What the program writes is kept up to one byte past the largest file the tools read (64 KB of
        stderr): the file tools run the sandbox's own programs, which a command may replace with one that
        writes without end. Past that it is no longer read, and the sandbox's removal ends it."""
        sandbox = self._created()
        with _service():
            process = await sandbox.exec.aio(*argv, workdir=workdir, text=False)
            if stdin:
                process.stdin.write(stdin)
            process.stdin.write_eof()
            await process.stdin.drain.aio()
        stderr_read = asyncio.ensure_future(_at_most(_chunks(process.stderr), STDERR_BYTES))
        stderr = b""
        try:
            stdout, overflowed = await _at_most(_chunks(process.stdout), self.settings.max_file_bytes)
            if not overflowed:
                stderr, overflowed = await stderr_read
        finally:
            _abandon(stderr_read)
        returncode = None
        if not overflowed:
            with _service():
                returncode = await process.wait.aio()
        return CliResult(returncode=returncode, stdout=stdout, stderr=stderr.decode("utf-8", "replace"),
                         overflowed=overflowed)

    def _raise_if_lost(self, failure: _ServiceFailed) -> None:
        """EnvironmentLostError where ``failure`` says the sandbox is gone: Modal ended it (its lifetime, a
        preemption, someone's `modal sandbox terminate`) or no longer knows it. Nothing the prompt asks for
        later can run, and kept as tool errors the prompt would end as a finished row that --resume never
        runs again. Any other failure of the service may pass, and is the one call's."""
        errors = self._modal.exception
        gone = (errors.SandboxTerminatedError, errors.SandboxTimeoutError, errors.NotFoundError)
        if isinstance(failure.error, gone):
            raise EnvironmentLostError(f"the Modal sandbox is gone: {failure.reason}") from None

    async def _exec_merged(self, argv: list[str], *, timeout: float) -> CommandResult:
        """Output is read as it comes and only the capped part kept; a command that outlives
        ``timeout`` is left to the in-sandbox `timeout` (or the sandbox's removal) to end."""
        collector = OutputCollector(self.settings.max_output_chars)
        try:
            exit_code = await within(timeout, self._follow(argv, collector))
        except TimeoutError:
            output, truncated = collector.finish()
            return CommandResult(output=output, exit_code=None, timed_out=True, truncated=truncated)
        except _ServiceFailed as failure:
            self._raise_if_lost(failure)
            output, truncated = collector.finish()
            return CommandResult(output=output, exit_code=None, truncated=truncated, error=f"Modal: {failure.reason}")
        output, truncated = collector.finish()
        return CommandResult(output=output, exit_code=exit_code, truncated=truncated)

    async def _follow(self, argv: list[str], collector: OutputCollector) -> int:
        """Run ``argv``, its output fed to ``collector``; its exit status. The exit is awaited alongside the
        output, not after its end: a background child the command left may hold its stdout open long after
        the command exited, which then took for a time-out. Once the command has exited, its output is read
        on until its end, or until none has come for OUTPUT_QUIET_SECONDS: the service sends the output and
        the exit over calls of their own, so output may come after the exit."""
        sandbox = self._created()
        with _service():
            process = await sandbox.exec.aio(*argv, workdir="/", text=False)
            process.stdin.write_eof()       # a command reading its input gets end-of-file, not a hang
            await process.stdin.drain.aio()

        loop = asyncio.get_running_loop()
        last_output = loop.time()

        async def read() -> None:
            nonlocal last_output
            async for chunk in _chunks(process.stdout):
                collector.feed(chunk)
                last_output = loop.time()

        async def exited() -> int:
            with _service():
                code: int = await process.wait.aio()
            return code

        reader, waiter = asyncio.ensure_future(read()), asyncio.ensure_future(exited())
        try:
            await asyncio.wait({reader, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done():
                reader.result()         # the output's reading failed: the service's failure, raised here
            exit_code = await waiter
            while not reader.done() and (quiet := last_output + OUTPUT_QUIET_SECONDS - loop.time()) > 0:
                await asyncio.wait({reader}, timeout=quiet)
            if reader.done():
                reader.result()
            return exit_code
        finally:
            _abandon(reader)
            _abandon(waiter)

    @classmethod
    def remove_leftovers(cls, settings: EnvironmentSettings) -> None:
        """Terminate the sandboxes a crashed run under this label left (at the run's end: those its own
        prompts could not). Without the package or the credentials there are none this run could reach, and
        its prompts say why; where the service fails or does not answer within LEFTOVERS_SECONDS, a warning
        says what was left, and the rest of the clean-up goes on: Modal ends them at their lifetime's end."""
        try:
            modal = modal_sdk()
        except EnvironmentSetupError:
            modal = None
        if modal is not None:
            problem = _run_apart(_terminate_leftovers(modal, settings.run_label),
                                 LEFTOVERS_SECONDS + _CANCEL_GRACE_SECONDS)
            if problem is not None:
                print(bounded(shown(f"warning: {problem}")), file=sys.stderr, flush=True)
        super().remove_leftovers(settings)

    @classmethod
    def remove_node_leftovers(cls, settings: EnvironmentSettings) -> None:
        """This machine's part alone: the sandboxes are the service's, looked for once, by the runner (on
        every node, a Modal that did not answer held the run's start and end once more per node)."""
        super().remove_leftovers(settings)


class _ServiceFailed(Exception):
    """An SDK call failed; ``error`` is what it raised."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error

    @property
    def reason(self) -> str:
        return _reason(self.error)


def _reason(error: BaseException) -> str:
    """What a failure of the service says (its type, where it says nothing: a TimeoutError)."""
    return str(error) or type(error).__name__


@contextlib.contextmanager
def _service() -> Iterator[None]:
    """Around SDK calls, and only those: what they raise (a cancellation aside) is the service failing,
    _ServiceFailed; a bug of ours around them stays the bug it is."""
    try:
        yield
    except Exception as exc:
        raise _ServiceFailed(exc) from exc


async def _chunks(stream: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The chunks of ``stream``, an SDK stream: what reading it raises is _ServiceFailed."""
    iterator = aiter(stream)
    while True:
        with _service():
            try:
                chunk = await anext(iterator)
            except StopAsyncIteration:
                return
        yield chunk


def _abandon(task: asyncio.Future[Any]) -> None:
    """Cancel ``task``, whose outcome is no longer wanted; one that failed already is not reported as a
    failure nobody looked at."""
    task.cancel()
    if task.done() and not task.cancelled():
        task.exception()


def _run_apart(work: Coroutine[Any, Any, str | None], seconds: float) -> str | None:
    """``work`` run in an event loop of a thread of its own, waited for ``seconds`` at most: the caller may be
    in a running event loop (a Ray actor's), and a stop signal still reaches the caller while it waits."""
    outcome: list[str | None] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(asyncio.run(work))
        except BaseException as exc:    # a bug of ours: raised in the caller's thread, where it is seen
            failure.append(exc)
    thread = threading.Thread(target=target, name="modal-leftovers", daemon=True)
    thread.start()
    thread.join(seconds)
    if failure:
        raise failure[0]
    if not outcome:     # an SDK call that ignored its cancellation; the thread ends with it, or with the process
        return (f"the clean-up of Modal sandboxes left under this run's tag did not end (Modal did not answer "
                f"within {seconds:g}s); any left run on {_LEFT_TO_MODAL}")
    return outcome[0]


async def _terminate_leftovers(modal: ModuleType, run_label: str) -> str | None:
    """Terminate the sandboxes tagged ``run_label``, taking LEFTOVERS_SECONDS at most in all; None, or what
    was left and why."""
    found: list[Sandbox] | None = None
    terminated = 0
    failures: list[str] = []
    room = asyncio.Semaphore(_TERMINATIONS_AT_ONCE)

    async def listed() -> list[Sandbox]:
        app = await modal.App.lookup.aio(APP_NAME, create_if_missing=True)
        return [sandbox async for sandbox in modal.Sandbox.list.aio(app_id=app.app_id, tags={RUN_TAG: run_label})]

    async def terminate(sandbox: Sandbox) -> None:
        nonlocal terminated
        async with room:
            try:
                await sandbox.terminate.aio()
            except Exception as exc:    # the service failing, whatever the SDK raised for it
                failures.append(f"Modal: {_reason(exc)}")
                return
        terminated += 1

    async def clean_up() -> None:
        nonlocal found
        try:
            found = await listed()
        except Exception as exc:        # the service failing, whatever the SDK raised for it
            failures.append(f"Modal: {_reason(exc)}")
            return
        await asyncio.gather(*(terminate(sandbox) for sandbox in found))

    try:
        await within(LEFTOVERS_SECONDS, clean_up())
    except TimeoutError:
        failures.append(f"Modal did not answer within {LEFTOVERS_SECONDS:g}s")
    if found is None:
        return (f"could not look for Modal sandboxes left under this run's tag ({failures[0]}); any there run on "
                f"{_LEFT_TO_MODAL}")
    if terminated < len(found):
        return (f"{len(found) - terminated} of {len(found)} Modal sandboxes left under this run's tag could not be "
                f"terminated ({failures[0]}); they run on {_LEFT_TO_MODAL}")
    return None


async def _at_most(stream: AsyncIterable[bytes], limit: int) -> tuple[bytes, bool]:
    """What ``stream`` holds up to one byte past ``limit``, and whether it held more (the rest unread)."""
    data = bytearray()
    async for chunk in stream:
        data += chunk
        if len(data) > limit:
            return bytes(data[:limit + 1]), True
    return bytes(data), False
