"""The newcomer's path without a model: data/demo.jsonl against the scripted endpoint, through the real
CLI and the default sandbox, and the README block that runs it, copied from the README as it stands."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, cli_environment, endpoint_args, process_state, read_jsonl, run_cli, wait_for, write_dataset
from scripted_endpoint import ScriptedEndpoint

DEMO = REPO / "data" / "demo.jsonl"
FILE_TOOLS = ("read_file", "write_file", "patch", "search_files")
DEMO_SECTION = "## Try it without a model"


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One run of the demo dataset, shared by the tests that only read what it left."""
    tmp_path = tmp_path_factory.mktemp("demo")
    with ScriptedEndpoint() as server:
        result = run_cli(tmp_path, f"--dataset_file={DEMO}", "--batch_size=4", "--run_name=demo",
                         "--distribution=terminal_only", *endpoint_args(server))
    return result, tmp_path / "data" / "demo"


def tool_calls(turn_value: str) -> list[dict]:
    """The calls of one assistant turn, read from its Hermes ``<tool_call>`` blocks (one JSON line each)."""
    lines = turn_value.split("\n")
    return [json.loads(lines[i + 1]) for i in range(len(lines) - 2)
            if lines[i] == "<tool_call>" and lines[i + 2] == "</tool_call>"]


def assistant_turns(run_dir: Path) -> list[str]:
    return [turn["value"] for row in read_jsonl(run_dir / "trajectories.jsonl")
            for turn in row["conversations"] if turn["from"] == "gpt"]


def readme_demo_block() -> str:
    """The first bash block of the README's demo section, the one a newcomer copies."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index(DEMO_SECTION):]
    return re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)


def test_every_demo_prompt_ends_with_a_final_answer(demo_run):
    result, run_dir = demo_run
    assert result.returncode == 0, result.stderr
    rows = read_jsonl(run_dir / "trajectories.jsonl")
    assert len(rows) == len(read_jsonl(DEMO)) == 8
    assert {row["end_reason"] for row in rows} == {"final_answer"}


def test_the_demo_calls_the_terminal_and_every_file_tool(demo_run):
    _, run_dir = demo_run
    called = {call["name"] for value in assistant_turns(run_dir) for call in tool_calls(value)}
    assert called == {"terminal", *FILE_TOOLS}


def test_the_demo_has_turns_with_several_tool_calls(demo_run):
    _, run_dir = demo_run
    assert sum(len(tool_calls(value)) > 1 for value in assistant_turns(run_dir)) >= 2


def test_statistics_count_terminal_and_file_tool_calls_with_one_failure(demo_run):
    _, run_dir = demo_run
    tools = json.loads((run_dir / "statistics.json").read_text())["tool_statistics"]
    assert all(tools[name]["count"] > 0 for name in ("terminal", *FILE_TOOLS))
    assert {name: figures["failure"] for name, figures in tools.items() if figures["failure"]} == {"read_file": 1}


def test_the_demo_run_writes_its_report(demo_run):
    result, run_dir = demo_run
    assert "Report: data/demo/report.html" in result.stdout
    page = (run_dir / "report.html").read_text(encoding="utf-8")
    assert all(name in page for name in ("terminal", *FILE_TOOLS))


def test_the_readme_block_runs_the_demo_and_stops_its_server(tmp_path):
    """The block as a newcomer pastes it, in a directory laid out like the checkout (its install line
    is the README's first command, already done where the tests run)."""
    for name in ("tests", "batch_runner.py"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "demo.jsonl").symlink_to(DEMO)
    block = "\n".join(line for line in readme_demo_block().splitlines() if not line.startswith("pip install"))
    env = cli_environment(tmp_path, {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"})
    result = subprocess.run(["bash", "-c", block + '\necho "server pid $SERVER_PID"'], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert "BATCH PROCESSING COMPLETE" in result.stdout, result.stdout + result.stderr
    assert "write_file" in result.stdout and "Report: data/demo/report.html" in result.stdout
    assert len(read_jsonl(tmp_path / "data" / "demo" / "trajectories.jsonl")) == 8
    server_pid = int(re.search(r"server pid (\d+)", result.stdout).group(1))
    wait_for(lambda: process_state(server_pid) == "Z", timeout=10, what="the scripted server to stop")


def test_the_no_key_error_points_to_the_demo(tmp_path):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["q"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run")
    assert result.returncode == 1
    assert DEMO_SECTION.removeprefix("## ") in result.stderr
    assert DEMO_SECTION in (REPO / "README.md").read_text(encoding="utf-8")
