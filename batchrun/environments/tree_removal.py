"""Removing a per-prompt directory on the host, whatever a command did to its permissions."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import sys
from pathlib import Path

# Each rmtree pass can unlock one more level of directories a command made unreadable.
_REMOVE_PASSES = 8


def remove_tree(root: Path) -> None:
    """Delete a prompt directory even where a command made parts of it read-only; never raises.

    Read-only directories are common (Go's module cache under HOME, for one): each failure makes the
    directories involved writable again, and the next pass removes what the previous could not.
    """
    top = os.fspath(root)

    def loosen(_function: object, failed: str, _error: object) -> None:
        for target in (os.path.dirname(failed), failed):
            inside = target == top or target.startswith(top + os.sep)
            if inside and not os.path.islink(target):
                with contextlib.suppress(OSError):
                    os.chmod(target, stat.S_IRWXU)

    for _ in range(_REMOVE_PASSES):
        if not os.path.lexists(top):
            return
        if sys.version_info >= (3, 12):
            shutil.rmtree(top, onexc=loosen)
        else:
            shutil.rmtree(top, onerror=loosen)      # onexc does not exist before 3.12
