"""--backend=ray: sessions in Ray actors, the parent the only writer, same outputs and resume.

Most tests start the CLI with a private Ray on 127.0.0.1 (no RAY_ADDRESS). Each Ray process the run
starts inherits a tag from the CLI's environment, so the tests find exactly this run's processes:
to check that they use only loopback addresses and that none is left once the runner is gone.
The cluster test starts two Ray nodes of its own on 127.0.0.1 (tests/ray_node.py), tagged the same way,
and ends every process of both when it ends, passed or failed.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import (
    PROMPTS_BESIDE_IT,
    RATE_LIMITED_PROMPT,
    REPO,
    HeldReplies,
    arrivals_around_a_429,
    assert_the_429_paused_every_other_session,
    batch_rows,
    batch_runner_command,
    cli_environment,
    default_stop_signals,
    endpoint_args,
    finished_row_count,
    holding_until_rows,
    human_prompt,
    last_user_message,
    process_state,
    read_jsonl,
    run_cli,
    spent_by_prompt,
    usage_of_replies,
    wait_for,
    write_dataset,
)

from batchrun.install_hint import install_hint
from batchrun.messages import Fatal, Spent

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason=f"Ray is not installed ({install_hint('ray')})")
# Lower case sorts last: Ray's processes write their title over the start of their environment block
# (which Ray's raylet fills in sorted order), and the tag must survive that.
TAG = "zz_batch_runner_test_tag"
TOOL_PROMPT = ('make a file [[call write_file {"path": "notes/a.txt", "content": "hello"}]] '
               '[[call terminal {"command": "cat notes/a.txt && exit 3"}]]')


def args(dataset: Path, endpoint, *extra: str, batch_size: int = 3, distribution: str = "terminal_only") -> list[str]:
    return [f"--dataset_file={dataset}", f"--batch_size={batch_size}", "--run_name=run",
            f"--distribution={distribution}", *endpoint_args(endpoint), *extra]


@pytest.fixture(autouse=True)
def ray_tmpdir(monkeypatch):
    """Ray's session directory (logs, sockets) per test, short enough for its socket paths, removed after."""
    directory = tempfile.mkdtemp(prefix="br-ray-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", directory)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def ray_environment(tag: str, **extra: str) -> dict[str, str]:
    return {TAG: tag, "RAY_ADDRESS": "", **extra}


def tagged_processes(tag: str, known: dict[int, str] | None = None) -> list[int]:
    """The live processes of a run: those carrying its tag, and those of ``known`` (pid -> start time)."""
    marker = f"{TAG}={tag}\0".encode()
    found = [pid for pid, started in (known or {}).items() if _start_time(pid) == started and process_state(pid) != "Z"]
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in found:
            try:
                if marker in Path(f"/proc/{entry}/environ").read_bytes() and process_state(int(entry)) != "Z":
                    found.append(int(entry))
            except OSError:
                pass
    return found


def descendants(root: int) -> dict[int, str]:
    """pid -> start time of every process below ``root`` now."""
    found, frontier = {}, [root]
    while frontier:
        pid = frontier.pop()
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                for child in map(int, (task / "children").read_text().split()):
                    if child not in found and (started := _start_time(child)):
                        found[child] = started
                        frontier.append(child)
        except OSError:
            pass
    return found


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def wait_until_gone(tag: str, known: dict[int, str] | None = None, timeout: float = 15.0) -> None:
    """Every process of the run (the CLI, Ray's processes, the actors) has exited."""
    deadline = time.monotonic() + timeout
    while left := tagged_processes(tag, known):
        if time.monotonic() > deadline:
            pytest.fail("processes left behind: " + "; ".join(f"{pid} {_command(pid)}" for pid in left))
        time.sleep(0.1)


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:100]
    except OSError:
        return "?"


def _address(hex_address: str) -> tuple[str, int]:
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # /proc/net/tcp* prints each 32-bit word of the address in host (little-endian) order.
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(port, 16)


