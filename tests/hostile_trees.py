"""Directory trees a hostile prompt can leave, and a prompt's user to build them and race the runner.

Deep trees are built one level at a time relative to a directory descriptor: a path naming the bottom
of one deeper than PATH_MAX is longer than any system call accepts.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

# A user no process of this machine runs as: the prompt's user when the tests run as root.
PROMPT_UID = PROMPT_GID = 43_210
# A directory name of the longest length a filesystem allows.
LONG_NAME = "n" * 255

T = TypeVar("T")


@contextlib.contextmanager
def deep_chain(top: Path, depth: int, name: str = "d", bottom_bytes: int = 0) -> Iterator[None]:
    """``depth`` nested directories named ``name`` under ``top`` for the block (a file of
    ``bottom_bytes`` random bytes in the deepest one when asked), and none of them left after it:
    pytest's own clean-up of old temporary directories recurses, and fails on deep trees."""
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            fd = _go_down(fd, name)
        if bottom_bytes:
            file = os.open("data", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
            try:
                os.write(file, os.urandom(bottom_bytes))
            finally:
                os.close(file)
    finally:
        os.close(fd)
    try:
        yield
    finally:
        _remove_chain(top, name)


def _go_down(fd: int, name: str) -> int:
    below = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
    os.close(fd)
    return below


def _remove_chain(top: Path, name: str) -> None:
    """What is left of a chain ``deep_chain`` made: down to its end, then up, removing each level."""
    if not top.is_dir():
        return
    fd, depth = os.open(top, os.O_RDONLY | os.O_DIRECTORY), 0
    while True:
        try:
            fd = _go_down(fd, name)
            depth += 1
        except FileNotFoundError:
            break
    with contextlib.suppress(FileNotFoundError):
        os.unlink("data", dir_fd=fd)
    for _ in range(depth):
        above = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = above
        os.rmdir(name, dir_fd=fd)
    os.close(fd)


def is_root() -> bool:
    return os.geteuid() == 0


def _become_prompt_user() -> None:
    if is_root():
        os.setgroups([])
        os.setresgid(PROMPT_GID, PROMPT_GID, PROMPT_GID)
        os.setresuid(PROMPT_UID, PROMPT_UID, PROMPT_UID)


def prompt_home(tmp_path: Path) -> Path:
    """A directory the prompt's user owns: where it builds and where the runner's work is done as it."""
    home = tmp_path / "home"
    home.mkdir()
    if is_root():
        os.chown(home, PROMPT_UID, PROMPT_GID)
    return home


def as_prompt_user(home: Path, action: Callable[[], T]) -> T:
    """``action()``'s result, run in a child process working in ``home`` as the prompt's user (an
    unprivileged uid when the tests run as root, else the tests' own). Paths in ``action`` are relative
    to ``home``: the directories above it (pytest's) may be closed to that user."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:       # the child: only system calls and modules already imported
        status = 0
        try:
            os.close(reader)
            os.chdir(home)
            _become_prompt_user()
            outcome: tuple[bool, object] = (True, action())
        except BaseException:
            outcome, status = (False, traceback.format_exc()), 1
        with os.fdopen(writer, "wb") as pipe:
            pickle.dump(outcome, pipe)
        os._exit(status)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    assert data, "the prompt user's process died without an answer"
    ok, value = pickle.loads(data)
    assert ok, f"the prompt user's action failed:\n{value}"
    return value  # type: ignore[return-value]


@contextlib.contextmanager
def swapping_for_symlink(directory: Path, target: Path) -> Iterator[None]:
    """A process of the prompt's user that swaps ``directory`` for a symlink to ``target`` and back,
    as fast as it can, until the block ends. The block starts once it has swapped once."""
    ready_reader, ready_writer = os.pipe()
    stop_reader, stop_writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_reader)
            os.close(stop_writer)
            parent = os.open(directory.parent, os.O_RDONLY | os.O_DIRECTORY)
            _become_prompt_user()
            os.set_blocking(stop_reader, False)
            name, away = directory.name, directory.name + ".away"
            steps = [lambda: os.rename(name, away, src_dir_fd=parent, dst_dir_fd=parent),
                     lambda: os.symlink(target, name, dir_fd=parent),
                     lambda: os.unlink(name, dir_fd=parent),
                     lambda: os.rename(away, name, src_dir_fd=parent, dst_dir_fd=parent)]
            for step in steps:
                step()
            os.write(ready_writer, b"r")
            while True:
                with contextlib.suppress(BlockingIOError):
                    os.read(stop_reader, 1)
                    break       # the write end closed: the block has ended
                for step in steps:      # each on its own: the runner removes things under it
                    with contextlib.suppress(OSError):
                        step()
        finally:
            os._exit(0)
    os.close(ready_writer)
    os.close(stop_reader)
    try:
        assert os.read(ready_reader, 1) == b"r", "the racing process could not swap the directory"
        yield
    finally:
        os.close(stop_writer)
        os.close(ready_reader)
        os.waitpid(pid, 0)


def open_descriptors(within: Path) -> int:
    """Descriptors of this process open on ``within`` or anything beneath it. Counting all of them
    would also count what earlier tests' garbage closes or threads open meanwhile."""
    root, count = str(within.resolve()), 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):        # the listing's own descriptor, closed by now
            target = os.readlink(f"/proc/self/fd/{name}")
            count += target == root or target.startswith(f"{root}/")
    return count
