"""The container backends as the tests drive them: real engines where they run, stand-ins where none can.

- ``docker`` and ``podman``: the real engines that ``.ci/container_engine.sh start`` sets up (CI does;
  elsewhere run ``eval "$(.ci/container_engine.sh start)"`` first), with the locally built image
  ``$BATCH_RUNNER_TEST_IMAGE``. ``$BATCH_RUNNER_TEST_ENGINES`` names the engines set up: tests that need
  another are skipped, saying how to set it up; tests of a named engine that does not answer fail.
- ``singularity``: no package exists for the test machines, so the stand-in CLI (fake_singularity.py).
- ``modal``: no Modal service is reachable, so the SDK is replaced at its boundary (fake_modal/modal.py):
  sandboxes are stand-in containers whose commands run as local processes.

Each backend answers the same questions (which of a run's containers exist, which image cannot be
pulled), so one test covers all four: test_container_environments.py, and with the other backends
test_environment_contract.py.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from batchrun.environments import create_environment
from batchrun.environments.base import EnvironmentSettings
from batchrun.environments.container import ContainerEnvironment, run_prefix
from batchrun.environments.docker import CLI_VARIABLE

TESTS = Path(__file__).resolve().parent
FAKE_MODAL = TESTS / "fake_modal"
STAND_IN_IMAGE = "example/tools:1"
ENGINE_IMAGE = os.environ.get("BATCH_RUNNER_TEST_IMAGE", "local/minbase:1")
# A registry that refuses at once: a pull fails the same way with or without the internet.
UNPULLABLE_IMAGE = "127.0.0.1:9/batch-runner/missing:1"
LISTING_ATTEMPTS = 10
ENGINE_SETUP = 'eval "$(.ci/container_engine.sh start)"'
BACKENDS = ["docker", "podman", "singularity", "modal"]
ENGINES = ["docker", "podman"]


def engine_set_up(cli: str) -> bool:
    return cli in os.environ.get("BATCH_RUNNER_TEST_ENGINES", "").split()


@functools.cache
def engine_problem(cli: str) -> str | None:
    """None when the engine behind ``cli`` answers and holds the test image, else why not."""
    if shutil.which(cli) is None:
        return f"`{cli}` is not on PATH"
    found = subprocess.run([cli, "image", "inspect", ENGINE_IMAGE], capture_output=True, text=True, timeout=60)
    if found.returncode != 0:
        return f"the {cli} engine does not answer or lacks {ENGINE_IMAGE}: {found.stderr.strip()[-300:]}"
    return None


@dataclass
class Backend:
    """One backend as a test drives it: TERMINAL_ENV, the variables the runner needs, an image."""

    name: str
    kind: str
    image: str
    variables: dict[str, str] = field(default_factory=dict)

    def live(self, run_label: str) -> list[str]:
        """The names of the run's containers (sandboxes, instances) that still exist."""
        raise NotImplementedError

    def fail_pulls_of(self, image: str, monkeypatch: pytest.MonkeyPatch) -> str:
        """An image whose pull fails here, with what the runtime's explanation contains."""
        raise NotImplementedError


@dataclass
class EngineBackend(Backend):
    """A real Docker or Podman engine, driven through TERMINAL_CONTAINER_CLI."""

    def live(self, run_label: str) -> list[str]:
        """Asked again when the listing fails: Podman's fails (exit 125, "does not exist in database") when a
        container goes while it lists, which is what a test watching a run's clean-up sees (podman#11810)."""
        external = ["--external"] if self.name == "podman" else []
        argv = [self.name, "ps", "-a", *external, "--filter", f"name=^{run_prefix(run_label)}",
                "--format", "{{.Names}}"]
        for _ in range(LISTING_ATTEMPTS):
            listed = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            if listed.returncode == 0:
                return listed.stdout.split()
            time.sleep(0.2)
        raise AssertionError(f"{' '.join(argv)} failed {LISTING_ATTEMPTS} times: {listed.stderr.strip()}")

    def fail_pulls_of(self, image: str, monkeypatch: pytest.MonkeyPatch) -> str:
        assert image == UNPULLABLE_IMAGE, "a real engine fails to pull only images that cannot exist"
        return "127.0.0.1:9"

    def run(self, *args: str) -> str:
        """The engine's CLI, for what a test checks behind the backend's back."""
        return subprocess.run([self.name, *args], capture_output=True, text=True, timeout=60, check=True).stdout

    def storage(self) -> Path:
        """Where the engine keeps its images and containers' layers."""
        template = "{{.Store.GraphRoot}}" if self.name == "podman" else "{{.DockerRootDir}}"
        return Path(self.run("info", "--format", template).strip())

    def require_overlay(self) -> None:
        """Skip, saying why, where the engine keeps layers otherwise than as overlay directories (the CI
        setup falls back to vfs where overlay cannot be mounted): only those can be watched."""
        template = "{{.Store.GraphDriverName}}" if self.name == "podman" else "{{.Driver}}"
        driver = self.run("info", "--format", template).strip()
        if not driver.startswith("overlay"):
            pytest.skip(f"{self.name} stores layers with {driver}, not overlay: no writable layer to watch")


