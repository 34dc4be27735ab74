"""The run report: data/<run_name>/report.html from a real run through the CLI, opened in a real
headless Chromium; and the streaming builder on a synthetic run of thousands of rows."""

from __future__ import annotations

import contextlib
import dataclasses
import html
import json
import os
import random
import re
import subprocess
import sys
import threading
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import (
    REPO,
    batch_runner_command,
    cli_environment,
    endpoint_args,
    obeying_file_modes,
    run_cli,
    wait_for,
    write_dataset,
)
from scripted_endpoint import ScriptedEndpoint

import toolset_distributions
from batchrun import report, rows
from batchrun.install_hint import install_hint
from batchrun.report import cards, tables
from batchrun.report import summary as report_summary
from batchrun.rows import AssistantTurn, SessionResult, ToolCallRecord, Usage
from batchrun.tools.browser.availability import chromium_executable

HOSTILE = '</script><script>alert("pwned")</script><img src=x onerror=alert(2)> & "quotes"'
PROMPTS = [
    'say hi [[call terminal {"command": "echo hi-from-terminal"}]]',
    'read a missing file [[call read_file {"path": "missing.txt"}]] [[call terminal {"command": "echo again"}]]',
    "answer without thinking [[reasoning none]]",
    "this one fails [[fail 400 always]]",
    "make up a tool [[invent]]",
    "runs out of room [[length]]",
    HOSTILE + " [[reasoning think]]",
    "plain question one",
    "plain question two",
]
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One real run of every kind of outcome, shared by the tests that only read it."""
    tmp_path = tmp_path_factory.mktemp("report")
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS)
    with ScriptedEndpoint() as server:
        result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=4", "--run_name=run",
                         "--distribution=terminal_only", "--max_tokens=50", *endpoint_args(server))
    assert result.returncode == 2, result.stderr      # 2: the run finished, and a prompt failed
    assert "Report: data/run/report.html" in result.stdout
    return tmp_path / "data" / "run"


def page_data(page: str) -> dict:
    found = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.DOTALL)
    return json.loads(found.group(1))


# ---------------------------------------------------------------------------------------------
# Through the CLI


def test_a_run_writes_a_self_contained_report(run_dir: Path) -> None:
    page = (run_dir / report.REPORT_FILE).read_text(encoding="utf-8")
    assert page.count('<svg class="chart"') == 7
    references = re.findall(r'(?:src|href)="([^"]*)"', page) + re.findall(r"url\(([^)]*)\)", page)
    assert references and all(target.startswith("#") for target in references)   # only inside the page
    assert "@import" not in page
    assert "default-src 'none'" in page                     # the page may not load anything, ever
    assert HOSTILE not in page and "</script><script>alert" not in page
    data = page_data(page)
    assert data["total"] == len(PROMPTS)
    by_prompt = {row["p"]: row for row in data["rows"]}
    assert by_prompt[HOSTILE + " [[reasoning think]]"]["s"] == "completed"     # escaped, not lost
    assert by_prompt["this one fails [[fail 400 always]]"]["et"] == "http_400"
    assert by_prompt["answer without thinking [[reasoning none]]"]["s"] == "discarded"
    assert by_prompt["make up a tool [[invent]]"]["s"] == "corrupted"
    assert by_prompt["runs out of room [[length]]"]["e"] == "truncated"


def test_report_flag_rebuilds_it_from_the_run_directory_alone(run_dir: Path) -> None:
    (run_dir / report.REPORT_FILE).unlink()
    result = run_cli(run_dir.parent.parent, "--report", "--run_name=run")    # no dataset, no key, no endpoint
    assert result.returncode == 0, result.stderr
    assert "data/run/report.html" in result.stdout
    assert (run_dir / report.REPORT_FILE).stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [(["--run_name=nothing_here"], "no run directory data/nothing_here/"),
                                           ([], "--run_name"),
                                           (["--run_name=../etc"], "--run_name must be a plain name")])
def test_report_flag_needs_an_existing_run_directory(tmp_path: Path, args: list[str], message: str) -> None:
    result = run_cli(tmp_path, "--report", *args)
    assert result.returncode == 1
    assert result.stderr.startswith("error:") and message in result.stderr


# --report ended in a traceback (PermissionError from looking the directory up); --export said "cannot
# write data/locked: Permission denied. Choose an --out", though it had only to read.
@pytest.mark.parametrize(("flag", "command"), [("--report", "--report"), ("--export=openai", "--export")])
def test_a_run_directory_this_user_may_not_read_is_named_as_such(tmp_path: Path, flag: str, command: str) -> None:
    prefix = obeying_file_modes()
    (tmp_path / "data" / "locked").mkdir(parents=True, mode=0)
    result = run_cli(tmp_path, flag, "--run_name=locked", prefix=prefix)
    assert result.returncode == 1
    assert result.stderr.strip() == ("error: cannot read the run directory data/locked/: Permission denied. "
                                     f"Run {command} as a user who may read it.")


def test_a_report_that_cannot_be_written_does_not_fail_the_run(tmp_path: Path, endpoint) -> None:
    blocker = tmp_path / "data" / "run" / report.REPORT_FILE / "in-the-way"
    blocker.mkdir(parents=True)                              # renaming the page into place fails
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["plain question"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                     "--distribution=terminal_only", *endpoint_args(endpoint))
    assert result.returncode == 0, result.stderr
    assert "run report was not written" in result.stdout + result.stderr
    assert (tmp_path / "data" / "run" / "trajectories.jsonl").stat().st_size > 0


def test_an_endpoints_huge_error_and_a_huge_invented_tool_name_are_trimmed_on_the_page(tmp_path: Path,
                                                                                       endpoint) -> None:
    error, name = "E" * 1_000_000, "N" * 300_000
    endpoint.script = lambda body: ((400, {"error": {"message": error}}, {})
                                    if "fail me" in json.dumps(body["messages"]) else None)
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["fail me", f"[[call {name} {{}}]]"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=2", "--run_name=run",
                     "--distribution=terminal_only", *endpoint_args(endpoint))
    assert result.returncode == 2, result.stderr
    page = (tmp_path / "data" / "run" / report.REPORT_FILE).read_text(encoding="utf-8")
    assert "E" * 10_000 not in page and "N" * 10_000 not in page
    assert len(page) < 500_000
    rows_shown = {row["s"]: row for row in page_data(page)["rows"]}
    # The failure row itself holds the message's start and its length (the endpoint's error is clipped
    # before it becomes a row); the page trims whatever else is long.
    assert rows_shown["failed"]["err"].startswith("HTTP 400: EEE") and len(rows_shown["failed"]["err"]) < 2_000
    assert rows_shown["corrupted"]["inv"][0].startswith("NNN")


def _descendants(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            children += [int(child) for child in (task / "children").read_text().split()]
    return children + [grandchild for child in children for grandchild in _descendants(child)]


def test_every_process_of_a_run_works_at_the_priority_the_run_was_started_with(tmp_path: Path, endpoint) -> None:
    # The end of a run waits for its report process: at a lower priority, on a machine busy with other
    # work, it gets next to no CPU time, and the run's exit waits minutes for it.
    checked = threading.Event()

    def hold_until_checked(body: dict) -> None:
        checked.wait(60)
        return None     # then answer as the prompt says

    endpoint.script = hold_until_checked
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["plain question"])
    run = subprocess.Popen(batch_runner_command(f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                                                "--distribution=terminal_only", *endpoint_args(endpoint)),
                           cwd=tmp_path, env=cli_environment(tmp_path), stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: endpoint.requests, 60, "the model call")
        started_with = os.getpriority(os.PRIO_PROCESS, run.pid)
        priorities = {}
        for pid in _descendants(run.pid):
            with contextlib.suppress(ProcessLookupError):      # a process that ended meanwhile
                priorities[pid] = os.getpriority(os.PRIO_PROCESS, pid)
    finally:
        checked.set()
        out, err = run.communicate(timeout=120)
    assert run.returncode == 0, out + err
    assert len(priorities) >= 2, priorities                     # the report process and a worker at least
    assert set(priorities.values()) == {started_with}, priorities


# ---------------------------------------------------------------------------------------------
# In a real browser


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = chromium_executable()       # found as the browser tools find it
    if chromium is None:
        pytest.skip("no Chromium here: apt-get install chromium (or set BROWSER_EXECUTABLE)")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=BROWSER_ARGS)
        yield launched
        launched.close()


def test_the_page_renders_plots_and_a_browsable_trajectory_offline(run_dir: Path, browser) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    requests, errors, dialogs = [], [], []
    page.on("request", lambda request: requests.append(request.url))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    url = (run_dir / report.REPORT_FILE).resolve().as_uri()
    page.goto(url)

    assert page.locator("svg.chart").count() == 7
    assert page.locator("#list button").count() == len(PROMPTS)
    assert "9 of 9 shown" in page.locator("#count").inner_text()

    page.fill("#search", "hi-from-terminal")
    assert page.locator("#list button").count() == 1
    page.locator("#list button").first.click()
    detail = page.locator("#detail")
    assert "call terminal" in detail.inner_text()
    assert detail.locator(".call pre").first.inner_text() == "echo hi-from-terminal"
    assert "hi-from-terminal\n" in detail.locator(".result.ok pre").first.inner_text()
    assert detail.locator("details.think").count() == 2                      # reasoning folded
    assert not detail.locator("details.think").first.evaluate("node => node.open")

    page.fill("#search", "no prompt says this")
    assert page.locator("#list button").count() == 0
    assert "No sampled trajectory matches" in page.locator("#list").inner_text()

    page.fill("#search", "")
    page.select_option("select[aria-label='any status']", "failed")
    assert page.locator("#list button").count() == 1
    assert "http_400" in detail.inner_text()
    page.select_option("select[aria-label='any status']", "")
    page.select_option("select[aria-label='any tool']", "read_file")
    page.locator("#list button").first.click()
    assert detail.locator(".result.failed").count() == 1                      # the missing file

    page.select_option("select[aria-label='any tool']", "")
    page.fill("#search", "pwned")
    page.locator("#list button").first.click()
    assert HOSTILE in detail.locator(".turn.human").inner_text()              # shown as text, never run
    page.fill("#search", "hi-from-terminal")
    page.locator("#list button").first.click()

    artifacts = REPO / "test-artifacts"
    artifacts.mkdir(exist_ok=True)
    page.screenshot(path=str(artifacts / "report.png"), full_page=True)
    assert errors == [] and dialogs == []
    assert requests == [url]                                                  # nothing but the file itself
    page.close()


# ---------------------------------------------------------------------------------------------
# The builder on a synthetic run: bounded sample, streaming figures


def synthetic_result(index: int, rng: random.Random) -> SessionResult:
    turns = []
    for turn in range(rng.randint(1, 5)):
        calls = []
        if rng.random() < 0.6:
            name = rng.choice(["terminal", "read_file", "write_file"])
            result = '{"error": "nope"}' if rng.random() < 0.2 else json.dumps({"output": "x" * rng.randint(0, 4000)})
            calls.append(ToolCallRecord(f"call_{turn}_0", name, '{"command": "ls"}', result))
        turns.append(AssistantTurn("thinking " * 10, "ok", calls))
    return SessionResult(prompt_index=index, content_key=f"{index:032x}", prompt=f"prompt {index} {HOSTILE}",
                         toolsets=["terminal", "file"], offered_tools=["terminal", "read_file", "write_file"],
                         turns=turns, api_calls=len(turns), usage=Usage(100 * index, 10, 5, 0, 0.001),
                         wall_time=1.5, end_reason="final_answer")


def write_synthetic_run(run_dir: Path, count: int) -> Counter:
    """Rows of every kind in batch files of 500, plus a half-written last line; returns the kinds."""
    rng = random.Random(7)
    kinds: Counter = Counter()
    run_dir.mkdir(parents=True)
    lines: dict[int, list[bytes]] = {}
    for index in range(count):
        result = synthetic_result(index, rng)
        roll = rng.random()
        if roll < 0.03:
            result.end_reason, result.error = "error", "HTTP 400"
            result.error_type = rng.choice(["http_400", "timeout"])
            row, kind = rows.failure_row(result), "failed"
        elif roll < 0.06:
            trajectory = rows.trajectory_row(result, batch_num=index // 500, model="synthetic",
                                             timestamp="2026-01-01T10:00:00")
            row, kind = rows.tombstone_row(trajectory, rows.NO_REASONING), "discarded"
        else:
            if roll < 0.08:
                result.turns[0].tool_calls.append(ToolCallRecord("call_x", "made_up_tool", "{}", "Error: unknown"))
            if roll > 0.9:
                result.end_reason = rng.choice(["max_turns", "truncated"])
            row = rows.trajectory_row(result, batch_num=index // 500, model="synthetic",
                                      timestamp=f"2026-01-01T10:{index // 60 % 60:02d}:{index % 60:02d}")
            kind = "corrupted" if roll < 0.08 else "partial" if roll > 0.9 else "completed"
        kinds[kind] += 1
        lines.setdefault(index // 500, []).append(rows.encode_row(row))
    for batch_num, batch in lines.items():
        (run_dir / f"batch_{batch_num}.jsonl").write_bytes(b"".join(batch))
    with (run_dir / "batch_0.jsonl").open("ab") as handle:
        handle.write(b'{"prompt_index": 99999, "content_key": "ab", "conversations": [')   # a crash mid-write
    (run_dir / "checkpoint.json").write_text(json.dumps({"distribution": "terminal_only", "total_prompts": count}))
    return kinds


def test_a_large_run_gives_a_bounded_sample_that_covers_every_kind(tmp_path: Path) -> None:
    run_dir = tmp_path / "data" / "big"
    kinds = write_synthetic_run(run_dir, 3000)
    scan = report.RunScan(run_dir)
    scan.read_new_rows()
    summary, sample = scan.summary, scan.sample
    assert summary.row_count == 3000 and summary.unreadable_lines == 0
    assert {status: summary.statuses[status] for status in kinds} == dict(kinds)
    assert summary.tools["terminal"][0] > 0 and summary.invented_tools["made_up_tool"] == kinds["corrupted"]
    assert summary.toolsets == {"terminal": summary.kept, "file": summary.kept}
    assert sum(summary.timeline.points()[i][1] + summary.timeline.points()[i][2]
               for i in range(len(summary.timeline.points()))) == summary.kept

    held = len(sample._rows)
    assert held <= sum(quota * 4 for quota in report.QUOTAS.values())      # bounded by quotas, not by rows
    chosen = sample.chosen()
    assert len(chosen) <= report.SAMPLE_LIMIT
    assert {row["s"] for row in chosen} == set(kinds)
    assert {tool for row in chosen for tool in row["tf"]} == {"terminal", "read_file", "write_file"}
    assert all(len(json.dumps(row["turns"])) < 3 * report.ROW_BUDGET for row in chosen)

    small = report.TrajectorySample(limit=25)
    for row_id, (kind, detail) in enumerate([("failed", "x")] * 100 + [("completed", "")] * 100):
        small.offer(row_id, [(kind, detail)], lambda row_id=row_id: {"id": row_id})
    picked = small.chosen()
    assert len(picked) == 25 and any(row["id"] < 100 for row in picked) and any(row["id"] >= 100 for row in picked)

    page = report.render(run_dir, summary, sample)
    data = page_data(page)
    assert data["total"] == 3000 and len(data["rows"]) == len(chosen)
    assert f"Showing {len(chosen)} of 3,000 rows" in page
    assert HOSTILE not in page and all(HOSTILE in row["p"] for row in data["rows"])


def test_a_scan_in_steps_counts_each_row_once_while_rows_are_still_being_written(tmp_path: Path) -> None:
    whole = tmp_path / "data" / "whole"
    write_synthetic_run(whole, 1200)
    once = report.RunScan(whole)
    once.read_new_rows()
    growing = tmp_path / "data" / "growing"
    growing.mkdir(parents=True)
    scan = report.RunScan(growing)
    for name in ("checkpoint.json", "batch_0.jsonl", "batch_1.jsonl", "batch_2.jsonl"):
        data = (whole / name).read_bytes()
        for cut in (len(data) // 3, len(data) // 3 + 17, len(data)):    # the middle of a row, then the rest
            with (growing / name).open("ab") as handle:
                handle.write(data[(growing / name).stat().st_size:cut])
            scan.read_new_rows()
    assert scan.summary.statuses == once.summary.statuses and scan.summary.row_count == 1200
    assert scan.summary.tools == once.summary.tools and scan.summary.batch_files == 3
    assert scan.summary.unreadable_lines == 0      # the half-written last line is not a row yet
    assert {row["s"] for row in scan.sample.chosen()} == {row["s"] for row in once.sample.chosen()}


def test_plots_drawn_before_the_end_are_used_only_if_no_row_came_after_them(tmp_path: Path) -> None:
    run_dir = tmp_path / "data" / "run"
    write_synthetic_run(run_dir, 40)
    scan = report.RunScan(run_dir)
    scan.read_new_rows()
    early = report.Plots(svg={"tools": "<svg>drawn early</svg>"}, distribution="terminal_only",
                         rows=scan.summary.row_count)
    assert "drawn early" in report.render(run_dir, scan.summary, scan.sample, early)
    stale = dataclasses.replace(early, rows=scan.summary.row_count - 1)
    assert "drawn early" not in report.render(run_dir, scan.summary, scan.sample, stale)
    other = dataclasses.replace(early, distribution="default")
    assert "drawn early" not in report.render(run_dir, scan.summary, scan.sample, other)


def test_the_report_of_a_resumed_run_covers_the_rows_of_earlier_invocations(tmp_path: Path, endpoint) -> None:
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"question {i}" for i in range(5)])
    args = [f"--dataset_file={dataset}", "--batch_size=2", "--run_name=run", "--distribution=terminal_only",
            *endpoint_args(endpoint)]
    assert run_cli(tmp_path, *args, "--max_samples=3").returncode == 0
    result = run_cli(tmp_path, *args, "--resume")
    assert result.returncode == 0, result.stderr
    data = page_data((tmp_path / "data" / "run" / report.REPORT_FILE).read_text(encoding="utf-8"))
    assert data["total"] == 5
    assert sorted(row["p"] for row in data["rows"]) == [f"question {i}" for i in range(5)]


def test_plots_drawn_by_two_processes_are_the_plots_one_process_draws(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "data" / "small"
    write_synthetic_run(run_dir, 300)
    # In a fresh interpreter: the test process has threads of its own, and with a thread running
    # the plots are drawn in one process.
    script = f"""
