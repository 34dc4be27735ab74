"""The file tools against a real local environment: confinement, reading, writing, patching, searching."""

from __future__ import annotations

import asyncio
import importlib
import os
import random
import stat
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from conftest import on_event_loop

from batchrun.environments.base import EnvironmentSettings
from batchrun.environments.local import LocalEnvironment
from batchrun.time_limit import within
from batchrun.tools import ToolContext, ToolError
from batchrun.tools.files import patch, read_file, search_files, write_file
from batchrun.tools.files import search as search_module
from batchrun.tools.files.diff import Hunk, Lines, apply_hunks

Handler = Callable[[dict, ToolContext], Awaitable[dict]]


@pytest.fixture
def workspace(tmp_path):
    """A started environment whose directory the test fills directly; closed afterwards."""
    settings = EnvironmentSettings(work_root=tmp_path / "work", run_label="test", max_file_bytes=10_000)
    env = LocalEnvironment(settings, prompt_index=0)
    asyncio.run(env.start())
    yield env
    asyncio.run(env.close())


def call(env: LocalEnvironment, handler: Handler, **args: object) -> dict:
    return asyncio.run(handler(args, ToolContext(env=env, settings=env.settings)))


def put(env: LocalEnvironment, name: str, content: str | bytes) -> Path:
    path = env.prompt_dir / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, str):
        content = content.encode()
    path.write_bytes(content)
    return path


# --- confinement ----------------------------------------------------------------------------------

def test_read_refuses_parent_directory_escape(workspace, tmp_path):
    (tmp_path / "work" / "x").write_text("outside")
    with pytest.raises(ToolError, match="outside the working directory"):
        call(workspace, read_file, path="../x")


def test_read_refuses_absolute_path_outside(workspace):
    with pytest.raises(ToolError, match="outside the working directory"):
        call(workspace, read_file, path="/etc/passwd")


def test_read_accepts_absolute_path_inside(workspace):
    put(workspace, "in.txt", "inside\n")
    assert call(workspace, read_file, path=str(workspace.prompt_dir / "in.txt"))["content"] == "inside\n"


def test_read_refuses_symlink_to_outside_directory(workspace):
    (workspace.prompt_dir / "etc").symlink_to("/etc")
    with pytest.raises(ToolError, match="outside the working directory"):
        call(workspace, read_file, path="etc/passwd")