def _is_loopback(host: str) -> bool:
    address = ipaddress.ip_address(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    return address.is_loopback


def sockets_of(pids: list[int]) -> list[dict]:
    """Every TCP/UDP socket the processes hold: local and remote addresses (IPv4 and IPv6)."""
    found = []
    for pid in pids:
        try:
            inodes = {os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] for fd in os.listdir(f"/proc/{pid}/fd")
                      if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:[")}
        except OSError:
            continue
        for table in ("tcp", "tcp6", "udp", "udp6"):
            try:
                lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if fields[9] in inodes:
                    found.append({"pid": pid, "table": table, "state": fields[3],
                                  "local": _address(fields[1]), "remote": _address(fields[2])})
    return found


def non_loopback(sockets: list[dict]) -> list[dict]:
    """Sockets bound to, listening on or connected to anything but loopback (0.0.0.0 and :: included)."""
    bad = []
    for entry in sockets:
        local, remote = entry["local"][0], entry["remote"][0]
        connected = entry["remote"][1] != 0
        if not _is_loopback(local) or (connected and not _is_loopback(remote)):
            bad.append(entry)
    return bad


def normalized(value):
    """A row or statistics without what differs between any two runs (times, durations)."""
    volatile = ("timestamp", "wall_time", "duration", "completed_at", "last_updated", "seconds")
    if isinstance(value, dict):
        return {k: normalized(v) for k, v in value.items() if not any(word in k for word in volatile)}
    if isinstance(value, list):
        return [normalized(v) for v in value]
    return value


def run_directory_summary(run_dir: Path) -> dict:
    rows = {human_prompt(row) if row.get("conversations") else row["prompt_index"]: normalized(row)
            for row in batch_rows(run_dir)}
    checkpoint = json.loads((run_dir / "checkpoint.json").read_text())
    return {
        "files": sorted(path.name for path in run_dir.iterdir() if path.name != ".lock"),
        "batches": {path.name: sorted(row["prompt_index"] for row in read_jsonl(path))
                    for path in run_dir.glob("batch_*.jsonl")},
        "rows": rows,
        "merged": sorted(human_prompt(row) for row in read_jsonl(run_dir / "trajectories.jsonl")),
        "checkpoint": normalized(checkpoint),
        "statistics": normalized(json.loads((run_dir / "statistics.json").read_text())),
    }


# -- without Ray ----------------------------------------------------------------------------------------


def test_backend_ray_without_ray_installed_says_how_to_install_and_exits_1(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["hello"])
    hide_ray = ("import os, runpy, sys; sys.modules['ray'] = None; sys.argv = sys.argv[1:]; "
                "sys.path.insert(0, os.path.dirname(sys.argv[0])); runpy.run_path(sys.argv[0], run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", hide_ray, str(REPO / "batch_runner.py"),
                             *args(dataset, endpoint, "--backend=ray")],
                            cwd=tmp_path, env=cli_environment(tmp_path), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert install_hint("ray") in result.stderr
    assert endpoint.requests == [] and not (tmp_path / "data").exists()


def test_unknown_backend_is_a_usage_error(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["hello"])
    result = run_cli(tmp_path, *args(dataset, endpoint, "--backend=spark"))
    assert result.returncode == 1
    assert "--backend must be one of local, ray" in result.stderr


def test_a_node_missing_a_tool_the_run_offers_is_a_problem(monkeypatch):
    from batchrun import registry
    from batchrun.ray.node_checks import node_tools_problem

    monkeypatch.setattr(registry, "unavailable_tools", lambda: {"web_search": "set SEARXNG_URL",
                                                                   "browser_navigate": "install chromium"})
    everything = frozenset(registry.TOOL_NAMES)
    assert node_tools_problem("terminal_only", everything) is None              # never offered: no problem
    problem = node_tools_problem("terminal_web", everything)
    assert problem is not None and "web_search (set SEARXNG_URL)" in problem and "browser" not in problem
    assert node_tools_problem("terminal_web", everything - {"web_search"}) is None  # unavailable everywhere anyway


@needs_ray
def test_each_ray_node_is_warned_of_against_its_own_process_limit():
    # Each node's kernel counts only its own sandboxes: before, every session was held against the driver's
    # limit, a warning where no node was short and none where one node's user had a lower limit.
    from batchrun.ray.pool import process_limit_warnings

    nodes = [{"node_id": "a", "process_limit": 4096}, {"node_id": "a", "process_limit": 4096},
             {"node_id": "b", "process_limit": 2048}, {"node_id": "c", "process_limit": None}]
    labels = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"}
    [warning] = process_limit_warnings(nodes, [2, 2, 3, 100], labels, 1024)
    assert warning.startswith("on Ray node 10.0.0.2, your process limit (ulimit -u: 2048) is below what 3 sessions")
    assert process_limit_warnings(nodes, [2, 2, 2, 100], labels, 1024) == []


def _failing_ray(error: BaseException):
    import ray

    def get(refs, timeout=None):
        raise error
    return SimpleNamespace(exceptions=ray.exceptions, get=get,
                           get_runtime_context=lambda: SimpleNamespace(get_node_id=lambda: "here"))


@needs_ray
@pytest.mark.parametrize("failure", ["lost", "raised", "slow"])
def test_a_failed_clean_up_of_another_node_at_the_start_is_one_line_not_a_traceback(failure):
    # Before, a node lost between its probe and its clean-up, a clean-up that raised, or one past its time
    # reached the user as a traceback.
    import ray

    from batchrun.ray.pool import RayWorkerPool
    from batchrun.workers import PoolStartError

    error = {"lost": ray.exceptions.ActorDiedError(), "slow": ray.exceptions.GetTimeoutError("took too long"),
             "raised": ray.exceptions.RayTaskError("remove_leftovers", "Traceback ...\nOSError: busy",
                                                   OSError("busy"))}[failure]
    pool = RayWorkerPool.__new__(RayWorkerPool)
    pool.ray, pool._lost, pool._clean_up_failed = _failing_ray(error), set(), False
    pool._actors = [SimpleNamespace(remove_leftovers=SimpleNamespace(remote=lambda: "ref"))]
    pool._nodes = [{"node_id": "there", "address": "10.0.0.2"}]
    with pytest.raises(PoolStartError, match="^removing what an earlier run left on the other Ray nodes "):
        pool._clean_before_work()
    assert pool._clean_up_failed        # the stop does not wait for it once more (a hung one took 180 s again)


SPENT = Spent(unit=1, usage={"prompt_tokens": 7})


def _pool_stopping_with(monkeypatch, hung: set[int], calls: list[tuple[str, float]]):
    """A RayWorkerPool of two actors, each with a session running, on a node other than the runner's, whose
    Ray stand-in answers nothing from the ``hung`` actors (each wait on them runs to its end, on a clock of
    its own) and at once from the others; ``calls`` records each wait (what, how long at most)."""
    import ray

    from batchrun.ray import pool as pool_module
    from batchrun.ray.pool import RayWorkerPool

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(pool_module, "time", SimpleNamespace(monotonic=lambda: clock.now))

    def answers(ref) -> bool:
        return ref[0] != "row" and ref[1] not in hung       # no session ends during the stop

    def wait(refs, num_returns=1, timeout=None):
        ready = [ref for ref in refs if answers(ref)]
        if len(ready) < num_returns and timeout:
            clock.now += timeout
            calls.append((refs[0][0], timeout))
        return ready, [ref for ref in refs if not answers(ref)]

    def get(refs, timeout=None):
        if refs == "keeper-figures":
            return None
        many = isinstance(refs, list)
        for ref in refs if many else [refs]:
            if not answers(ref):
                clock.now += timeout
                calls.append((ref[0], timeout))
                raise ray.exceptions.GetTimeoutError("took too long")
        calls.append(((refs[0] if many else refs)[0], timeout))
        answer = {"drain_spent": [SPENT], "remove_leftovers": None}
        return [answer[ref[0]] for ref in refs] if many else answer[refs[0]]

    def actor(index: int) -> SimpleNamespace:
        return SimpleNamespace(**{name: SimpleNamespace(remote=lambda name=name: (name, index))
                                  for name in ("stop", "drain_spent", "remove_leftovers")})
    pool = RayWorkerPool.__new__(RayWorkerPool)
    pool.ray = SimpleNamespace(exceptions=ray.exceptions, get=get, wait=wait, is_initialized=lambda: True,
                               get_runtime_context=lambda: SimpleNamespace(get_node_id=lambda: "here"),
                               kill=lambda actor, no_restart=True: None, shutdown=lambda: None)
    pool._stopped, pool._head_lost, pool._clean_up_failed, pool._watcher = False, False, False, None
    pool._actors, pool._lost, pool._starting, pool._retries = [actor(0), actor(1)], set(), {}, deque()
    pool._nodes = [{"node_id": "there", "address": "10.0.0.2"}, {"node_id": "yonder", "address": "10.0.0.3"}]
    pool._pending = {("row", 0): (0, "attempt"), ("row", 1): (1, "attempt")}
    pool._draining = {}
    pool._keeper = SimpleNamespace(figures=SimpleNamespace(remote=lambda: "keeper-figures"))
    return pool, clock


@needs_ray
def test_the_stop_of_a_ray_run_waits_for_a_hung_node_no_longer_than_a_worker_processs_stop(monkeypatch):
    # With a node that answers nothing (stopped, cut off), the stop waited 15 s for the actors, 15 s for each
    # actor's spending, twice, and 180 s for the node's clean-up: a SIGTERM took a minute to end the run, past
    # the grace a scheduler gives (30 s under Kubernetes and Slurm), which then killed it before its merge.
    from batchrun.workers import STOP_GRACE_SECONDS

    calls: list[tuple[str, float]] = []
    pool, clock = _pool_stopping_with(monkeypatch, {0, 1}, calls)
    assert pool.stop() == []
    assert clock.now <= STOP_GRACE_SECONDS, calls


@needs_ray
def test_a_hung_node_costs_the_other_nodes_neither_their_spending_nor_their_clean_up(monkeypatch):
    # With one deadline for every wait, the hung node's 15 s left none to ask the others what their stopped
    # sessions spent (uncounted in the run's cost and --max_cost), nor to clean their nodes up.
    from batchrun.workers import STOP_GRACE_SECONDS

    calls: list[tuple[str, float]] = []
    pool, clock = _pool_stopping_with(monkeypatch, {0}, calls)
    assert pool.stop() == [SPENT]
    assert ("remove_leftovers", STOP_GRACE_SECONDS) in calls        # the answering node's, with time to do it
    assert clock.now <= STOP_GRACE_SECONDS, calls


@needs_ray
def test_a_row_lost_with_its_node_sends_the_prompt_again_instead_of_stopping_the_run():
    # A row of over 100 KB waits in the object store of its actor's node; the node gone before the parent
    # fetched it, Ray says ObjectLostError, which stopped the run as a bug of the call.
    import ray

    from batchrun.ray.pool import RayWorkerPool

    for error in (ray.exceptions.ObjectLostError("ab" * 14, None, ""),
                  ray.exceptions.ObjectReconstructionFailedError("ab" * 14)):
        pool = RayWorkerPool.__new__(RayWorkerPool)
        pool.ray = _failing_ray(error)
        pool._pending = {"ref": (0, "attempt")}
        pool._lose = lambda actor, exc, attempt: [("lost", actor, type(exc).__name__, attempt)]
        assert pool._outcome("ref") == [("lost", 0, type(error).__name__, "attempt")]


@needs_ray
def test_a_row_whose_fetch_timed_out_loses_no_actor():
    # The node is still there: killing its actor would run all its sessions again, each paid for once more.
    import ray

    from batchrun.ray.pool import RayWorkerPool

    pool = RayWorkerPool.__new__(RayWorkerPool)
    pool.ray = _failing_ray(ray.exceptions.ObjectFetchTimedOutError("ab" * 14, None, ""))
    pool._pending, pool._nodes = {"ref": (0, "attempt")}, [{"node_id": "n", "address": "10.0.0.2", "pid": 7}]
    pool._lose = lambda actor, exc, attempt: pytest.fail("the actor was taken for lost")
    [fatal] = pool._outcome("ref")
    assert isinstance(fatal, Fatal) and "ObjectFetchTimedOutError" in fatal.message


@needs_ray
@pytest.mark.parametrize(("failure", "learned"), [("out of reach", 1000.0), ("a bug", 0.0)])
def test_an_actor_goes_on_learning_of_pauses_after_the_keeper_was_out_of_reach_for_a_moment(failure, learned):
    # Before, one failed long poll (a network blip: ActorUnavailableError) ended the actor's following of the
    # run's 429 pauses for good: it sent requests through every later pause the other actors kept. Any other
    # failure still ends it: polling again would only meet it again.
    import asyncio

    import ray

    from batchrun.ray.gate import RayRateGate

    answers = [ray.exceptions.ActorUnavailableError("the keeper's node is out of reach for a moment", None)
               if failure == "out of reach" else TypeError("a bug"), 1000.0]

    async def next_pause(known: float) -> float:
        answer = answers.pop(0) if answers else None
        if isinstance(answer, BaseException):
            raise answer
        if answer is None:
            await asyncio.Event().wait()        # no later pause
        return answer

    keeper = SimpleNamespace(next_pause=SimpleNamespace(remote=next_pause))

    async def scenario() -> float:
        gate = RayRateGate(keeper, None, adaptive=True)
        gate._resume_at()                       # starts the following
        await asyncio.sleep(3)
        return gate._resume_at()

    assert asyncio.run(scenario()) == learned


@needs_ray
def test_a_pool_warning_shows_what_ray_quoted_escaped_and_bounded(capsys):
    # The pool's warnings quote Ray's exceptions, which quote a node's or a task's words: printed raw.
    from batchrun.ray.pool import warn

    warn("lost an actor: \x1b]0;owned\x07 " + "x" * 10_000)
    said = capsys.readouterr().err
    assert said.startswith("warning: lost an actor: \\x1b]0;owned\\x07 ") and "\x1b" not in said
    assert len(said) < 4_100 and "characters left out" in said


# -- with Ray -------------------------------------------------------------------------------------------


@needs_ray
def test_ray_run_writes_what_a_local_run_writes_on_loopback_only_and_leaves_no_process(tmp_path, endpoint):
    prompts = [TOOL_PROMPT, "[[invent]] inventive", "[[reasoning none]] silent", "[[fail 400 always]] refused",
               *[f"[[sleep 0.5]] question {i}" for i in range(8)]]
    local_dir, ray_dir = tmp_path / "local", tmp_path / "ray"
    local_dir.mkdir()
    ray_dir.mkdir()
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    local = run_cli(local_dir, *args(dataset, endpoint, "--num_workers=4", "--seed=7"))
    assert local.returncode == 2, local.stderr      # the run finished; the refused prompt failed
    local_calls = Counter(map(last_user_message, endpoint.requests))
    endpoint.reset()

    tag = uuid.uuid4().hex
    process = subprocess.Popen(batch_runner_command(*args(dataset, endpoint, "--num_workers=4", "--seed=7",
                                                          "--backend=ray")),
                               cwd=ray_dir, env=cli_environment(ray_dir, ray_environment(tag)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any(prompt.startswith("[[sleep") for prompt in map(last_user_message, endpoint.requests))
                 or process.poll() is not None, timeout=90, what="the first request of a session actor")
        known = descendants(process.pid)
        running = tagged_processes(tag, known)
        sockets = sockets_of(running)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 2, stderr
    assert len(running) > 3 and sockets     # the CLI, Ray's own processes and the actors, with their sockets
    assert non_loopback(sockets) == []
    assert any(entry["state"] == "0A" for entry in sockets)   # Ray's servers listen: on 127.0.0.1 only
    assert "backend ray · local Ray on 127.0.0.1 · 1 node (127.0.0.1: 2 actors · 4 sessions)" in stdout
    assert "Traceback" not in stderr
    wait_until_gone(tag, known)

    assert run_directory_summary(ray_dir / "data" / "run") == run_directory_summary(local_dir / "data" / "run")
    assert Counter(map(last_user_message, endpoint.requests)) == local_calls   # the same model calls per prompt


def prompts_half_held(endpoint) -> tuple[list[str], HeldReplies]:
    """Sixteen prompts of 0.4 s, the replies to the last eight held until released: a run stopped once five
    rows are written is still running then, however slow the machine."""
    prompts = [f"[[sleep 0.4]] slow prompt {i}" + (f" (held {i})" if i >= 8 else "") for i in range(16)]
    return prompts, HeldReplies(endpoint, {f"(held {i})": 0 for i in range(8, 16)})


@needs_ray
def test_kill_9_of_the_driver_then_resume_on_ray_runs_every_prompt_exactly_once(tmp_path, endpoint):
    prompts, held = prompts_half_held(endpoint)
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    run_dir = tmp_path / "data" / "run"
    tag = uuid.uuid4().hex
    process = subprocess.Popen(batch_runner_command(*args(dataset, endpoint, "--num_workers=4", "--backend=ray")),
                               cwd=tmp_path, env=cli_environment(tmp_path, ray_environment(tag)),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: finished_row_count(run_dir) >= 5, timeout=90, what="five finished rows")
    known = descendants(process.pid)
    assert len(known) > 3
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    held.open_all()
    wait_until_gone(tag, known)
    done_before = {human_prompt(row) for row in batch_rows(run_dir)}
    assert 5 <= len(done_before) < 16
    endpoint.reset()

    result = run_cli(tmp_path, *args(dataset, endpoint, "--num_workers=4", "--backend=ray", "--resume"),
                     env=ray_environment(tag))
    assert result.returncode == 0, result.stderr
    assert f"{len(done_before)} already done" in result.stdout
    merged = Counter(human_prompt(row) for row in read_jsonl(run_dir / "trajectories.jsonl"))
    assert merged == Counter(prompts)
    assert not {last_user_message(request) for request in endpoint.requests} & done_before
    wait_until_gone(tag)


@needs_ray
@pytest.mark.parametrize(("signum", "code", "said", "to_group"),
                         [(signal.SIGINT, 130, "Interrupted.", True), (signal.SIGHUP, 129, "Stopped by SIGHUP.", True),
                          (signal.SIGTERM, 143, "Stopped by SIGTERM.", True),
                          (signal.SIGTERM, 143, "Stopped by SIGTERM.", False)],
                         ids=["ctrl-c", "hangup", "terminate", "terminate the runner alone"])
def test_a_stop_signal_stops_a_ray_run_in_order(tmp_path, endpoint, signum, code, said, to_group):
    """Ctrl-C and a closed terminal's SIGHUP reach every process of the terminal's group, as a job scheduler's
    SIGTERM reaches every process of the job, Ray's too; `kill PID` (or `timeout`, or a service manager)
    signals the runner alone, though ray.init puts a SIGTERM handler of Ray's own in it. Each time the
    runner stops the run, keeping what finished, and then Ray."""
    prompts, held = prompts_half_held(endpoint)
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    run_dir = tmp_path / "data" / "run"
    tag = uuid.uuid4().hex
    process = subprocess.Popen(batch_runner_command(*args(dataset, endpoint, "--num_workers=4", "--backend=ray")),
                               cwd=tmp_path, env=cli_environment(tmp_path, ray_environment(tag)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                               preexec_fn=default_stop_signals)
    try:
        wait_for(lambda: finished_row_count(run_dir) >= 5, timeout=90, what="five finished rows")
        known = descendants(process.pid)
        if to_group:
            os.killpg(process.pid, signum)
        else:
            process.send_signal(signum)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
        held.open_all()
    assert process.returncode == code, stderr
    assert said in stdout and "Traceback" not in stderr
    kept = Counter(human_prompt(row) for row in read_jsonl(run_dir / "trajectories.jsonl"))
    assert len(kept) >= 5 and set(kept.values()) == {1}
    wait_until_gone(tag, known)
    endpoint.reset()

    result = run_cli(tmp_path, *args(dataset, endpoint, "--num_workers=4", "--backend=ray", "--resume"),
                     env=ray_environment(tag))
    assert result.returncode == 0, result.stderr
    assert Counter(human_prompt(row) for row in read_jsonl(run_dir / "trajectories.jsonl")) == Counter(prompts)
    assert not {last_user_message(request) for request in endpoint.requests} & set(kept)
    wait_until_gone(tag)


@needs_ray
def test_ctrl_c_while_the_runner_waits_on_ray_stops_the_run_in_order(tmp_path, endpoint):
    """Ray's wait turns what the stop signal's handler raises into a plain KeyboardInterrupt; the run
    still stops in order. The only prompt waits for its reply, so the runner is in that wait."""
    held = HeldReplies(endpoint, {"held": 0})
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["held until the stop"])
    tag = uuid.uuid4().hex
    process = subprocess.Popen(batch_runner_command(*args(dataset, endpoint, "--num_workers=1", "--backend=ray")),
                               cwd=tmp_path, env=cli_environment(tmp_path, ray_environment(tag)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_stop_signals)
    try:
        assert held.arrived["held"].wait(90)
        known = descendants(process.pid)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        held.open_all()
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    assert "Interrupted." in stdout and "Traceback" not in stderr
    wait_until_gone(tag, known)


@needs_ray
def test_ctrl_c_while_ray_starts_the_session_actors_stops_the_run_in_order(tmp_path, endpoint):
    """The pool's start waits on Ray too: each actor checks its node first, and here the container CLI it
    asks holds that check until the stop. Before, the KeyboardInterrupt Ray made of the stop ended the
    run in a traceback."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    asked = tmp_path / "asked"
    # The runner's own calls (which engine, any containers left) find nothing; the engine's version, which
    # only an actor's check asks, gets no answer for as long as the actor lives.
    (bin_dir / "docker").write_text(f'#!/bin/sh\n[ "$1" = version ] || exit 0\ntouch {asked}\n'
                                    'while kill -0 $PPID; do sleep 0.1; done\n')
    (bin_dir / "docker").chmod(0o755)
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["never started"])
    tag = uuid.uuid4().hex
    environment = ray_environment(tag, TERMINAL_ENV="docker", PATH=f"{bin_dir}:{os.environ['PATH']}")
    process = subprocess.Popen(batch_runner_command(*args(dataset, endpoint, "--num_workers=1", "--backend=ray")),
                               cwd=tmp_path, env=cli_environment(tmp_path, environment),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_stop_signals)
    try:
        wait_for(asked.exists, timeout=90, what="an actor's check of its node")
        known = descendants(process.pid)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    assert "Interrupted." in stdout and "Traceback" not in stderr
    assert endpoint.requests == []
    wait_until_gone(tag, known)


@needs_ray
def test_what_a_session_cut_off_by_kill_9_of_the_driver_spent_on_ray_is_counted_after_resume(tmp_path, endpoint):
    held = HeldReplies(endpoint, {"cut off": 1})       # its first reply comes back, its second waits
    dataset = write_dataset(tmp_path / "dataset.jsonl",
                            ["first", '[[call terminal {"command": "echo two"}]] cut off by the kill'])
    run_dir = tmp_path / "data" / "run"
    tag = uuid.uuid4().hex
    process = subprocess.Popen(batch_runner_command(*args(dataset, endpoint, "--num_workers=2", "--backend=ray",
                                                          batch_size=1)),
                               cwd=tmp_path, env=cli_environment(tmp_path, ray_environment(tag)),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert held.arrived["cut off"].wait(90)
        wait_for(lambda: finished_row_count(run_dir) == 1 and spent_by_prompt(run_dir, 1) == 1, timeout=30,
                 what="the first row, and the cut-off session's reply noted as spent")
        known = descendants(process.pid)
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    held.open_all()
    wait_until_gone(tag, known)

    result = run_cli(tmp_path, *args(dataset, endpoint, "--num_workers=2", "--backend=ray", "--resume", batch_size=1),
                     env=ray_environment(tag))
    assert result.returncode == 0, result.stderr
    statistics = json.loads((run_dir / "statistics.json").read_text())
    assert statistics["spent_by_unfinished_sessions"] == usage_of_replies(1)
    wait_until_gone(tag)


@needs_ray
def test_a_429_in_one_actor_pauses_the_sessions_of_the_other(tmp_path, endpoint):
    arrivals = arrivals_around_a_429(endpoint)
    dataset = write_dataset(tmp_path / "dataset.jsonl", [RATE_LIMITED_PROMPT, *PROMPTS_BESIDE_IT])
    # Two actors of two slots: the limited prompt shares its actor with one other, two run in the other actor.
    result = run_cli(tmp_path, *args(dataset, endpoint, "--num_workers=4", "--backend=ray", batch_size=100),
                     env=ray_environment(uuid.uuid4().hex))
    assert result.returncode == 0, result.stderr
    assert_the_429_paused_every_other_session(arrivals)
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 4


@needs_ray
def test_a_pause_the_endpoint_asks_for_is_said_in_a_ray_runs_log(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["[[fail 429 1 retry_after=6]] limited"])
    result = run_cli(tmp_path, *args(dataset, endpoint, "--num_workers=2", "--backend=ray", distribution="minimal"),
                     env=ray_environment(uuid.uuid4().hex))
    assert result.returncode == 0, result.stderr
    assert "the endpoint answered 429 (too many requests): no model request goes out before" in result.stdout


@needs_ray
def test_an_outage_of_the_endpoint_holds_every_actors_prompts_and_is_said_in_the_log(tmp_path, endpoint):
    # The log speaks of an outage once the actors have seen it five seconds; they see it only from a failure
    # with no other request in flight, seconds into the endpoint's: before, seven left a loaded machine
    # no look at one five seconds old.
    endpoint.outage = (503, 10.0)
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"question {i}" for i in range(6)])
    result = run_cli(tmp_path, *args(dataset, endpoint, "--num_workers=4", "--backend=ray", "--max_retries=3",
                                     distribution="minimal"), env=ray_environment(uuid.uuid4().hex))
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert len(rows) == 6 and not any(row.get("failed") for row in rows)
    assert "the endpoint has been down since" in result.stdout
    assert "the endpoint is up again, after" in result.stdout


@needs_ray
def test_requests_per_minute_paces_every_actor_together(tmp_path, endpoint):
    arrivals: list[float] = []
    endpoint.script = lambda body: arrivals.append(time.monotonic())
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"paced {i}" for i in range(4)])
    # Web tools only (none called): no sandbox starting beside a request delays its delivery.
    result = run_cli(tmp_path, *args(dataset, endpoint, "--num_workers=4", "--backend=ray",
                                     "--requests_per_minute=120", distribution="minimal"),
                     env=ray_environment(uuid.uuid4().hex))
    assert result.returncode == 0, result.stderr
    times = sorted(arrivals)
    # 120/min = one every 0.5 s: four requests span 1.5 s (unpaced, they would arrive together). A request
    # goes out at its slot, but an actor's first may arrive late (its client connects first), which
    # shortens the span by up to one interval on a loaded machine.
    assert len(times) == 4 and times[-1] - times[0] >= 1.0


@needs_ray
def test_a_slow_prompt_holds_one_slot_while_the_others_finish(tmp_path, endpoint):
    # The straggler's reply waits until the nine other rows are written (a minute at most), which
    # they are only if they do not wait for it.
    run_dir = tmp_path / "data" / "run"
    endpoint.script = holding_until_rows(run_dir, "straggler", 9)
    prompts = ["straggler", *[f"quick {i}" for i in range(9)]]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    result = run_cli(tmp_path, *args(dataset, endpoint, "--num_workers=2", "--backend=ray", batch_size=100,
                                     distribution="minimal"),
                     env=ray_environment(uuid.uuid4().hex))
    assert result.returncode == 0, result.stderr
    written = [human_prompt(row) for row in batch_rows(run_dir)]
    assert written[-1] == "straggler"
    assert sorted(written[:-1]) == sorted(prompts[1:])


@needs_ray
def test_an_environment_backend_missing_on_a_node_stops_the_run_before_any_model_call(tmp_path, endpoint):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "docker"
    fake.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon at unix:///var/run/docker.sock.' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["hello", "world"])
    tag = uuid.uuid4().hex
    result = run_cli(tmp_path, *args(dataset, endpoint, "--backend=ray"),
                     env=ray_environment(tag, TERMINAL_ENV="docker", PATH=f"{bin_dir}:{os.environ['PATH']}"))
    assert result.returncode == 1
    assert "Ray node 127.0.0.1 cannot run this run's sessions: TERMINAL_ENV=docker does not work there" in result.stderr
    assert "Cannot connect to the Docker daemon" in result.stderr
    assert endpoint.requests == [] and batch_rows(tmp_path / "data" / "run") == []
    wait_until_gone(tag)


# -- failures: an unreachable cluster, a lost actor, a lost node -------------------------------------------


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (the kernel's pick, released at once)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def row_prompt(row: dict) -> str:
    """The dataset prompt of any row: failure rows carry it, trajectory rows hold it as the human turn."""
    return row["prompt"] if "prompt" in row else human_prompt(row)


@needs_ray
def test_a_ray_address_where_nothing_listens_fails_at_once_with_one_clear_line(tmp_path, endpoint):
    address = f"127.0.0.1:{free_port()}"
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["hello"])
    # Ray alone retries such an address for 13 minutes: the test's 60 s limit would end it.
    result = run_cli(tmp_path, *args(dataset, endpoint, "--backend=ray"), env={"RAY_ADDRESS": address}, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: nothing answers at RAY_ADDRESS={address} (Connection refused): start the cluster's head "
        f"node there (ray start --head --port={address.rsplit(':', 1)[1]}) or unset RAY_ADDRESS to run on a "
        "private local Ray"]
    assert endpoint.requests == [] and batch_rows(tmp_path / "data" / "run") == []


@needs_ray
def test_ray_address_local_starts_the_private_loopback_ray_and_leaves_no_process(tmp_path, endpoint):
    # Ray reads RAY_ADDRESS=local as "start a new Ray here": that is the private Ray, on 127.0.0.1 only.
    tag = uuid.uuid4().hex
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["[[sleep 2]] hello"])
    process = subprocess.Popen(batch_runner_command(*args(dataset, endpoint, "--num_workers=1", "--backend=ray")),
                               cwd=tmp_path, env=cli_environment(tmp_path, ray_environment(tag, RAY_ADDRESS="local")),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: endpoint.requests or process.poll() is not None, timeout=90,
                 what="the first request of a session actor")
        known = descendants(process.pid)
        sockets = sockets_of(tagged_processes(tag, known))
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    assert "backend ray · local Ray on 127.0.0.1 · 1 node" in stdout
    assert sockets and non_loopback(sockets) == []
    wait_until_gone(tag, known)


@needs_ray
def test_a_ray_client_address_where_nothing_listens_names_the_client_server_port(tmp_path, endpoint):
    # The port of a ray:// address is the head's Ray Client server, not its GCS port (--port).
    port = free_port()
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["hello"])
    result = run_cli(tmp_path, *args(dataset, endpoint, "--backend=ray"), env={"RAY_ADDRESS": f"ray://127.0.0.1:{port}"},
                     timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: nothing answers at RAY_ADDRESS=ray://127.0.0.1:{port} (Connection refused): start the cluster's "
        f"head node there (ray start --head --ray-client-server-port={port}) or unset RAY_ADDRESS to run on a "
        "private local Ray"]
    assert endpoint.requests == []


KILLER = '[[call terminal {"command": "kill -9 $PPID"}]] kills whichever actor runs it'


@needs_ray
def test_a_prompt_that_kills_its_actor_twice_gets_a_failure_row_and_the_run_goes_on(tmp_path, endpoint):
    others = [f"[[sleep 0.2]] question {i}" for i in range(6)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", [KILLER, *others])
    tag = uuid.uuid4().hex
    # Two actors of one session each (one per CPU), so no other prompt shares an actor with the killer.
    result = run_cli(tmp_path, *args(dataset, endpoint, "--num_workers=2", "--backend=ray", batch_size=100),
                     env=ray_environment(tag, TERMINAL_ENV="local"), timeout=240)
    assert result.returncode == 2, result.stderr      # the run finished; one prompt failed
    run_dir = tmp_path / "data" / "run"
    written = batch_rows(run_dir)
    assert Counter(map(row_prompt, written)) == Counter([KILLER, *others])        # each prompt exactly once
    killer_row = next(row for row in written if row_prompt(row) == KILLER)
    assert killer_row["failed"] is True and killer_row["error_type"] == "worker_died"
    assert killer_row["error"].startswith("the Ray session actors running this prompt were lost twice: ")
    assert sum(last_user_message(request) == KILLER for request in endpoint.requests) == 2   # sent once more
    assert Counter(human_prompt(row) for row in read_jsonl(run_dir / "trajectories.jsonl")) == Counter(others)
    assert result.stderr.count("warning: lost Ray session actor") == 2
    wait_until_gone(tag)


class TwoNodeCluster:
    """A Ray head and a second node on 127.0.0.1, one CPU each (the head ``head_cpus``), started with tests/ray_node.py; every process of each node is found by its tag (and the processes below those)."""

    def __init__(self, temp_dir: str, tmp_path: Path, head_cpus: int = 1) -> None:
        self.port = free_port()
        self.head_cpus = head_cpus
        self.address = f"127.0.0.1:{self.port}"
        self.tags = {"head": uuid.uuid4().hex, "second": uuid.uuid4().hex}
        self._temp_dir, self._tmp_path = temp_dir, tmp_path
        # Ray's token authentication, with a token of this cluster's own: otherwise each `ray start`
        # decides by whether ~/.ray/auth_token exists (any local ray.init writes one), and the second
        # node cannot join a head that enabled it.
        self.environment = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex + uuid.uuid4().hex,
                            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_ADDRESS": ""}

    def start(self) -> None:
        self.start_head()
        self._ray_start("second", f"--address={self.address}", *self._common(cpus=1))

    def start_head(self) -> None:
        """The head node alone: a cluster of one node."""
        self._ray_start("head", "--head", f"--port={self.port}", f"--temp-dir={self._temp_dir}",
                        "--include-dashboard=false", *self._common(cpus=self.head_cpus))

    @staticmethod
    def _common(cpus: int) -> list[str]:
        return ["--node-ip-address=127.0.0.1", f"--num-cpus={cpus}", "--disable-usage-stats",
                f"--dashboard-agent-listen-port={free_port()}"]   # not Ray's fixed default 52365

    def _ray_start(self, node: str, *flags: str) -> None:
        environment = cli_environment(self._tmp_path, {**self.environment, TAG: self.tags[node],
                                                       "RAY_USAGE_STATS_ENABLED": "0"})
        started = subprocess.run([sys.executable, str(REPO / "tests" / "ray_node.py"), *flags], env=environment,
                                 capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert started.returncode == 0, f"ray start ({node}) failed:\n{started.stdout}\n{started.stderr}"

    def processes(self, *nodes: str) -> dict[int, str]:
        """pid -> start time of every live process of these nodes (Ray retitles some of them over their
        environment, so the processes below the tagged ones count too)."""
        found: dict[int, str] = {}
        for node in nodes:
            for pid in tagged_processes(self.tags[node]):
                if started := _start_time(pid):
                    found[pid] = started
                found.update(descendants(pid))
        return {pid: started for pid, started in found.items() if process_state(pid) != "Z"}

    def kill(self, *nodes: str) -> None:
        """kill -9 every process of these nodes, all found before any dies (orphans leave the tree)."""
        deadline = time.monotonic() + 15
        while processes := self.processes(*nodes):
            assert time.monotonic() < deadline, f"Ray processes survive kill -9: {sorted(processes)}"
            for pid, started in processes.items():
                if _start_time(pid) == started:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            time.sleep(0.2)


@pytest.fixture
def two_node_cluster(ray_tmpdir, tmp_path):
    cluster = TwoNodeCluster(ray_tmpdir, tmp_path)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.kill("second", "head")


@needs_ray
def test_losing_a_ray_node_mid_run_moves_its_prompts_to_the_actor_that_remains(tmp_path, endpoint,
                                                                              two_node_cluster):
    prompts = [f"[[sleep 0.6]] question {i}" for i in range(16)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    run_dir = tmp_path / "data" / "run"
    stdout_path, stderr_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    # Two actors of two sessions, one per node (one CPU each); the runner's driver joins the head.
    with stdout_path.open("w") as stdout, stderr_path.open("w") as stderr:
        process = subprocess.Popen(
            batch_runner_command(*args(dataset, endpoint, "--num_workers=4", "--backend=ray")),
            cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
            env=cli_environment(tmp_path, {**two_node_cluster.environment, "RAY_ADDRESS": two_node_cluster.address}))
    try:
        wait_for(lambda: finished_row_count(run_dir) >= 3 or process.poll() is not None, timeout=120,
                 what="three finished rows")
        assert process.poll() is None, stderr_path.read_text()
        two_node_cluster.kill("second")        # both of its sessions hold a prompt now: 13 are left to run
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stdout, stderr = stdout_path.read_text(), stderr_path.read_text()
    assert process.returncode == 0, stderr
    assert "· 2 nodes (" in stdout              # two raylets on one address are two nodes
    # The lost actor held prompts (perhaps before their first model call), and they went elsewhere.
    assert re.search(r"^warning: lost Ray session actor \d+ .*\. [12] prompt\(s\) it was running go once more", stderr,
                     re.MULTILINE), stderr
    assert Counter(map(row_prompt, batch_rows(run_dir))) == Counter(prompts)
    assert Counter(human_prompt(row) for row in read_jsonl(run_dir / "trajectories.jsonl")) == Counter(prompts)
    assert max(Counter(map(last_user_message, endpoint.requests)).values()) <= 2


@dataclass
class HeadLoss:
    """How a run on a cluster ended once its head was killed."""

    returncode: int
    stdout: str
    stderr: str
    stopped_after: float        # seconds from the head's kill to the runner's exit


def run_until_the_head_is_killed(cluster: TwoNodeCluster, tmp_path: Path, command: list[str],
                                 ready: Callable[[], bool], what: str, ready_within: float = 120,
                                 **environment: str) -> HeadLoss:
    """``command`` run on ``cluster`` (started), with its head killed once ``ready()`` (or the run ended)."""
    process = subprocess.Popen(
        command, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=cli_environment(tmp_path, {**cluster.environment, "RAY_ADDRESS": cluster.address, **environment}))
    try:
        wait_for(lambda: ready() or process.poll() is not None, timeout=ready_within, what=what)
        cluster.kill("head")
        lost_at = time.monotonic()
        stdout, stderr = process.communicate(timeout=120)
        return HeadLoss(process.returncode, stdout, stderr, time.monotonic() - lost_at)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@needs_ray
def test_losing_the_ray_head_mid_run_stops_the_run_in_order_with_one_clear_line(tmp_path, ray_tmpdir, endpoint):
    """Without its head (GCS) a driver cannot go on: Ray itself ends the runner's process after 60 s with a
    line of its own and no report. The runner notices the head is gone when it loses the actors, and stops
    in order at once, keeping what finished."""
    cluster = TwoNodeCluster(ray_tmpdir, tmp_path)
    prompts = [f"[[sleep 0.5]] question {i}" for i in range(30)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    run_dir = tmp_path / "data" / "run"
    try:
        cluster.start_head()
        lost = run_until_the_head_is_killed(
            cluster, tmp_path, batch_runner_command(*args(dataset, endpoint, "--num_workers=2", "--backend=ray")),
            lambda: finished_row_count(run_dir) >= 3, "three finished rows")
    finally:
        cluster.kill("head")
    assert lost.returncode == 1, lost.stderr
    assert lost.stopped_after < 30, lost.stderr          # Ray alone ends the process after 60 s
    assert f"error: the Ray cluster's head at {cluster.address} no longer answers" in lost.stderr
    assert "The run stopped; finished prompts are saved." in lost.stderr and "Traceback" not in lost.stderr
    written = Counter(map(row_prompt, batch_rows(run_dir)))
    assert len(written) >= 3 and set(written.values()) == {1}


@needs_ray
def test_losing_the_ray_head_while_the_sessions_run_on_another_node_stops_the_run_and_fails_no_prompt(
        tmp_path, ray_tmpdir, endpoint):
    """The run's rate-limit keeper lives on the runner's node, the head here, and goes with it; the sessions on
    the other node then meet no keeper at their next model request. That is the head's loss, not a failure of
    their prompts (each had already paid for a reply): they are left to --resume, as the prompts of any stop."""
    cluster = TwoNodeCluster(ray_tmpdir, tmp_path, head_cpus=0)      # every session actor on the second node
    prompts = [f'[[call terminal {{"command": "sleep 1"}}]] question {i}' for i in range(20)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    run_dir = tmp_path / "data" / "run"
    try:
        cluster.start()
        lost = run_until_the_head_is_killed(
            cluster, tmp_path, batch_runner_command(*args(dataset, endpoint, "--num_workers=2", "--backend=ray")),
            lambda: finished_row_count(run_dir) >= 3, "three finished rows", TERMINAL_ENV="local")
    finally:
        cluster.kill("second", "head")
    assert lost.returncode == 1, lost.stderr
    assert lost.stopped_after < 30, lost.stderr
    assert f"error: the Ray cluster's head at {cluster.address} no longer answers" in lost.stderr
    assert "Traceback" not in lost.stderr
    written = batch_rows(run_dir)
    assert [row_prompt(row) for row in written if row.get("failed")] == []
    assert len(written) >= 3 and set(Counter(map(row_prompt, written)).values()) == {1}


@needs_ray
def test_losing_the_ray_head_while_the_actors_start_stops_the_run_at_once_with_one_clear_line(
        tmp_path, ray_tmpdir, endpoint):
    """The session actor starts on the second node, where its check of the node asks the container CLI for its
    version, which never answers. Before, the runner waited on that actor until Ray ended it 60 s after the
    head was lost, with a line of Ray's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    asked = tmp_path / "asked"
    (bin_dir / "docker").write_text(f'#!/bin/sh\n[ "$1" = version ] || exit 0\ntouch {asked}\n'
                                    'while kill -0 $PPID; do sleep 0.1; done\n')
    (bin_dir / "docker").chmod(0o755)
    cluster = TwoNodeCluster(ray_tmpdir, tmp_path, head_cpus=0)
    cluster.environment["PATH"] = f"{bin_dir}:{os.environ['PATH']}"     # the nodes' too, so the actor's
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["never started"])
    try:
        cluster.start()
        lost = run_until_the_head_is_killed(
            cluster, tmp_path, batch_runner_command(*args(dataset, endpoint, "--num_workers=1", "--backend=ray")),
            asked.exists, "an actor's check of its node", ready_within=90, TERMINAL_ENV="docker")
    finally:
        cluster.kill("second", "head")
    assert lost.returncode == 1, lost.stderr
    assert lost.stopped_after < 30, lost.stderr          # Ray alone ends the process after 60 s
    assert lost.stderr.strip().splitlines()[0].startswith(
        f"error: the Ray cluster's head at {cluster.address} no longer answers ("), lost.stderr
    assert "Traceback" not in lost.stderr and "GCS" not in lost.stdout + lost.stderr
    assert endpoint.requests == []


@needs_ray
def test_a_node_lost_just_before_the_run_costs_its_actor_not_the_run(tmp_path, endpoint, two_node_cluster):
    """Ray counts a node killed a moment ago as alive for a while (until its heartbeats are missed), and
    places a session actor there, which never starts. That is a node lost, as during a run: a warning with a
    clean first line, and the run goes on with the actor that started. Ray's own line about the dead node
    reaches the runner's output without terminal control characters."""
    two_node_cluster.kill("second")
    prompts = [f"[[sleep 0.2]] question {i}" for i in range(6)]
    dataset = write_dataset(tmp_path / "dataset.jsonl", prompts)
    result = run_cli(tmp_path, *args(dataset, endpoint, "--num_workers=2", "--backend=ray", batch_size=100),
                     env={**two_node_cluster.environment, "RAY_ADDRESS": two_node_cluster.address}, timeout=240)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^warning: a Ray session actor was lost while it started \(ActorDiedError: The actor died",
                     result.stderr, re.MULTILINE), result.stderr
    assert "error:" not in result.stderr
    assert Counter(map(row_prompt, batch_rows(tmp_path / "data" / "run"))) == Counter(prompts)
    assert "\x1b" not in result.stdout + result.stderr