@dataclass
class StandInBackend(Backend):
    """A stand-in whose containers are directories (fake_container.py) under ``state``."""

    state: Path = Path()
    log: Path = Path()

    def containers(self) -> list[dict]:
        folder = self.state / "containers"
        return [json.loads((d / "meta.json").read_text()) for d in folder.iterdir()] if folder.is_dir() else []

    def live(self, run_label: str) -> list[str]:
        if self.kind == "modal":
            return [c["name"] for c in self.containers() if c["tags"].get("batch_runner.run") == run_label]
        return [c["name"] for c in self.containers() if c["name"].startswith(run_prefix(run_label))]

    def fail_pulls_of(self, image: str, monkeypatch: pytest.MonkeyPatch) -> str:
        monkeypatch.setenv("FAKE_PULL_FAIL", image)
        return "denied"

    def calls(self, tool: str, *prefix: str) -> list[list]:
        """The argument lists of the stand-in's calls (of ``tool``) that start with ``prefix``."""
        if not self.log.exists():
            return []
        entries = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [e["argv"] for e in entries if e["tool"] == tool and e["argv"][:len(prefix)] == list(prefix)]


def install_stand_in_clis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> StandInBackend:
    """Executables named docker, singularity and apptainer first on PATH, their state under tmp_path;
    the backend of TERMINAL_ENV=kind drives them."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for program, script in (("docker", "fake_docker.py"), ("singularity", "fake_singularity.py"),
                            ("apptainer", "fake_singularity.py")):
        wrapper = bin_dir / program
        wrapper.write_text(f'#!/bin/sh\nFAKE_PROGRAM={program} exec "{sys.executable}" "{TESTS / script}" "$@"\n')
        wrapper.chmod(0o755)
    backend = stand_in_state(tmp_path, monkeypatch, kind)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(CLI_VARIABLE, raising=False)
    return backend


def stand_in_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> StandInBackend:
    log, state = tmp_path / "calls.jsonl", tmp_path / "state"
    state.mkdir(exist_ok=True)
    monkeypatch.setenv("FAKE_CONTAINER_LOG", str(log))
    monkeypatch.setenv("FAKE_CONTAINER_STATE", str(state))
    # The SIF cache is the user's: a test's own, so no test finds another's images.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return StandInBackend(name=kind, kind=kind, image=STAND_IN_IMAGE, state=state, log=log)


def use_fake_modal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StandInBackend:
    """``import modal`` finds the stand-in, here and in the runner's processes, with credentials set."""
    from batchrun.environments import modal as modal_backend

    backend = stand_in_state(tmp_path, monkeypatch, "modal")
    monkeypatch.syspath_prepend(str(FAKE_MODAL))
    # Recorded first, so that afterwards sys.modules holds what it held before (the real modal, or none).
    monkeypatch.setitem(sys.modules, "modal", None)
    monkeypatch.delitem(sys.modules, "modal")       # imported afresh, from FAKE_MODAL
    monkeypatch.setattr(modal_backend, "_apps", {})
    variables = {"MODAL_TOKEN_ID": "ak-test", "MODAL_TOKEN_SECRET": "as-test",
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(FAKE_MODAL), os.environ.get("PYTHONPATH")]))}
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    backend.variables = variables
    return backend


def make_backend(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Backend:
    """The backend ``name`` ready to use in this test (skipped where it cannot run)."""
    if name in ENGINES:
        if not engine_set_up(name):
            pytest.skip(f"no {name} engine set up for the tests (run `{ENGINE_SETUP}` first; CI does)")
        problem = engine_problem(name)
        if problem is not None:
            pytest.fail(f"{problem} (BATCH_RUNNER_TEST_ENGINES names it)")
        monkeypatch.setenv(CLI_VARIABLE, name)
        return EngineBackend(name=name, kind="docker", image=ENGINE_IMAGE, variables={CLI_VARIABLE: name})
    if name == "modal":
        return use_fake_modal(tmp_path, monkeypatch)
    return install_stand_in_clis(tmp_path, monkeypatch, name)


def make_settings(tmp_path: Path, run_label: str | None = None, **overrides: object) -> EnvironmentSettings:
    """Settings whose run label is the test's own: a test sees only its own containers."""
    return EnvironmentSettings(work_root=tmp_path / "work", run_label=run_label or f"test-{tmp_path.name}",
                               command_timeout=20, **overrides)


def environment(backend: Backend, settings: EnvironmentSettings, *, prompt_index: int = 0,
                image: str | None = "", cwd: str | None = None) -> ContainerEnvironment:
    """A new environment of the backend; ``image`` defaults to the backend's own."""
    env = create_environment(backend.kind, settings, prompt_index=prompt_index,
                             image=backend.image if image == "" else image, cwd=cwd)
    assert isinstance(env, ContainerEnvironment)
    return env
