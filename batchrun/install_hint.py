"""The commands messages tell the user to type, in the form that works for this installation: the
one that installs an optional extra, and the program itself.

Every message that tells the user to install something optional (web tools, browser, Ray, report
plots) or to run batch_runner again takes its command from here, so the console, the start-up
summary, the help page and the report agree.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

DISTRIBUTION = "batch-runner"
# The package directory's parent: the project root in a source checkout, site-packages otherwise.
_PACKAGE_PARENT = Path(__file__).resolve().parent.parent


def source_checkout() -> Path | None:
    """The project directory when batch_runner runs from a source checkout (editable install, or
    ``python batch_runner.py`` in a clone), else None.

    Only a checkout has the project's pyproject.toml beside the package; an installed package sits in
    site-packages, which has none.
    """
    return _PACKAGE_PARENT if (_PACKAGE_PARENT / "pyproject.toml").is_file() else None


def install_hint(extra: str) -> str:
    """The pip command that adds ``extra`` (e.g. ``web``) to this installation.

    From a checkout the extra must come from the checkout itself: the distribution's name might
    resolve to a different release on the package index, or to nothing. The path is absolute because
    the hint may be read in another working directory than the one it was made in.
    """
    checkout = source_checkout()
    if checkout is not None:
        return f"pip install -e {shlex.quote(f'{checkout}[{extra}]')}"
    return f"pip install {shlex.quote(f'{DISTRIBUTION}[{extra}]')}"


def program() -> str:
    """The program as the user started it: ``batch_runner`` (the command ``pip install`` made) or
    ``python batch_runner.py`` (the script of a checkout)."""
    return "batch_runner" if Path(sys.argv[0]).name == "batch_runner" else "python batch_runner.py"