import json, threading
from pathlib import Path
from batchrun import report
from batchrun.report import plots as report_plots
scan = report.RunScan(Path({str(run_dir)!r}))
scan.read_new_rows()
assert threading.active_count() == 1
forked = report_plots.draw(scan.summary, None, "terminal_only")
release = threading.Event()
threading.Thread(target=release.wait).start()
alone = report_plots.draw(scan.summary, None, "terminal_only")
release.set()
print(json.dumps([list(forked), forked == alone]))
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    names, same = json.loads(result.stdout)
    assert names == ["tools", "toolsets", "reasoning", "outcomes", "turns", "usage", "timeline"]
    assert same


def test_without_matplotlib_each_plot_says_in_its_place_what_draws_it(tmp_path: Path, monkeypatch) -> None:
    run_dir = tmp_path / "data" / "small"
    write_synthetic_run(run_dir, 50)
    monkeypatch.setitem(sys.modules, "matplotlib", None)           # import matplotlib -> ImportError
    page = report.write_report(run_dir).read_text(encoding="utf-8")
    assert "<svg" not in page
    assert "<table>" in page and "terminal" in page
    panels = re.findall(r'<section class="panel">(.*?)</section>', page, re.S)
    assert len(panels) == 7
    for panel in panels:
        [place] = re.findall(r'<div class="plot missing">(.*?)</div>', panel, re.S)
        assert "matplotlib" in place and html.escape(install_hint("report")) in place
        assert "--report --run_name=small" in place


