"""Shared fixtures: a scripted OpenAI-compatible server on 127.0.0.1 and the real CLI as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import queue
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Generator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from scripted_endpoint import ScriptedEndpoint, prompt_text

from batchrun.environments.base import run_identity
from batchrun.environments.limits import remove_kept_groups
from batchrun.run_dir import SPENT

REPO = Path(__file__).resolve().parent.parent
SECRET_VARIABLES = ("OPENROUTER_API_KEY", "OPENAI_API_KEY")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``bubblewrap`` start sandboxes with the bwrap the product picks (the system's, else
    the bundled one); where none can sandbox, they skip saying why."""
    marked = [item for item in items if item.get_closest_marker("bubblewrap")]
    if not marked:
        return
    from batchrun.environments.bubblewrap import bubblewrap_problem
    if (problem := bubblewrap_problem()) is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=f"no bubblewrap sandbox here: {problem}"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Garbage is collected before pytest writes up a failure. A failed test can leave objects whose
    finalizers raise (an asyncio subprocess transport of a loop already closed); collected while pytest
    parses the test's source for the report, they break CPython 3.11's count of the AST constructor's
    depth, and pytest ends with "SystemError: AST constructor recursion depth mismatch", naming no test."""
    if call.excinfo is not None:
        gc.collect()
    return (yield)


# Where the product makes its control groups: one directory per run below these (cgroup v2, or the
# memory and pids hierarchies of v1).
CONTROL_GROUP_ROOTS = tuple(Path("/sys/fs/cgroup", *hierarchy, "batch_runner")
                            for hierarchy in ((), ("memory",), ("pids",)))
# The run labels tests give environments they make directly (a real run's label is its run_identity).
SUITE_RUN_LABELS = re.compile(r"(test|race|session|crashed|other|first|second|limits)(-.*)?")


def run_control_groups() -> set[Path]:
    """The runs' directories of control groups on this machine now."""
    return {path for root in CONTROL_GROUP_ROOTS if root.is_dir() for path in root.iterdir() if path.is_dir()}


def suites_run_labels(basetemp: Path) -> set[str]:
    """The labels of the runs the suite's CLI runs made: each under a test's own directory."""
    return {run_identity(run_dir) for pattern in ("*/data/*", "*/*/data/*") for run_dir in basetemp.glob(pattern)}


@pytest.fixture(autouse=True, scope="session")
def _remove_the_suites_control_groups(tmp_path_factory: pytest.TempPathFactory):
    """The control groups the suite's own prompts kept for further prompts go when the suite ends, as
    they go when a worker process ends; so do the empty directories of the suite's runs, which a real
    run's end removes but an environment a test made directly, or a run a test killed and never
    resumed, leaves behind: they would pile up on the machine with every run of the suite. Only a
    directory of one of the suite's runs, new since the suite began and empty, is removed; another
    run's, a real one's included, is never touched."""
    before = run_control_groups()
    yield
    remove_kept_groups()
    labels = suites_run_labels(tmp_path_factory.getbasetemp())
    for run in run_control_groups() - before:
        if run.name in labels or SUITE_RUN_LABELS.fullmatch(run.name):
            with contextlib.suppress(OSError):
                run.rmdir()


@pytest.fixture
def endpoint():
    with ScriptedEndpoint() as server:
        yield server


# The scripted endpoint reports each reply's cost, which every figure takes as it is; --max_cost still
# needs a price to start (most endpoints report none), here one that never applies.
REPORTED_COST = ("--price_per_mtok=0,0",)


def cli_environment(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SECRET_VARIABLES}
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def default_stop_signals() -> None:
    """preexec_fn for a CLI that a test stops with a signal: a test run started with ``nohup`` or ``&``
    passes SIGHUP or SIGINT on ignored, and the CLI leaves a stop signal it was started with ignored."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def batch_runner_command(*args: str) -> list[str]:
    return [sys.executable, str(REPO / "batch_runner.py"), *args]


# Runs the CLI with one function replaced by a copy that first prints "paused at NAME" and waits until
# the file GO exists: a test can then signal the runner while it is at that point, and only there.
_PAUSED_CLI = """
import importlib, os, sys, time
sys.path.insert(0, sys.argv[1])
import batch_runner
module, name, go = sys.argv[2:5]
owner = importlib.import_module(module)
*path, attribute = name.split(".")
for part in path:
    owner = getattr(owner, part)
original = getattr(owner, attribute)
def paused(*args, **kwargs):
    print("paused at", name, flush=True)
    while not os.path.exists(go):
        time.sleep(0.02)
    return original(*args, **kwargs)
setattr(owner, attribute, paused)
sys.argv = ["batch_runner.py", *sys.argv[5:]]
batch_runner.cli()
"""


def paused_cli_command(module: str, name: str, go: Path, *args: str) -> list[str]:
    """The CLI with ``module``'s ``name`` (``Class.method`` or a function) pausing until ``go`` exists."""
    return [sys.executable, "-c", _PAUSED_CLI, str(REPO), module, name, str(go), *args]


