"""Per-prompt start cost of the container engines: what a prompt waits before its first model call.

    eval "$(.ci/container_engine.sh start)"          # the engines and image the tests use
    python benchmarks/container_start.py             # 20 prompts per engine
    python benchmarks/container_start.py --prompts 50 --concurrency 16

For each engine that answers here (docker, and podman through TERMINAL_CONTAINER_CLI=podman), with the
image $BATCH_RUNNER_TEST_IMAGE (local/minbase:1 unless set) already present: the mean and median of
starting a prompt's environment (container created, working directory made) and of closing it, one
prompt at a time; the wall time per prompt with --concurrency prompts starting and closing together;
and the mean cost of one terminal command (`true`). The bubblewrap sandbox is measured the same way
for comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from batchrun.environments import create_environment, environment_class  # noqa: E402
from batchrun.environments.base import EnvironmentSettings, EnvironmentSetupError  # noqa: E402
from batchrun.environments.bubblewrap import bubblewrap_problem  # noqa: E402
from batchrun.environments.docker import CLI_VARIABLE  # noqa: E402

IMAGE = os.environ.get("BATCH_RUNNER_TEST_IMAGE", "local/minbase:1")
COMMANDS = 20


def engine_problem(cli: str) -> str | None:
    if shutil.which(cli) is None:
        return f"`{cli}` is not on PATH"
    found = subprocess.run([cli, "image", "inspect", IMAGE], capture_output=True, text=True, timeout=60)
    if found.returncode != 0:
        return f"no engine answers or {IMAGE} is missing: {' '.join(found.stderr.split())[-160:]}"
    return None


async def one_by_one(kind: str, settings: EnvironmentSettings, prompts: int) -> tuple[list[float], list[float], float]:
    """Start and close times (seconds) of ``prompts`` prompts in turn, and a command's mean cost."""
    starts, closes, command = [], [], 0.0
    for index in range(prompts):
        env = create_environment(kind, settings, prompt_index=index, image=IMAGE)
        began = time.perf_counter()
        await env.start()
        starts.append(time.perf_counter() - began)
        if index == 0:
            began = time.perf_counter()
            for _ in range(COMMANDS):
                assert (await env.run("true")).exit_code == 0
            command = (time.perf_counter() - began) / COMMANDS
        began = time.perf_counter()
        await env.close()
        closes.append(time.perf_counter() - began)
    return starts, closes, command


async def together(kind: str, settings: EnvironmentSettings, prompts: int, concurrency: int) -> float:
    """Wall seconds per prompt with ``concurrency`` prompts at a time starting, running `true`, closing."""
    gate = asyncio.Semaphore(concurrency)

    async def prompt(index: int) -> None:
        async with gate:
            env = create_environment(kind, settings, prompt_index=index, image=IMAGE)
            await env.start()
            try:
                await env.run("true")
            finally:
                await env.close()
    began = time.perf_counter()
    await asyncio.gather(*(prompt(index) for index in range(prompts)))
    return (time.perf_counter() - began) / prompts


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.0f} ms"


async def measure(label: str, kind: str, work_root: Path, prompts: int, concurrency: int) -> None:
    settings = EnvironmentSettings(work_root=work_root / label, run_label=f"bench-{label}")
    try:
        await one_by_one(kind, settings, 2)      # warm-up: the engine's caches, our per-process answers
    except EnvironmentSetupError as exc:
        print(f"  {label:<11} failed: {exc}")
        return
    try:
        starts, closes, command = await one_by_one(kind, settings, prompts)
        per_prompt = await together(kind, settings, prompts, concurrency)
    finally:
        # What a worker does as it ends: the spare sandboxes and kept control groups go.
        await environment_class(kind).close_idle()
    print(f"  {label:<11} start {ms(statistics.mean(starts))} (median {ms(statistics.median(starts)).strip()})"
          f"   close {ms(statistics.mean(closes))}   {concurrency} at a time {ms(per_prompt)} per prompt"
          f"   command {command * 1000:5.1f} ms")


async def main(prompts: int, concurrency: int) -> None:
    print(f"per-prompt start cost, {prompts} prompts each, image {IMAGE}")
    with tempfile.TemporaryDirectory(prefix="container-start-") as scratch:
        for cli in ("docker", "podman"):
            problem = engine_problem(cli)
            if problem is not None:
                print(f"  {cli:<11} skipped: {problem}")
                continue
            os.environ[CLI_VARIABLE] = cli
            await measure(cli, "docker", Path(scratch), prompts, concurrency)
        problem = bubblewrap_problem()
        if problem is None:
            await measure("bubblewrap", "bubblewrap", Path(scratch), prompts, concurrency)
        else:
            print(f"  bubblewrap  skipped: {problem}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=8)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.prompts, arguments.concurrency))
