"""Resume-scan and merge at scale: a synthetic run directory of N rows (default 1,000,000).

    python benchmarks/run_dir_scale.py --rows 1000000

Rows are real rows (rendered by batchrun.rows from a session with two tool calls), varied per prompt;
1% are failures, 1% tombstones, 0.5% name an invented tool. Each phase runs in a fresh process so its
peak RSS is its own; prints rows/s, CPU seconds and peak memory for the scan and for the merge, and
how fast the kernel alone copies the same bytes to disk (the merge writes every kept row once more,
so on a slow disk that copy, not the runner, bounds it), the merge at the end of a resumed run
that added 1% more rows (the previous merge's record lets it append only those), and the run report:
drawn from the whole directory (``--report``) and at the end of a run whose report process has
followed the batch files (only the last rows are read, then the page is drawn); and the size and
write cost of checkpoint.json at 100,000 completed prompts, beside the form earlier versions wrote
(every done index, and counts per batch).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAST_ROWS = 400     # rows written in the report process's last follow interval: 2 s at 200 rows/s
sys.path.insert(0, str(REPO))

from batchrun import rows  # noqa: E402
from batchrun.run_dir import CHECKPOINT, Checkpoint, RunDirectory, atomic_write_json  # noqa: E402

CHECKPOINT_PROMPTS = 100_000
CHECKPOINT_WRITES = 20


def sample_rows() -> dict[str, bytes]:
    """One encoded row of each kind, with placeholders for what varies per prompt."""
    def turn(calls: list[rows.ToolCallRecord], content: str = "") -> rows.AssistantTurn:
        return rows.AssistantTurn(reasoning="Let me think about the next step carefully.", content=content,
                                  tool_calls=calls)
    result = rows.SessionResult(
        prompt_index=123456789, content_key="KEY_PLACEHOLDER_0000000000000000", prompt="PROMPT_PLACEHOLDER",
        toolsets=["terminal", "file"], offered_tools=["terminal", "read_file", "write_file", "patch", "search_files"],
        turns=[turn([rows.ToolCallRecord("call_0", "terminal", '{"command": "ls -la"}',
                                         '{"output": "total 0\\nfile.txt\\n", "exit_code": 0, "error": null}')]),
               turn([rows.ToolCallRecord("call_1", "read_file", '{"path": "file.txt"}',
                                         '{"path": "file.txt", "content": "hello", "total_lines": 1}')]),
               turn([], "Here is the answer to your question.")],
        api_calls=3, usage=rows.Usage(300, 60, 15, 30, 0.003), wall_time=2.5, end_reason="final_answer")
    invented = rows.SessionResult(**{**result.__dict__, "turns": [
        turn([rows.ToolCallRecord("call_0", "made_up_tool", "{}", '{"error": "unknown tool"}')]), turn([], "ok")]})
    failed = rows.SessionResult(**{**result.__dict__, "turns": [], "end_reason": "error",
                                   "error": "HTTP 400: bad request", "error_type": "http_400"})
    ok = rows.trajectory_row(result, batch_num=0, model="m", timestamp="2026-11-30T00:00:00")
    kinds = {"ok": ok,
             "invented": rows.trajectory_row(invented, batch_num=0, model="m", timestamp="2026-11-30T00:00:00"),
             "failed": rows.failure_row(failed), "discarded": rows.tombstone_row(ok, rows.NO_REASONING)}
    return {name: rows.encode_row(row) for name, row in kinds.items()}


def synthetic_row(templates: dict[str, bytes], index: int) -> bytes:
    kind = ("failed" if index % 100 == 1 else "discarded" if index % 100 == 2
            else "invented" if index % 200 == 3 else "ok")
    return (templates[kind].replace(b"123456789", str(index).encode())
            .replace(b"KEY_PLACEHOLDER_0000000000000000", f"{index:032x}".encode())
            .replace(b"PROMPT_PLACEHOLDER", f"synthetic prompt number {index}".encode()))


def generate(run_dir: Path, count: int, batch_size: int) -> None:
    templates = sample_rows()
    run_dir.mkdir(parents=True, exist_ok=True)
    handles: dict[int, object] = {}
    for index in range(count):
        batch = index // batch_size
        if batch not in handles:
            for old in handles.values():
                old.close()
            handles = {batch: (run_dir / f"batch_{batch}.jsonl").open("wb")}
        handles[batch].write(synthetic_row(templates, index))
    for handle in handles.values():
        handle.close()


def append_resumed_rows(run_dir: Path, first: int, count: int) -> None:
    """What a resumed run adds: retries land in the old batch files, spread over all of them."""
    templates = sample_rows()
    files = sorted(run_dir.glob("batch_*.jsonl"))
    lines: dict[Path, list[bytes]] = {}
    for offset in range(count):
        lines.setdefault(files[offset * 7919 % len(files)], []).append(synthetic_row(templates, first + offset))
    for path, new in lines.items():
        with path.open("ab") as handle:
            handle.write(b"".join(new))


def measure(phase: str, run_dir: Path) -> None:
    """Runs inside a fresh process: one phase, then prints a JSON line of figures."""
    from batchrun import report
    from batchrun.report import plots
    from batchrun.report_follower import BatchFollower, OpenBatches
    from batchrun.run_dir import RunDirectory

    directory = RunDirectory(run_dir)
    if phase == "report-end":       # what the report process has done by the time the run ends
        plots.preload()
        open_batches = OpenBatches(1)
        open_batches.publish(len(directory.batch_files()) - 1, [])      # the run's work is over
        follower = BatchFollower(report.RunScan(run_dir), open_batches)
        follower.read_existing()
        append_resumed_rows(run_dir, 10**9, LAST_ROWS)
    cpu_before = _cpu_seconds()
    started = time.perf_counter()
    if phase == "scan":
        directory.scan()
    elif phase == "merge":
        directory.merge(lambda *_: None)
    elif phase == "report":
        report.write_report(run_dir)
    else:
        follower.read_new()
        report.save(follower.scan)
    elapsed = time.perf_counter() - started
    peak_mb = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 1024
    print(json.dumps({"phase": phase, "seconds": elapsed, "cpu_seconds": _cpu_seconds() - cpu_before,
                      "peak_mb": peak_mb}))


def _cpu_seconds() -> float:
    """This process and the helpers it waited for (the scan shares its work out over the cores)."""
    return sum(usage.ru_utime + usage.ru_stime
               for usage in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


def copy_ceiling(run_dir: Path) -> float:
    """Seconds the kernel takes to copy every batch file into one file and make it durable: what
    any merge must at least pay on this disk."""
    started = time.perf_counter()
    target = run_dir / "copy.tmp"
    out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for path in sorted(run_dir.glob("batch_*.jsonl")):
            with path.open("rb") as source:
                size, copied = path.stat().st_size, 0
                while copied < size:
                    copied += os.copy_file_range(source.fileno(), out, size - copied)
        os.fsync(out)
    finally:
        os.close(out)
        target.unlink()
    return time.perf_counter() - started


def checkpoint_cost(run_dir: Path) -> None:
    """Size and seconds per write of checkpoint.json at CHECKPOINT_PROMPTS completed prompts (batch size 1,
    where the per-batch counts earlier versions kept were largest)."""
    outcomes = Counter(completed=CHECKPOINT_PROMPTS * 98 // 100, failed=CHECKPOINT_PROMPTS // 100,
                       discarded=CHECKPOINT_PROMPTS // 100)
    checkpoint = Checkpoint(run_name="scale", dataset_file="dataset.jsonl", distribution="default", model="m",
                            batch_size=1, total_prompts=CHECKPOINT_PROMPTS, completed_samples=CHECKPOINT_PROMPTS,
                            batch_stats=outcomes)
    directory = RunDirectory(run_dir)
    earlier = {**checkpoint.as_json(), "completed_prompts": list(range(CHECKPOINT_PROMPTS)),
               "batch_stats": {str(index): {"completed": 1} for index in range(CHECKPOINT_PROMPTS)}}
    for label, write in (("checkpoint", lambda: directory.write_checkpoint(checkpoint)),
                         ("earlier form", lambda: atomic_write_json(run_dir / CHECKPOINT, earlier))):
        started = time.perf_counter()
        for _ in range(CHECKPOINT_WRITES):
            write()
        seconds = (time.perf_counter() - started) / CHECKPOINT_WRITES
        print(f"{label:>12}: {(run_dir / CHECKPOINT).stat().st_size:>10,} bytes, {seconds * 1000:7.2f} ms per write "
              f"at {CHECKPOINT_PROMPTS:,} completed prompts (write, fsync, rename)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--measure", choices=["scan", "merge", "report", "report-end"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.dir)
        return
    with tempfile.TemporaryDirectory(prefix="br-scale-") as work:
        run_dir = Path(work) / "run"
        started = time.perf_counter()
        generate(run_dir, args.rows, args.batch_size)
        size_gb = sum(p.stat().st_size for p in run_dir.iterdir()) / 1e9
        print(f"generated {args.rows:,} rows ({size_gb:.2f} GB) in {time.perf_counter() - started:.1f}s")
        report("scan", args.rows, measured("scan", run_dir), "one process per core")
        report("merge", args.rows, measured("merge", run_dir), "from nothing: every kept row written and fsynced")
        seconds = copy_ceiling(run_dir)
        print(f"{'copy':>6}: {args.rows / seconds:>9,.0f} rows/s  (the same bytes copied by the kernel and fsynced "
              f"in {seconds:.1f}s: the disk's ceiling for a merge from nothing)")
        added = max(1, args.rows // 100)
        append_resumed_rows(run_dir, args.rows, added)
        figures = measured("merge", run_dir)
        print(f"remerge: {added / figures['seconds']:>9,.0f} rows/s  ({added:,} rows that a resumed run added to the "
              f"{args.rows:,} merged before, in {figures['seconds']:.2f}s, {figures['cpu_seconds']:.2f} CPU-s, "
              f"peak RSS {figures['peak_mb']:.0f} MB: only they are read and appended)")
        report("report", args.rows + added, measured("report", run_dir), "--report: every row read, then drawn")
        figures = measured("report-end", run_dir)
        print(f"report at the end of a run: {figures['seconds']:.2f}s, {figures['cpu_seconds']:.2f} CPU-s (the report "
              f"process had followed the batch files; it reads the last {LAST_ROWS} rows and draws the page)")
        checkpoint_cost(run_dir)


def measured(phase: str, run_dir: Path) -> dict:
    output = subprocess.run([sys.executable, __file__, "--measure", phase, "--dir", str(run_dir)],
                            capture_output=True, text=True, check=True).stdout
    return json.loads(output)


def report(label: str, rows_in_directory: int, figures: dict, note: str) -> None:
    print(f"{label:>6}: {rows_in_directory / figures['seconds']:>9,.0f} rows/s  ({rows_in_directory:,} rows in "
          f"{figures['seconds']:.1f}s, {figures['cpu_seconds']:.1f} CPU-s, peak RSS {figures['peak_mb']:.0f} MB; "
          f"{note})")


if __name__ == "__main__":
    main()
