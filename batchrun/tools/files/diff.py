"""Unified diffs: parsed into hunks per file, and applied to a file's lines, each hunk found near where
it says (the model's line numbers are often off), never where it does not match."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from batchrun.tools import ToolError

_HUNK_HEADER = re.compile(r"@@ -(\d+)(?:,(\d+))?")


@dataclass
class Hunk:
    """One ``@@`` block: the lines it expects (old) and the lines it leaves (new), without '\\n'."""

    start: int | None                   # 0-based index the header points at; a hint, context decides
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    old_missing_newline: bool = False   # "\ No newline at end of file" after an old-side line
    new_missing_newline: bool = False
    last_kind: str = " "

    def add(self, kind: str, text: str) -> None:
        if kind != "+":
            self.old.append(text)
        if kind != "-":
            self.new.append(text)
        self.last_kind = kind

    def mark_missing_newline(self) -> None:
        """The marker refers to the line before it: old side, new side, or both for context."""
        if self.last_kind != "+":
            self.old_missing_newline = True
        if self.last_kind != "-":
            self.new_missing_newline = True


@dataclass
class FilePatch:
    old_path: str | None                # None for /dev/null: the diff creates the file
    new_path: str | None                # None for /dev/null: the diff deletes the file
    hunks: list[Hunk] = field(default_factory=list)


@dataclass
class Lines:
    """A file as lines without terminators, plus whether it ends with a newline."""

    lines: list[str]
    ends_with_newline: bool

    @classmethod
    def parse(cls, text: str) -> Lines:
        lines = text.split("\n")
        if text.endswith("\n") or not text:
            lines.pop()
            return cls(lines, True)
        return cls(lines, False)

    def render(self) -> str:
        return "\n".join(self.lines) + ("\n" if self.lines and self.ends_with_newline else "")


def _header_path(line: str, prefix: str) -> str | None:
    """The path of a ``---``/``+++`` line: timestamp dropped, ``a/``/``b/`` stripped, /dev/null None."""
    name = line[4:].split("\t")[0].strip()
    if name == "/dev/null":
        return None
    return name[len(prefix):] if name.startswith(prefix) else name


def _new_hunk(line: str) -> Hunk:
    """A hunk from its header; a header without line numbers (``@@ @@``) searches from the top."""
    match = _HUNK_HEADER.match(line)
    if match is None:
        return Hunk(None)
    first, count = int(match.group(1)), match.group(2)
    # "-5,0" (nothing removed) means "after line 5", so the block starts at index 5, not 4.
    return Hunk(first if count == "0" else max(first - 1, 0))


def parse_diff(diff: str, default_path: str | None) -> list[FilePatch]:
    """Split a unified diff into per-file hunks.

    Line counts in ``@@`` headers are ignored (models often get them wrong); a hunk ends at the next
    header. A bare empty line inside a hunk is taken as an empty context line (editors strip the
    space), except at the end of a hunk, where it is only the gap before the next file.
    """
    lines = diff.split("\n")
    patches: list[FilePatch] = []
    hunk: Hunk | None = None
    blank_lines = 0
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("--- ") and index + 1 < len(lines) and lines[index + 1].startswith("+++ "):
            patches.append(FilePatch(_header_path(line, "a/"), _header_path(lines[index + 1], "b/")))
            hunk, blank_lines, index = None, 0, index + 2
            continue
        if line.startswith("@@"):
            if not patches:
                if default_path is None:
                    raise ToolError("the diff has no '--- a/FILE' / '+++ b/FILE' headers; "
                                    "add them or give the file in 'path'")
                patches.append(FilePatch(default_path, default_path))
            hunk, blank_lines = _new_hunk(line), 0
            patches[-1].hunks.append(hunk)
        elif hunk is None or line.startswith("diff "):
            hunk = None                       # git/diff headers and commentary between files
        elif line == "":
            blank_lines += 1
        elif line[0] in " -+":
            for _ in range(blank_lines):
                hunk.add(" ", "")
            blank_lines = 0
            hunk.add(line[0], line[1:])
        elif line.startswith("\\"):
            hunk.mark_missing_newline()
        else:
            raise ToolError(f"line {index + 1} of the diff is not a hunk line (it must start with "
                            f"' ', '-' or '+'): {line[:80]!r}")
        index += 1
    if not any(file_patch.hunks for file_patch in patches):
        raise ToolError("the diff contains no hunks ('@@ -N,M +N,M @@' followed by lines)")
    return patches


def _locate(lines: list[str], old: list[str], expected: int, floor: int) -> int | None:
    """Where ``old`` occurs at or after ``floor``, nearest to ``expected`` (offset drift); None if nowhere."""
    last = len(lines) - len(old)
    if last < floor:
        return None
    expected = min(max(expected, floor), last)
    for distance in range(max(expected - floor, last - expected) + 1):
        for at in (expected - distance, expected + distance):
            if floor <= at <= last and lines[at:at + len(old)] == old:
                return at
    return None


def apply_hunks(current: Lines, hunks: list[Hunk], path: str) -> Lines:
    """The file after every hunk, applied in order; raises ToolError at the first that does not fit."""
    lines, ends_with_newline = list(current.lines), current.ends_with_newline
    shift = 0       # how far the previous hunk moved things from the positions the headers assume
    floor = 0       # hunks apply in order and never overlap
    for number, hunk in enumerate(hunks, 1):
        expected = floor if hunk.start is None else hunk.start + shift
        at = _locate(lines, hunk.old, expected, floor)
        if at is None:
            raise ToolError(
                f"hunk {number} of the diff for {path!r} does not apply: its context and removed lines "
                f"were not found (expected near line {expected + 1}). Nothing was written; read the "
                "file again and make those lines match it exactly")
        reaches_end = at + len(hunk.old) == len(lines)
        lines[at:at + len(hunk.old)] = hunk.new
        if reaches_end and (hunk.old_missing_newline or hunk.new_missing_newline):
            ends_with_newline = not hunk.new_missing_newline
        if hunk.start is not None:
            shift = at - hunk.start + len(hunk.new) - len(hunk.old)
        floor = at + len(hunk.new)
    return Lines(lines, ends_with_newline)
