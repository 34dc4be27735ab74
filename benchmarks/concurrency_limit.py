"""Adaptive concurrency against an endpoint with a per-key concurrency limit.

    python benchmarks/concurrency_limit.py                          # both scenarios, once each
    python benchmarks/concurrency_limit.py --scenario fixed --runs 3
    python benchmarks/concurrency_limit.py --scenario fixed --off-for 60   # and with the adaptation off

The endpoint is benchmarks/fast_endpoint.py with a cap: it serves at most K requests at once, 200 ms
each, and answers 429 without Retry-After beyond. Each prompt makes 3 model calls and runs 2 terminal
commands (TERMINAL_ENV=local unless set: this measures the requests, not the sandboxes).

* fixed: K = 32, --num_workers=256, 400 prompts. Printed: goodput (requests answered per second from
  the first request to the last reply, over the K-limited ideal K / latency), steady (requests served
  at once on average, from 1 s after the first request to 1 s before the last reply, over K), the
  whole run against the K-limited ideal (prompts / (K / (3 x latency)): start-up, merge and report
  included), the 429s and their share of the requests, failed prompts, and the runner's limit (final,
  lowest, highest, from statistics.json). --off-for S runs the same with --adaptive_concurrency=False, stopped by
  Ctrl-C after S seconds (it may take minutes to finish), for comparison.
* changing: K = 32, then 8, then 64 (--changes), --num_workers=256, 1,000 prompts. Printed: the
  concurrency served and the 429s per half second, and for each change how long the run took to
  follow it: until the first second in which the endpoint served at least 80% of K on average and
  answered at most 5% of the requests with 429.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from throughput import CALLS_PER_PROMPT, REPO, TOOL_TURNS, server_stats

SAMPLE_EVERY = 0.1        # seconds between looks at the endpoint's figures
FOLLOWED_SHARE = 0.8      # of K served on average, over FOLLOW_WINDOW ...
FOLLOWED_429S = 0.05      # ... with at most this share of 429s
FOLLOW_WINDOW = 1.0


@dataclass
class Sample:
    at: float             # seconds after the first request
    limit: int            # K at that moment
    answered: int
    rejected: int
    busy_seconds: float


@contextmanager
def capped_endpoint(latency: float, max_concurrent: int) -> Iterator[str]:
    """fast_endpoint.py with a concurrency cap, in its own process; yields its base URL."""
    server = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "fast_endpoint.py"), f"--latency={latency}",
                               f"--tool-turns={TOOL_TURNS}", f"--max-concurrent={max_concurrent}"],
                              stdout=subprocess.PIPE, text=True)
    try:
        yield f"http://127.0.0.1:{server.stdout.readline().strip()}/v1"
    finally:
        server.terminate()
        server.wait()


def set_limit(base_url: str, max_concurrent: int) -> None:
    request = urllib.request.Request(base_url.removesuffix("/v1") + "/limit", method="POST",
                                     data=json.dumps({"max_concurrent": max_concurrent}).encode())
    urllib.request.urlopen(request).close()


class Watcher(threading.Thread):
    """Samples the endpoint's figures and applies the K schedule ((seconds after the first request, K))."""

    def __init__(self, base_url: str, schedule: list[tuple[float, int]]) -> None:
        super().__init__(daemon=True)
        self.base_url, self.schedule = base_url, list(schedule)
        self.samples: list[Sample] = []
        self.changed_at: list[tuple[float, int]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        first = None
        while not self.stopped.wait(SAMPLE_EVERY):
            stats = server_stats(self.base_url)
            if stats["first_request"] is None:
                continue
            first = first or stats["first_request"]
            at = time.monotonic() - first
            while self.schedule and at >= self.schedule[0][0]:
                _, limit = self.schedule.pop(0)
                set_limit(self.base_url, limit)
                self.changed_at.append((at, limit))
                stats = server_stats(self.base_url)
            self.samples.append(Sample(at, stats["max_concurrent"], stats["requests"], stats["rejected"],
                                       stats["busy_seconds"]))


def write_dataset(work: Path, prompts: int) -> Path:
    dataset = work / "dataset.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"benchmark prompt {i}"}) + "\n" for i in range(prompts)))
    return dataset


def run_runner(work: Path, base_url: str, prompts: int, workers: int, adaptive: bool,
               stop_after: float | None = None) -> tuple[float, dict]:
    """(seconds, statistics.json) of one batch_runner run; Ctrl-C after ``stop_after`` seconds."""
    dataset = write_dataset(work, prompts)
    env = {**os.environ, "TMPDIR": str(work), "TERMINAL_ENV": os.environ.get("TERMINAL_ENV") or "local"}
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--batch_size=100",
         "--run_name=bench", "--distribution=terminal_only", f"--num_workers={workers}", f"--base_url={base_url}",
         "--model=bench", f"--adaptive_concurrency={adaptive}"],
        cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        process.wait(stop_after)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGINT)
        process.wait()
    elapsed = time.monotonic() - started
    if process.returncode not in (0, 2, 130):
        raise SystemExit(f"batch_runner failed: {process.stderr.read()}")
    return elapsed, json.loads((work / "data" / "bench" / "statistics.json").read_text())


