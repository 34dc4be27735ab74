"""Removing a prompt's directory: at any depth, whatever the prompt did to permissions, and never
anything outside it, whatever a process of the prompt does while it is removed."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hostile_trees import (
    LONG_NAME,
    as_prompt_user,
    deep_chain,
    is_root,
    open_descriptors,
    prompt_home,
    swapping_for_symlink,
)

from batchrun.environments.base import Environment, EnvironmentSettings
from batchrun.environments.tree_removal import remove_tree

# Rounds of the race test: the old clean-up changed the outside directory within a few hundred.
RACE_ROUNDS = 50
REMOVE_IN_CHILD = ("import resource, sys; from pathlib import Path; "
                   "from batchrun.environments.tree_removal import remove_tree; "
                   "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)); remove_tree(Path(sys.argv[1]))")


def snapshot(top: Path) -> dict[str, tuple[int, int, int, bytes | None]]:
    """Mode, owner, group and (for files) contents of ``top`` and everything in it."""
    found = {}
    for directory, names, files in os.walk(top):
        for name in [".", *names, *files]:
            path = Path(directory, name)
            info = path.lstat()
            found[str(path.relative_to(top))] = (info.st_mode, info.st_uid, info.st_gid,
                                                 path.read_bytes() if stat.S_ISREG(info.st_mode) else None)
    return found


def make_outside(tmp_path: Path) -> Path:
    """A directory of the host next to the prompt's, with a mode the clean-up would never give."""
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "kept").write_text("host data")
    os.chmod(outside / "sub", 0o750)
    os.chmod(outside, 0o751)
    return outside


def build_locked_tree(tree: Path) -> None:
    """Directories of mode 000, 0500 and 0100 at several levels, files of mode 0000, the top 0500."""
    for directory in ["a/b/c", "r/s", "x/y"]:
        (tree / directory).mkdir(parents=True)
    for file in ["f", "a/f", "a/b/f", "a/b/c/f", "r/s/f", "x/y/f"]:
        (tree / file).write_text("locked")
        os.chmod(tree / file, 0)
    for directory, mode in [("a/b/c", 0o100), ("a/b", 0o000), ("a", 0o500), ("r/s", 0o000), ("r", 0o100),
                            ("x/y", 0o500), ("x", 0o000), (".", 0o500)]:
        os.chmod(tree / directory, mode)


def build_swap_tree(tree: Path) -> None:
    """A tree with a directory ``swap`` full of entries, for a racing process to swap for a symlink."""
    for number in range(20):
        (tree / "swap" / f"d{number}").mkdir(parents=True)
        (tree / f"sibling{number}").mkdir()
        for file in range(5):
            (tree / "swap" / f"d{number}" / f"f{file}").write_text("x")


def test_removes_files_directories_and_hidden_entries(tmp_path):
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / ".hidden").write_text("x")
    (tree / "a" / "b" / "f").write_text("x")
    (tree / "a" / "empty").mkdir()
    remove_tree(tree)
    assert not tree.exists()
    assert tmp_path.exists()


def test_a_symlink_inside_is_removed_and_what_it_points_to_is_left(tmp_path):
    outside = make_outside(tmp_path)
    before = snapshot(outside)
    tree = tmp_path / "tree"
    (tree / "a").mkdir(parents=True)
    (tree / "to_dir").symlink_to(outside)
    (tree / "a" / "to_file").symlink_to(outside / "kept")
    (tree / "a" / "loop").symlink_to("loop")
    remove_tree(tree)
    assert not tree.exists()
    assert snapshot(outside) == before


def test_a_root_that_is_a_symlink_is_unlinked_and_its_target_left(tmp_path):
    outside = make_outside(tmp_path)
    before = snapshot(outside)
    (tmp_path / "tree").symlink_to(outside)
    remove_tree(tmp_path / "tree")
    assert not os.path.lexists(tmp_path / "tree")
    assert snapshot(outside) == before


def test_a_missing_root_is_not_an_error(tmp_path):
    remove_tree(tmp_path / "missing")
    remove_tree(tmp_path / "missing" / "below")


def test_removes_a_1100_level_tree(tmp_path):
    (tmp_path / "tree").mkdir()
    with deep_chain(tmp_path / "tree", 1100):
        remove_tree(tmp_path / "tree")
        assert not (tmp_path / "tree").exists()


