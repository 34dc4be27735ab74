"""A killed worker's browser directory (its profile among what it holds) goes at the next start of any run;
one whose worker lives, one being made, another user's, and anything reached through a link stay."""

from __future__ import annotations

import errno
import fcntl
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import endpoint_args, run_cli, write_dataset

from batchrun.tools.browser import availability, directories
from batchrun.tools.browser.directories import new_browser_directory

# A worker as far as its browser's directory goes: it makes one, says where, and lives until killed.
HOLDING_WORKER = ("from batchrun.tools.browser.directories import new_browser_directory\n"
                  "import sys, time\nprint(new_browser_directory()[0], flush=True)\ntime.sleep(3600)\n")
THIS_MACHINE = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
REMOVING = ("from batchrun.tools.browser.directories import remove_abandoned_browser_directories\n"
            "remove_abandoned_browser_directories()\n")


@pytest.fixture
def temporary() -> Iterator[Path]:
    """The TMPDIR of the workers and runs of a test: its own, short enough for Chromium's socket paths."""
    directory = Path(tempfile.mkdtemp(prefix="br-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory)


def under(temporary: Path) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(temporary)}


def holding_worker(temporary: Path) -> tuple[subprocess.Popen, Path]:
    worker = subprocess.Popen([sys.executable, "-c", HOLDING_WORKER], stdout=subprocess.PIPE, text=True,
                              env=under(temporary))
    assert worker.stdout is not None
    return worker, Path(worker.stdout.readline().strip())


def remove_abandoned(temporary: Path) -> None:
    """What a run's start does, with ``temporary`` as its TMPDIR."""
    subprocess.run([sys.executable, "-c", REMOVING], env=under(temporary), check=True)


def killed_workers_directory(temporary: Path) -> Path:
    worker, directory = holding_worker(temporary)
    worker.kill()
    worker.wait()
    worker.stdout.close()       # type: ignore[union-attr]
    (directory / "profile").mkdir()
    (directory / "profile" / "Cookies").write_text("a page's cookie")
    return directory


def test_the_browser_directory_of_a_killed_worker_is_removed(temporary: Path) -> None:
    directory = killed_workers_directory(temporary)
    remove_abandoned(temporary)
    assert not directory.exists()


def test_the_browser_directory_of_a_living_worker_is_kept(temporary: Path) -> None:
    worker, directory = holding_worker(temporary)
    try:
        remove_abandoned(temporary)
        assert directory.is_dir()
    finally:
        worker.kill()
        worker.wait()
        worker.stdout.close()       # type: ignore[union-attr]


def test_a_browser_directory_not_yet_marked_held_is_kept(temporary: Path) -> None:
    being_made = temporary / "batchrun-browser-new"
    being_made.mkdir()
    remove_abandoned(temporary)
    assert being_made.is_dir()


def test_a_link_named_as_a_browser_directory_is_not_followed(temporary: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "held").write_text(THIS_MACHINE)
    (elsewhere / "keep").write_text("not the browser's")
    (temporary / "batchrun-browser-link").symlink_to(elsewhere)
    remove_abandoned(temporary)
    assert (elsewhere / "keep").read_text() == "not the browser's"


def test_a_browser_directory_held_on_another_machine_is_kept(temporary: Path) -> None:
    # Where TMPDIR is shared between machines (NFS), a lock on a directory is seen only where it was taken.
    directory = killed_workers_directory(temporary)
    (directory / "held").write_text("another machine's boot")
    remove_abandoned(temporary)
    assert directory.is_dir()


def test_a_browser_directory_is_made_unmarked_where_no_lock_can_be_taken(temporary: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def no_locks_here(fd: int, operation: int) -> None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    monkeypatch.setattr(fcntl, "flock", no_locks_here)
    directory, lock = new_browser_directory()
    os.close(lock)
    monkeypatch.undo()
    remove_abandoned(temporary)
    assert directory.is_dir() and not (directory / "held").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a directory to another user")
def test_another_users_browser_directory_is_kept(temporary: Path) -> None:
    directory = killed_workers_directory(temporary)
    os.chown(directory, 65534, 65534)
    remove_abandoned(temporary)
    assert directory.is_dir()


def test_a_runs_start_removes_killed_workers_browser_directories(temporary: Path, tmp_path: Path,
                                                                 endpoint) -> None:
    directory = killed_workers_directory(temporary)
    dataset = write_dataset(tmp_path / "prompts.jsonl", ["[[final done]]"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--run_name=run", "--distribution=minimal",
                     "--batch_size=1", *endpoint_args(endpoint), env={"TMPDIR": str(temporary)})
    assert result.returncode == 0, result.stderr
    assert not directory.exists()


@pytest.fixture
def deep_tmpdir(temporary: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A TMPDIR too deep for Chromium's sockets, in this process."""
    deep = temporary / ("d" * 60)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    return deep


def test_under_a_deep_tmpdir_the_browser_takes_the_first_short_place_it_may_write(
        deep_tmpdir: Path, temporary: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # /tmp came unchecked: on a host that closes /tmp to its users, every browser call failed with a
    # PermissionError, and the rows said completed.
    monkeypatch.setattr(directories, "SHORT_TEMPORARIES", ("/no-such-temporary", str(temporary)))
    directory, lock = directories.new_browser_directory()
    os.close(lock)
    assert directory.parent == temporary


def test_with_no_short_place_to_write_the_browser_tools_are_unavailable_saying_why(
        deep_tmpdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(directories, "SHORT_TEMPORARIES", ("/no-such-temporary",))
    if availability.chromium_executable() is None or importlib.util.find_spec("playwright") is None:
        pytest.skip("no Chromium or Playwright here: the browser is unavailable for that first")
    assert availability.unavailable_reason() == directories.NO_TEMPORARY
    assert "set TMPDIR to a shorter directory" in directories.NO_TEMPORARY
