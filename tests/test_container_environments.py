"""The docker and singularity/apptainer backends, against stand-in CLIs (tests/fake_docker.py,
tests/fake_singularity.py) put first on PATH: no container engine exists on the test machines."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

from batchrun.environments import create_environment, environment_class
from batchrun.environments import container as container_module
from batchrun.environments.base import EnvironmentSettings, EnvironmentSetupError
from batchrun.environments.container import ContainerEnvironment
from batchrun.environments.image_lock import image_file_stem
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.files import patch, read_file, search_files, write_file
from batchrun.tools.terminal import terminal
from conftest import batch_rows, batch_runner_command, cli_environment, default_sigint, endpoint_args, read_jsonl, \
    run_cli, write_dataset

TESTS = Path(__file__).resolve().parent
IMAGE = "example/tools:1"
CONTAINER_KINDS = ["docker", "singularity"]


@dataclass
class FakeCli:
    """The stand-in for one backend's program: its log of calls and its state."""

    kind: str
    program: str
    log: Path
    state: Path

    def calls(self, *prefix: str) -> list[list[str]]:
        """The argument lists of every call whose arguments start with ``prefix``."""
        if not self.log.exists():
            return []
        entries = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [e["argv"] for e in entries if e["tool"] == self.program and e["argv"][:len(prefix)] == list(prefix)]

    @property
    def creates(self) -> tuple[str, ...]:
        return ("run",) if self.kind == "docker" else ("instance", "start")

    def containers(self) -> list[dict]:
        folder = self.state / "containers"
        return [json.loads((d / "meta.json").read_text()) for d in folder.iterdir()] if folder.is_dir() else []

    def root(self, name: str) -> Path:
        """The host directory standing in for a container's ``/``."""
        return self.state / "containers" / quote(name, safe="") / "root"

    def make_present(self, image: str, settings: EnvironmentSettings) -> None:
        if self.kind == "docker":
            target = self.state / "images" / quote(image, safe="")
        else:
            target = settings.work_root / "images" / f"{image_file_stem(image)}.sif"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(image)


def install_fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> FakeCli:
    """Executables named docker, singularity and apptainer in a bin directory first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for program, script in (("docker", "fake_docker.py"), ("singularity", "fake_singularity.py"),
                            ("apptainer", "fake_singularity.py")):
        wrapper = bin_dir / program
        wrapper.write_text(f'#!/bin/sh\nFAKE_PROGRAM={program} exec "{sys.executable}" "{TESTS / script}" "$@"\n')
        wrapper.chmod(0o755)
    log, state = tmp_path / "calls.jsonl", tmp_path / "state"
    state.mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CONTAINER_LOG", str(log))
    monkeypatch.setenv("FAKE_CONTAINER_STATE", str(state))
    program = "docker" if kind == "docker" else kind
    return FakeCli(kind=kind, program=program, log=log, state=state)


@pytest.fixture(params=CONTAINER_KINDS)
def fake(request, tmp_path, monkeypatch) -> FakeCli:
    return install_fake(tmp_path, monkeypatch, request.param)


@pytest.fixture
def docker(tmp_path, monkeypatch) -> FakeCli:
    return install_fake(tmp_path, monkeypatch, "docker")


@pytest.fixture
def singularity(tmp_path, monkeypatch) -> FakeCli:
    return install_fake(tmp_path, monkeypatch, "singularity")


def make_settings(tmp_path: Path, run_label: str = "test-run", **overrides: object) -> EnvironmentSettings:
    return EnvironmentSettings(work_root=tmp_path / "work", run_label=run_label, command_timeout=20, **overrides)


def environment(fake: FakeCli, settings: EnvironmentSettings, *, prompt_index: int = 0, image: str | None = IMAGE,
                cwd: str | None = None) -> ContainerEnvironment:
    env = create_environment(fake.kind, settings, prompt_index=prompt_index, image=image, cwd=cwd)
    assert isinstance(env, ContainerEnvironment)
    return env


def started(fake: FakeCli, settings: EnvironmentSettings, **kwargs: object) -> ContainerEnvironment:
    """An environment started in its own event loop (each tool call below runs in another)."""
    env = environment(fake, settings, **kwargs)
    asyncio.run(env.start())
    return env


def call(env: ContainerEnvironment, handler, **args: object) -> dict:
    return asyncio.run(handler(args, ToolContext(env=env, settings=env.settings)))


def process_gone(pid: int, seconds: float = 5.0) -> bool:
    """True once ``pid`` has exited (a zombie waiting to be reaped counts as gone)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z":
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.05)
    return False


