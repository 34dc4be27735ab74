"""Soak: a long run in small batches under a low descriptor limit, watched for anything that grows.

    python benchmarks/soak.py                                  # 200,000 prompts, batches of 10, ulimit -n 1024
    python benchmarks/soak.py --prompts 20000 --every 2000     # a shorter look

batch_runner runs against ``benchmarks/fast_endpoint.py`` (its own process; 50 ms per reply, one
terminal command per prompt by default: two model calls) with the open-file limit set to
``--nofile`` for both soft and hard, as ``ulimit -n`` sets it, so raising the soft limit cannot help.
Every ``--every`` prompts it prints the throughput since the last line and, for the parent, the worker
processes (the largest and all together) and the report's helper, RSS and PSS, open descriptors,
and the processes in the run's whole tree (sandboxes included). At the end it prints how each figure
moved from the line nearest ``--from`` prompts to the last one taken while prompts ran (after the last
row the run stops its workers and merges): growth shows there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))

from throughput import endpoint, tree_pids, tree_pss_bytes  # noqa: E402

PROGRESS = re.compile(r"\[([\d,]+)/([\d,]+)\]")
SAMPLE_SECONDS = 1.0


@dataclass
class Process:
    rss: int        # bytes
    pss: int
    fds: int


def measure(pid: int) -> Process | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    kilobytes = {line.split(":")[0]: int(line.split()[1]) for line in (status + rollup).splitlines()
                 if line.startswith(("VmRSS:", "Pss:"))}
    return Process(kilobytes.get("VmRSS", 0) * 1024, kilobytes.get("Pss", 0) * 1024, fds)


def niceness(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
    except (OSError, IndexError, ValueError):
        return 0


def python_children(pid: int) -> list[int]:
    """The parent's own forks (worker processes and the report's helper), not the tools they start."""
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(child) for child in (task / "children").read_text().split()]
    except OSError:
        return []
    mine = executable(pid)
    return [child for child in found if mine is not None and executable(child) == mine]


def executable(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:         # gone meanwhile
        return None


@dataclass
class Snapshot:
    prompts: int
    seconds: float
    parent: Process
    workers: list[Process]
    report: Process | None
    processes: int
    tree_pss: int   # every process of the run's tree: what the run takes of the machine's memory

    def row(self, rate: float) -> str:
        mb = 1 << 20
        workers_rss = sum(w.rss for w in self.workers)
        workers_pss = sum(w.pss for w in self.workers)
        biggest = max((w.rss for w in self.workers), default=0)
        report = self.report or Process(0, 0, 0)
        return (f"{self.prompts:>8,} {self.seconds:>7.0f} {rate:>7.1f} "
                f"{self.parent.rss / mb:>7.1f} {self.parent.pss / mb:>7.1f} {self.parent.fds:>5} "
                f"{len(self.workers):>3} {biggest / mb:>7.1f} {workers_rss / mb:>7.1f} {workers_pss / mb:>7.1f} "
                f"{max((w.fds for w in self.workers), default=0):>5} "
                f"{report.rss / mb:>7.1f} {report.pss / mb:>7.1f} {report.fds:>5} {self.processes:>6} "
                f"{self.tree_pss / mb:>8.1f}")


HEADER = (f"{'prompts':>8} {'seconds':>7} {'traj/s':>7} "
          f"{'par RSS':>7} {'par PSS':>7} {'p fds':>5} "
          f"{'wkr':>3} {'wmaxRSS':>7} {'wrk RSS':>7} {'wrk PSS':>7} {'w fds':>5} "
          f"{'rep RSS':>7} {'rep PSS':>7} {'r fds':>5} {'procs':>6} {'tree PSS':>8}")


def snapshot(pid: int, prompts: int, seconds: float) -> Snapshot | None:
    parent = measure(pid)
    if parent is None:
        return None
    workers, report = [], None
    for child in python_children(pid):
        figures = measure(child)
        if figures is None:
            continue
        if niceness(child) > 0:      # the report's helper runs at the lowest priority
            report = figures
        else:
            workers.append(figures)
    return Snapshot(prompts, seconds, parent, workers, report, len(tree_pids(pid)), tree_pss_bytes(pid))


class Progress(threading.Thread):
    """Follows the runner's plain per-prompt lines ("✅ [done/total] prompt ...")."""

    def __init__(self, stream) -> None:
        super().__init__(daemon=True)
        self.stream, self.done, self.tail = stream, 0, []

    def run(self) -> None:
        for line in self.stream:
            if match := PROGRESS.search(line):
                self.done = int(match.group(1).replace(",", ""))
            self.tail = [*self.tail[-20:], line]