def test_removes_a_tree_whose_paths_are_longer_than_path_max(tmp_path):
    (tmp_path / "tree").mkdir()
    with deep_chain(tmp_path / "tree", 40, name=LONG_NAME, bottom_bytes=10):      # 10,000 bytes of path
        remove_tree(tmp_path / "tree")
        assert not (tmp_path / "tree").exists()


def test_removes_a_5000_level_tree_with_64_descriptors_allowed(tmp_path):
    (tmp_path / "tree").mkdir()
    with deep_chain(tmp_path / "tree", 5000):
        subprocess.run([sys.executable, "-c", REMOVE_IN_CHILD, str(tmp_path / "tree")], check=True, timeout=120)
        assert not (tmp_path / "tree").exists()


def test_holds_no_descriptor_after_removing(tmp_path):
    (tmp_path / "tree").mkdir()
    with deep_chain(tmp_path / "tree", 30, bottom_bytes=10):
        before = open_descriptors(tmp_path)
        remove_tree(tmp_path / "tree")
        assert open_descriptors(tmp_path) == before


@pytest.mark.parametrize("user", ["root", "prompt user"])
def test_removes_directories_and_files_a_command_locked(tmp_path, user):
    if user == "root" and not is_root():
        pytest.skip("needs root")
    home = prompt_home(tmp_path)
    as_prompt_user(home, lambda: build_locked_tree(Path("tree")))
    if user == "root":
        remove_tree(home / "tree")
    else:
        as_prompt_user(home, lambda: remove_tree(Path("tree")))
    assert not (home / "tree").exists()


def test_unlinks_fifos_sockets_and_device_nodes_without_opening_them(tmp_path):
    tree = tmp_path / "tree"
    (tree / "deep").mkdir(parents=True)
    for directory in (tree, tree / "deep"):
        os.mkfifo(directory / "fifo")       # opening it would wait for a writer forever
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(directory / "socket"))
        if is_root():
            os.mknod(directory / "device", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    # In a child with a time limit: a removal that opened the FIFO would hang, not fail.
    subprocess.run([sys.executable, "-c", REMOVE_IN_CHILD, str(tree)], check=True, timeout=60)
    assert not tree.exists()


def _can_mount() -> bool:
    try:
        return is_root() and subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0
    except OSError:
        return False


@pytest.mark.skipif(not _can_mount(), reason="needs root and mount namespaces (unshare --mount)")
def test_leaves_a_filesystem_mounted_inside_alone(tmp_path):
    tree = tmp_path / "tree"
    (tree / "mounted").mkdir(parents=True)
    (tree / "other").write_text("x")
    # The mount lives in a private mount namespace, gone with the shell.
    script = (f'mount -t tmpfs none "$1/mounted" && echo kept > "$1/mounted/file" && '
              f'"$2" -c "{REMOVE_IN_CHILD}" "$1" && cat "$1/mounted/file" && ls -A "$1"')
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
                           str(tree), sys.executable], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "kept\nmounted\n"), done.stderr
    remove_tree(tree)
    assert not tree.exists()


@pytest.mark.skipif(not is_root(), reason="the clean-up of interest runs as root, the racing command as another user")
def test_a_directory_swapped_for_a_symlink_while_removing_never_changes_the_outside(tmp_path):
    outside = make_outside(tmp_path)
    before = snapshot(outside)
    home = prompt_home(tmp_path)
    tree = home / "tree"
    for round_number in range(RACE_ROUNDS):
        as_prompt_user(home, lambda: build_swap_tree(Path("tree")))
        with swapping_for_symlink(tree / "swap", outside):
            remove_tree(tree)
        assert snapshot(outside) == before, f"round {round_number}"
        remove_tree(tree)       # what the racing process kept from the first removal
        assert not tree.exists()


def test_the_start_of_a_resumed_run_removes_a_1100_level_tree_under_the_work_root(tmp_path):
    settings = EnvironmentSettings(work_root=tmp_path / "work", run_label="test-leftovers")
    (settings.work_root / "prompt-3-abc").mkdir(parents=True)
    with deep_chain(settings.work_root / "prompt-3-abc", 1100):
        Environment.remove_leftovers(settings)
        assert not settings.work_root.exists()