def running_pids(fake: FakeCli) -> list[int]:
    return [int(p.name) for p in (fake.state / "containers").glob("*/pids/*")]


async def wait_for_running_command(fake: FakeCli) -> int:
    for _ in range(200):
        if pids := running_pids(fake):
            return pids[0]
        await asyncio.sleep(0.05)
    raise AssertionError("the command never started in the container")


# -- images: checked, pulled when missing, once per image ----------------------------------------

def test_docker_checks_the_engine_then_pulls_a_missing_image_before_creating_the_container(docker, tmp_path):
    env = started(docker, make_settings(tmp_path))
    asyncio.run(env.close())
    commands = [argv[0] if argv[0] != "image" else "image inspect" for argv in docker.calls()]
    assert commands[:4] == ["version", "image inspect", "image inspect", "pull"]
    assert commands.index("pull") < commands.index("run")
    assert docker.calls("pull") == [["pull", IMAGE]]


def test_singularity_pulls_a_missing_image_from_docker_into_the_runs_sif_cache(singularity, tmp_path):
    settings = make_settings(tmp_path)
    env = started(singularity, settings)
    asyncio.run(env.close())
    [pull] = singularity.calls("pull")
    assert pull[2] == f"docker://{IMAGE}"
    assert env.sif.is_file() and env.sif.parent == settings.work_root / "images"
    assert [path.name for path in env.sif.parent.iterdir()] == [env.sif.name]     # no partial file left
    [start] = singularity.calls("instance", "start")
    assert start[-2:] == [str(env.sif), env.name]


def test_a_present_image_is_not_pulled(fake, tmp_path):
    settings = make_settings(tmp_path)
    fake.make_present(IMAGE, settings)
    env = started(fake, settings)
    asyncio.run(env.close())
    assert fake.calls("pull") == []
    assert len(fake.calls(*fake.creates)) == 1


