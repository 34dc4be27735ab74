"""Ctrl-C (SIGINT), SIGTERM and SIGHUP in the parent process: the first one stops the run in order, later ones
only say that it is stopping.

The parent is the run directory's one writer, and its stop is what keeps the rows the workers finished
meanwhile and merges them into trajectories.jsonl and statistics.json: an exception raised in the middle
of those steps would lose them. So a stop signal raises :class:`Interrupted` only inside an
*interruptible* stretch of code (the start; the scheduling loop, but for the rows it receives and writes);
inside a *shielded* one (rows received and written, the stop, the merge, the report) it is noted, and
raised when the code is interruptible again; once every prompt has run, it stops nothing. The stop is
bounded (workers get workers.STOP_GRACE_SECONDS, then are killed); the merge takes as long as the rows
written since the last one. A signal after the first never raises: it prints one line saying the run is
already stopping. Once the run is over (see StopSignals.ended), a signal does nothing.

SIGTERM (a job scheduler's or a service manager's stop) and SIGHUP (the terminal closed, an ssh session
lost) are taken as Ctrl-C is, so such a stop keeps the merge too (SIGHUP's default ended the run and its
workers at once); the exit code is the shell's for the signal, 128 + its number: 130 for SIGINT, 143 for
SIGTERM, 129 for SIGHUP. A stop signal the process was started with ignored stays ignored: whoever
started it so (``nohup``, for a run that outlives its terminal; a shell's background job) asked for that.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from types import FrameType

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOPPING_NOTE = b"Already stopping: keeping the rows finished so far and merging them; this ends by itself.\n"


class Interrupted(KeyboardInterrupt):
    """The first stop signal, raised where the code may be interrupted. A KeyboardInterrupt, so that the
    handlers of `except Exception` (libraries', the report's) let it through as they let Ctrl-C through."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return exit_code(self.signum)


def exit_code(signum: int) -> int:
    return 128 + signum


def stopped_line(signum: int, *, resume: bool = True) -> str:
    """What happened, and for a run what to do, as the one line a stopped command ends with."""
    what = "Interrupted." if signum == signal.SIGINT else f"Stopped by {signal.Signals(signum).name}."
    return f"{what} Finished prompts are saved; run the same command with --resume to continue." if resume else what


def end_quietly_while_loading() -> None:
    """Until :meth:`StopSignals.install`: a stop signal ends the program with the one line it ends with later,
    instead of Python's traceback of whichever import Ctrl-C interrupted, or no word at all for SIGTERM and
    SIGHUP. Nothing is written yet to keep."""
    for signum in _not_ignored():
        signal.signal(signum, _end_while_loading)


def _not_ignored() -> list[signal.Signals]:
    """The stop signals this process was not started with ignored (see the module's docstring)."""
    return [signum for signum in HANDLED if signal.getsignal(signum) is not signal.SIG_IGN]


def _end_while_loading(signum: int, frame: FrameType | None) -> None:
    with contextlib.suppress(OSError):
        os.write(1, f"{stopped_line(signum, resume=False)}\n".encode())
    os._exit(exit_code(signum))


@contextlib.contextmanager
def interrupts_unwrapped() -> Iterator[None]:
    """An Interrupted that code wrapped as the cause of an exception of its own raised as itself: Python
    wraps what a class's ``__set_name__`` raises in a RuntimeError, so a stop signal while a library imported
    late (a price table, pandas) defines its classes was a traceback and exit 1, not a stop."""
    try:
        yield
    except Exception as exc:
        cause: BaseException | None = exc
        while cause is not None and not isinstance(cause, Interrupted):
            cause = cause.__cause__
        if cause is None:
            raise
        raise cause from None


class StopSignals:
    """The parent's handler of the stop signals, and the stretches of code it may interrupt."""

    def __init__(self) -> None:
        self.received: int | None = None    # the first stop signal
        self._raised = False                # ... raised, or taken by the code (see take)
        self._interruptible = [True]        # per stretch entered, innermost last
        self._pid: int | None = None
        self._said_stopping = False
        self._ended = False                 # see ended

    def install(self) -> None:
        self._pid = os.getpid()
        for signum in _not_ignored():
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # A process forked from this one (a reading pool, a plot being drawn) keeps the handler: the
        # signal reached the whole process group, and the parent decides how its helpers end.
        if os.getpid() != self._pid or self._ended:
            return
        if self.received is not None:
            self._say_stopping()
            return
        self.received = signum
        self._raise_pending()

    def _say_stopping(self) -> None:
        """Once: written straight to the descriptor, as the signal may come in the middle of a print."""
        if not self._said_stopping:
            self._said_stopping = True
            with contextlib.suppress(OSError):
                os.write(2, STOPPING_NOTE)

    def _raise_pending(self) -> None:
        if self._interruptible[-1] and self.received is not None and not self._raised:
            self._raised = True
            raise Interrupted(self.received)

    def ended(self) -> None:
        """The run is over: its rows are written, its last line said, its exit code decided, and the process
        exits at once. A stop signal from now on changes none of these; raised, it was a traceback after that
        last line, and exit code 1."""
        self._ended = True

    def take(self) -> int | None:
        """The stop signal received so far, if any, now dealt with by the caller: no stretch raises it."""
        if self.received is not None:
            self._raised = True
        return self.received

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """A stretch a stop signal does not interrupt; one received meanwhile is raised as it ends, if
        the code around it is interruptible and the stretch ended without an exception of its own."""
        with self._stretch(interruptible=False):
            yield

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A stretch a stop signal interrupts, inside a shielded one; one received before it raises at once."""
        with self._stretch(interruptible=True):
            yield

    @contextlib.contextmanager
    def _stretch(self, *, interruptible: bool) -> Iterator[None]:
        self._interruptible.append(interruptible)
        try:
            self._raise_pending()
            yield
        finally:
            self._interruptible.pop()
        self._raise_pending()


STOP_SIGNALS = StopSignals()