class OutputLines:
    """The lines a process writes to its stdout (stderr joined to it), read as they come, so that a test
    can wait for one before it acts."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        self._process = process
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self._new.put(line)
        self._new.put(None)

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        """Until a line holding ``text`` has come (it may have come already)."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.lines):
            try:
                line = self._new.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"timed out waiting for {text!r}:\n{''.join(self.lines)}") from None
            assert line is not None, f"the process ended without saying {text!r}:\n{self.text()}"
            self.lines.append(line)

    def text(self) -> str:
        """Everything written, once the process has ended."""
        self._reader.join(60)
        while not self._new.empty():
            if (line := self._new.get()) is not None:
                self.lines.append(line)
        return "".join(self.lines)


def run_cli(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
            timeout: float = 120, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run the real CLI in tmp_path (so data/<run_name>/ lands there) and wait for it."""
    return subprocess.run([*prefix, *batch_runner_command(*args)], cwd=tmp_path, env=cli_environment(tmp_path, env),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def obeying_file_modes() -> tuple[str, ...]:
    """A command prefix under which file modes hold, as for any user: root reads and searches everything
    only through capabilities, which this takes away. Skips the test where it cannot."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv reads every file")
    return ("setpriv", "--bounding-set", "-dac_override,-dac_read_search")


def made_a_fifo_once_checked(monkeypatch: pytest.MonkeyPatch, target: Path, check: str) -> None:
    """``Path.<check>`` (exists, is_file) answers for ``target`` as the file it is, then a FIFO takes its place:
    what another program may do between a look at a file and its opening."""
    checked = getattr(Path, check)

    def checked_then_replaced(path: Path) -> bool:
        answer = checked(path)
        if path == target and answer and not stat.S_ISFIFO(os.lstat(path).st_mode):
            path.unlink()
            os.mkfifo(path)
        return answer

    monkeypatch.setattr(Path, check, checked_then_replaced)


def endpoint_args(server: ScriptedEndpoint, **extra: object) -> list[str]:
    flags = {"base_url": server.base_url, "model": "scripted-model", **extra}
    return [f"--{name}={value}" for name, value in flags.items()]


def write_dataset(path: Path, prompts: list[str | dict]) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        for item in prompts:
            handle.write(json.dumps(item if isinstance(item, dict) else {"prompt": item}) + "\n")
    return path


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def batch_rows(run_dir: Path) -> list[dict]:
    rows = []
    for path in sorted(run_dir.glob("batch_*.jsonl")):
        rows.extend(read_jsonl(path))
    return rows


def human_prompt(row: dict) -> str:
    return next(turn["value"] for turn in row["conversations"] if turn["from"] == "human")


def last_user_message(request: dict) -> str:
    """The dataset prompt of a chat request: its last user message."""
    return [m for m in request["messages"] if m["role"] == "user"][-1]["content"]


def record_arrivals(endpoint) -> list[tuple[float, str]]:
    """(arrival time, prompt) of every chat request the endpoint receives from now on."""
    arrivals: list[tuple[float, str]] = []
    lock = threading.Lock()

    def script(body: dict) -> None:
        with lock:
            arrivals.append((time.monotonic(), last_user_message(body)))
        return None   # fall through to the prompt's own directives

    endpoint.script = script
    return arrivals


# A prompt whose first call gets a 429 with Retry-After 1.5 s, and three that each call twice, a 1 s
# command apart, their first replies held until the 429 goes out: for the pause to be shared, none of
# their second calls may come before it ends (without it they would come about 1 s after the 429).
RATE_LIMITED_PROMPT = "[[fail 429 1 retry_after=1.5]] limited"
PROMPTS_BESIDE_IT = [f'[[call terminal {{"command": "sleep 1"}}]] other {i}' for i in range(3)]


def arrivals_around_a_429(endpoint) -> list[tuple[float, str]]:
    """(arrival time, prompt) of every chat request from now on; the first replies to the prompts
    beside RATE_LIMITED_PROMPT wait until its request has come (however slowly its sandbox started)."""
    arrivals: list[tuple[float, str]] = []
    lock = threading.Lock()
    limited_came = threading.Event()

    def script(body: dict) -> None:
        prompt = last_user_message(body)
        with lock:
            first = all(seen != prompt for _, seen in arrivals)
            arrivals.append((time.monotonic(), prompt))
        if prompt == RATE_LIMITED_PROMPT:
            limited_came.set()
        elif first:
            limited_came.wait(60)
        return None   # then the prompt's own directives answer

    endpoint.script = script
    return arrivals


