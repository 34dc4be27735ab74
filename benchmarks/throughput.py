"""Throughput benchmark: batch_runner against a scripted OpenAI-compatible server on 127.0.0.1.

    python benchmarks/throughput.py                         # the README's figures
    python benchmarks/throughput.py --workers 64 --prompts 1000 --latency 0.2
    python benchmarks/throughput.py --backend local ray     # the same runs on worker processes and on Ray

It first prints the machine: its CPU, and the CPU time of a program's start and of a fixed Python loop
there: machines handed out as one kind differ in both (docs/performance.md). Then, for each worker
count, it prints trajectories/s over the whole run (start-up, merge and exit included), the ideal
(workers / (model calls per prompt x latency)), their ratio, the steady-state ratio (from the first
model request to the last response, so start-up is left to its own column), the runner's CPU
milliseconds per trajectory (the process tree as the kernel accounts it to the runner: parent, workers,
the tool commands they ran; a sandbox's processes that the kernel tears down after its bwrap was killed
are accounted to the machine's init instead, so under bubblewrap this misses much of the sandboxes'
cost), the whole machine's busy CPU milliseconds per trajectory (everything: the sandboxes whole, the
kernel's own threads, which do much of the work of tearing sandboxes down, and the benchmark server),
the benchmark server's own share of that, the peak PSS of the runner's tree, and the seconds from start
to the first model request.
Each prompt makes 3 model calls and runs 2 terminal commands in the backend a real run would use
(TERMINAL_ENV=local or =bubblewrap to choose).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TOOL_TURNS = 2
CALLS_PER_PROMPT = TOOL_TURNS + 1
_PROGRAM_STARTS = 200
_PYTHON_LOOP_ROUNDS = 2_000_000
_MEMORY_SAMPLE_SECONDS = 5.0


def tree_pids(root: int) -> list[int]:
    pids, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        pids.append(pid)
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                frontier.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            pass
    return pids


def process_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of one process in bytes; zeros for one that is gone."""
    rss = pss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Rss:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, pss


def tree_pss_bytes(root: int) -> int:
    return sum(pss for _, pss in map(process_memory, tree_pids(root)))


class TreeSampler(threading.Thread):
    """Peak RSS, PSS and process count of a process tree, sampled every ``every`` seconds. Each sample
    walks the tree and reads the memory map of every process in it, the sandboxes' too: once a second
    that took 3.5% of the machine from the 64-session bubblewrap run it measured (docs/performance.md).
    The runner's memory settles within seconds of its start, so a few seconds apart still see the peak."""

    def __init__(self, pid: int, every: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.every = pid, every
        self.peak_rss = self.peak_pss = self.peak_processes = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.every):
            pids = tree_pids(self.pid)
            memory = [process_memory(pid) for pid in pids]
            self.peak_processes = max(self.peak_processes, len(pids))
            self.peak_rss = max(self.peak_rss, sum(rss for rss, _ in memory))
            self.peak_pss = max(self.peak_pss, sum(pss for _, pss in memory))


