"""Per-call overhead of the environments: what one terminal or file-tool call costs beyond its work.

    python benchmarks/environment_overhead.py                  # 200 calls each
    python benchmarks/environment_overhead.py --commands 1000

Prints the wall time and the whole machine's CPU of a prompt (start, two commands, release), then the
mean wall time of ``true`` in the local backend (a new bash per command), the bubblewrap
backend (a command sent to the prompt's long-lived shell in its sandbox), and, for comparison, a new
bwrap sandbox per command, which is what the long-lived shell saves. Then the mean wall time of
read_file and write_file of a 1 KB file three directories deep, as the file tools make them (a
thread hop, the confined lookup, the read or the write-and-rename), with the lookup done by openat2
and by the component walk that kernels without openat2 get.

Under bubblewrap it also prints what one sandbox costs (made and destroyed as a prompt's, one after
another), and bwrap running ``true`` whole and with one part left out at a time (setpriv, the network
namespace, the PID namespace), each as wall time and the whole machine's CPU; in a root run also bwrap
started as the sandbox's uid, making a user namespace instead of dropping to that uid with setpriv.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from batchrun.environments import confined_files, create_environment, environment_class  # noqa: E402
from batchrun.environments.base import EnvironmentSettings  # noqa: E402

# bubblewrap's own sandbox options, so that the comparison is like for like.
from batchrun.environments.bubblewrap import (  # noqa: E402
    bubblewrap_problem,
    program,
    sandbox,
    working_bwrap,
)
from batchrun.environments.limits import ResourceLimits, remove_run_leftovers  # noqa: E402

WARM_UP = 5
SMALL_FILE = b"x" * 1024
SMALL_FILE_PATH = "src/pkg/sub/small.py"


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
    settings = EnvironmentSettings(work_root=work_root, run_label="bench")
    bwrap = working_bwrap()
    assert not isinstance(bwrap, str), bwrap
    uid = program.sandbox_uid() if program.RUNNING_AS_ROOT else None
    if uid is not None:
        os.chown(workspace, uid, uid)
    root = await program.root_descriptor(work_root, False)

    async def step() -> None:
        descriptors = program.Descriptors(root, workspace, uid)
        try:
            argv = program.sandbox_command(bwrap.path, False, settings.limits, descriptors, uid, ["bash", "-c", "true"])
            process = await asyncio.create_subprocess_exec(*argv, env=program.sandbox_environment(),
                                                           pass_fds=descriptors.passed())
        finally:
            descriptors.close()
        assert await process.wait() == 0
    return await mean_ms(step, commands)


# About what a worker process holds (RSS), for the starts whose cost grows with the starting process.
WORKER_MB = 64
# What a sandbox's parts cost: bwrap's command line with one part left out (the figure is the whole
# less that part), and, in a root run, the alternative to setpriv (bwrap started as the sandbox's uid,
# making a user namespace).
SANDBOX_PARTS = {
    "bwrap with `true` (all of it)": (),
    "  without setpriv": ("setpriv",),
    "  without the network namespace": ("--unshare-net",),
    "  without the PID namespace": ("--unshare-pid",),
}


def bwrap_part_ms(work_root: Path, root: int, left_out: tuple[str, ...], runs: int, *,
                  as_sandbox_user: bool = False) -> tuple[float, float]:
    """(wall, machine CPU) milliseconds of one bwrap sandbox running ``true``, one after another."""
    bwrap = working_bwrap()
    assert not isinstance(bwrap, str), bwrap
    workspace = work_root / "parts"
    workspace.mkdir(exist_ok=True)
    uid = program.sandbox_uid() if program.RUNNING_AS_ROOT else None
    if uid is not None:
        os.chown(workspace, uid, uid)
    # Started as the sandbox's uid, bwrap makes a user namespace instead of dropping to it with setpriv.
    as_uid = {"user": uid, "group": uid, "extra_groups": []} if as_sandbox_user and uid is not None else {}

    def once() -> None:
        descriptors = program.Descriptors(root, workspace, None if as_uid else uid)
        try:
            argv = program.sandbox_command(bwrap.path, False, ResourceLimits(), descriptors,
                                           None if as_uid else uid, ["true"])
            if "setpriv" in left_out:
                start = argv.index("setpriv")
                del argv[start:argv.index("--", start) + 1]
            argv = [arg for arg in argv if arg not in left_out]
            subprocess.run(argv, env=program.sandbox_environment(), pass_fds=descriptors.passed(), check=True,
                           **as_uid)
        finally:
            descriptors.close()
    once()
    busy, started = machine_busy_seconds(), time.perf_counter()
    for _ in range(runs):
        once()
    return (time.perf_counter() - started) / runs * 1000, (machine_busy_seconds() - busy) / runs * 1000


async def sandbox_ms(work_root: Path, runs: int) -> tuple[float, float]:
    """(wall, machine CPU) milliseconds to make a prompt's sandbox (directory, control group, bwrap, its
    shell) and destroy it, one after another."""
    settings = EnvironmentSettings(work_root=work_root / "sandboxes", run_label="bench")
    await (await sandbox.new_sandbox(settings, "warm-")).destroy()
    busy, started = machine_busy_seconds(), time.perf_counter()
    for _ in range(runs):
        await (await sandbox.new_sandbox(settings, "bench-")).destroy()
    return (time.perf_counter() - started) / runs * 1000, (machine_busy_seconds() - busy) / runs * 1000


def machine_busy_seconds() -> float:
    """CPU seconds every core has spent busy since boot (the kernel's own threads included)."""
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


async def prompt_ms(kind: str, work_root: Path, prompts: int) -> tuple[float, float]:
    """(wall, machine CPU) milliseconds per prompt, prompts one after another as a session has them:
    start the environment, run two commands, release it (bubblewrap kills the sandbox and takes one of
    the spares for the next prompt). Machine CPU counts what the kernel spends on namespaces."""
    # As a run's workers have them: a few sandboxes started ahead of need.
    settings = EnvironmentSettings(work_root=work_root / f"{kind}-prompts", run_label="bench", spare_sandboxes=2)
    environment = environment_class(kind)

    async def prompt() -> None:
        env = create_environment(kind, settings, prompt_index=0)
        await env.start()
        for _ in range(2):
            assert (await env.run("true")).exit_code == 0
        await env.release()
    try:
        for _ in range(WARM_UP):
            await prompt()
        busy, started = machine_busy_seconds(), time.perf_counter()
        for _ in range(prompts):
            await prompt()
        wall, busy = time.perf_counter() - started, machine_busy_seconds() - busy
    finally:
        await environment.close_idle()
    return wall / prompts * 1000, busy / prompts * 1000


async def file_tools_ms(kind: str, work_root: Path, calls: int, openat2: bool) -> tuple[float, float]:
    """Mean (read_file, write_file) milliseconds of a small file, lookups by openat2 or by the walk."""
    usable = confined_files._openat2_usable
    confined_files._openat2_usable = usable and openat2
    settings = EnvironmentSettings(work_root=work_root / f"{kind}-files", run_label="bench")
    env = create_environment(kind, settings, prompt_index=0)
    await env.start()
    try:
        await env.write_file(SMALL_FILE_PATH, SMALL_FILE)

        async def read() -> None:
            assert await env.read_file(SMALL_FILE_PATH) == SMALL_FILE

        async def write() -> None:
            await env.write_file(SMALL_FILE_PATH, SMALL_FILE)
        return await mean_ms(read, calls), await mean_ms(write, calls)
    finally:
        await env.close()
        confined_files._openat2_usable = usable


async def print_file_tools(kind: str, work_root: Path, calls: int) -> None:
    lookups = ["openat2", "walk"] if confined_files._openat2_usable else ["walk"]
    for lookup in lookups:
        read, write = await file_tools_ms(kind, work_root, calls, openat2=lookup == "openat2")
        label = f"{kind}, {lookup}"
        print(f"  {label:<24} read_file {read:6.3f} ms   write_file {write:6.3f} ms")


async def main(commands: int) -> None:
    with tempfile.TemporaryDirectory(prefix="environment-overhead-") as scratch:
        work_root = Path(scratch)
        os.chmod(work_root, 0o755)      # a sandbox's uid must reach the run's root below it
        problem = bubblewrap_problem()
        print(f"mean per-command overhead over {commands} `true` commands")
        print(f"  local (new bash per command)          {await backend_ms('local', work_root, commands):8.2f} ms")
        if problem is None:
            shell = await backend_ms("bubblewrap", work_root, commands)
            print(f"  bubblewrap (one shell per prompt)     {shell:8.2f} ms")
            print(f"  new bwrap sandbox per command         {await new_sandbox_ms(work_root, commands):8.2f} ms")
        print(f"per prompt (start, two commands, release) over {commands} prompts: wall / machine CPU")
        for kind in ["local"] + (["bubblewrap"] if problem is None else []):
            wall, busy = await prompt_ms(kind, work_root, commands)
            print(f"  {kind:<36} {wall:8.2f} ms / {busy:5.2f} ms")
        if problem is None:
            print(f"a bubblewrap sandbox, over {commands} made one after another: wall / machine CPU")
            wall, busy = await sandbox_ms(work_root, commands)
            print(f"  {'made and destroyed (new_sandbox)':<36} {wall:8.2f} ms / {busy:5.2f} ms")
            root = await program.root_descriptor(work_root, False)
            for label, left_out in SANDBOX_PARTS.items():
                wall, busy = bwrap_part_ms(work_root, root, left_out, commands)
                print(f"  {label:<36} {wall:8.2f} ms / {busy:5.2f} ms")
            if program.RUNNING_AS_ROOT:
                # Python starts a program with vfork, but must fork to change its uid first: a copy of
                # the page tables, which grows with the process. Both measured from a worker's size.
                ballast = bytearray(WORKER_MB << 20)
                ballast[::4096] = b"x" * len(range(0, len(ballast), 4096))
                print(f"  from a process of a worker's size ({WORKER_MB} MB):")
                wall, busy = bwrap_part_ms(work_root, root, (), commands)
                print(f"  {'    setpriv':<36} {wall:8.2f} ms / {busy:5.2f} ms")
                label = "    a user namespace instead"
                try:
                    wall, busy = bwrap_part_ms(work_root, root, (), commands, as_sandbox_user=True)
                    print(f"  {label:<36} {wall:8.2f} ms / {busy:5.2f} ms")
                except PermissionError as exc:
                    # Started as the sandbox's uid, bwrap must be where that uid may go; the bundled one is
                    # not where Python lies under /root.
                    print(f"  {label:<36} skipped: the sandbox's uid cannot run {exc.filename}")
                del ballast
        print(f"mean per-call time of the file tools over {commands} calls ({len(SMALL_FILE)} bytes)")
        await print_file_tools("local", work_root, commands)
        if problem is None:
            await print_file_tools("bubblewrap", work_root, commands)
        else:
            print(f"  bubblewrap: skipped, {problem}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commands", type=int, default=200)
    try:
        asyncio.run(main(parser.parse_args().commands))
    finally:
        remove_run_leftovers("bench")   # the control groups' run directory, as a run's parent removes its own
