"""Thousands of sessions against a slow endpoint: does every session stay in flight?

    python benchmarks/sessions_sweep.py                                   # 256, 1,024, 2,048 sessions, 10 s
    python benchmarks/sessions_sweep.py --sessions 8192 --latency 30 --tool-turns 0 --prompts-per-session 2
    python benchmarks/sessions_sweep.py --adaptive on off                 # the same with the adaptation off
    python benchmarks/sessions_sweep.py --one-worker --sessions 512 1024 --tool-turns 0

The endpoint is benchmarks/fast_endpoint.py without a limit of its own: every reply takes --latency
seconds, and each prompt makes --tool-turns terminal calls before its answer. With tool turns the run
uses --distribution=terminal_only in the backend TERMINAL_ENV names (bubblewrap where it works);
without, --distribution=minimal (web tools only, which the model never calls: no environment starts).

It first prints the machine line of throughput.py. For each session count it prints trajectories/s over
the whole run (start-up, merge and exit included), the ideal (sessions / (model calls per prompt x
latency)) and their ratio, the steady ratio (from the first model request to the last reply), the
requests the endpoint served at once on average over that span (the ideal is the sessions, less the
time they spend in tools) and at most, the seconds from the start of the run until it first served 90%
of the sessions, the run's concurrency limit (highest and final, from statistics.json), the runner's
CPU milliseconds per trajectory (the whole process tree), and the peak RSS (summed over the tree:
shared pages count once per process), peak PSS and peak process count of the tree (sampled every
--sample-every seconds; reading thousands of processes' memory maps costs the benchmark CPU the runner
competes for).

--one-worker runs one worker process (batchrun.worker_process, as the pool forks it) with all the
sessions, fed over its pipe by this script as the parent would: the event loop and the HTTP clients of
one process with that many requests in flight. It prints the same ratios and in-flight figures, the
worker's CPU milliseconds per request and its peak RSS. --sessions-per-client N sets
batchrun.worker_process.SESSIONS_PER_CLIENT for the run (the sessions that share one model client and
its connection pool), to measure that choice.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from throughput import REPO, TreeSampler, children_cpu_seconds, machine_line, server_stats

import model_tools
from batchrun import endpoint, worker_process
from batchrun.config import RunConfig, build_config
from batchrun.environments import environment_class
from batchrun.environments.base import EnvironmentSettings
from batchrun.messages import Finished, Spent, Task
from batchrun.rate_limit import RateGate
from batchrun.workers import waiting_places

SERVED_SHARE = 0.9      # "all in flight": the endpoint serves this share of the sessions at once


@contextmanager
def slow_endpoint(latency: float, tool_turns: int) -> Iterator[str]:
    """fast_endpoint.py in its own process; yields its base URL."""
    server = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "fast_endpoint.py"), f"--latency={latency}",
                               f"--tool-turns={tool_turns}"], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    try:
        yield f"http://127.0.0.1:{server.stdout.readline().strip()}/v1"
    finally:
        server.terminate()
        server.wait()


class ServedWatcher(threading.Thread):
    """When the endpoint first served SERVED_SHARE of the sessions at once (seconds after ``started``,
    the run's start: from the first request would favour a run whose first request came late), and
    the most it served."""

    def __init__(self, base_url: str, sessions: int, started: float) -> None:
        super().__init__(daemon=True)
        self.base_url, self.sessions, self.started = base_url, sessions, started
        self.most = 0
        self.all_in_flight_at: float | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.25):
            stats = server_stats(self.base_url)
            self.most = max(self.most, stats["serving"])
            if self.all_in_flight_at is None and stats["serving"] >= SERVED_SHARE * self.sessions:
                self.all_in_flight_at = time.monotonic() - self.started


@dataclass
class Served:
    """What the endpoint saw of one run."""

    seconds: float            # first request to last reply
    mean_in_flight: float
    most_in_flight: int
    all_in_flight_after: float | None

    @classmethod
    def of(cls, stats: dict, watcher: ServedWatcher) -> Served:
        seconds = stats["last_response"] - stats["first_request"]
        return cls(seconds, stats["busy_seconds"] / seconds, watcher.most, watcher.all_in_flight_at)


def write_dataset(work: Path, prompts: int) -> Path:
    dataset = work / "dataset.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"benchmark prompt {i}"}) + "\n" for i in range(prompts)))
    return dataset


def distribution(tool_turns: int) -> str:
    return "terminal_only" if tool_turns else "minimal"


def run_sweep_point(args: argparse.Namespace, sessions: int, adaptive: bool) -> None:
    prompts = sessions * args.prompts_per_session
    ideal = sessions / ((args.tool_turns + 1) * args.latency)
    with (tempfile.TemporaryDirectory(prefix="br-sweep-") as work,
          slow_endpoint(args.latency, args.tool_turns) as base_url):
        dataset = write_dataset(Path(work), prompts)
        cpu_before = children_cpu_seconds()
        started = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=100",
             "--run_name=bench", f"--distribution={distribution(args.tool_turns)}", f"--num_workers={sessions}",
             f"--base_url={base_url}", "--model=bench", "--max_retries=0", f"--adaptive_concurrency={adaptive}"],
            cwd=work, env={**os.environ, "TMPDIR": work}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        sampler, watcher = TreeSampler(process.pid, args.sample_every), ServedWatcher(base_url, sessions, started)
        sampler.start()
        watcher.start()
        _, stderr = process.communicate()
        elapsed = time.monotonic() - started
        cpu = children_cpu_seconds() - cpu_before
        for thread in (sampler, watcher):
            thread.stopped.set()
            thread.join()
        if process.returncode != 0:
            raise SystemExit(f"batch_runner failed ({process.returncode}): {stderr[-2000:]}")
        stats = json.loads((Path(work) / "data" / "bench" / "statistics.json").read_text())
        served = Served.of(server_stats(base_url), watcher)
    done = stats["trajectories_in_merged_file"]
    limit = stats["this_run"].get("concurrency", {})
    print(f"{'on' if adaptive else 'off':>8} {sessions:>8} {done:>7} {elapsed:>7.1f} {done / elapsed:>7.1f} "
          f"{ideal:>7.1f} {done / elapsed / ideal:>6.2f} {done / served.seconds / ideal:>6.2f} "
          f"{served.mean_in_flight:>9.0f} {served.most_in_flight:>7} {_seconds(served.all_in_flight_after):>8} "
          f"{limit.get('max', '-'):>6} {limit.get('final', '-'):>6} {1000 * cpu / done:>7.2f} "
          f"{sampler.peak_rss / 2**20:>8.0f} {sampler.peak_pss / 2**20:>8.0f} {sampler.peak_processes:>6}",
          flush=True)


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}"


# -- one worker process -------------------------------------------------------------------------------


def worker_config(dataset: Path, sessions: int, base_url: str, tool_turns: int, adaptive: bool) -> RunConfig:
    """The RunConfig a run with these flags gets (every other flag at the CLI's default)."""
    return build_config(**{"dataset_file": str(dataset), "batch_size": 100, "run_name": "bench",
                           "distribution": distribution(tool_turns), "num_workers": sessions, "base_url": base_url,
                           "model": "bench", "api_key": "bench", "max_retries": 0,
                           "adaptive_concurrency": adaptive})


def process_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def finished_prompt(conn: Connection) -> bool:
    """Wait for the worker's next finished prompt: whether it did not fail. The replies' usage the
    worker reports on the way (Spent) is the parent's to record, and is passed over here."""
    while isinstance(message := conn.recv(), Spent):
        pass
    if not isinstance(message, Finished):
        raise SystemExit(f"the worker stopped the run: {message}")
    return message.status != "failed"


def run_one_worker(args: argparse.Namespace, sessions: int, adaptive: bool) -> None:
    prompts = sessions * args.prompts_per_session
    ideal = sessions / ((args.tool_turns + 1) * args.latency)
    fork = multiprocessing.get_context("fork")
    with (tempfile.TemporaryDirectory(prefix="br-worker-") as work,
          slow_endpoint(args.latency, args.tool_turns) as base_url):
        config = worker_config(write_dataset(Path(work), prompts), sessions, base_url, args.tool_turns, adaptive)
        gate = RateGate(None, ceiling=sessions, adaptive=adaptive, workers=1)
        settings = EnvironmentSettings(work_root=Path(work) / "work", run_label="bench-worker")
        # As the runner's parent does around a run: what a worker could not remove in time (control
        # groups whose last processes were still dying) goes with the run, not with the machine.
        leftovers = environment_class(config.environment.kind)
        leftovers.remove_leftovers(settings)
        available = frozenset(model_tools.TOOL_NAMES) - set(model_tools.unavailable_tools())
        endpoint.preload_http_stack()
        if args.sessions_per_client:      # before the fork: the worker reads it when it makes its clients
            worker_process.SESSIONS_PER_CLIENT = args.sessions_per_client
        parent_end, child_end = fork.Pipe(duplex=True)
        worker = fork.Process(target=worker_process.main, daemon=True,
                              args=(child_end, [parent_end], 0, sessions, config, gate, settings, available))
        started = time.monotonic()
        worker.start()
        child_end.close()
        assert worker.pid is not None
        sampler, watcher = TreeSampler(worker.pid, args.sample_every), ServedWatcher(base_url, sessions, started)
        sampler.start()
        watcher.start()
        tasks = (Task(prompt_index=i, prompt=f"benchmark prompt {i}", image=None, cwd=None, content_key=str(i),
                      toolsets=("terminal",) if args.tool_turns else ("web",), unit=i) for i in range(prompts))
        sent = done = failed = 0
        for task in tasks:     # as the parent does: the sessions, and a few tasks waiting for one
            if sent - done >= sessions + waiting_places(sessions):
                failed += not finished_prompt(parent_end)
                done += 1
            parent_end.send(asdict(task))
            sent += 1
        while done < sent:
            failed += not finished_prompt(parent_end)
            done += 1
        elapsed = time.monotonic() - started
        cpu = process_cpu_seconds(worker.pid)
        requests = server_stats(base_url)["requests"]
        parent_end.send(None)
        worker.join(30)
        leftovers.remove_leftovers(settings)
        for thread in (sampler, watcher):
            thread.stopped.set()
            thread.join()
        served = Served.of(server_stats(base_url), watcher)
    print(f"{'on' if adaptive else 'off':>8} {sessions:>8} {done:>7} {failed:>6} {elapsed:>7.1f} "
          f"{done / elapsed:>7.1f} {ideal:>7.1f} {done / elapsed / ideal:>6.2f} {done / served.seconds / ideal:>6.2f} "
          f"{served.mean_in_flight:>9.0f} {served.most_in_flight:>7} {_seconds(served.all_in_flight_after):>8} "
          f"{1000 * cpu / requests:>8.2f} {sampler.peak_rss / 2**20:>8.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--latency", type=float, default=10.0, help="seconds per reply")
    parser.add_argument("--tool-turns", type=int, default=1, help="terminal calls per prompt before its answer")
    parser.add_argument("--prompts-per-session", type=int, default=3)
    parser.add_argument("--adaptive", nargs="+", choices=("on", "off"), default=["on"])
    parser.add_argument("--one-worker", action="store_true", help="one worker process with all the sessions")
    parser.add_argument("--sessions-per-client", type=int, default=0,
                        help="with --one-worker: sessions per model client (default: the worker's own)")
    parser.add_argument("--sample-every", type=float, default=10.0,
                        help="seconds between memory samples: each reads the memory of every process of the "
                             "tree (6,000 at 2,048 sessions), CPU taken from the run it measures")
    args = parser.parse_args()
    calls = args.tool_turns + 1
    print(machine_line())
    print(f"{args.latency:g} s per reply, {calls} model call{'s' if calls > 1 else ''} per prompt, "
          f"{args.prompts_per_session} prompts per session, --distribution={distribution(args.tool_turns)}"
          + (f", TERMINAL_ENV={os.environ.get('TERMINAL_ENV') or '(unset: bubblewrap where it works)'}"
             if args.tool_turns else ""))
    if args.one_worker:
        print(f"{'adaptive':>8} {'sessions':>8} {'done':>7} {'failed':>6} {'seconds':>7} {'traj/s':>7} {'ideal':>7} "
              f"{'ratio':>6} {'steady':>6} {'in flight':>9} {'most':>7} {'all at s':>8} {'cpu ms/req':>8} "
              f"{'RSS MB':>8}")
    else:
        print(f"{'adaptive':>8} {'sessions':>8} {'done':>7} {'seconds':>7} {'traj/s':>7} {'ideal':>7} {'ratio':>6} "
              f"{'steady':>6} {'in flight':>9} {'most':>7} {'all at s':>8} {'max':>6} {'final':>6} "
              f"{'cpu ms':>7} {'RSS MB':>8} {'PSS MB':>8} {'procs':>6}")
    if args.one_worker:
        print(f"sessions per model client: {args.sessions_per_client or worker_process.SESSIONS_PER_CLIENT}")
    for sessions in args.sessions:
        for adaptive in args.adaptive:
            (run_one_worker if args.one_worker else run_sweep_point)(args, sessions, adaptive == "on")


if __name__ == "__main__":
    main()
