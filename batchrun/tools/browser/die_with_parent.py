"""Runs a command that the kernel kills when its parent dies: a program of its own, run with
``python -I -S -c`` (as enter_namespace.py is), never imported.

Playwright's driver runs under it, killed when the worker dies, and so does a Chromium started without
bwrap (whose --die-with-parent does this for the sandboxed one), killed when the driver dies. It asks
for SIGKILL on its parent's death (PR_SET_PDEATHSIG, which exec keeps), checks that the parent had not
died already, and becomes the command.

Usage: die_with_parent.py PARENT_PID COMMAND...
"""

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(parent: int, command: list[str]) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        sys.exit(f"{command[0]} not started: its parent, process {parent}, is gone")
    os.execv(command[0], command)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