def test_a_plot_with_nothing_to_draw_says_so_in_its_place(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "data" / "empty"
    run_dir.mkdir(parents=True)
    page = report.write_report(run_dir).read_text(encoding="utf-8")
    panels = re.findall(r'<section class="panel"><h2>(.*?)</h2>(.*?)</section>', page, re.S)
    for title, panel in panels:
        assert "<svg" in panel or "<table>" in panel or "Nothing to plot" in panel, title


def test_expected_toolset_shares_match_the_sampler() -> None:
    assert report.expected_toolset_shares("terminal_only") == {"terminal": 1.0, "file": 1.0}
    assert report.expected_toolset_shares("no such distribution") is None
    for name in ("development", "research", "creative"):
        expected = report.expected_toolset_shares(name)
        rng = random.Random(1)
        draws = 20_000
        seen = Counter(toolset for _ in range(draws) for toolset in toolset_distributions.sample_toolsets(name, rng))
        for toolset, share in expected.items():
            assert abs(seen[toolset] / draws - share) < 0.015, (name, toolset)


def test_the_timeline_widens_its_buckets_instead_of_growing() -> None:
    timeline = report_summary.Timeline()
    for second in range(0, 100_000, 7):
        timeline.add(1_700_000_000 + second, completed=second % 2 == 0)
    assert len(timeline.counts) <= report_summary.TIMELINE_BUCKETS
    assert sum(a + b for _, a, b in timeline.points()) == len(range(0, 100_000, 7))


def reencode_batch_files(run_dir: Path) -> None:
    """Every complete row rewritten with sorted keys and no spaces, as another JSON encoder might."""
    for path in run_dir.glob("batch_*.jsonl"):
        lines = path.read_bytes().splitlines(keepends=True)
        path.write_bytes(b"".join(json.dumps(json.loads(line), sort_keys=True, separators=(",", ":")).encode() + b"\n"
                                  if line.endswith(b"\n") else line for line in lines))


def test_the_report_counts_rows_of_any_json_encoding_as_it_counts_its_own(tmp_path: Path) -> None:
    ours, other = tmp_path / "data" / "ours", tmp_path / "data" / "other"
    write_synthetic_run(ours, 600)
    write_synthetic_run(other, 600)
    reencode_batch_files(other)
    scans = [report.RunScan(run_dir) for run_dir in (ours, other)]
    for scan in scans:
        scan.read_new_rows()
    first, second = (scan.summary for scan in scans)
    assert second.row_count == first.row_count == 600 and second.unreadable_lines == 0
    assert (second.statuses, second.tools, second.toolsets, second.models) == \
           (first.statuses, first.tools, first.toolsets, first.models)
    assert (second.timeline.counts, second.wall_time.bins, second.failure_causes, second.discard_reasons) == \
           (first.timeline.counts, first.wall_time.bins, first.failure_causes, first.discard_reasons)


def test_a_line_that_is_json_but_not_a_row_is_named_on_the_page(tmp_path: Path) -> None:
    run_dir = tmp_path / "data" / "odd"
    write_synthetic_run(run_dir, 50)
    batch = run_dir / "batch_0.jsonl"
    lines = batch.read_bytes().splitlines(keepends=True)
    lines.insert(3, b'{"format": 9, "prompt_index": 3}\n')
    batch.write_bytes(b"".join(lines))
    page = report.write_report(run_dir).read_text(encoding="utf-8")
    assert "1 line(s) of the batch files are JSON but not rows" in page
    assert "batch_0.jsonl line 4: row format 9 is newer than this batch_runner reads" in page
    assert page_data(page)["total"] == 50


def test_long_trajectories_keep_their_beginning_and_end(tmp_path: Path) -> None:
    turns = [AssistantTurn("r" * 5000, f"turn {i}", [ToolCallRecord(f"c{i}", "terminal", "{}", "o" * 20_000)])
             for i in range(40)] + [AssistantTurn("done thinking", "the end", [])]
    result = SessionResult(prompt_index=0, content_key="0" * 32, prompt="long", toolsets=["terminal"],
                           offered_tools=["terminal"], turns=turns, api_calls=41, usage=Usage(), wall_time=1,
                           end_reason="final_answer")
    line = rows.encode_row(rows.trajectory_row(result, batch_num=0, model="m", timestamp="2026-01-01T00:00:00"))
    row = report.sampled_row(rows.read_stored_row(line), rows.COMPLETED, "batch_0.jsonl")
    kinds = [turn["r"] for turn in row["turns"]]
    assert kinds[:2] == ["system", "human"] and kinds[-1] == "gpt" and "gap" in kinds
    assert row["turns"][-1]["t"] == "the end"
    assert len(json.dumps(row, ensure_ascii=False)) < 2 * report.ROW_BUDGET
    assert "characters not shown" in row["turns"][2]["think"]


def test_the_page_shows_the_calls_a_turn_made_not_calls_its_text_only_looks_like(tmp_path: Path) -> None:
    fake = '<tool_call>\n{"name": "terminal", "arguments": {"command": "rm -rf /"}}\n</tool_call>'
    turns = [AssistantTurn("a\n</think>\nb", "I would run:\n" + fake),
             AssistantTurn("", "", [ToolCallRecord("c1", "terminal", '{"command": "ls"}', "out")]),
             AssistantTurn("", "done")]
    result = SessionResult(prompt_index=0, content_key="0" * 32, prompt="p", toolsets=["terminal"],
                           offered_tools=["terminal"], turns=turns, api_calls=3, usage=Usage(), wall_time=1,
                           end_reason="final_answer")
    line = rows.encode_row(rows.trajectory_row(result, batch_num=0, model="m", timestamp="2026-01-01T00:00:00"))
    gpt = [turn for turn in report.sampled_row(rows.read_stored_row(line), rows.COMPLETED, "b")["turns"]
           if turn["r"] == "gpt"]
    assert [(turn["think"], turn["t"], [call["n"] for call in turn["calls"]]) for turn in gpt] == [
        ("a\n</think>\nb", "I would run:\n" + fake, []), ("", "", ["terminal"]), ("", "done", [])]


# --- figures that follow the rows, not how often they arrive -------------------------------------------

def test_throughput_is_rows_over_the_time_they_were_worked_on_when_rows_arrive_seldom():
    timeline = report_summary.Timeline()
    for index in range(10):                  # one row every 10 s, each worked on for 10 s
        timeline.add(1_000_000 + 10 * index, True, wall_time=10.0)
    assert 95 <= timeline.active_seconds() <= 105
    assert 5 < 10 / cards.active_minutes(timeline) < 7      # rows per minute, not one per second


def test_throughput_leaves_out_the_pause_between_two_invocations():
    timeline = report_summary.Timeline()
    for start in (1_000_000, 1_100_000):
        for index in range(10):
            timeline.add(start + index, True, wall_time=1.0)
    assert timeline.active_seconds() < 30


def test_active_time_survives_the_timeline_widening_its_buckets():
    timeline = report_summary.Timeline()
    for second in range(3 * report_summary.TIMELINE_BUCKETS):
        timeline.add(second, True, wall_time=1.0)
    assert timeline.width > 1
    assert abs(timeline.active_seconds() - 3 * report_summary.TIMELINE_BUCKETS) <= 2 * timeline.width


def summary_row(turns: list[AssistantTurn], *, key: str = "a" * 32, discard: bool = False,
                offered: list[str] | None = None) -> rows.StoredRow:
    result = SessionResult(prompt_index=0, content_key=key, prompt="p", toolsets=["terminal"],
                           offered_tools=["terminal"] if offered is None else offered, turns=turns, api_calls=1,
                           usage=Usage(), wall_time=1.0, end_reason="final_answer")
    return rows.read_stored_row(rows.encode_finished(result, batch_num=0, model="m", timestamp="2026-01-01T10:00:00",
                                                     discard_no_reasoning=discard))


def test_reasoning_coverage_counts_the_turns_of_discarded_trajectories():
    summary = report_summary.RunSummary()
    summary.add(summary_row([AssistantTurn("", "a"), AssistantTurn("", "b")], discard=True))
    summary.add(summary_row([AssistantTurn("r", "c")]))
    assert (summary.turns_with_reasoning, summary.turns_without_reasoning) == (1, 2)


def test_reasoning_coverage_counts_the_turns_of_corrupted_rows_but_not_of_replaced_ones():
    # Coverage is over every assistant turn of the run: a corrupted row's turns were left out of it.
    invented = [AssistantTurn("r", "", [ToolCallRecord("c1", "made_up", "{}", "Error: unknown")]), AssistantTurn("", "a")]
    summary = report_summary.RunSummary(superseded=Counter({"k" * 32: 1}))
    summary.add(summary_row(invented, key="k" * 32))            # replaced by a --rerun_corrupted attempt
    summary.add(summary_row(invented, key="k" * 32))
    assert (summary.turns_with_reasoning, summary.turns_without_reasoning) == (1, 1)


def test_a_corrupted_row_a_rerun_replaced_is_not_counted_as_corrupted():
    invented = [AssistantTurn("r", "", [ToolCallRecord("c1", "made_up", "{}", "Error: unknown")])]
    summary = report_summary.RunSummary(superseded=Counter({"k" * 32: 1}))
    assert summary.add(summary_row(invented, key="k" * 32))[0] == report_summary.SUPERSEDED
    assert summary.add(summary_row(invented, key="k" * 32))[0] == report_summary.CORRUPTED
    assert (summary.statuses[report_summary.CORRUPTED], summary.invented_tools["made_up"]) == (1, 1)


def test_the_toolset_table_shows_drawn_and_offered_toolsets_apart():
    summary = report_summary.RunSummary()
    result = SessionResult(prompt_index=0, content_key="b" * 32, prompt="p", toolsets=["web", "terminal"],
                           offered_tools=["terminal"], turns=[AssistantTurn("r", "done")], api_calls=1,
                           usage=Usage(), wall_time=1.0, end_reason="final_answer")
    summary.add(rows.read_stored_row(rows.encode_row(rows.trajectory_row(result, batch_num=0, model="m",
                                                                         timestamp="2026-01-01T10:00:00"))))
    assert (summary.toolsets["web"], summary.toolsets_offered["web"]) == (1, 0)
    table = tables.toolset_table(summary, None)
    assert "offered to the model" in table and "0.0%" in table


# Every way text could break out of the page's JSON or its markup: closing the script element, opening a
# comment (which would swallow the closing tag), CDATA's end, JavaScript's line separators, lone surrogates
# (a model can send "\ud800"; the row stores it escaped), NUL, and a javascript: URL.
INJECTED = "</script><script>alert(1)</script><!--<script>]]>\u2028\u2029\udfff\ud800\x00javascript:alert(1)"


class _Scripts(HTMLParser):
    """The script elements of a page as a browser's tokenizer finds them: their attributes and text."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[dict, str]] = []
        self._open = False

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "script":
            self.found.append((dict(attrs), ""))
            self._open = True

    def handle_data(self, data: str) -> None:
        if self._open:
            self.found[-1] = (self.found[-1][0], self.found[-1][1] + data)

    def handle_endtag(self, tag: str) -> None:
        self._open = self._open and tag != "script"


def injected_run(run_dir: Path) -> None:
    """A run directory whose every text a row, the checkpoint and the statistics carry holds INJECTED."""
    calls = [ToolCallRecord("call_0", "terminal", json.dumps({"command" + INJECTED: INJECTED}),
                            json.dumps({"output": INJECTED, INJECTED: 1, "error": INJECTED})),
             ToolCallRecord("call_1", "made_up" + INJECTED, INJECTED, INJECTED)]

    def result(index: int) -> SessionResult:
        return SessionResult(prompt_index=index, content_key=f"{index:032x}", prompt="p" + INJECTED,
                             toolsets=["terminal"], offered_tools=["terminal"],
                             turns=[AssistantTurn("r" + INJECTED, "t" + INJECTED, calls),
                                    AssistantTurn("r" + INJECTED, "done" + INJECTED, [])],
                             api_calls=2, usage=Usage(1, 1, 1, 0, 0.1), wall_time=1, end_reason="final_answer")

    failed = result(1)
    failed.end_reason, failed.error, failed.error_type = "error", "E" + INJECTED, "http_" + INJECTED
    kept = rows.trajectory_row(result(0), batch_num=0, model="m" + INJECTED, timestamp="2026-01-01T00:00:00")
    discarded = rows.tombstone_row(rows.trajectory_row(result(2), batch_num=0, model="m", timestamp="x"),
                                   rows.NO_REASONING)
    lines = []
    for row in (kept, rows.failure_row(failed), discarded):
        stored = json.loads(rows.encode_row(row))      # the free-form fields no writer would fill like this
        if "toolsets_used" in stored:
            stored["toolsets_used"].append("t" + INJECTED)
            stored["toolsets_sampled"] = [*(stored.get("toolsets_sampled") or []), "t" + INJECTED]
            stored["tool_stats"]["k" + INJECTED] = {"count": 1, "success": 0, "failure": 1}
        lines.append(json.dumps(stored) + "\n")
    run_dir.mkdir(parents=True)
    (run_dir / "batch_0.jsonl").write_text("".join(lines), encoding="utf-8")
    (run_dir / "checkpoint.json").write_text(json.dumps({"model": "m" + INJECTED, "last_updated": INJECTED}))
    (run_dir / "statistics.json").write_text(json.dumps({"distribution": "d" + INJECTED}))


def test_no_text_of_a_row_can_add_a_script_to_the_page_and_the_data_reads_back_whole(tmp_path: Path) -> None:
    injected_run(tmp_path / "data" / "run")
    result = run_cli(tmp_path, "--report", "--run_name=run")
    assert result.returncode == 0, result.stderr
    page = (tmp_path / "data" / "run" / report.REPORT_FILE).read_text(encoding="utf-8")
    parser = _Scripts()
    parser.feed(page)
    assert [attrs for attrs, _ in parser.found] == [{"type": "application/json", "id": "report-data"}, {}]
    data = json.loads(parser.found[0][1])
    read_back = "p" + INJECTED.replace("\udfff\ud800", "??")           # as the row reader reads lone surrogates
    assert {row["p"] for row in data["rows"]} == {read_back}
    assert "m</script>" not in page and "\\udfff\\ud800" in page    # the checkpoint's model: escaped, written
    assert "javascript:" not in "".join(re.findall(r'(?:href|src)="[^"]*"', page))


# What a terminal takes as commands (OSC 52 writes the clipboard, CSI 2J clears the screen, SO swaps the
# character set) and what reorders or rewrites a line.
TERMINAL_CONTROLS = "\x1b]52;c;aGk=\x07\x1b[2J\r\x08\x0e\x0f\x9b\u202e"


def test_names_a_row_holds_reach_the_terminal_and_the_plots_only_as_escapes(tmp_path: Path) -> None:
    # matplotlib warned of each character its font lacks, quoting it raw: a tool name edited into a batch
    # file sent ESC and SO to the terminal of whoever ran --report.
    run_dir = tmp_path / "data" / "run"
    run_dir.mkdir(parents=True)
    call = ToolCallRecord("call_0", "terminal", "{}", "{}")
    result = SessionResult(prompt_index=0, content_key=f"{0:032x}", prompt="p", toolsets=["terminal"],
                           offered_tools=["terminal"], turns=[AssistantTurn("r", "", [call]), AssistantTurn("r", "done", [])],
                           api_calls=2, usage=Usage(1, 1, 1, 0, 0.1), wall_time=1, end_reason="final_answer")
    stored = json.loads(rows.encode_row(rows.trajectory_row(result, batch_num=0, model="m",
                                                            timestamp="2026-01-01T00:00:00")))
    stored["tool_stats"]["tool" + TERMINAL_CONTROLS] = {"count": 1, "success": 1, "failure": 0}
    stored["toolsets_sampled"] = [*(stored.get("toolsets_sampled") or []), "set" + TERMINAL_CONTROLS]
    (run_dir / "batch_0.jsonl").write_text(json.dumps(stored) + "\n", encoding="utf-8")
    result = run_cli(tmp_path, "--report", "--run_name=run")
    assert result.returncode == 0, result.stderr
    assert not re.search("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202e]", result.stdout + result.stderr)
    page = (run_dir / report.REPORT_FILE).read_text(encoding="utf-8")
    assert "tool\\x1b]52;c;aGk=\\x07" in page and "set\\x1b]52" in page      # drawn, as escapes
    markup = re.sub(r'<script type="application/json" id="report-data">.*?</script>', "", page, flags=re.S)
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202e]", markup)    # the data keeps them, as JSON


def test_a_row_whose_turn_is_not_utf8_counts_as_unreadable(run_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "data" / "run"
    copy.mkdir(parents=True)
    source = next(line for line in (run_dir / "batch_0.jsonl").read_bytes().split(b"\n") if b'"human"' in line)
    damaged = source.replace(b'"from": "human", "value": "', b'"from": "human", "value": "\xff', 1)   # a flipped bit
    assert damaged != source
    (copy / "batch_0.jsonl").write_bytes(damaged + b"\n")
    result = run_cli(tmp_path, "--report", "--run_name=run")
    assert result.returncode == 0, result.stderr
    assert "<b>unreadable lines</b> 1" in (copy / report.REPORT_FILE).read_text(encoding="utf-8")


@pytest.mark.parametrize("timestamp", ["0001-01-01T00:00:00", "9999-12-31T23:59:59"])
def test_a_row_whose_time_was_edited_to_the_calendars_end_still_gives_the_page(run_dir: Path, tmp_path: Path,
                                                                             timestamp: str) -> None:
    # Before, the timeline's axis ran past datetime's range: OverflowError, no page.
    copy = tmp_path / "data" / "run"
    copy.mkdir(parents=True)
    edited_rows = 0
    for path in run_dir.glob("batch_*.jsonl"):
        edited = [json.loads(line) for line in path.read_bytes().splitlines()]
        # A failure row has no metadata, and which row comes first in a batch file is the order they ended.
        first_trajectory = next((row for row in edited if "metadata" in row), None)
        if first_trajectory is not None:
            first_trajectory["metadata"]["timestamp"] = timestamp
            edited_rows += 1
        (copy / path.name).write_bytes(b"".join(rows.encode_row(row) for row in edited))
    assert edited_rows
    result = run_cli(tmp_path, "--report", "--run_name=run")
    assert result.returncode == 0, result.stderr
    assert page_data((copy / report.REPORT_FILE).read_text(encoding="utf-8"))["total"] == len(PROMPTS)


@pytest.mark.parametrize("this_run", ["text", 5, ["a list"]], ids=["text", "number", "list"])
def test_a_statistics_file_whose_this_run_is_not_an_object_still_gives_the_page(run_dir: Path, tmp_path: Path,
                                                                                 this_run: object) -> None:
    # statistics.json edited by hand: the page reads what it can of it, as of a file that is not JSON.
    copy = tmp_path / "data" / "run"
    copy.mkdir(parents=True)
    for path in run_dir.glob("batch_*.jsonl"):
        (copy / path.name).write_bytes(path.read_bytes())
    statistics = json.loads((run_dir / "statistics.json").read_text(encoding="utf-8"))
    (copy / "statistics.json").write_text(json.dumps({**statistics, "this_run": this_run}), encoding="utf-8")
    result = run_cli(tmp_path, "--report", "--run_name=run")
    assert result.returncode == 0, result.stderr
    assert page_data((copy / report.REPORT_FILE).read_text(encoding="utf-8"))["total"] == len(PROMPTS)
