"""A stand-in for the part of the ``modal`` SDK that batchrun's modal backend uses.

No Modal service is reachable from the test machines. With this directory first on the import path,
``import modal`` finds this module: each sandbox is a stand-in container (fake_container.py) under
``$FAKE_CONTAINER_STATE``, and what is exec'd in it runs as a local process, its absolute paths moved
under the container's root. Like the SDK, every call has a blocking form, ``f(...)``, and an awaitable
one, ``f.aio(...)``; keyword arguments are the SDK's (a test binds the ones the backend passes to the
real signatures where the real package is installed). Each call is logged to ``$FAKE_CONTAINER_LOG``
as ``{"tool": "modal", "argv": [NAME, {argument: value}]}``, ``args`` holding the positional ones.

Switches, from the environment: ``MODAL_TOKEN_ID`` and ``MODAL_TOKEN_SECRET`` are the credentials, as
in the real configuration (``MODAL_TOKEN_ID=rejected``: the service refuses them);
``FAKE_PULL_FAIL=img[,img]``: sandboxes from these images fail as a failed image build does;
``FAKE_MODAL_HANG=call[,call]`` (``App.lookup``, ``Sandbox.list``, ``Sandbox.exec``, ...): these calls never answer,
as a service that took the request and never replies; ``FAKE_MODAL_RAISE=call[:error][,...]``: these calls fail with
grpclib's StreamTerminatedError, which the real SDK raises as it is (no modal error) once its retries on a broken
connection are spent, or with the ``modal.exception`` error named (``Sandbox.exec:NotFoundError``). Each is read
at every call, so a test may set it once a sandbox has started. ``FAKE_MODAL_OUTPUT_LAG=seconds``: each chunk of a
process's output comes that much later, as the service streams output over calls of its own, apart from the exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import secrets
import sys
import threading
import types
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))     # tests/, for fake_container
from fake_container import Container, container_env, log_call, pull_fails

__version__ = "0.0-fake"


class Error(Exception):
    pass


class AuthError(Error):
    pass


class RemoteError(Error):
    pass


class SandboxTerminatedError(Error):
    pass


class NotFoundError(Error):
    pass


class SandboxTimeoutError(Error):
    pass


exception = types.SimpleNamespace(Error=Error, AuthError=AuthError, RemoteError=RemoteError,
                                  SandboxTerminatedError=SandboxTerminatedError, NotFoundError=NotFoundError,
                                  SandboxTimeoutError=SandboxTimeoutError)


class StreamTerminatedError(Exception):
    """grpclib's (grpclib.exceptions.StreamTerminatedError), which is neither a modal error nor an OSError: the real
    SDK raises it as it is when a connection to the service keeps breaking."""


class _Config:
    def get(self, key: str) -> str | None:
        return os.environ.get(f"MODAL_{key.upper()}") or None


config = types.SimpleNamespace(config=_Config())


def _log(call: str, /, **arguments: Any) -> None:
    plain = (str, int, float, bool, list, tuple, dict, type(None))
    log_call("modal", [call, {key: value if isinstance(value, plain) else repr(value)
                              for key, value in arguments.items()}])


def _blocking(awaitable: Any) -> Any:
    """Run ``awaitable`` to its end from plain code, in an event loop of its own thread (the SDK's
    blocking calls work inside a running loop too)."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = asyncio.run(awaitable)
        except BaseException as exc:
            outcome["error"] = exc
    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


async def _collect(generator: AsyncIterator[Any]) -> list[Any]:
    return [item async for item in generator]


def _switched(name: str) -> list[str]:
    return [entry for entry in os.environ.get(name, "").split(",") if entry]


async def _misbehave(call: str) -> None:
    """What FAKE_MODAL_HANG and FAKE_MODAL_RAISE make of ``call`` before it does anything."""
    if call in _switched("FAKE_MODAL_HANG"):
        await asyncio.Event().wait()        # never set: only a cancellation ends the wait
    for entry in _switched("FAKE_MODAL_RAISE"):
        name, _, error = entry.partition(":")
        if name == call:
            raise getattr(exception, error)(f"{call} failed (FAKE_MODAL_RAISE)") if error else \
                StreamTerminatedError("Connection lost")


