"""The Modal backend (TERMINAL_ENV=modal): one Modal Sandbox per prompt, built from the row's image.

The sandbox idles (``sleep infinity``) while commands and the file tools run in it through
``Sandbox.exec``, exactly as the other container backends run them. Credentials come from Modal's own
configuration: ``modal token new`` (which writes ``~/.modal.toml``), or MODAL_TOKEN_ID and
MODAL_TOKEN_SECRET. Sandboxes belong to the Modal app ``batch_runner`` and are tagged with the run and
the prompt: they are terminated when their prompt ends, those of a crashed run before the next run
under the same name starts, and Modal itself ends any sandbox after SANDBOX_LIFETIME seconds.

Limits: memory is capped by Modal (the sandbox's memory limit); Modal has no process or ``/tmp`` size
limit to set, so those two are not enforced here.
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import AsyncIterable
from types import ModuleType
from typing import TYPE_CHECKING

from batchrun.environments.base import CommandResult, EnvironmentSettings, EnvironmentSetupError
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
        except (TimeoutError, modal.exception.Error, OSError) as exc:
            raise setup_error("Modal is not reachable", str(exc) or type(exc).__name__) from None
        _apps[APP_NAME] = app
        return app

    async def _ensure_image(self) -> None:
        """Nothing to do here: Modal pulls the image when the first sandbox needs it, and keeps it."""

    async def _create(self) -> None:
        modal = self._modal
        caps = self.settings.limits
        try:
            self._sandbox = await within(PULL_TIMEOUT, modal.Sandbox.create.aio(
                "sleep", "infinity", app=self._app, image=modal.Image.from_registry(self.image),
                tags={RUN_TAG: self.settings.run_label, PROMPT_TAG: str(self.prompt_index)},
                timeout=SANDBOX_LIFETIME, workdir="/", block_network=not self.settings.allow_network,
                memory=(min(MEMORY_REQUEST_MB, caps.memory_mb), caps.memory_mb)))
        except (TimeoutError, modal.exception.Error, OSError) as exc:
            raise setup_error(f"cannot start a Modal sandbox from {self.image}",
                              str(exc) or type(exc).__name__) from None

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
        except (self._modal.exception.Error, OSError) as exc:
            return CliResult(returncode=127, stdout=b"", stderr=f"Modal: {exc}")

    async def _exec_captured(self, argv: list[str], workdir: str, stdin: bytes) -> CliResult:
        """What the program writes is kept up to one byte past the largest file the tools read (64 KB of
        stderr): the file tools run the sandbox's own programs, which a command may replace with one that
        writes without end. Past that it is no longer read, and the sandbox's removal ends it."""
        process = await self._created().exec.aio(*argv, workdir=workdir, text=False)
        if stdin:
            process.stdin.write(stdin)
        process.stdin.write_eof()
        await process.stdin.drain.aio()
        stderr_read = asyncio.ensure_future(_at_most(process.stderr, STDERR_BYTES))
        stderr = b""
        try:
            stdout, overflowed = await _at_most(process.stdout, self.settings.max_file_bytes)
            if not overflowed:
                stderr, overflowed = await stderr_read
        finally:
            stderr_read.cancel()
        returncode = None if overflowed else await process.wait.aio()
        return CliResult(returncode=returncode, stdout=stdout, stderr=stderr.decode("utf-8", "replace"),
                         overflowed=overflowed)

    async def _exec_merged(self, argv: list[str], *, timeout: float) -> CommandResult:
        """Output is read as it comes and only the capped part kept; a command that outlives
        ``timeout`` is left to the in-sandbox `timeout` (or the sandbox's removal) to end."""
        collector = OutputCollector(self.settings.max_output_chars)

        async def follow() -> int:
            process = await self._created().exec.aio(*argv, workdir="/", text=False)
            process.stdin.write_eof()       # a command reading its input gets end-of-file, not a hang
            await process.stdin.drain.aio()
            async for chunk in process.stdout:
                collector.feed(chunk)
            return await process.wait.aio()

        try:
            exit_code = await within(timeout, follow())
        except TimeoutError:
            output, truncated = collector.finish()
            return CommandResult(output=output, exit_code=None, timed_out=True, truncated=truncated)
        except (self._modal.exception.Error, OSError) as exc:
            output, truncated = collector.finish()
            return CommandResult(output=output, exit_code=None, truncated=truncated, error=f"Modal: {exc}")
        output, truncated = collector.finish()
        return CommandResult(output=output, exit_code=exit_code, truncated=truncated)

    @classmethod
    def remove_leftovers(cls, settings: EnvironmentSettings) -> None:
        """Terminate the sandboxes a crashed run under this label left. Without the package, the
        credentials or the service there are none this run could reach, and its prompts say why."""
        try:
            modal = modal_sdk()
        except EnvironmentSetupError:
            modal = None
        if modal is not None:
            try:
                app = modal.App.lookup(APP_NAME, create_if_missing=True)
                for sandbox in modal.Sandbox.list(app_id=app.app_id, tags={RUN_TAG: settings.run_label}):
                    sandbox.terminate()
            except (modal.exception.Error, OSError):
                pass
        super().remove_leftovers(settings)


async def _at_most(stream: AsyncIterable[bytes], limit: int) -> tuple[bytes, bool]:
    """What ``stream`` holds up to one byte past ``limit``, and whether it held more (the rest unread)."""
    data = bytearray()
    async for chunk in stream:
        data += chunk
        if len(data) > limit:
            return bytes(data[:limit + 1]), True
    return bytes(data), False