def assert_the_429_paused_every_other_session(arrivals: list[tuple[float, str]]) -> None:
    rejected_at = next(t for t, prompt in arrivals if prompt == RATE_LIMITED_PROMPT)
    second_calls = [t for t, prompt in arrivals if prompt != RATE_LIMITED_PROMPT][3:]
    assert len(second_calls) == 3
    assert all(t >= rejected_at + 1.4 for t in second_calls)


def on_event_loop() -> bool:
    """Whether the caller runs on an event loop (rather than in a thread of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def wait_for(condition, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@contextlib.contextmanager
def mounted_tmpfs(directory: Path, options: str):
    """A tmpfs of its own at ``directory`` (made here) with mount ``options``, unmounted afterwards;
    skips the test where no tmpfs can be mounted (it needs root)."""
    if os.geteuid() != 0:
        pytest.skip("a disk of a chosen size is made by mounting a tmpfs, which needs root")
    directory.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        if subprocess.run(["umount", str(directory)]).returncode != 0:
            subprocess.run(["umount", "--lazy", str(directory)], check=True)
            raise AssertionError(f"{directory} was still in use after the test (a process left running?)")


def process_state(pid: int) -> str:
    """The state letter of a process (R, S, Z, ...); "Z" also for one that is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def live_processes_mentioning(text: str) -> list[int]:
    """Processes (not zombies) whose command line, its arguments joined by spaces, contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command_line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in command_line and process_state(int(entry.name)) != "Z":
                found.append(int(entry.name))
    return found


def finished_row_count(run_dir: Path) -> int:
    return sum(path.read_bytes().count(b"\n") for path in run_dir.glob("batch_*.jsonl"))


def holding_until_rows(run_dir: Path, prompt: str, rows: int) -> Callable[[dict], None]:
    """An endpoint script that holds the reply to ``prompt`` until ``rows`` rows are written in ``run_dir``
    (a minute at most), then lets the prompt's own directives answer: those rows come only from sessions
    that do not wait for it."""
    def hold(body: dict) -> None:
        if last_user_message(body) == prompt:
            deadline = time.monotonic() + 60
            while finished_row_count(run_dir) < rows and time.monotonic() < deadline:
                time.sleep(0.05)
    return hold


@pytest.fixture(params=["as-this-run", "user-namespace"])
def sandbox_home(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where a test's sandboxes live, once for each way they are made: as this run makes them (a root
    run's: no user namespace, the shell dropping to a uid of its own), and as an ordinary user's run
    does (a user namespace of its own). As root, the second is built as an ordinary user's would be but
    maps the sandbox to root outside, so tests of what root's sandboxes may not do take only the first."""
    if request.param == "user-namespace" and os.geteuid() == 0:
        from batchrun.environments.bubblewrap import program, sandbox
        monkeypatch.setattr(program, "RUNNING_AS_ROOT", False)
        monkeypatch.setattr(sandbox, "RUNNING_AS_ROOT", False)
    return tmp_path


class HeldReplies:
    """An endpoint script that holds the reply to a prompt's request number ``request`` (0-based) until
    released, so that a test can kill the runner while that session waits; once ``open_all`` runs, no
    reply waits."""

    def __init__(self, endpoint, holds: dict[str, int]) -> None:
        self.holds = holds
        self.released = {marker: threading.Event() for marker in holds}
        self.arrived = {marker: threading.Event() for marker in holds}
        self.seen: Counter = Counter()
        self.lock = threading.Lock()
        endpoint.script = self

    def __call__(self, body: dict) -> None:
        prompt = prompt_text(body)
        for marker, request in self.holds.items():
            if marker in prompt:
                with self.lock:
                    number = self.seen[marker]
                    self.seen[marker] += 1
                if number == request:
                    self.arrived[marker].set()
                    self.released[marker].wait(60)
        return None     # then the prompt's own directives answer

    def release(self, marker: str) -> None:
        self.released[marker].set()

    def open_all(self) -> None:
        for event in self.released.values():
            event.set()


def usage_of_replies(replies: int) -> dict:
    """What the scripted endpoint reports for ``replies`` replies, in the keys of statistics.json."""
    return {"prompt_tokens": 100 * replies, "completion_tokens": 20 * replies, "reasoning_tokens": 5 * replies,
            "cached_tokens": 10 * replies, "cost": round(0.001 * replies, 8)}


def spent_by_prompt(run_dir: Path, prompt_index: int) -> int:
    """How many replies of the prompt spent.jsonl notes as spent."""
    path = run_dir / SPENT
    lines = path.read_text().splitlines() if path.exists() else []
    return sum(1 for line in lines if (record := json.loads(line)).get("prompt") == prompt_index and "spent" in record)


def peak_python_bytes(step: Callable[[], object]) -> int:
    """The most memory this process's Python held at once while ``step`` ran (tracemalloc). Not growth: that
    is what stays held after the step, and a step that held everything while it ran (an export holding every
    row, a page pushed whole through Playwright's pipe) has let go of it by the time it returns."""
    tracemalloc.start()
    try:
        step()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
