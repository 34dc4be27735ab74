"""The descriptor walk under removal and the workspace walk: where it goes when the tree changes."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from hostile_trees import deep_chain, open_descriptors

from batchrun.environments.tree_cursor import Moved, TreeCursor


def identity(fd_or_path: int | Path) -> tuple[int, int]:
    info = os.fstat(fd_or_path) if isinstance(fd_or_path, int) else os.lstat(fd_or_path)
    return info.st_dev, info.st_ino


def cursor_at(tree: Path) -> TreeCursor:
    cursor = TreeCursor.at(tree, stat.S_IRWXU)
    assert cursor is not None
    return cursor


def test_going_up_out_of_a_directory_moved_elsewhere_raises_moved(tmp_path):
    (tmp_path / "tree" / "a" / "b" / "c").mkdir(parents=True)
    (tmp_path / "tree" / "x").mkdir()
    with cursor_at(tmp_path / "tree") as cursor:
        assert cursor.enter("a") and cursor.enter("b") and cursor.enter("c")
        os.rename(tmp_path / "tree" / "a" / "b", tmp_path / "tree" / "x" / "b")
        assert cursor.leave() == "c"        # b is still the directory the walk came down through
        with pytest.raises(Moved):
            cursor.leave()                  # but b's parent is x now, not a
        cursor.restart()
        assert (cursor.at_root, identity(cursor.fd)) == (True, identity(tmp_path / "tree"))


def test_going_up_to_the_root_goes_to_the_root_wherever_the_directory_went(tmp_path):
    (tmp_path / "tree" / "a").mkdir(parents=True)
    with cursor_at(tmp_path / "tree") as cursor:
        assert cursor.enter("a")
        os.rename(tmp_path / "tree" / "a", tmp_path / "a")        # out of the tree
        assert cursor.leave() == "a"
        assert identity(cursor.fd) == identity(tmp_path / "tree")


def test_a_symlink_to_a_directory_is_never_entered(tmp_path):
    (tmp_path / "tree").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "tree" / "link").symlink_to(tmp_path / "outside")
    with cursor_at(tmp_path / "tree") as cursor:
        assert not cursor.enter("link")
        assert cursor.at_root


def test_a_cursor_holds_two_descriptors_at_any_depth(tmp_path):
    (tmp_path / "tree").mkdir()
    with deep_chain(tmp_path / "tree", 200):
        before = open_descriptors(tmp_path)
        with cursor_at(tmp_path / "tree") as cursor:
            for _ in range(200):
                assert cursor.enter("d")
            assert open_descriptors(tmp_path) == before + 2
            for _ in range(200):
                assert cursor.leave() == "d"
        assert open_descriptors(tmp_path) == before
