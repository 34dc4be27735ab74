"""The workspace's disk usage walk: nothing a prompt does hides what its workspace holds, and nothing
outside the workspace is counted."""

from __future__ import annotations

import os
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

from batchrun.environments.disk_usage import DiskUsageWalk
from batchrun.environments.limits import MIB

WALK_IN_CHILD = ("import resource, sys; from pathlib import Path; from batchrun.environments.disk_usage import DiskUsageWalk; "
                 "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)); "
                 "print(DiskUsageWalk(Path(sys.argv[1]), int(sys.argv[2])).run())")
RACE_ROUNDS = 200      # the old walk counted the outside directory within a few hundred


def write_data(path: Path, size: int) -> None:
    path.write_bytes(os.urandom(size))


def usage(top: Path) -> int:
    """What ``du`` would say, in bytes, of everything below ``top`` (not ``top`` itself)."""
    return sum(os.lstat(Path(directory, name)).st_blocks * 512
               for directory, names, files in os.walk(top) for name in names + files)


def build_locked_tree(tree: Path) -> None:
    """2 MiB in a directory of mode 000, and 2 MiB two levels below a directory of mode 0100."""
    (tree / "locked").mkdir(parents=True)
    (tree / "a" / "b").mkdir(parents=True)
    write_data(tree / "locked" / "data", 2 * MIB)
    write_data(tree / "a" / "b" / "data", 2 * MIB)
    for directory, mode in [("locked", 0o000), ("a/b", 0o000), ("a", 0o100)]:
        os.chmod(tree / directory, mode)


def test_the_walk_counts_what_lies_deeper_than_path_max(tmp_path):
    (tmp_path / "tree").mkdir()
    with deep_chain(tmp_path / "tree", 40, name=LONG_NAME, bottom_bytes=2 * MIB):     # 10,000 bytes of path
        assert DiskUsageWalk(tmp_path / "tree", 2 * MIB).run() is True


def test_the_walk_counts_a_5000_level_tree_with_64_descriptors_allowed(tmp_path):
    (tmp_path / "tree").mkdir()
    directories = 5000 * os.stat(tmp_path / "tree").st_blocks * 512
    with deep_chain(tmp_path / "tree", 5000, bottom_bytes=2 * MIB):
        walked = subprocess.run([sys.executable, "-c", WALK_IN_CHILD, str(tmp_path / "tree"),
                                 str(directories + MIB)], capture_output=True, text=True, check=True, timeout=120)
    assert walked.stdout == "True\n"


@pytest.mark.parametrize("user", ["root", "prompt user"])
def test_the_walk_counts_what_lies_in_directories_a_command_locked(tmp_path, user):
    if user == "root" and not is_root():
        pytest.skip("needs root")
    home = prompt_home(tmp_path)
    as_prompt_user(home, lambda: build_locked_tree(Path("tree")))
    if user == "root":
        over = DiskUsageWalk(home / "tree", 3 * MIB).run()
    else:
        over = as_prompt_user(home, lambda: DiskUsageWalk(Path("tree"), 3 * MIB).run())
    assert over is True


def test_the_walk_counts_symlinks_not_what_they_point_to(tmp_path):
    (tmp_path / "outside").mkdir()
    write_data(tmp_path / "outside" / "big", 4 * MIB)
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "to_dir").symlink_to(tmp_path / "outside")
    (tree / "sub" / "to_file").symlink_to(tmp_path / "outside" / "big")
    (tree / "sub" / "up").symlink_to("..")
    (tree / "sub" / "here").symlink_to(".")
    (tree / "loop").symlink_to("loop")
    assert DiskUsageWalk(tree, MIB).run() is False


def test_the_walk_paused_deep_in_a_tree_goes_on_where_it_left_off(tmp_path):
    tree = tmp_path / "tree"
    (tree / "side").mkdir(parents=True)
    with deep_chain(tree, 300, bottom_bytes=64 * 1024), deep_chain(tree / "side", 50, bottom_bytes=64 * 1024):
        total = usage(tree)
        for limit, expected in [(total - 1, True), (total, False)]:
            walk, pauses = DiskUsageWalk(tree, limit), 0
            while (over := walk.run(max_entries=7)) is None:
                pauses += 1
            assert (over, pauses > 40) == (expected, True)


def test_the_walk_holds_no_descriptor_once_it_has_an_answer(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    with deep_chain(tree, 30, bottom_bytes=2 * MIB):
        before = open_descriptors(tmp_path)
        assert DiskUsageWalk(tree, 64 * MIB).run() is False
        assert DiskUsageWalk(tree, MIB).run() is True
        assert open_descriptors(tmp_path) == before


@pytest.mark.skipif(not is_root(), reason="the runner of interest is root, the racing command another user")
def test_the_walk_never_counts_a_directory_swapped_in_from_outside(tmp_path):
    (tmp_path / "outside").mkdir()
    write_data(tmp_path / "outside" / "big", 4 * MIB)
    home = prompt_home(tmp_path)
    tree = home / "tree"

    def build() -> None:
        """``swap`` among many directories: the walk gets to it a while after it saw it."""
        for number in range(100):
            Path("tree", f"d{number}").mkdir(parents=True)
            for file in range(5):
                Path("tree", f"d{number}", f"f{file}").touch()
        Path("tree", "swap").mkdir()

    as_prompt_user(home, build)
    with swapping_for_symlink(tree / "swap", tmp_path / "outside"):
        for round_number in range(RACE_ROUNDS):
            assert DiskUsageWalk(tree, MIB).run() is False, f"round {round_number}"


def test_an_empty_file_counts_the_least_a_file_is_given(tmp_path):
    # An empty file takes no block but an inode; a walk that counted blocks only let a prompt use up the
    # disk's inodes while its workspace stayed far below its limit.
    tree = tmp_path / "tree"
    tree.mkdir()
    for number in range(100):
        (tree / f"empty{number}").touch()
    walk = DiskUsageWalk(tree, 100 * 16384, least_per_file=16384)
    assert walk.run() is False and walk.used == 100 * 16384
    assert DiskUsageWalk(tree, 100 * 16384 - 1, least_per_file=16384).run() is True
