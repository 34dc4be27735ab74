"""The code's shape, checked by a test rather than by a reader: the modules of batchrun/ and the
top-level modules import one another without a cycle, so each layer of the data path can be read,
tested and replaced below the ones that use it."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for the top-level modules and everything under batchrun/."""
    found = {path.stem: path for path in REPO.glob("*.py")}
    for path in (REPO / "batchrun").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """Every dotted name an import statement may load: ``from a import b`` loads a, and a.b if that
    is a module."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        parent = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join([*parent, base] if base else parent)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def project_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules a module imports anywhere: at the top, in a function, or only for the
    type checker (a cycle a lazy import hides is still two modules that cannot be read apart)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in imported_names(node, package):
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
    return found


def test_the_import_graph_has_no_cycle() -> None:
    modules = project_modules()
    graph = {name: project_imports(name, path, set(modules)) for name, path in modules.items()}
    assert "batchrun.report" in graph and "model_tools" in graph       # the walk found the code
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        raise AssertionError(f"import cycle: {' -> '.join(error.args[1])}") from None


PUBLIC_FACES = ("batch_runner", "model_tools", "toolset_distributions")


def test_the_package_never_imports_a_public_face() -> None:
    """batch_runner.py, model_tools.py and toolset_distributions.py are what users import and run; the
    package sits below them, so a walk through the code never climbs back up to a face."""
    modules = project_modules()
    for name, path in modules.items():
        if name.startswith("batchrun"):
            faces = project_imports(name, path, set(modules)) & set(PUBLIC_FACES)
            assert not faces, f"{name} imports the public face {', '.join(sorted(faces))}"


def test_reading_rows_loads_no_tool_implementation() -> None:
    """Rows, statistics and the report depend on tool names and toolsets, not on the tools: reading a
    run's files must not load a handler module (the browser's, the web's...)."""
    code = ("import sys, batchrun.rows, batchrun.stats, batchrun.run_dir, batchrun.report, batchrun.export; "
            "from batchrun.registry import REGISTRY; "
            "handlers = {spec.handler_path.partition(':')[0] for spec in REGISTRY.values()}; "
            "loaded = sorted(handlers & set(sys.modules)); "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# "About 400": a module a little over it is not split for the number's sake.
LONG_MODULE_LINES = 450


def test_a_long_module_says_why_at_its_top() -> None:
    """docs/layout.md: no product module is over about 400 lines unless its docstring says why."""
    for name, path in project_modules().items():
        text = path.read_text(encoding="utf-8")
        if name.startswith("batchrun") and text.count("\n") > LONG_MODULE_LINES:
            docstring = ast.get_docstring(ast.parse(text)) or ""
            assert "400 lines" in docstring, f"{name} has {text.count(chr(10))} lines and its docstring does not say why"
