"""Per-command overhead of the environments: what one terminal call costs beyond the command itself.

    python benchmarks/environment_overhead.py                  # 200 commands each
    python benchmarks/environment_overhead.py --commands 1000

Prints the mean wall time of ``true`` in the local backend (a new bash per command), the bubblewrap
backend (a command sent to the prompt's long-lived shell in its sandbox), and, for comparison, a new
bwrap sandbox per command, which is what the long-lived shell saves.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from batchrun.environments import create_environment  # noqa: E402
from batchrun.environments.base import EnvironmentSettings  # noqa: E402
from batchrun.environments.bubblewrap import (  # noqa: E402
    _sandbox_argv,          # the backend's own sandbox options, so the comparison is like for like
    _sandbox_environment,
    bubblewrap_problem,
)

WARM_UP = 5


async def mean_ms(step: Callable[[], Awaitable[None]], commands: int) -> float:
    for _ in range(WARM_UP):
        await step()
    started = time.perf_counter()
    for _ in range(commands):
        await step()
    return (time.perf_counter() - started) / commands * 1000


async def backend_ms(kind: str, work_root: Path, commands: int) -> float:
    env = create_environment(kind, EnvironmentSettings(work_root=work_root / kind, run_label="bench"),
                             prompt_index=0)
    await env.start()
    try:
        async def step() -> None:
            result = await env.run("true")
            assert result.exit_code == 0, result
        return await mean_ms(step, commands)
    finally:
        await env.close()


async def new_sandbox_ms(work_root: Path, commands: int) -> float:
    workspace = work_root / "per-command"
    workspace.mkdir()
    argv = [*_sandbox_argv(allow_network=False, workspace=workspace), "--", "bash", "-c", "true"]

    async def step() -> None:
        process = await asyncio.create_subprocess_exec(*argv, env=_sandbox_environment())
        assert await process.wait() == 0
    return await mean_ms(step, commands)


async def main(commands: int) -> None:
    with tempfile.TemporaryDirectory(prefix="environment-overhead-") as scratch:
        work_root = Path(scratch)
        print(f"mean per-command overhead over {commands} `true` commands")
        print(f"  local (new bash per command)          {await backend_ms('local', work_root, commands):8.2f} ms")
        problem = bubblewrap_problem()
        if problem is not None:
            print(f"  bubblewrap: skipped, {problem}")
            return
        print(f"  bubblewrap (one shell per prompt)     {await backend_ms('bubblewrap', work_root, commands):8.2f} ms")
        print(f"  new bwrap sandbox per command         {await new_sandbox_ms(work_root, commands):8.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=200)
    asyncio.run(main(parser.parse_args().commands))