def test_write_refuses_symlinked_directory_outside(workspace, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (workspace.prompt_dir / "out").symlink_to(outside)
    with pytest.raises(ToolError, match="outside the working directory"):
        call(workspace, write_file, path="out/planted.txt", content="x")
    assert not (outside / "planted.txt").exists()


def test_write_refuses_parent_directory_escape(workspace, tmp_path):
    with pytest.raises(ToolError, match="outside the working directory"):
        call(workspace, write_file, path="../../escaped.txt", content="x")
    assert not (tmp_path / "escaped.txt").exists()


def test_read_refuses_a_directory(workspace):
    (workspace.prompt_dir / "sub").mkdir()
    with pytest.raises(ToolError, match="is a directory"):
        call(workspace, read_file, path="sub")


def test_read_refuses_a_file_over_the_size_limit(workspace):
    put(workspace, "big.txt", "x" * 10_001)
    with pytest.raises(ToolError, match="limit of 10000 bytes"):
        call(workspace, read_file, path="big.txt")


def test_write_refuses_content_over_the_size_limit(workspace):
    with pytest.raises(ToolError, match="limit of 10000 bytes"):
        call(workspace, write_file, path="big.txt", content="x" * 10_001)


def test_read_of_a_missing_file_says_so(workspace):
    with pytest.raises(ToolError, match="does not exist"):
        call(workspace, read_file, path="nope.txt")


# --- read_file / write_file ---------------------------------------------------------------------

def test_read_returns_the_requested_window_of_lines(workspace):
    put(workspace, "lines.txt", "".join(f"line {n}\n" for n in range(1, 11)))
    assert call(workspace, read_file, path="lines.txt", offset=3, limit=2) == {
        "path": "lines.txt", "content": "line 3\nline 4\n", "total_lines": 10, "offset": 3,
        "lines_returned": 2, "truncated": True}


def test_read_of_the_last_lines_is_not_truncated(workspace):
    put(workspace, "lines.txt", "a\nb\nc")
    result = call(workspace, read_file, path="lines.txt", offset=2)
    assert (result["content"], result["truncated"], result["total_lines"]) == ("b\nc", False, 3)


def test_read_splits_lines_at_newlines_only(workspace):
    put(workspace, "odd.txt", "a\r\nb\x0cc\u2028d\n\nlast")
    result = call(workspace, read_file, path="odd.txt", offset=2, limit=2)
    assert (result["content"], result["total_lines"], result["lines_returned"], result["truncated"]) == (
        "b\x0cc\u2028d\n\n", 4, 2, True)


def test_read_of_an_empty_file_has_no_lines(workspace):
    put(workspace, "empty.txt", "")
    assert call(workspace, read_file, path="empty.txt") == {
        "path": "empty.txt", "content": "", "total_lines": 0, "offset": 1, "lines_returned": 0, "truncated": False}


def test_read_of_invalid_utf8_replaces_only_the_bad_bytes(workspace):
    put(workspace, "bad.txt", b"ok\n\xe2\x82\nend\xff")
    assert call(workspace, read_file, path="bad.txt", offset=2)["content"] == "\ufffd\nend\ufffd"


# A window of a file of a million short lines split all of it into a million strings (tens of MB, and
# a second on the event loop that every session of the worker shares).
def test_a_window_of_a_file_of_many_lines_costs_memory_of_the_file_not_of_its_lines(tmp_path):
    settings = EnvironmentSettings(work_root=tmp_path / "work", run_label="test", max_file_bytes=10_000_000)
    env = LocalEnvironment(settings, prompt_index=0)
    asyncio.run(env.start())
    try:
        put(env, "many.txt", "ab\n" * 999_999 + "last")
        tracemalloc.start()
        try:
            result = call(env, read_file, path="many.txt", offset=999_998, limit=5)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        asyncio.run(env.close())
    assert (result["content"], result["total_lines"], result["lines_returned"]) == ("ab\nab\nlast", 1_000_000, 3)
    assert peak < 8_000_000       # the file is 3 MB


def test_read_offset_past_the_end_is_refused(workspace):
    put(workspace, "short.txt", "one\n")
    with pytest.raises(ToolError, match="past the end"):
        call(workspace, read_file, path="short.txt", offset=5)


def test_read_refuses_a_binary_file(workspace):
    put(workspace, "blob.bin", b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(ToolError, match="binary"):
        call(workspace, read_file, path="blob.bin")


@pytest.mark.parametrize("args", [{}, {"path": 3}, {"path": ""}, {"path": "a", "offset": 0},
                                  {"path": "a", "limit": "10"}])
def test_read_rejects_invalid_arguments(workspace, args):
    with pytest.raises(ToolError):
        call(workspace, read_file, **args)


def test_write_creates_parent_directories_and_reports_the_relative_path(workspace):
    assert call(workspace, write_file, path="pkg/mod/new.py", content="print('é')\n") == {
        "path": "pkg/mod/new.py", "bytes_written": 12}
    assert (workspace.prompt_dir / "pkg/mod/new.py").read_text() == "print('é')\n"


def test_write_reports_an_absolute_path_inside_relative_to_the_working_directory(workspace):
    result = call(workspace, write_file, path=str(workspace.prompt_dir / "pkg" / "abs.txt"), content="x")
    assert result == {"path": "pkg/abs.txt", "bytes_written": 1}


def test_write_keeps_the_permissions_of_the_file_it_replaces(workspace):
    script = put(workspace, "run.sh", "#!/bin/sh\necho old\n")
    script.chmod(0o750)
    call(workspace, write_file, path="run.sh", content="#!/bin/sh\necho new\n")
    assert stat.S_IMODE(script.stat().st_mode) == 0o750 and script.read_text().endswith("new\n")


def test_write_leaves_nothing_but_the_file(workspace):
    put(workspace, "kept.txt", "old\n")
    call(workspace, write_file, path="kept.txt", content="new\n")
    call(workspace, write_file, path="fresh.txt", content="new\n")
    assert sorted(os.listdir(workspace.prompt_dir)) == ["fresh.txt", "kept.txt"]


def test_a_path_with_a_nul_byte_is_refused(workspace):
    with pytest.raises(ToolError, match="NUL byte"):
        call(workspace, read_file, path="a\0b")
    with pytest.raises(ToolError, match="NUL byte"):
        call(workspace, write_file, path="a\0b", content="x")


def test_write_requires_content(workspace):
    with pytest.raises(ToolError, match="'content'"):
        call(workspace, write_file, path="a.txt")


# --- patch: exact string ------------------------------------------------------------------------

def test_patch_replaces_a_unique_string(workspace):
    target = put(workspace, "app.py", "def f():\n    return 1\n")
    result = call(workspace, patch, path="app.py", old_string="return 1", new_string="return 2")
    assert result == {"path": "app.py", "replacements": 1}
    assert target.read_text() == "def f():\n    return 2\n"


def test_patch_refuses_an_ambiguous_string_and_says_how_often_it_occurs(workspace):
    target = put(workspace, "app.py", "x = 1\nx = 1\n")
    with pytest.raises(ToolError, match="occurs 2 times.*replace_all"):
        call(workspace, patch, path="app.py", old_string="x = 1", new_string="x = 2")
    assert target.read_text() == "x = 1\nx = 1\n"


def test_patch_reports_a_missing_string(workspace):
    put(workspace, "app.py", "x = 1\n")
    with pytest.raises(ToolError, match="not found"):
        call(workspace, patch, path="app.py", old_string="y = 1", new_string="y = 2")


def test_patch_replace_all_replaces_every_occurrence(workspace):
    target = put(workspace, "app.py", "x = 1\nx = 1\n")
    result = call(workspace, patch, path="app.py", old_string="x", new_string="y", replace_all=True)
    assert result["replacements"] == 2
    assert target.read_text() == "y = 1\ny = 1\n"


def test_patch_refuses_a_result_over_the_limit_without_building_it(workspace):
    target = put(workspace, "a.txt", "a" * 5_000)
    tracemalloc.start()
    try:
        with pytest.raises(ToolError, match="would be 10000000 bytes, more than the file tools' limit of 10000"):
            call(workspace, patch, path="a.txt", old_string="a", new_string="b" * 2_000, replace_all=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000          # not the 10 MB result, twice
    assert target.read_text() == "a" * 5_000


def test_patch_needs_either_a_diff_or_old_string(workspace):
    with pytest.raises(ToolError, match="'path'"):
        call(workspace, patch)


# --- patch: unified diff ------------------------------------------------------------------------

ORIGINAL = "".join(f"line {n}\n" for n in range(1, 21))


def test_diff_modifies_a_file_and_creates_another(workspace):
    target = put(workspace, "src/data.txt", ORIGINAL)
    diff = (
        "diff --git a/src/data.txt b/src/data.txt\n"
        "index 1234567..89abcde 100644\n"
        "--- a/src/data.txt\n"
        "+++ b/src/data.txt\n"
        "@@ -2,3 +2,3 @@\n"
        " line 2\n"
        "-line 3\n"
        "+line three\n"
        " line 4\n"
        "@@ -18,3 +18,4 @@\n"
        " line 18\n"
        " line 19\n"
        " line 20\n"
        "+line 21\n"
        "--- /dev/null\n"
        "+++ b/notes/new.md\n"
        "@@ -0,0 +1,2 @@\n"
        "+# New\n"
        "+text\n")
    result = call(workspace, patch, diff=diff)
    assert result == {"files": [{"path": "src/data.txt", "created": False},
                                {"path": "notes/new.md", "created": True}]}
    assert target.read_text() == ORIGINAL.replace("line 3\n", "line three\n") + "line 21\n"
    assert (workspace.prompt_dir / "notes/new.md").read_text() == "# New\ntext\n"


def test_diff_finds_a_hunk_whose_line_numbers_drifted(workspace):
    target = put(workspace, "data.txt", "header\nheader\nheader\n" + ORIGINAL)
    diff = "--- a/data.txt\n+++ b/data.txt\n@@ -9,3 +9,3 @@\n line 9\n-line 10\n+line ten\n line 11\n"
    call(workspace, patch, diff=diff)
    assert "line ten\nline 11\n" in target.read_text() and "line 10\n" not in target.read_text()


def test_diff_with_a_failing_hunk_writes_nothing(workspace):
    target = put(workspace, "data.txt", ORIGINAL)
    diff = ("--- a/data.txt\n+++ b/data.txt\n"
            "@@ -2,3 +2,3 @@\n line 2\n-line 3\n+line three\n line 4\n"
            "@@ -10,3 +10,3 @@\n line 10\n-line 99\n+changed\n line 12\n")
    with pytest.raises(ToolError, match="hunk 2 .*does not apply"):
        call(workspace, patch, diff=diff)
    assert target.read_text() == ORIGINAL


def test_diff_without_headers_uses_the_path_argument(workspace):
    target = put(workspace, "data.txt", ORIGINAL)
    call(workspace, patch, path="data.txt", diff="@@ -1,2 +1,2 @@\n-line 1\n+first\n line 2\n")
    assert target.read_text().startswith("first\nline 2\n")


def test_diff_honours_no_newline_at_end_of_file(workspace):
    target = put(workspace, "data.txt", "a\nb\n")
    call(workspace, patch, diff="--- a/data.txt\n+++ b/data.txt\n@@ -1,2 +1,2 @@\n a\n-b\n+c\n"
                                "\\ No newline at end of file\n")
    assert target.read_bytes() == b"a\nc"


def test_diff_creating_an_existing_file_is_refused(workspace):
    put(workspace, "there.txt", "keep\n")
    with pytest.raises(ToolError, match="already exists"):
        call(workspace, patch, diff="--- /dev/null\n+++ b/there.txt\n@@ -0,0 +1 @@\n+new\n")
    assert (workspace.prompt_dir / "there.txt").read_text() == "keep\n"


def test_diff_with_a_line_outside_any_hunk_form_is_refused(workspace):
    put(workspace, "data.txt", ORIGINAL)
    with pytest.raises(ToolError, match="not a hunk line"):
        call(workspace, patch, diff="--- a/data.txt\n+++ b/data.txt\n@@ -1,2 +1,2 @@\nline 1\n-line 2\n")


def test_diff_cannot_escape_the_working_directory(workspace):
    with pytest.raises(ToolError, match="outside the working directory"):
        call(workspace, patch, diff="--- /dev/null\n+++ b/../../evil.txt\n@@ -0,0 +1 @@\n+x\n")


@pytest.mark.parametrize("alias", ["./f", "{root}/f"])
def test_diff_naming_one_file_under_two_spellings_applies_both_sections_in_turn(workspace, alias):
    target = put(workspace, "f", "one\ntwo\n")
    alias = alias.format(root=workspace.prompt_dir)
    diff = (f"--- a/f\n+++ b/f\n@@ -1 +1 @@\n-one\n+ONE\n"
            f"--- {alias}\n+++ {alias}\n@@ -2 +2 @@\n-two\n+TWO\n")
    assert call(workspace, patch, diff=diff) == {"files": [{"path": "f", "created": False}]}
    assert target.read_text() == "ONE\nTWO\n"


def test_diff_whose_later_file_would_exceed_the_size_limit_writes_none(workspace):
    small, big = put(workspace, "small", "s\n"), put(workspace, "big", "b\n")
    diff = ("--- a/small\n+++ b/small\n@@ -1 +1 @@\n-s\n+S\n"
            "--- a/big\n+++ b/big\n@@ -1 +1 @@\n-b\n+" + "X" * 20_000 + "\n")
    with pytest.raises(ToolError, match="'big' would be 20001 bytes, more than the file tools' limit of 10000 bytes. Nothing was written"):
        call(workspace, patch, diff=diff)
    assert (small.read_text(), big.read_text()) == ("s\n", "b\n")


def test_diff_whose_later_file_cannot_be_written_leaves_the_others_as_they_were(workspace):
    target = put(workspace, "data.txt", ORIGINAL)
    diff = ("--- /dev/null\n+++ b/new.txt\n@@ -0,0 +1 @@\n+new\n"
            "--- a/data.txt\n+++ b/data.txt\n@@ -1 +1 @@\n-line 1\n+first\n"
            "--- /dev/null\n+++ b/../../evil.txt\n@@ -0,0 +1 @@\n+x\n")
    with pytest.raises(ToolError, match="outside the working directory.*the files written before it were put back"):
        call(workspace, patch, diff=diff)
    assert target.read_text() == ORIGINAL
    assert not (workspace.prompt_dir / "new.txt").exists()


# The call's time limit struck between two of a diff's writes: the first file kept the diff's change,
# though the model was told the call did not finish.
def test_diff_stopped_by_its_time_limit_between_writes_leaves_the_files_as_they_were(workspace, monkeypatch):
    first, second = put(workspace, "first.txt", "a\n"), put(workspace, "second.txt", "b\n")
    write_file = workspace.write_file

    async def second_write_hangs(path: str, data: bytes) -> str:
        if path == "second.txt" and data == b"B\n":
            await asyncio.Event().wait()
        return await write_file(path, data)

    monkeypatch.setattr(workspace, "write_file", second_write_hangs)
    diff = ("--- a/first.txt\n+++ b/first.txt\n@@ -1 +1 @@\n-a\n+A\n"
            "--- /dev/null\n+++ b/created.txt\n@@ -0,0 +1 @@\n+new\n"
            "--- a/second.txt\n+++ b/second.txt\n@@ -1 +1 @@\n-b\n+B\n")

    async def limited() -> None:
        await within(0.5, patch({"diff": diff}, ToolContext(env=workspace, settings=workspace.settings)))

    with pytest.raises(TimeoutError):
        asyncio.run(limited())
    assert (first.read_text(), second.read_text()) == ("a\n", "b\n")
    assert not (workspace.prompt_dir / "created.txt").exists()


def test_a_string_replacement_runs_off_the_event_loop(workspace, monkeypatch):
    """Decoding, counting and replacing in a file of 10 MB took 0.16 s of the event loop the worker's
    other sessions share."""
    patch_module = importlib.import_module("batchrun.tools.files.patch")
    ran_on_loop: list[bool] = []
    editable_text = patch_module.editable_text

    def watching(data: bytes, path: str) -> str:
        ran_on_loop.append(on_event_loop())
        return editable_text(data, path)

    monkeypatch.setattr(patch_module, "editable_text", watching)
    put(workspace, "data.txt", ORIGINAL)
    assert call(workspace, patch, path="data.txt", old_string="line 1\n", new_string="first\n")["replacements"] == 1
    assert ran_on_loop == [False]


def test_diff_parsing_and_hunk_search_run_off_the_event_loop(workspace, monkeypatch):
    """On a large file they are seconds of CPU, which on the worker's event loop would stop every other
    session it runs (and the call's own time limit) for as long."""
    patch_module = importlib.import_module("batchrun.tools.files.patch")
    ran_on_loop: list[bool] = []

    def watched(function: Callable) -> Callable:
        def watching(*args: object) -> object:
            ran_on_loop.append(on_event_loop())
            return function(*args)
        return watching

    monkeypatch.setattr(patch_module, "parse_diff", watched(patch_module.parse_diff))
    monkeypatch.setattr(patch_module, "apply_hunks", watched(patch_module.apply_hunks))
    put(workspace, "data.txt", ORIGINAL)
    call(workspace, patch, diff="--- a/data.txt\n+++ b/data.txt\n@@ -1 +1 @@\n-line 1\n+first\n")
    assert ran_on_loop == [False, False]


def test_diff_whose_hunks_are_all_far_from_their_headers_is_refused(workspace, monkeypatch):
    """Headers that send each search to the far end of the file would cost a pass over it per hunk (a
    million-line file, minutes): the search reads a few passes' worth of lines at most."""
    monkeypatch.setattr(workspace.settings, "max_file_bytes", 1_000_000)
    lines = 20_000
    target = put(workspace, "data.txt", "".join(f"line {n}\n" for n in range(lines)))
    hunks = "".join(f"@@ -{lines if n % 2 == 0 else n + 1} @@\n-line {n}\n+LINE {n}\n" for n in range(200))
    with pytest.raises(ToolError, match="too far from the lines their '@@' headers give"):
        call(workspace, patch, diff="--- a/data.txt\n+++ b/data.txt\n" + hunks)
    assert target.read_text().startswith("line 0\n")


def test_diff_with_more_distinct_lines_to_match_than_the_search_can_tell_apart_is_refused(workspace, monkeypatch):
    monkeypatch.setattr(importlib.import_module("batchrun.tools.files.diff"), "_DISTINCT_LINES", 2)
    put(workspace, "data.txt", ORIGINAL)
    with pytest.raises(ToolError, match="more than 2 different lines"):
        call(workspace, patch, diff="--- a/data.txt\n+++ b/data.txt\n@@ -1,3 +1,3 @@\n line 1\n-line 2\n+two\n line 3\n")


def _first_search(lines: list[str], hunks: list[Hunk]) -> list[str] | int:
    """The hunks applied as the first version did (a list comparison at every position, nearest to
    the expected line, the earlier on a tie; a list insertion per hunk): the file's new lines, or the
    number of the hunk that did not apply."""
    lines, shift, floor = list(lines), 0, 0
    for number, hunk in enumerate(hunks, 1):
        last = len(lines) - len(hunk.old)
        expected = min(max(floor if hunk.start is None else hunk.start + shift, floor), last)
        places = sorted(range(floor, last + 1), key=lambda at: (abs(at - expected), at))
        at = next((at for at in places if lines[at:at + len(hunk.old)] == hunk.old), None)
        if at is None:
            return number
        lines[at:at + len(hunk.old)] = hunk.new
        if hunk.start is not None:
            shift = at - hunk.start + len(hunk.new) - len(hunk.old)
        floor = at + len(hunk.new)
    return lines


def _random_hunks(rng: random.Random, lines: list[str]) -> list[Hunk]:
    """Hunks in file order, some with lines the file lacks, all numbered (off by a little) or none."""
    numbered, hunks, at = rng.random() < 0.7, [], 0
    for _ in range(rng.randint(1, 4)):
        at = rng.randint(min(at, len(lines)), len(lines))
        old = lines[at:at + rng.randint(0, 3)] + (["absent"] if rng.random() < 0.1 else [])
        new = [rng.choice(["a", "b", "", "new"]) for _ in range(rng.randint(0, 3))]
        hunks.append(Hunk(max(at + rng.randint(-4, 4), 0) if numbered else None, old, new))
        at += len(old)
    return hunks


def test_diff_hunks_are_found_where_the_first_search_found_them():
    """The faster search keeps the rules: nearest to the header's line after the previous hunk, the
    earlier of two equally near, line numbers corrected by how far the previous hunk was found."""
    rng = random.Random(7)
    for _ in range(2_000):
        lines = [rng.choice(["a", "b", ""]) for _ in range(rng.randint(0, 30))]
        hunks = _random_hunks(rng, lines)
        expected = _first_search(lines, hunks)
        if isinstance(expected, int):
            with pytest.raises(ToolError, match=f"hunk {expected} of the diff"):
                apply_hunks(Lines(lines, True), hunks, "f")
        else:
            assert apply_hunks(Lines(lines, True), hunks, "f").lines == expected, (lines, hunks)


# --- search_files -------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["content", "files"])
def test_search_in_a_fifo_is_a_tool_error_not_a_wait_for_the_time_out(workspace, target):
    os.mkfifo(workspace.prompt_dir / "pipe")
    (workspace.prompt_dir / "link").symlink_to("pipe")
    for path in ("pipe", "link"):
        with pytest.raises(ToolError, match="not a regular file or a directory"):
            call(workspace, search_files, pattern="x", path=path, target=target)


def test_search_content_finds_matching_lines(workspace):
    put(workspace, "src/a.py", "import os\ndef main():\n    pass\n")
    put(workspace, "src/b.py", "def helper():\n    pass\n")
    put(workspace, "blob.bin", b"def \x00binary")
    assert call(workspace, search_files, pattern=r"^def \w+\(") == {
        "matches": [{"path": "src/a.py", "line": 2, "text": "def main():"},
                    {"path": "src/b.py", "line": 1, "text": "def helper():"}],
        "truncated": False}


def test_search_content_respects_max_results(workspace):
    put(workspace, "many.txt", "hit\n" * 5)
    result = call(workspace, search_files, pattern="hit", max_results=2)
    assert len(result["matches"]) == 2 and result["truncated"]


def test_search_files_matches_names_by_glob(workspace):
    put(workspace, "src/a.py", "")
    put(workspace, "src/deep/b.py", "")
    put(workspace, "README.md", "")
    assert call(workspace, search_files, pattern="*.py", target="files") == {
        "files": ["src/a.py", "src/deep/b.py"], "truncated": False}


def test_search_files_within_a_subdirectory(workspace):
    put(workspace, "src/a.py", "")
    put(workspace, "tests/t.py", "")
    assert call(workspace, search_files, pattern="*.py", target="files", path="tests")["files"] == ["tests/t.py"]


def test_search_with_no_match_returns_an_empty_list(workspace):
    put(workspace, "a.txt", "nothing here\n")
    assert call(workspace, search_files, pattern="absent") == {"matches": [], "truncated": False}


def test_search_with_a_bad_regex_reports_greps_message(workspace):
    put(workspace, "a.txt", "text\n")
    with pytest.raises(ToolError, match="grep failed: grep: "):
        call(workspace, search_files, pattern="(unclosed")


@pytest.mark.parametrize("path", ["..", "../..", "/etc", "src/../../x"])
def test_search_refuses_paths_outside_the_working_directory(workspace, path):
    with pytest.raises(ToolError, match="relative to the working directory"):
        call(workspace, search_files, pattern="root", path=path)


def test_search_refuses_a_symlink_leading_outside(workspace):
    (workspace.prompt_dir / "etc").symlink_to("/etc")
    with pytest.raises(ToolError, match="outside the working directory"):
        call(workspace, search_files, pattern="root", path="etc")


def test_search_of_a_missing_path_says_so(workspace):
    with pytest.raises(ToolError, match="does not exist"):
        call(workspace, search_files, pattern="x", path="missing")


def test_search_rejects_an_unknown_target(workspace):
    with pytest.raises(ToolError, match="'target'"):
        call(workspace, search_files, pattern="x", target="dirs")


def test_search_pattern_is_passed_literally_to_the_shell(workspace):
    put(workspace, "a.txt", "$(touch pwned)\n")
    result = call(workspace, search_files, pattern="$(touch pwned)|;rm -rf x")
    assert not os.path.exists(workspace.prompt_dir / "pwned")
    assert result["matches"] == []


@pytest.mark.parametrize("target", ["content", "files"])
def test_search_reports_a_name_holding_a_newline_as_the_one_file_it_is(workspace, target):
    # Results were split at newlines: a directory named "a\n." holding "passwd" gave a match in "passwd"
    # and a file list of "a" and "passwd", neither of which exists.
    put(workspace, "a\n./passwd", "root:x:0:0\n")
    result = call(workspace, search_files, pattern="passwd" if target == "files" else "root", target=target)
    if target == "files":
        assert result == {"files": ["a\n./passwd"], "truncated": False}
    else:
        assert result == {"matches": [{"path": "a\n./passwd", "line": 1, "text": "root:x:0:0"}], "truncated": False}


@pytest.mark.parametrize("target", ["content", "files"])
def test_a_search_whose_output_was_cut_lists_only_what_exists(tmp_path, target):
    # The output was cut in the middle of a line, and that part line read as a result: a name that
    # no file has.
    settings = EnvironmentSettings(work_root=tmp_path / "work", run_label="test", max_output_chars=1_000)
    env = LocalEnvironment(settings, prompt_index=0)
    asyncio.run(env.start())
    try:
        for number in range(100):
            put(env, f"p{number:03}_{'z' * 37}", "hit\n")
        result = call(env, search_files, pattern="*z" if target == "files" else "hit", target=target)
        found = result["files"] if target == "files" else [match["path"] for match in result["matches"]]
        assert result["truncated"] and found
        assert all((env.prompt_dir / name).is_file() for name in found), found
    finally:
        asyncio.run(env.close())



# --- '..' after a name: the kernel climbs from where the name leads --------------------------------------

def test_a_write_through_a_symlink_and_dotdot_reports_the_path_as_given(workspace):
    # 'a/../w' with 'a' a symlink to 'c/d' is 'c/w'; the result named 'w', a file it had not written.
    (workspace.prompt_dir / "c" / "d").mkdir(parents=True)
    (workspace.prompt_dir / "a").symlink_to("c/d")
    assert call(workspace, write_file, path="a/../w", content="x")["path"] == "a/../w"
    assert (workspace.prompt_dir / "c" / "w").read_text() == "x"
    assert not (workspace.prompt_dir / "w").exists()


def test_a_diff_naming_a_file_with_dotdot_after_a_name_is_refused_and_writes_nothing(workspace):
    # 'b' and 'a/../b' were taken as one file: with 'a' a symlink to 'c/d', both sections went to 'b',
    # and 'c/b', the file the second named, was left as it was, the call saying it succeeded.
    (workspace.prompt_dir / "c" / "d").mkdir(parents=True)
    (workspace.prompt_dir / "a").symlink_to("c/d")
    top, below = put(workspace, "b", "one\n"), put(workspace, "c/b", "two\n")
    diff = ("--- a/b\n+++ b/b\n@@ -1 +1 @@\n-one\n+two\n"
            "--- a/a/../b\n+++ b/a/../b\n@@ -1 +1 @@\n-two\n+three\n")
    with pytest.raises(ToolError, match=r"'\.\.' after a directory's name.*Nothing was written"):
        call(workspace, patch, diff=diff)
    assert (top.read_text(), below.read_text()) == ("one\n", "two\n")


def test_greps_note_on_a_binary_file_among_the_results_loses_no_match():
    # grep before 3.5 (Ubuntu 20.04, Debian 10, CentOS 7) writes "Binary file X matches" among its results,
    # on stdout and without a NUL: it was taken for the start of the next path, and that file's match lost.
    output = "./a\x001:abc\nBinary file ./b matches\n./c\x001:abc\n./d\x002:abc\n"
    assert [match["path"] for match in search_module._grep_matches(output)] == ["a", "c", "d"]