def machine_busy_seconds() -> float:
    """CPU time the whole machine spent busy (every core, the kernel's own threads included)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def machine_line() -> str:
    """The machine the figures come from, and two costs every run here is made of. Machines handed out as
    the same kind differ in both (docs/performance.md), so figures compare only under the same line."""
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        model = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    true = shutil.which("true") or "/bin/true"
    before = children_cpu_seconds()
    for _ in range(_PROGRAM_STARTS):
        subprocess.run([true], check=True)
    start_ms = 1000 * (children_cpu_seconds() - before) / _PROGRAM_STARTS
    started = time.process_time()
    total = 0
    for number in range(_PYTHON_LOOP_ROUNDS):
        total += number % 7
    loop_ms = 1000 * (time.process_time() - started)
    return (f"machine: {model}, {os.cpu_count()} cores; a program's start {start_ms:.2f} ms of CPU "
            f"(/bin/true, {_PROGRAM_STARTS} times), a Python loop of {_PYTHON_LOOP_ROUNDS:,} rounds {loop_ms:.0f} ms")


@contextmanager
def endpoint(latency: float, jitter: float, tool_turns: int = TOOL_TURNS) -> Iterator[str]:
    """benchmarks/fast_endpoint.py in its own process; yields its base URL."""
    server = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "fast_endpoint.py"), f"--latency={latency}",
                               f"--jitter={jitter}", f"--tool-turns={tool_turns}"], stdout=subprocess.PIPE, text=True)
    try:
        yield f"http://127.0.0.1:{server.stdout.readline().strip()}/v1"
    finally:
        server.terminate()
        server.wait()


def server_stats(base_url: str) -> dict:
    with urllib.request.urlopen(base_url.removesuffix("/v1") + "/stats") as response:
        return json.load(response)


def run_once(workers: int, prompts: int, latency: float, jitter: float, backend: str = "local") -> dict:
    with tempfile.TemporaryDirectory(prefix="br-bench-") as work, endpoint(latency, jitter) as base_url:
        work_path = Path(work)
        dataset = work_path / "dataset.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": f"benchmark prompt {i}"}) + "\n" for i in range(prompts)))
        env = {**os.environ, "TMPDIR": work}
        cpu_before, machine_before = children_cpu_seconds(), machine_busy_seconds()
        started = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=100",
             "--run_name=bench", "--distribution=terminal_only", f"--num_workers={workers}",
             f"--base_url={base_url}", "--model=bench", "--max_retries=0", f"--backend={backend}"],
            cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        sampler = TreeSampler(process.pid, _MEMORY_SAMPLE_SECONDS)
        sampler.start()
        process.wait()
        elapsed = time.monotonic() - started
        sampler.stopped.set()
        sampler.join()
        cpu = children_cpu_seconds() - cpu_before
        machine = machine_busy_seconds() - machine_before
        if process.returncode != 0:
            raise SystemExit(f"batch_runner failed: {process.stderr.read()}")
        stats = json.loads((work_path / "data" / "bench" / "statistics.json").read_text())
        done = stats["trajectories_in_merged_file"]
        ideal = workers / (CALLS_PER_PROMPT * latency)
        served = server_stats(base_url)
        steady = done / (served["last_response"] - served["first_request"])
        return {"backend": backend, "workers": workers, "prompts": done, "seconds": elapsed,
                "trajectories_per_s": done / elapsed, "ideal_per_s": ideal, "ratio": done / elapsed / ideal,
                "steady_ratio": steady / ideal,
                "cpu_ms_per_trajectory": 1000 * cpu / done, "machine_ms_per_trajectory": 1000 * machine / done,
                "server_ms_per_trajectory": 1000 * served["cpu_seconds"] / done,
                "peak_pss_mb": sampler.peak_pss / 2**20,
                "first_request_s": served["first_request"] - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[4, 64, 256])
    parser.add_argument("--prompts", type=int, default=0, help="prompts per run (default: 30 s of ideal work)")
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="replies take latency +/- up to this (uniform, same mean): real endpoints vary, and "
                             "a fixed latency makes every session of a process come back at the same instant")
    parser.add_argument("--backend", nargs="+", choices=("local", "ray"), default=["local"],
                        help="where sessions run; ray starts a private local Ray per run (its start-up "
                             "shows in '1st req s')")
    args = parser.parse_args()
    header = (f"{'backend':>7} {'workers':>7} {'prompts':>7} {'traj/s':>8} {'ideal':>8} {'ratio':>6} {'steady':>6} "
              f"{'cpu ms/traj':>11} {'machine ms':>10} {'server ms':>9} {'peak PSS MB':>11} {'1st req s':>9}")
    print(machine_line())
    print(f"TERMINAL_ENV={os.environ.get('TERMINAL_ENV') or '(unset: bubblewrap where it works)'}, "
          f"{args.latency:g} s per reply (+/- {args.jitter:g} s)")
    print(header)
    for workers in args.workers:
        ideal = workers / (CALLS_PER_PROMPT * args.latency)
        prompts = args.prompts or max(workers * 4, round(ideal * 30))
        for backend in args.backend:
            r = run_once(workers, prompts, args.latency, args.jitter, backend)
            print(f"{r['backend']:>7} {r['workers']:>7} {r['prompts']:>7} {r['trajectories_per_s']:>8.1f} "
                  f"{r['ideal_per_s']:>8.1f} {r['ratio']:>6.2f} {r['steady_ratio']:>6.2f} "
                  f"{r['cpu_ms_per_trajectory']:>11.2f} {r['machine_ms_per_trajectory']:>10.2f} "
                  f"{r['server_ms_per_trajectory']:>9.2f} "
                  f"{r['peak_pss_mb']:>11.0f} {r['first_request_s']:>9.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
