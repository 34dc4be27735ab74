"""Every benchmark runs to its figures: each at a size of seconds, so a change that breaks one (a new
message its loop does not expect, a renamed module) is caught here, not on the day its figures are
needed. What the figures are is the benchmarks' business, never asserted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_benchmark(name: str, *args: str) -> list[str]:
    """The lines a benchmark printed, once it ended well."""
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{name}.py"), *args],
                            env={**os.environ, "TERMINAL_ENV": "local"}, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def figures(line: str) -> list[float]:
    numbers = []
    for word in line.split():
        try:
            numbers.append(float(word))
        except ValueError:
            pass
    return numbers


def test_the_throughput_benchmark_prints_a_line_of_figures_per_run():
    lines = run_benchmark("throughput", "--workers", "4", "--prompts", "8", "--latency", "0.01")
    assert len(figures(lines[-1])) >= 10


def test_the_throughput_benchmark_first_names_the_machine_its_figures_come_from():
    lines = run_benchmark("throughput", "--workers", "4", "--prompts", "8", "--latency", "0.01")
    assert lines[0].startswith("machine: ") and "a program's start" in lines[0]


@pytest.mark.parametrize("mode", [[], ["--one-worker"]], ids=["runner", "one-worker"])
def test_the_sessions_sweep_prints_a_line_of_figures_per_point(mode):
    lines = run_benchmark("sessions_sweep", *mode, "--sessions", "4", "--latency", "0.05", "--tool-turns", "0",
                          "--prompts-per-session", "1")
    assert len(figures(lines[-1])) >= 10


def test_the_concurrency_limit_benchmark_prints_its_runs():
    lines = run_benchmark("concurrency_limit", "--scenario", "fixed", "--runs", "1", "--k", "4", "--workers", "8",
                          "--prompts", "16", "--latency", "0.02")
    assert lines[-1].split()[1] == "16/16"


def test_the_stalled_replies_benchmark_prints_a_line_of_figures_per_point():
    lines = run_benchmark("stalled_replies", "--sessions", "4", "--mib", "1", "--wait", "20")
    assert figures(lines[-1])[:3] == [4, 1, 4]


def test_the_soak_runs_to_the_end_under_its_descriptor_limit():
    lines = run_benchmark("soak", "--prompts", "200", "--batch-size", "10", "--sessions", "8", "--latency", "0.01",
                          "--tool-turns", "0", "--every", "100", "--from", "100")
    assert lines[-1].startswith("done: 200 trajectories")


def test_the_run_directory_benchmark_prints_its_figures():
    lines = run_benchmark("run_dir_scale", "--rows", "500", "--batch-size", "50")
    assert any("ms per write" in line for line in lines)


def test_the_environment_overhead_benchmark_prints_its_figures():
    lines = run_benchmark("environment_overhead", "--commands", "3")
    assert any("write_file" in line for line in lines)
