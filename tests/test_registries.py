"""A tool and an environment backend are each one module and one table entry: what the runner needs to
know about them (whether a tool acts in the prompt's environment, what it leaves running in a worker,
whether a backend can work on a Ray node) is asked of the entry, never written in the runner."""

from __future__ import annotations

import asyncio
import importlib
import sys
import textwrap
from pathlib import Path

import pytest

import model_tools
from batchrun import worker_process
from batchrun.environments import ENVIRONMENT_KINDS
from batchrun.ray import node_checks
from model_tools import ToolSpec

TOOL_MODULE = "registry_probe_tool"


def register(monkeypatch: pytest.MonkeyPatch, name: str, **facts: object) -> None:
    spec = ToolSpec(name, "probe", "A tool of the test.", {"type": "object", "properties": {}},
                    f"{TOOL_MODULE}:handle", **facts)  # type: ignore[arg-type]
    monkeypatch.setitem(model_tools.REGISTRY, name, spec)


@pytest.fixture
def tool_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A real tool module on the path whose tear-downs note each call in ``ended``."""
    (tmp_path / f"{TOOL_MODULE}.py").write_text(textwrap.dedent("""
        ended = []

        async def handle(args, ctx):
            return {}

        async def close():
            ended.append("close")

        async def broken():
            raise RuntimeError("teardown failed")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield TOOL_MODULE
    sys.modules.pop(TOOL_MODULE, None)      # the next test loads its own, with nothing ended yet


class ClosedServices:
    """What shut_down closes last: the model clients, here nothing to close."""

    async def close(self) -> None:
        pass


def test_a_toolset_holding_a_tool_that_acts_on_what_the_model_wrote_needs_isolation(monkeypatch) -> None:
    register(monkeypatch, "probe_runner", needs_isolation=True)
    monkeypatch.setitem(model_tools.TOOLSETS, "probe", ("probe_runner",))
    assert model_tools.toolsets_needing_isolation({"probe", "web", "terminal"}) == {"probe", "terminal"}


def test_the_terminal_and_file_tools_need_isolation_and_the_others_do_not() -> None:
    isolated = {name for name, spec in model_tools.REGISTRY.items() if spec.needs_isolation}
    assert isolated == {"terminal", "read_file", "write_file", "patch", "search_files"}


def test_a_session_offering_a_tool_that_needs_an_environment_gets_one(monkeypatch) -> None:
    register(monkeypatch, "probe_in_sandbox", needs_environment=True)
    assert model_tools.needs_environment(["web_search", "probe_in_sandbox"])


def test_a_session_offering_only_tools_that_need_no_environment_gets_none(monkeypatch) -> None:
    register(monkeypatch, "probe_elsewhere")
    assert not model_tools.needs_environment(["web_search", "browser_navigate", "probe_elsewhere"])


def test_a_worker_ending_runs_the_teardown_of_a_loaded_tool_module_once(monkeypatch, tool_module) -> None:
    register(monkeypatch, "probe_one", process_teardown=f"{tool_module}:close")
    register(monkeypatch, "probe_two", process_teardown=f"{tool_module}:close")    # same module, same hook
    module = importlib.import_module(tool_module)
    asyncio.run(worker_process.shut_down(set(), ClosedServices()))  # type: ignore[arg-type]
    assert module.ended == ["close"]


def test_a_tool_module_the_worker_never_loaded_is_not_imported_to_tear_it_down(monkeypatch, tool_module) -> None:
    register(monkeypatch, "probe_unused", process_teardown=f"{tool_module}:close")
    asyncio.run(model_tools.tear_down_process())
    assert tool_module not in sys.modules


def test_a_failing_teardown_does_not_keep_the_next_from_running(monkeypatch, tool_module) -> None:
    register(monkeypatch, "probe_broken", process_teardown=f"{tool_module}:broken")
    register(monkeypatch, "probe_fine", process_teardown=f"{tool_module}:close")
    module = importlib.import_module(tool_module)
    asyncio.run(model_tools.tear_down_process())
    assert module.ended == ["close"]


def test_the_browser_tools_close_the_shared_browser_when_the_worker_ends() -> None:
    hooks = {spec.process_teardown for spec in model_tools.TOOLS if spec.toolset == "browser"}
    assert hooks == {"batchrun.tools.browser.launch:close_browser"}


def test_a_new_backend_says_what_its_ray_node_lacks(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "registry_probe_backend.py").write_text(textwrap.dedent("""
        from batchrun.environments.local import LocalEnvironment

        class ProbeEnvironment(LocalEnvironment):
            kind = "probe"

            @classmethod
            def node_problem(cls):
                return "the probe is not installed"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(ENVIRONMENT_KINDS, "probe", "registry_probe_backend:ProbeEnvironment")
    assert node_checks.node_environment_problem("probe") == "the probe is not installed"


def test_a_container_backend_whose_program_is_missing_says_so(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "registry_probe_container.py").write_text(textwrap.dedent("""
        from batchrun.environments.singularity import SingularityEnvironment

        class MissingEnvironment(SingularityEnvironment):
            kind = "missing"
            program = "no-such-container-program"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(ENVIRONMENT_KINDS, "missing", "registry_probe_container:MissingEnvironment")
    assert node_checks.node_environment_problem("missing") == "`no-such-container-program` was not found on PATH"


def test_the_local_backend_works_on_any_node() -> None:
    assert node_checks.node_environment_problem("local") is None
