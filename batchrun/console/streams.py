"""The program's stdout and stderr, whose loss ends nothing: what the run prints is for a reader, what it
writes to the run directory is the work."""

from __future__ import annotations

import contextlib
import io
import os
from typing import TextIO


class OutputStream(io.TextIOBase):
    """A standard stream that a failed write closes for good instead of failing the run: a pipe whose
    reader left (`| head -1`), a full disk (`> /dev/full`), a terminal closed (EIO). Raised, such a write
    ended the run at the line it printed, before its merge: a traceback, or exit 1 with none (rich's
    answer to a broken pipe). The first failure of stdout is said once on stderr, should it still work,
    unless its reader left: that one chose to read no further."""

    def __init__(self, stream: TextIO, name: str) -> None:
        super().__init__()
        self._stream = stream
        self._name = name
        self._lost = False

    def write(self, text: str) -> int:
        if not self._lost:
            try:
                self._stream.write(text)
            except OSError as exc:
                self._lose(exc)
        return len(text)

    def flush(self) -> None:
        if not self._lost:
            try:
                self._stream.flush()
            except OSError as exc:
                self._lose(exc)

    def _lose(self, exc: OSError) -> None:
        self._lost = True
        if self._name == "stdout" and not isinstance(exc, BrokenPipeError):
            note = f"warning: stdout cannot be written ({exc.strerror}): nothing more is printed there\n"
            # Straight to the descriptor, past what stderr holds buffered.
            with contextlib.suppress(OSError):
                os.write(2, note.encode(errors="backslashreplace"))

    # What rich and print ask of a stream, answered by the stream underneath.
    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:     # type: ignore[override]
        return self._stream.encoding

    @property
    def errors(self) -> str | None:     # type: ignore[override]
        return self._stream.errors

    def writable(self) -> bool:
        return True
