"""The package's metadata in the forms its build backend keeps accepting: a fresh machine installs with
the newest setuptools, so a form it has deprecated becomes a failed `pip install -e .` on its removal date."""

import re
import tomllib
from pathlib import Path

PYPROJECT = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())


def test_the_license_is_an_spdx_expression_not_the_table_setuptools_stops_building_in_2027() -> None:
    assert isinstance(PYPROJECT["project"]["license"], str)


def test_the_build_asks_for_a_setuptools_that_reads_an_spdx_license() -> None:
    requirement = next(r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools"))
    minimum = re.fullmatch(r"setuptools>=(\d+)(\.\d+)*", requirement)
    assert minimum is not None and int(minimum.group(1)) >= 77