def _with_switches(call: str, function: Callable[..., Any], generator: bool) -> Callable[..., Any]:
    """``function`` (a coroutine or async generator function) behaving as the switches make ``call`` behave."""
    if generator:
        async def items(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            await _misbehave(call)
            async for item in function(*args, **kwargs):
                yield item
        return items

    async def answer(*args: Any, **kwargs: Any) -> Any:
        await _misbehave(call)
        return await function(*args, **kwargs)
    return answer


class _Call:
    """One SDK call bound to its object: ``call(...)`` blocks, ``call.aio(...)`` is awaited."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self._function = function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self._function(*args, **kwargs)
        return _blocking(_collect(result) if inspect.isasyncgen(result) else result)

    def aio(self, *args: Any, **kwargs: Any) -> Any:
        return self._function(*args, **kwargs)


class _dual:
    """A method (or, looked up on the class, a class method) with the SDK's two forms."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self._function = function
        self._name = function.__name__

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = f"{owner.__name__}.{name}"     # what the switches call it: Sandbox.exec

    def __get__(self, instance: Any, owner: type) -> _Call:
        bound = functools.partial(self._function, owner if instance is None else instance)
        return _Call(_with_switches(self._name, bound, inspect.isasyncgenfunction(self._function)))


class App:
    def __init__(self, app_id: str) -> None:
        self.app_id = app_id

    @_dual
    async def lookup(cls, name: str, *, client: Any = None, environment_name: str | None = None,
                     create_if_missing: bool = False) -> App:
        _log("App.lookup", name=name, create_if_missing=create_if_missing)
        if config.config.get("token_id") == "rejected":
            raise AuthError("Token ID is malformed or invalid")
        return cls(f"ap-{name}")


class Image:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    @staticmethod
    def from_registry(tag: str, secret: Any = None, **kwargs: Any) -> Image:
        _log("Image.from_registry", tag=tag, **kwargs)
        return Image(tag)


class _Reader:
    def __init__(self, stream: asyncio.StreamReader, text: bool) -> None:
        self._stream = stream
        self._text = text

    @_dual
    async def read(self) -> bytes | str:
        data = await self._stream.read()
        return data.decode() if self._text else data

    async def __aiter__(self) -> AsyncIterator[bytes | str]:
        lag = float(os.environ.get("FAKE_MODAL_OUTPUT_LAG", "0"))
        while chunk := await self._stream.read(65536):
            await asyncio.sleep(lag)
            yield chunk.decode() if self._text else chunk


class _Writer:
    """The SDK sends input to the service, which drops what a process that has ended cannot take;
    here, a pipe closed at the other end does the same."""

    def __init__(self, stream: asyncio.StreamWriter) -> None:
        self._stream = stream

    def write(self, data: bytes | str) -> None:
        self._stream.write(data.encode() if isinstance(data, str) else bytes(data))

    def write_eof(self) -> None:
        if not self._stream.is_closing():
            self._stream.write_eof()

    @_dual
    async def drain(self) -> None:
        try:
            await self._stream.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass


class ContainerProcess:
    def __init__(self, process: asyncio.subprocess.Process, text: bool, pid_file: Path) -> None:
        self._process = process
        self._pid_file = pid_file
        self.stdin = _Writer(process.stdin)
        self.stdout = _Reader(process.stdout, text)
        self.stderr = _Reader(process.stderr, text)

    @_dual
    async def wait(self) -> int:
        # The service answers once the process has exited. asyncio's wait() also waits for its pipes to close,
        # which a child the process left in the background may hold open long after.
        while (code := self._process.returncode) is None:
            await asyncio.sleep(0.01)
        try:        # a child left in the background is the sandbox's still, ended with it
            os.killpg(self._process.pid, 0)
        except ProcessLookupError:
            self._pid_file.unlink(missing_ok=True)
        return code if code >= 0 else 128 - code

    @property
    def returncode(self) -> int | None:
        return self._process.returncode


class Sandbox:
    def __init__(self, container: Container) -> None:
        self._container = container
        self.object_id = container.name
        self._processes: list[asyncio.subprocess.Process] = []      # what this object exec'd

    @_dual
    async def create(cls, *args: str, app: App | None = None, tags: dict[str, str] | None = None,
                     image: Image | None = None, timeout: int | None = 300, workdir: str | None = None,
                     block_network: bool = False, memory: int | tuple[int, int] | None = None,
                     **others: Any) -> Sandbox:
        _log("Sandbox.create", args=args, app=app, tags=tags, image=image and image.tag, timeout=timeout,
             workdir=workdir, block_network=block_network, memory=memory, **others)
        if image is not None and pull_fails(image.tag):
            raise RemoteError(f"Image build failed: pulling {image.tag} from its registry was denied")
        container = Container(f"sb-{secrets.token_hex(8)}")
        container.create({"app_id": app and app.app_id, "tags": tags or {}, "image": image and image.tag,
                          "command": list(args), "block_network": block_network, "memory": memory,
                          "timeout": timeout, "workdir": workdir or "/"})
        return cls(container)

    @_dual
    async def list(cls, *, app_id: str | None = None, tags: dict[str, str] | None = None,
                   client: Any = None) -> AsyncIterator[Sandbox]:
        _log("Sandbox.list", app_id=app_id, tags=tags)
        for container in Container.all():
            meta = container.meta
            if (app_id is None or meta["app_id"] == app_id) and (tags or {}).items() <= meta["tags"].items():
                yield cls(container)

    @_dual
    async def exec(self, *args: str, workdir: str | None = None, text: bool = True,
                   **others: Any) -> ContainerProcess:
        _log("Sandbox.exec", args=args, workdir=workdir, text=text, **others)
        if not self._container.exists():
            raise SandboxTerminatedError("Sandbox has been terminated")
        cwd = self._container.host_path(workdir or self._container.meta["workdir"])
        argv = self._container.host_argv(list(args))
        if not os.path.isdir(cwd):      # as a runtime that cannot enter the directory answers
            argv, cwd = ["sh", "-c", f"echo 'cannot chdir to {workdir}' >&2; exit 126"], self._container.host_path("/")
        process = await asyncio.create_subprocess_exec(
            *argv, cwd=cwd, env=container_env(self._container.host_path("/root")), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True)
        self._processes.append(process)
        return ContainerProcess(process, text, self._container.track(process.pid))

    @_dual
    async def terminate(self, *, wait: bool = False) -> None:
        _log("Sandbox.terminate", object_id=self.object_id)
        self._container.remove()
        for process in self._processes:     # killed with the container: its pipes read out and it reaped
            with contextlib.suppress(TimeoutError):     # while the caller's loop runs, which may end next
                await asyncio.wait_for(process.communicate(), 5)
        for process in self._processes:     # reaped in their loop, not complained about when it closes
            with contextlib.suppress(RuntimeError):     # exec'd from a loop that has ended since
                await process.wait()
