"""What the stand-in container runtimes (fake_docker.py, fake_singularity.py, fake_modal/modal.py) share.

Where no container runtime can run, the stand-ins keep a container as a directory:
``$FAKE_CONTAINER_STATE/containers/<name>/`` holds ``meta.json``, ``root/`` (the container's ``/``)
and ``pids/`` (processes running "inside", killed when the container goes). A program executed in a
container really runs, on the host, with its working directory and every absolute path among its
arguments moved under ``root/`` (or under a bind mount's host directory) — except the script after
``sh -c``, which tests keep to relative paths. That is enough for the terminal and file tools to
work end to end. Every call is appended, as ``{"tool": ..., "argv": [...]}``, to
``$FAKE_CONTAINER_LOG``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote


def state() -> Path:
    """Where containers and images are kept; read at each use, since the modal stand-in lives on in a
    test process whose tests each have their own."""
    return Path(os.environ.get("FAKE_CONTAINER_STATE", "/nonexistent-fake-container-state"))

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def log_call(tool: str, argv: list[str]) -> None:
    log = os.environ.get("FAKE_CONTAINER_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as handle:    # one short O_APPEND write per call
            handle.write(json.dumps({"tool": tool, "argv": argv}) + "\n")


def fail(message: str, code: int = 1) -> None:
    print(message, file=sys.stderr)
    sys.exit(code)


def pull_fails(image: str) -> bool:
    return image in os.environ.get("FAKE_PULL_FAIL", "").split(",")


def pull_delay() -> None:
    """FAKE_PULL_SECONDS makes pulls slow enough for concurrent starts to overlap."""
    time.sleep(float(os.environ.get("FAKE_PULL_SECONDS", "0")))


def file_name(text: str) -> str:
    return quote(text, safe="")


class Container:
    """One container (docker) or instance (singularity) kept as a directory."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dir = state() / "containers" / file_name(name)

    @classmethod
    def all(cls) -> list[Container]:
        """Every container; one another command is creating or removing at this moment is skipped,
        as the real CLIs list only containers that fully exist."""
        folder = state() / "containers"
        found = []
        for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
            try:
                found.append(cls(json.loads((entry / "meta.json").read_text())["name"]))
            except (FileNotFoundError, NotADirectoryError, ValueError):
                continue
        return found

    def exists(self) -> bool:
        return (self.dir / "meta.json").is_file()

    @property
    def meta(self) -> dict:
        return json.loads((self.dir / "meta.json").read_text())

    def create(self, meta: dict) -> None:
        (self.dir / "root").mkdir(parents=True)
        (self.dir / "pids").mkdir()
        # Written whole, then renamed: no other command ever reads half a meta.json.
        partial = self.dir / "meta.json.partial"
        partial.write_text(json.dumps({"name": self.name, "binds": [], **meta}))
        partial.rename(self.dir / "meta.json")

    def host_path(self, path: str) -> str:
        """Where the container path ``path`` lives on the host (bind mounts first)."""
        for host, inside in self.meta["binds"]:
            if path == inside or path.startswith(inside.rstrip("/") + "/"):
                return host + path[len(inside.rstrip("/")):]
        return str(self.dir / "root") + path

    def host_argv(self, argv: list[str]) -> list[str]:
        """``argv`` with its absolute paths moved to where they live on the host (not a ``sh -c`` script)."""
        return [self.host_path(arg) if arg.startswith("/") and (i == 0 or argv[i - 1] != "-c") else arg
                for i, arg in enumerate(argv)]

    def track(self, pid: int) -> Path:
        """Note a process running inside, to be killed with the container; the file to remove once it ends."""
        pid_file = self.dir / "pids" / str(pid)
        pid_file.write_text("")
        return pid_file

    def execute(self, argv: list[str], *, workdir: str, env: dict[str, str], stdin: bool) -> int:
        """Run ``argv`` "in" the container; returns its exit status (as docker/singularity exec do)."""
        moved = self.host_argv(argv)
        cwd = self.host_path(workdir)
        if not os.path.isdir(cwd):
            fail(f"OCI runtime exec failed: chdir to cwd ({workdir!r}) set in config.json failed: "
                 "no such file or directory", 126)
        try:
            process = subprocess.Popen(moved, cwd=cwd, env=env, stdin=None if stdin else subprocess.DEVNULL,
                                       start_new_session=True)
        except OSError:
            fail(f'OCI runtime exec failed: exec: "{argv[0]}": executable file not found in $PATH', 127)
        pid_file = self.track(process.pid)
        code = process.wait()
        pid_file.unlink(missing_ok=True)
        return code if code >= 0 else 128 - code

    def remove(self) -> None:
        """Kill what runs inside, then forget the container."""
        for pid_file in (self.dir / "pids").glob("*"):
            try:
                os.killpg(int(pid_file.name), signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)


def container_env(home: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """What a process in a container sees: the image's few variables, none of the host's."""
    return {"PATH": DEFAULT_PATH, "HOME": home, **(extra or {})}
