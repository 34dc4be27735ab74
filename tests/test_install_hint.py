"""install_hint: one command per optional extra, in the form that works for how batch_runner was installed.

The module is copied into directories laid out like a checkout or like site-packages and asked there, in
an interpreter without site-packages, so the answer comes from the copy's own surroundings.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO

from batchrun.install_hint import install_hint

MODULE = REPO / "batchrun" / "install_hint.py"


def hint_of_a_copy(package_parent: Path, extra: str) -> str:
    """install_hint(extra) as the module answers it from package_parent/batchrun/."""
    (package_parent / "batchrun").mkdir(parents=True)
    shutil.copy(MODULE, package_parent / "batchrun" / "install_hint.py")
    code = f"from batchrun.install_hint import install_hint; print(install_hint({extra!r}))"
    result = subprocess.run([sys.executable, "-S", "-c", code], cwd=package_parent.parent,
                            env={"PYTHONPATH": str(package_parent)}, capture_output=True, text=True, check=True)
    return result.stdout.rstrip("\n")


def test_from_this_checkout_the_extra_comes_from_the_checkout():
    assert shlex.split(install_hint("web")) == ["pip", "install", "-e", f"{REPO}[web]"]


def test_an_installed_package_gets_the_extra_by_distribution_name(tmp_path):
    hint = hint_of_a_copy(tmp_path / "site-packages", "browser")
    assert shlex.split(hint) == ["pip", "install", "batch-runner[browser]"]


def test_a_checkout_path_with_spaces_and_quotes_stays_one_shell_word(tmp_path):
    checkout = tmp_path / "it's my project"
    checkout.mkdir()
    (checkout / "pyproject.toml").write_text("[project]\nname = \"batch-runner\"\n")
    hint = hint_of_a_copy(checkout, "report")
    assert shlex.split(hint) == ["pip", "install", "-e", f"{checkout}[report]"]