def fixed(args: argparse.Namespace, adaptive: bool = True, stop_after: float | None = None) -> None:
    k, latency = args.k, args.latency
    with tempfile.TemporaryDirectory(prefix="br-conc-") as work, capped_endpoint(latency, k) as base_url:
        watcher = Watcher(base_url, [])
        watcher.start()
        elapsed, stats = run_runner(Path(work), base_url, args.prompts, args.workers, adaptive, stop_after)
        watcher.stopped.set()
        watcher.join()
        served = server_stats(base_url)
    done = stats["trajectories_in_merged_file"]
    requests = served["requests"] + served["rejected"]
    serving = served["last_response"] - served["first_request"]
    goodput = served["requests"] / serving / (k / latency)
    whole = done / elapsed / (k / (CALLS_PER_PROMPT * latency))
    steady = mean_served([s for s in watcher.samples if 1.0 <= s.at <= serving - 1.0]) / k
    limit = stats["this_run"].get("concurrency", {})
    print(f"{'on' if adaptive else 'off':>8} {done:>5}/{args.prompts:<5} {elapsed:>7.1f} {goodput:>7.2f} "
          f"{steady:>6.2f} {whole:>6.2f} {served['rejected']:>6} {100 * served['rejected'] / requests:>6.1f}% "
          f"{stats['failed_prompts']:>6} {limit.get('final', '-'):>5} {limit.get('min', '-'):>4} "
          f"{limit.get('max', '-'):>4}", flush=True)


def mean_served(samples: list[Sample]) -> float:
    """Requests served at once on average between the first and the last sample."""
    if len(samples) < 2:
        return float("nan")
    return (samples[-1].busy_seconds - samples[0].busy_seconds) / (samples[-1].at - samples[0].at)


def follow_time(samples: list[Sample], since: float, limit: int) -> float | None:
    """Seconds from ``since`` to the start of the first FOLLOW_WINDOW that served FOLLOWED_SHARE of
    ``limit`` on average with at most FOLLOWED_429S of its requests refused."""
    after = [s for s in samples if s.at >= since]
    for index, start in enumerate(after):
        end = next((s for s in after[index:] if s.at >= start.at + FOLLOW_WINDOW), None)
        if end is None or end.limit != limit:
            return None
        concurrency = (end.busy_seconds - start.busy_seconds) / (end.at - start.at)
        rejected = end.rejected - start.rejected
        requests = rejected + end.answered - start.answered
        if concurrency >= FOLLOWED_SHARE * limit and rejected <= FOLLOWED_429S * max(1, requests):
            return start.at - since
    return None


def changing(args: argparse.Namespace) -> None:
    schedule = [(float(at), int(limit)) for at, limit in (change.split(":") for change in args.changes)]
    with tempfile.TemporaryDirectory(prefix="br-conc-") as work, capped_endpoint(args.latency, args.k) as base_url:
        watcher = Watcher(base_url, schedule)
        watcher.start()
        elapsed, stats = run_runner(Path(work), base_url, args.changing_prompts, args.workers, True)
        watcher.stopped.set()
        watcher.join()
    samples = watcher.samples
    print(f"K = {args.k}, then {', '.join(f'{k} at {at:g} s' for at, k in schedule)} after the first request; "
          f"{args.changing_prompts} prompts in {elapsed:.1f} s, {stats['failed_prompts']} failed")
    print(f"{'t s':>6} {'K':>4} {'served at once':>14} {'answered':>8} {'429s':>5}")
    step = max(1, round(0.5 / SAMPLE_EVERY))
    for before, after in zip(samples[::step], samples[step::step], strict=False):
        at_once = (after.busy_seconds - before.busy_seconds) / (after.at - before.at)
        print(f"{after.at:>6.1f} {after.limit:>4} {at_once:>14.1f} {after.answered - before.answered:>8} "
              f"{after.rejected - before.rejected:>5}")
    for at, limit in [(0.0, args.k), *watcher.changed_at]:
        took = follow_time(samples, at, limit)
        print(f"K = {limit} at {at:.1f} s: followed " + (f"after {took:.1f} s" if took is not None else "never"))
    total = samples[-1].answered + samples[-1].rejected
    print(f"429s: {samples[-1].rejected} of {total} requests ({100 * samples[-1].rejected / total:.1f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=("fixed", "changing", "both"), default="both")
    parser.add_argument("--runs", type=int, default=1, help="runs of the fixed scenario")
    parser.add_argument("--k", type=int, default=32, help="requests the endpoint serves at once (at the start)")
    parser.add_argument("--workers", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=400, help="prompts of the fixed scenario")
    parser.add_argument("--changing-prompts", type=int, default=1000)
    parser.add_argument("--changes", nargs="+", default=["5:8", "12:64"],
                        help="SECONDS:K, seconds after the first request (changing scenario)")
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--off-for", type=float, default=0.0,
                        help="also run the fixed scenario with --adaptive_concurrency=False, stopped after this "
                             "many seconds")
    args = parser.parse_args()
    print(f"TERMINAL_ENV={os.environ.get('TERMINAL_ENV') or 'local'}, {args.latency:g} s per reply, "
          f"--num_workers={args.workers}")
    if args.scenario in ("fixed", "both"):
        print(f"fixed: K = {args.k}, ideal {args.k / args.latency:.0f} requests/s, "
              f"{args.k / (CALLS_PER_PROMPT * args.latency):.1f} prompts/s")
        print(f"{'adaptive':>8} {'done':>11} {'seconds':>7} {'goodput':>7} {'steady':>6} {'whole':>6} {'429s':>6} "
              f"{'share':>7} {'failed':>6} {'final':>5} {'min':>4} {'max':>4}")
        for _ in range(args.runs):
            fixed(args)
        if args.off_for:
            fixed(args, adaptive=False, stop_after=args.off_for)
    if args.scenario in ("changing", "both"):
        changing(args)


if __name__ == "__main__":
    main()