def test_many_prompts_starting_together_pull_their_image_once(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PULL_SECONDS", "0.3")
    settings = make_settings(tmp_path)

    async def scenario():
        envs = [environment(fake, settings, prompt_index=i) for i in range(6)]
        await asyncio.gather(*(env.start() for env in envs))
        await asyncio.gather(*(env.close() for env in envs))
    asyncio.run(scenario())
    assert len(fake.calls("pull")) == 1
    assert len(fake.calls(*fake.creates)) == 6


def test_docker_engine_is_asked_once_per_process_even_by_prompts_starting_together(docker, tmp_path):
    settings = make_settings(tmp_path)
    docker.make_present(IMAGE, settings)

    async def scenario():
        for wave in range(2):
            envs = [environment(docker, settings, prompt_index=4 * wave + i) for i in range(4)]
            await asyncio.gather(*(env.start() for env in envs))
            await asyncio.gather(*(env.close() for env in envs))
    asyncio.run(scenario())
    assert len(docker.calls("version")) == 1
    assert len(docker.calls("image", "inspect")) == 1


def _start_three_and_close(kind: str, settings: EnvironmentSettings, first_index: int) -> None:
    async def scenario():
        envs = [create_environment(kind, settings, prompt_index=first_index + i, image=IMAGE) for i in range(3)]
        await asyncio.gather(*(env.start() for env in envs))
        await asyncio.gather(*(env.close() for env in envs))
    asyncio.run(scenario())


def test_worker_processes_starting_together_pull_their_image_once(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PULL_SECONDS", "0.3")
    settings = make_settings(tmp_path)
    fork = multiprocessing.get_context("fork")     # how the runner starts its workers
    workers = [fork.Process(target=_start_three_and_close, args=(fake.kind, settings, 3 * n)) for n in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert [worker.exitcode for worker in workers] == [0, 0]
    assert len(fake.calls("pull")) == 1
    assert len(fake.calls(*fake.creates)) == 6


def test_a_failed_pull_fails_the_start_naming_the_image_and_creates_nothing(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PULL_FAIL", "ghost/image:9")
    env = environment(fake, make_settings(tmp_path), image="ghost/image:9")
    with pytest.raises(EnvironmentSetupError, match="ghost/image:9") as failure:
        asyncio.run(env.start())
    assert "denied" in str(failure.value)            # the engine's own explanation is passed on
    assert fake.calls(*fake.creates) == [] and fake.containers() == []


def test_a_prompt_without_an_image_uses_the_default_image(fake, tmp_path):
    env = started(fake, make_settings(tmp_path, default_image="default/img:2"), image=None)
    asyncio.run(env.close())
    assert env.image == "default/img:2"
    assert fake.calls("pull")[0][-1].endswith("default/img:2")


def test_docker_engine_down_fails_the_start_with_the_daemons_message(docker, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_DOCKER_ENGINE", "down")
    env = environment(docker, make_settings(tmp_path))
    with pytest.raises(EnvironmentSetupError) as failure:
        asyncio.run(env.start())
    message = str(failure.value)
    assert message.startswith("Docker engine is not reachable: Cannot connect to the Docker daemon")
    assert "start the daemon or choose another TERMINAL_ENV" in message
    assert [argv[0] for argv in docker.calls()] == ["version"]


@pytest.mark.parametrize(("kind", "hint"), [("docker", "install Docker"), ("singularity", "install SingularityCE"),
                                            ("apptainer", "install Apptainer")])
def test_a_missing_program_fails_the_start_with_an_install_hint(tmp_path, monkeypatch, kind, hint):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    env = create_environment(kind, make_settings(tmp_path), prompt_index=0, image=IMAGE)
    with pytest.raises(EnvironmentSetupError, match=hint):
        asyncio.run(env.start())
    asyncio.run(env.close())        # nothing to remove, and no error for it


def test_apptainer_kind_drives_the_apptainer_program(tmp_path, monkeypatch):
    fake = install_fake(tmp_path, monkeypatch, "apptainer")
    env = started(fake, make_settings(tmp_path))
    result = asyncio.run(env.run("echo hello"))
    asyncio.run(env.close())
    assert result.output == "hello\n"
    assert fake.calls("instance", "start") and fake.calls("instance", "stop")


# -- the container: labelled, isolated, removed ---------------------------------------------------

def test_docker_container_carries_the_run_and_prompt_labels_and_no_network(docker, tmp_path):
    env = started(docker, make_settings(tmp_path, run_label="labelled"), prompt_index=3)
    [container] = docker.containers()
    asyncio.run(env.close())
    assert container["labels"] == {"batch_runner.run": "labelled", "batch_runner.prompt": "3"}
    assert container["network"] == "none"
    assert container["command"] == ["sleep", "infinity"]


def test_singularity_instance_is_contained_without_network_with_the_prompt_dir_at_workspace(singularity, tmp_path):
    env = started(singularity, make_settings(tmp_path))
    [instance] = singularity.containers()
    asyncio.run(env.close())
    assert {"--containall", "--cleanenv", "--no-home", "--net"} <= set(instance["options"])
    assert instance["network"] == "none"
    assert instance["binds"] == [[str(env.prompt_dir), "/workspace"]]


def test_allow_network_leaves_the_network_alone(fake, tmp_path):
    env = started(fake, make_settings(tmp_path, allow_network=True))
    [created] = fake.calls(*fake.creates)
    asyncio.run(env.close())
    assert "--network" not in created


def test_close_removes_the_container_once(fake, tmp_path):
    env = started(fake, make_settings(tmp_path))
    assert len(fake.containers()) == 1

    async def close_twice():
        await env.close()
        await env.close()
    asyncio.run(close_twice())
    assert fake.containers() == []
    removals = fake.calls("rm") if fake.kind == "docker" else fake.calls("instance", "stop")
    assert len(removals) == 1


def test_singularity_close_removes_the_prompt_directory(singularity, tmp_path):
    env = started(singularity, make_settings(tmp_path))
    asyncio.run(env.run("echo data > kept.txt"))
    assert (env.prompt_dir / "kept.txt").exists()
    asyncio.run(env.close())
    assert not env.prompt_dir.exists()


def test_cancelling_a_running_command_kills_it_and_close_removes_the_container(fake, tmp_path):
    env = started(fake, make_settings(tmp_path))

    async def scenario() -> int:
        task = asyncio.create_task(env.run("sleep 60"))
        pid = await wait_for_running_command(fake)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await env.close()
        return pid
    pid = asyncio.run(scenario())
    assert fake.containers() == []
    assert process_gone(pid)


def test_cancelling_a_start_during_the_pull_leaves_nothing_and_frees_the_image(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PULL_SECONDS", "1")
    settings = make_settings(tmp_path)

    async def scenario():
        first = environment(fake, settings, prompt_index=0)
        task = asyncio.create_task(first.start())
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await first.close()
        assert fake.calls(*fake.creates) == []
        second = environment(fake, settings, prompt_index=1)
        await asyncio.wait_for(second.start(), 30)      # the image's lock was not left taken
        await second.close()
    asyncio.run(scenario())
    assert fake.containers() == []


def test_a_start_failing_after_the_container_exists_removes_it(fake, tmp_path, monkeypatch):
    """The working directory cannot be made (a file stands in the way): the container must go."""
    settings = make_settings(tmp_path)
    env = environment(fake, settings, cwd="/blocked/sub")
    original_create = type(env)._create

    async def create_then_block(self) -> None:
        await original_create(self)
        blocked = fake.root(self.name) / "blocked"
        shutil.rmtree(blocked, ignore_errors=True)      # docker run -w made it already
        blocked.parent.mkdir(parents=True, exist_ok=True)
        blocked.write_text("a file, not a directory")
    monkeypatch.setattr(type(env), "_create", create_then_block)
    with pytest.raises(EnvironmentSetupError, match="/blocked/sub"):
        asyncio.run(env.start())
    assert fake.containers() == []


def test_remove_leftovers_removes_the_containers_of_a_crashed_run_only(fake, tmp_path):
    crashed = make_settings(tmp_path, run_label="crashed")
    other = EnvironmentSettings(work_root=tmp_path / "other-work", run_label="crashed-2")
    for index in range(2):
        started(fake, crashed, prompt_index=index)      # never closed: the run "crashed"
    survivor = started(fake, other)
    environment_class(fake.kind).remove_leftovers(crashed)
    assert [container["name"] for container in fake.containers()] == [survivor.name]
    assert not crashed.work_root.exists()
    asyncio.run(survivor.close())


def test_remove_leftovers_without_an_engine_does_nothing_and_raises_nothing(docker, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_DOCKER_ENGINE", "down")
    environment_class("docker").remove_leftovers(make_settings(tmp_path))
    assert docker.calls("rm") == []


# -- where commands run ------------------------------------------------------------------------------

def exec_workdir(fake: FakeCli, argv: list[str]) -> str:
    return argv[argv.index("-w" if fake.kind == "docker" else "--pwd") + 1]


def test_commands_start_in_workspace_without_a_cwd(fake, tmp_path):
    env = started(fake, make_settings(tmp_path))
    result = asyncio.run(env.run("pwd"))
    asyncio.run(env.close())
    [*_, command] = fake.calls("exec")
    assert exec_workdir(fake, command) == "/workspace"
    assert result.exit_code == 0


@pytest.mark.parametrize(("cwd", "workdir"), [("/app/src", "/app/src"), ("proj", "/workspace/proj")])
def test_rows_cwd_is_created_and_commands_start_there(fake, tmp_path, cwd, workdir):
    env = started(fake, make_settings(tmp_path), cwd=cwd)
    result = asyncio.run(env.run("pwd"))
    asyncio.run(env.close())
    assert result.output.strip().endswith(workdir.rsplit("/", 1)[1])      # the stand-in's host path
    [*_, command] = fake.calls("exec")
    assert exec_workdir(fake, command) == workdir
    if fake.kind == "docker":
        [create] = fake.calls("run")
        assert create[create.index("-w") + 1] == workdir


def test_rows_cwd_climbing_above_the_root_fails_the_start_before_any_call(fake, tmp_path):
    env = environment(fake, make_settings(tmp_path), cwd="../../..")
    with pytest.raises(EnvironmentSetupError, match="cwd"):
        asyncio.run(env.start())
    assert fake.calls() == []


# -- the terminal tool -----------------------------------------------------------------------------

def test_terminal_tool_runs_the_command_in_the_container_with_sh(fake, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = started(fake, make_settings(tmp_path))
    result = call(env, terminal, command="echo made > here.txt; cat here.txt; echo oops >&2; exit 3")
    asyncio.run(env.close())
    assert result == {"output": "made\noops\n", "exit_code": 3, "error": None}
    assert not (tmp_path / "here.txt").exists()
    [*_, command] = fake.calls("exec")
    assert command[-5:-1] == ["KILL", "20", "sh", "-c"]


def test_terminal_time_out_is_enforced_inside_the_container(fake, tmp_path):
    env = started(fake, make_settings(tmp_path))
    began = time.monotonic()
    result = call(env, terminal, command="echo begun; sleep 30", timeout=1)
    asyncio.run(env.close())
    assert time.monotonic() - began < 10
    assert result["exit_code"] is None and "timed out after 1s" in result["error"]
    assert result["output"] == "begun\n"


def test_a_hung_container_cli_is_killed_on_our_side(docker, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_EXEC_IGNORES_TIMEOUT", "1")
    monkeypatch.setattr(container_module, "_CLI_GRACE_SECONDS", 0.5)
    env = started(docker, make_settings(tmp_path))
    began = time.monotonic()
    result = asyncio.run(env.run("sleep 30", timeout=1))
    asyncio.run(env.close())
    assert result.timed_out and result.exit_code is None
    assert time.monotonic() - began < 10


def test_terminal_output_over_the_cap_is_cut_with_a_note(fake, tmp_path):
    env = started(fake, make_settings(tmp_path, max_output_chars=10))
    result = asyncio.run(env.run("printf '%050d' 0"))
    asyncio.run(env.close())
    assert result.truncated
    assert result.output == "0" * 10 + "\n[output truncated: 40 more characters not shown]"


def test_singularity_commands_do_not_see_the_users_secrets(singularity, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-secret-openai-123")
    env = started(singularity, make_settings(tmp_path))
    result = asyncio.run(env.run("env"))
    asyncio.run(env.close())
    assert "PATH=" in result.output and "sk-secret-openai-123" not in result.output


# -- the file tools ----------------------------------------------------------------------------------

def test_file_tools_work_through_the_container(fake, tmp_path):
    env = started(fake, make_settings(tmp_path))
    try:
        assert call(env, write_file, path="src/app.py", content="x = 1\ny = 2\n") == \
            {"path": "src/app.py", "bytes_written": 12}
        assert call(env, read_file, path="src/app.py")["content"] == "x = 1\ny = 2\n"
        assert call(env, patch, path="src/app.py", old_string="y = 2", new_string="y = 3")["replacements"] == 1
        assert call(env, terminal, command="cat src/app.py")["output"] == "x = 1\ny = 3\n"
        found = call(env, search_files, pattern="y = [0-9]")
        assert found["matches"] == [{"path": "src/app.py", "line": 2, "text": "y = 3"}]
        assert call(env, search_files, pattern="*.py", target="files")["files"] == ["src/app.py"]
    finally:
        asyncio.run(env.close())


def test_file_tools_reach_absolute_paths_inside_the_container_only(fake, tmp_path):
    env = started(fake, make_settings(tmp_path))
    try:
        assert call(env, write_file, path="/opt/notes.txt", content="hi")["path"] == "/opt/notes.txt"
        assert call(env, read_file, path="../opt/notes.txt")["content"] == "hi"
        with pytest.raises(ToolError, match="climbs above"):
            call(env, read_file, path="../../../etc/passwd")
    finally:
        asyncio.run(env.close())


def test_read_file_tells_missing_files_and_directories_apart(fake, tmp_path):
    env = started(fake, make_settings(tmp_path))
    try:
        with pytest.raises(ToolError, match="does not exist"):
            call(env, read_file, path="nothing.txt")
        asyncio.run(env.run("mkdir folder"))
        with pytest.raises(ToolError, match="is a directory"):
            call(env, read_file, path="folder")
        with pytest.raises(ToolError, match="is a directory"):
            call(env, write_file, path="folder", content="x")
    finally:
        asyncio.run(env.close())


def test_file_size_limits_hold_in_the_container(fake, tmp_path):
    env = started(fake, make_settings(tmp_path, max_file_bytes=10))
    try:
        with pytest.raises(ToolError, match="limit of 10 bytes"):
            call(env, write_file, path="big.txt", content="x" * 11)
        asyncio.run(env.run("printf '%020d' 0 > big.txt"))
        with pytest.raises(ToolError, match="larger than the file tools' limit of 10 bytes"):
            call(env, read_file, path="big.txt")
    finally:
        asyncio.run(env.close())


# -- through the real CLI ----------------------------------------------------------------------------

def test_cli_fails_a_prompt_whose_image_cannot_be_pulled_without_a_model_call_and_runs_the_other_inside(
        tmp_path, endpoint, monkeypatch):
    fake = install_fake(tmp_path, monkeypatch, "docker")
    monkeypatch.setenv("FAKE_PULL_FAIL", "ghost/image:9")
    dataset = write_dataset(tmp_path / "dataset.jsonl", [
        {"prompt": '[[call terminal {"command": "echo inside > proof.txt; cat proof.txt; pwd"}]] works',
         "image": IMAGE, "cwd": "/srv/app"},
        {"prompt": "never sent", "image": "ghost/image:9"},
    ])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=5", "--run_name=dockerrun",
                     "--distribution=terminal_only", *endpoint_args(endpoint), env={"TERMINAL_ENV": "docker"})
    assert result.returncode == 2, result.stderr      # the failed pull: --resume retries it
    rows = {row["prompt_index"]: row for row in batch_rows(tmp_path / "data" / "dockerrun")}
    assert rows[1]["failed"] and rows[1]["error_type"] == "environment"
    assert "ghost/image:9" in rows[1]["error"] and "pull access denied" in rows[1]["error"]
    assert endpoint.chat_requests_for("never sent") == []
    [completed] = read_jsonl(tmp_path / "data" / "dockerrun" / "trajectories.jsonl")
    tool_turn = completed["conversations"][3]["value"]
    assert "inside" in tool_turn and "/srv/app" in tool_turn
    [run] = fake.calls("run")
    assert any(argument.startswith("batch_runner.run=dockerrun-") for argument in run)   # the run identity
    assert fake.containers() == []                          # removed after the prompt
    assert not list(tmp_path.glob("proof.txt"))


def test_cli_interrupted_mid_command_removes_the_container(tmp_path, endpoint, monkeypatch):
    fake = install_fake(tmp_path, monkeypatch, "docker")
    fake.make_present(IMAGE, make_settings(tmp_path))
    dataset = write_dataset(tmp_path / "dataset.jsonl", [
        {"prompt": '[[call terminal {"command": "sleep 60"}]] long', "image": IMAGE}])
    process = subprocess.Popen(
        batch_runner_command(f"--dataset_file={dataset}", "--batch_size=5", "--run_name=stopped",
                             "--distribution=terminal_only", *endpoint_args(endpoint)),
        cwd=tmp_path, env=cli_environment(tmp_path, {"TERMINAL_ENV": "docker"}), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 60
        while not running_pids(fake):
            assert time.monotonic() < deadline and process.poll() is None, process.communicate()
            time.sleep(0.1)
        pid = running_pids(fake)[0]
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert fake.containers() == []
    assert process_gone(pid)