def change(first: float, last: float) -> str:
    return f"{first / (1 << 20):.1f} -> {last / (1 << 20):.1f} MB ({100 * (last - first) / first:+.1f}%)" if first \
        else "n/a"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--tool-turns", type=int, default=1, help="terminal commands per prompt (0: no tools)")
    parser.add_argument("--nofile", type=int, default=1024, help="soft and hard limit on open descriptors")
    parser.add_argument("--every", type=int, default=10_000, help="prompts between two lines")
    parser.add_argument("--from", dest="since", type=int, default=20_000,
                        help="the summary compares the end with the line nearest this many prompts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="br-soak-") as work, \
            endpoint(args.latency, 0.0, args.tool_turns) as base_url:
        work_path = Path(work)
        dataset = work_path / "dataset.jsonl"
        with dataset.open("w") as handle:
            for number in range(args.prompts):
                handle.write(json.dumps({"prompt": f"soak prompt {number}"}) + "\n")
        limit = args.nofile
        process = subprocess.Popen(
            [sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}",
             f"--batch_size={args.batch_size}", "--run_name=soak",
             f"--distribution={'terminal_only' if args.tool_turns else 'minimal'}",
             f"--num_workers={args.sessions}", f"--base_url={base_url}", "--model=soak", "--max_retries=0"],
            cwd=work, env={**os.environ, "TMPDIR": work}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit)))
        progress = Progress(process.stdout)
        progress.start()
        print(f"{args.prompts:,} prompts, batches of {args.batch_size}, {args.sessions} sessions, "
              f"{args.latency:g} s per reply, {args.tool_turns} command(s) per prompt, "
              f"TERMINAL_ENV={os.environ.get('TERMINAL_ENV') or '(default)'}, ulimit -n {limit}", flush=True)
        print(HEADER, flush=True)
        started = time.monotonic()
        lines: list[Snapshot] = []
        next_line, last_prompts, last_seconds = args.every, 0, 0.0
        peak_fds = peak_processes = 0
        while process.poll() is None:
            time.sleep(SAMPLE_SECONDS)
            current = snapshot(process.pid, progress.done, time.monotonic() - started)
            if current is None:
                continue
            peak_fds = max(peak_fds, current.parent.fds, *(w.fds for w in current.workers))
            peak_processes = max(peak_processes, current.processes)
            # Lines while prompts run; once the last row is in, the run stops its workers and merges.
            if next_line <= current.prompts < args.prompts:
                rate = (current.prompts - last_prompts) / (current.seconds - last_seconds)
                print(current.row(rate), flush=True)
                lines.append(current)
                last_prompts, last_seconds = current.prompts, current.seconds
                next_line = (current.prompts // args.every + 1) * args.every
        progress.join(5)
        elapsed = time.monotonic() - started
        if process.returncode != 0:
            sys.exit(f"batch_runner exited {process.returncode}:\n{''.join(progress.tail)}")
        statistics = json.loads((work_path / "data" / "soak" / "statistics.json").read_text())
        kept = statistics["trajectories_in_merged_file"]
        print(f"done: {kept:,} trajectories in {elapsed:.0f} s ({kept / elapsed:.1f}/s, start and merge included), "
              f"{len(list((work_path / 'data' / 'soak').glob('batch_*.jsonl'))):,} batch files; "
              f"at most {peak_fds} descriptors in one process, {peak_processes} processes")
        if len(lines) >= 2:
            first = min(lines, key=lambda line: abs(line.prompts - args.since))
            last = lines[-1]
            print(f"from {first.prompts:,} to {last.prompts:,} prompts:")
            print(f"  parent   RSS {change(first.parent.rss, last.parent.rss)}, PSS "
                  f"{change(first.parent.pss, last.parent.pss)}")
            print(f"  workers  RSS {change(sum(w.rss for w in first.workers), sum(w.rss for w in last.workers))}, "
                  f"PSS {change(sum(w.pss for w in first.workers), sum(w.pss for w in last.workers))}")
            if first.report and last.report:
                print(f"  report   RSS {change(first.report.rss, last.report.rss)}, PSS "
                      f"{change(first.report.pss, last.report.pss)}")
            print(f"  the whole tree, PSS {change(first.tree_pss, last.tree_pss)} (pages a worker copies on "
                  f"writing move PSS from the process it shared them with to the worker)")
            print(f"  descriptors: parent {first.parent.fds} -> {last.parent.fds}, largest worker "
                  f"{max(w.fds for w in first.workers)} -> {max(w.fds for w in last.workers)}; "
                  f"processes {first.processes} -> {last.processes}")


if __name__ == "__main__":
    main()
