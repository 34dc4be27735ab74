"""Dataset loading: validate once, remember only where the pending prompts are.

A dataset may hold millions of lines, so nothing here keeps prompts in memory: the plan stores the
byte offset of every pending sample's line (with how many earlier lines hold the same prompt, the
prompt's index and a fingerprint of its content key), and :func:`iter_pending` re-reads them one at a
time as workers need work, refusing a line that is not the one planned.

Over 400 lines: the validation that plans and the re-reading that checks each line against its plan
must read a line alike, byte for byte; kept in one module, they share one reading of a line.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import shlex
from array import array
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from batchrun.flag_values import MOST_TEXT_BYTES, is_utf8
from batchrun.paths import NotRegularFile, file_kind, lookup_error, open_regular, unexpanded_home
from batchrun.rows import content_key, content_key_of_sample, sample_key, split_unit, unit_key

# A longer line is passed over unread, a chunk at a time.
LONGEST_LINE = MOST_TEXT_BYTES
_SKIP_CHUNK = 1024 * 1024
# The first read of a line re-read by its offset (see _line_at): a whole prompt, most of the time, in one
# system call; a longer line is read on in chunks twice the last.
_FIRST_READ = 8192

# Bad lines named one by one; past these a count stands for the rest, so a file of 500 bad lines
# cannot bury the console (the total goes to the summary and statistics.json).
NAMED_BAD_LINES = 5


class SkippedLines:
    """Warns about the first bad lines by number, then counts the rest quietly."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self._warn = warn
        self.count = 0

    def add(self, warning: str) -> None:
        self.count += 1
        if self.count <= NAMED_BAD_LINES:
            self._warn(warning)

    def finish(self, *, remedy: str = "fix them and run again with --resume to include them") -> None:
        """One line for those not named, saying ``remedy``."""
        if self.count > NAMED_BAD_LINES:
            self._warn(f"{self.count - NAMED_BAD_LINES} more bad lines skipped ({self.count} in all); {remedy}")


class DatasetError(Exception):
    """The dataset cannot be used at all (missing file, no valid prompt)."""


class DatasetChanged(Exception):
    """A line re-read during the run is not the line planned, or cannot be read at all: the file changed
    under the run (rewritten, removed, replaced by something else)."""


@dataclass(frozen=True)
class DatasetRecord:
    prompt_index: int
    prompt: str
    image: str | None
    cwd: str | None
    key: str
    occurrence: int        # how many earlier valid lines had the same content key
    sample_index: int = 0  # which of the prompt's --samples_per_prompt runs


@dataclass
class PendingRound:
    """The prompts whose sample of one index is still to run, in dataset order."""

    offsets: array = field(default_factory=lambda: array("q"))       # of the line
    occurrences: array = field(default_factory=lambda: array("I"))   # see DatasetRecord
    indexes: array = field(default_factory=lambda: array("q"))       # the prompt index
    fingerprints: array = field(default_factory=lambda: array("Q"))  # see content_fingerprint

    def __len__(self) -> int:
        return len(self.offsets)


@dataclass
class DatasetPlan:
    path: Path
    total: int                                   # valid prompts considered (after --max_samples)
    already_done: int                            # samples (of the first samples_per_prompt) already done
    skipped_lines: int
    samples_per_prompt: int = 1
    pending_with_image: int = 0                  # prompts with a sample pending that name a container image
    pending_chars: int = 0                       # the prompt characters of every pending sample
    rounds: list[PendingRound] = field(default_factory=list)     # per sample index
    # Where the units of earlier rows are now, when their line holds other content: rows.unit_key as the
    # rows name it -> the prompt index now, or None where no line of the dataset is theirs (see
    # plan_dataset). Empty unless the dataset changed.
    relocated: dict[str, int | None] = field(default_factory=dict)

    @property
    def pending(self) -> int:
        return sum(len(pending) for pending in self.rounds)

    @property
    def units(self) -> int:
        """Samples the run is to have: every prompt's first samples_per_prompt."""
        return self.total * self.samples_per_prompt

    def is_pending(self, prompt_index: int, sample_index: int) -> bool:
        """Whether that sample of that prompt (by its place among the valid lines) is to run."""
        if sample_index >= len(self.rounds):
            return False
        indexes = self.rounds[sample_index].indexes      # ascending: the dataset's order
        place = bisect.bisect_left(indexes, prompt_index)
        return place < len(indexes) and indexes[place] == prompt_index

    def pending_units(self) -> list[int]:
        """Every pending sample's unit, in the order iter_pending hands them out."""
        return [self.unit(index, sample_index) for sample_index, pending in enumerate(self.rounds)
                for index in pending.indexes]

    def pending_units_in_dataset_order(self) -> list[int]:
        """Every pending sample's unit, by its prompt's place in the dataset (then by sample): what
        --estimate spaces its draw over, so that the draw covers the dataset from end to end however
        many samples each prompt has."""
        return sorted(self.pending_units(), key=lambda unit: (unit % self.total, unit // self.total))

    def unit(self, prompt_index: int, sample_index: int) -> int:
        """The unit of one sample (see messages.Task): unique in the plan, rising in the order
        iter_pending hands samples out, and the prompt index itself for a prompt's first sample."""
        return sample_index * self.total + prompt_index


def parse_line(raw: bytes | None, line_number: int) -> tuple[dict | None, str | None]:
    """(record fields, None) for a usable line, (None, warning) for a bad one, (None, None) if blank; ``raw``
    is None for a line longer than LONGEST_LINE."""
    if raw is None:
        return None, (f"line {line_number}: longer than {LONGEST_LINE // 1024**2} MiB, more than a prompt can be; "
                      "skipped")
    try:
        # A byte order mark some editors write before the first line (or before each file joined into
        # one) is not part of the line.
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None, f"line {line_number}: not valid UTF-8; skipped"
    if not text.strip():
        return None, None
    try:
        # Without its line end: json would name the column after it, "column 1" of a next line, for a
        # line cut short.
        obj = json.loads(text.removesuffix("\n").removesuffix("\r"))
    except json.JSONDecodeError as exc:
        where = f"{exc.msg.removesuffix(' at')} at column {exc.colno}"
        return None, f"line {line_number}: not valid JSON ({where}); skipped"
    except ValueError as exc:   # valid JSON past one of Python's limits, such as an integer's digits
        return None, f"line {line_number}: not readable JSON ({exc}); skipped"
    except RecursionError:
        return None, f"line {line_number}: JSON nested too deeply to read; skipped"
    if not isinstance(obj, dict):
        return None, f"line {line_number}: expected a JSON object, got {type(obj).__name__}; skipped"
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        return None, f'line {line_number}: needs a non-empty string "prompt"; skipped'
    if not is_utf8(prompt):     # no request or row can carry it as it is
        return None, f'line {line_number}: "prompt" is not valid Unicode (a lone surrogate); skipped'
    image = obj.get("image") if obj.get("image") is not None else obj.get("docker_image")
    cwd = obj.get("cwd")
    for name, value in (("image", image), ("cwd", cwd)):
        if value is not None and (not isinstance(value, str) or not value.strip()):
            return None, f'line {line_number}: "{name}" must be a non-empty string; skipped'
        if value is not None and "\0" in value:     # no path or image name can hold one
            return None, f'line {line_number}: "{name}" contains a NUL character; skipped'
        if value is not None and not is_utf8(value):
            return None, f'line {line_number}: "{name}" is not valid Unicode (a lone surrogate); skipped'
    if image is not None and image.startswith("-"):     # a container engine would read it as an option
        return None, f'line {line_number}: "image" starts with "-", as no image name does; skipped'
    return {"prompt": prompt, "image": image, "cwd": cwd}, None


def content_fingerprint(key: str) -> int:
    """The first 64 bits of a content key: what the plan keeps of each pending line, to tell a line
    re-read from the one planned without holding a string per line."""
    return int(key[:16], 16)


def _lines(path: Path) -> Iterator[tuple[int, int, bytes | None]]:
    """(1-based line number, byte offset, raw line) without decoding the whole file; the raw line is None
    for one longer than LONGEST_LINE. A file that opens but fails to read (EIO: a failing disk,
    /proc/self/mem) is a DatasetError, said as one line."""
    offset = 0
    try:
        with path.open("rb") as handle:
            for number in itertools.count(1):
                raw = handle.readline(LONGEST_LINE + 1)
                if not raw:
                    return
                if len(raw) > LONGEST_LINE and not raw.endswith(b"\n"):
                    yield number, offset, None
                    offset += len(raw) + _rest_of_line(handle)
                else:
                    yield number, offset, raw
                    offset += len(raw)
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror}.") from None


def _rest_of_line(handle: BinaryIO) -> int:
    """Reads past the rest of the line a chunk at a time (readline with a limit copies a few KiB at a
    time, minutes for gigabytes); the bytes it held."""
    skipped = 0
    while chunk := handle.read(_SKIP_CHUNK):
        end = chunk.find(b"\n")
        if end >= 0:
            handle.seek(end + 1 - len(chunk), os.SEEK_CUR)
            return skipped + end + 1
        skipped += len(chunk)
    return skipped


def check_dataset_file(path: Path) -> None:
    """The dataset is a regular file this process can read: it is read more than once (planned, then
    each prompt read again by its offset), which a pipe or a FIFO cannot be."""
    if problem := lookup_error(path):
        raise DatasetError(f"--dataset_file={path} cannot be opened: {problem}.")
    if not path.exists():
        raise DatasetError(f"dataset file not found: {path}{unexpanded_home(path, '--dataset_file')}. Pass an "
                           "existing JSONL file with --dataset_file.")
    if path.is_dir():
        raise DatasetError(f"--dataset_file must be a file, but {path} is a directory.")
    if not path.is_file():
        raise DatasetError(f"--dataset_file must be a regular file (it is read more than once), but {path} is "
                           f"{file_kind(path)}. Save it to a file first.")
    try:
        path.open("rb").close()
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror}. Give this user read access to it.") from None


def require_valid_prompt(path: Path, *, warn: Callable[[str], None]) -> None:
    """Fail before the run directory is created when no line holds a usable prompt. Reads only up
    to the first valid line; the skipped-line warnings are shown here only when there is none
    (otherwise :func:`plan_dataset` shows them during its pass)."""
    check_dataset_file(path)
    # Held back until the file proves to have no valid line; SkippedLines keeps only the lines it would
    # name, so millions of bad lines before the first valid one cost no memory.
    held: list[str] = []
    skipped = SkippedLines(held.append)
    for number, _offset, raw in _lines(path):
        fields, warning = parse_line(raw, number)
        if fields is not None:
            return
        if warning:
            skipped.add(warning)
    if (what := _what_else(path)) is not None:   # its lines' warnings would say only that it is not JSONL
        raise DatasetError(what)
    skipped.finish(remedy="fix them and run the same command again")     # nothing ran: there is no run to resume
    for warning in held:
        warn(warning)
    raise _no_valid_prompt(path, skipped.count > 0)


# What a dataset that is not JSONL text often is instead, told by its first bytes: (they, what it is, how
# to make JSONL of it; {path} is the file, quoted for a shell).
_OTHER_FORMATS = (
    (b"\x1f\x8b", "gzip-compressed", "decompress it first: gunzip -c {path} > out.jsonl"),
    (b"BZh", "bzip2-compressed", "decompress it first: bunzip2 -c {path} > out.jsonl"),
    (b"\xfd7zXZ\x00", "xz-compressed", "decompress it first: xz -dc {path} > out.jsonl"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed", "decompress it first: zstd -dc {path} > out.jsonl"),
    (b"PK\x03\x04", "a zip archive", "unzip it and pass the JSONL file inside"),
    (b"PAR1", "a Parquet file", "convert it first, e.g. with pandas: "
                                 "read_parquet(FILE).to_json('out.jsonl', orient='records', lines=True)"),
    (b"\xff\xfe", "UTF-16 text", "save it as UTF-8: iconv -f UTF-16 -t UTF-8 {path} > out.jsonl"),
    (b"\xfe\xff", "UTF-16 text", "save it as UTF-8: iconv -f UTF-16 -t UTF-8 {path} > out.jsonl"),
)


def _what_else(path: Path) -> str | None:
    """For a file without a valid line: what it is instead, and how to make JSONL of it, where its first
    bytes tell (a compressed file, UTF-16 text, one JSON array, lines ended by a carriage return alone,
    pretty-printed objects); else None."""
    try:
        with path.open("rb") as handle:
            start = handle.read(4096)
    except OSError:
        return None
    quoted = shlex.quote(str(path))
    for magic, kind, remedy in _OTHER_FORMATS:
        if start.startswith(magic):
            return f"{path} is {kind}, not JSONL text (UTF-8, one JSON object per line); {remedy.format(path=quoted)}"
    for order, nuls, ascii_bytes in (("LE", start[1:8:2], start[0:8:2]), ("BE", start[0:8:2], start[1:8:2])):
        # ASCII text written as UTF-16 without a byte order mark: every other byte a NUL
        if len(start) >= 8 and nuls == b"\0" * 4 and b"\0" not in ascii_bytes:
            return (f"{path} is UTF-16 text, not JSONL text (UTF-8, one JSON object per line); save it as UTF-8: "
                    f"iconv -f UTF-16{order} -t UTF-8 {quoted} > out.jsonl")
    text = start.removeprefix(b"\xef\xbb\xbf").lstrip()
    if text.startswith(b"["):
        return (f"{path} holds one JSON array, not JSONL (one JSON object per line); convert it: "
                f"jq -c '.[]' {quoted} > out.jsonl")
    if b"\r" in text and b"\n" not in text:     # the whole file one line, as the reader splits it
        return (f"{path} ends its lines with a carriage return alone (as old Mac programs wrote them), not a "
                f"newline; convert it: tr '\\r' '\\n' < {quoted} > out.jsonl")
    if text.split(b"\n", 1)[0].strip() == b"{":    # how json.dumps(indent=...) and jq begin an object
        return (f"{path} holds JSON objects spread over several lines (pretty-printed), not one per line; "
                f"convert it: jq -c . {quoted} > out.jsonl")
    return None


def _no_valid_prompt(path: Path, warned: bool) -> DatasetError:
    return DatasetError(f"no valid prompt in {path}: every line was blank or skipped"
                        + (" (see the warnings above)" if warned else "")
                        + '. Each line needs a JSON object with a non-empty "prompt" string.')


def plan_dataset(path: Path, *, max_samples: int | None, done_units: Counter,
                 warn: Callable[[str], None], samples_per_prompt: int = 1,
                 other_units: Iterable[str] = ()) -> DatasetPlan:
    """One pass over the dataset: validate every line, count valid prompts, and decide per unit (a
    sample of a line) what is pending. ``done_units`` (rows.unit_key -> finished rows): a row counts for
    the unit it names while that line still holds the row's content, every row there for that one unit,
    so of two lines with one prompt the one without a row runs. A row whose line holds something else
    now (the dataset was edited, reordered or cut between runs) counts by its content instead, for the
    first units of its sample key without a row of their own, in dataset order; knowing which rows those
    are takes the whole first pass, so a second one runs, only when there are such rows.

    The second pass also finds where the units of such rows are now (DatasetPlan.relocated), and those
    of ``other_units`` (the units of rows that count nothing done: failures, corrupted rows): a unit is
    on the line its row was counted for; else, where one line (past --max_samples too) holds its content,
    on that line, unless it is a finished sample that line already has; else on none (None): its prompt is
    no longer in the dataset, or which of several lines it was written for cannot be known, and any place
    given it would put it among another prompt's rows."""
    check_dataset_file(path)
    plan, moved, stale = _plan_pass(path, max_samples, Counter(done_units), {}, _by_prompt(other_units), None,
                                    warn, samples_per_prompt)
    if moved or stale:      # the second pass finds the lines the first warned about
        relocation = _Relocation(stale, done_units)
        plan, _, _ = _plan_pass(path, max_samples, Counter(done_units), moved, {}, relocation,
                                lambda _warning: None, samples_per_prompt)
        plan.relocated = relocation.places()
    if plan.total == 0:
        raise _no_valid_prompt(path, plan.skipped_lines > 0)
    return plan


def _by_prompt(units: Iterable[str]) -> dict[str, set[str]]:
    """Units grouped by the prompt they name: rows.prompt_key -> their sample keys."""
    grouped: dict[str, set[str]] = {}
    for unit in units:
        index, key = split_unit(unit)
        grouped.setdefault(unit_key(index, content_key_of_sample(key)), set()).add(key)
    return grouped


class _Relocation:
    """What the second pass learns about the units whose rows name a line that holds other content now."""

    def __init__(self, stale: dict[str, set[str]], done_units: Counter) -> None:
        self.stale = stale                  # rows.prompt_key -> sample keys, as the rows name them
        self.done_units = done_units        # where finished rows are, as they name it
        self.lines: dict[str, list[int]] = {split_unit(prompt)[1]: [] for prompt in stale}  # per content key
        self.counted: dict[str, int] = {}   # unit -> the line its row was counted for
        self.finished_at: set[str] = set()  # the units (lines now) that moved finished rows take

    def see(self, prompt_index: int, key: str) -> None:
        """A valid line, within --max_samples or past it."""
        self.stale.pop(unit_key(prompt_index, key), None)   # rows of its own (a sample past --samples_per_prompt)
        if (lines := self.lines.get(key)) is not None:
            lines.append(prompt_index)

    def count(self, written: int, done_key: str, prompt_index: int) -> None:
        """A row written for line ``written`` counts done for this line."""
        self.counted.setdefault(unit_key(written, done_key), prompt_index)
        self.finished_at.add(unit_key(prompt_index, done_key))

    def places(self) -> dict[str, int | None]:
        places: dict[str, int | None] = dict(self.counted)
        for prompt in sorted(self.stale):
            written, key = split_unit(prompt)
            for done_key in sorted(self.stale[prompt]):
                if (unit := unit_key(written, done_key)) not in places:
                    places[unit] = self._line_now(unit, done_key, self.lines[key])
        return places

    def _line_now(self, unit: str, done_key: str, lines: list[int]) -> int | None:
        """The place of a row no line counted: the one line that holds its content. A finished row of a
        text on several lines is one sample more than any of them has (each without that sample would
        have counted it), and a failure there could be a try of any of them."""
        if len(lines) != 1:
            return None
        if unit in self.done_units:
            there = unit_key(lines[0], done_key)
            if there in self.done_units or there in self.finished_at:
                return None     # the line has that sample: this row is one more, of a line now gone
            self.finished_at.add(there)
        return lines[0]


def _plan_pass(path: Path, max_samples: int | None, own: Counter, moved: dict[str, list[int]],
               others: dict[str, set[str]], relocation: _Relocation | None, warn: Callable[[str], None],
               samples_per_prompt: int) -> tuple[DatasetPlan, dict[str, list[int]], dict[str, set[str]]]:
    """A plan where ``own`` (unit key -> rows) counts for its units and ``moved`` (sample key -> the
    prompt indexes its rows name, highest first) for the first units of its key left without; both are
    used up. Returns it with what is left of ``own`` as ``moved`` takes it, and the units of those rows
    and of ``others`` (see _by_prompt) whose line does not hold their content, by prompt. With a
    ``relocation``, the lines past --max_samples are read too, only to be seen by it."""
    seen: Counter = Counter()       # valid lines so far per content key: gone once the plan is made
    plan = DatasetPlan(path=path, total=0, already_done=0, skipped_lines=0, samples_per_prompt=samples_per_prompt,
                       rounds=[PendingRound() for _ in range(samples_per_prompt)])
    skipped = SkippedLines(warn)
    beyond = 0                      # valid lines past --max_samples
    for number, offset, raw in _lines(path):
        past = max_samples is not None and plan.total >= max_samples
        if past and relocation is None:
            break
        fields, warning = parse_line(raw, number)
        if fields is None:
            if warning and not past:
                skipped.add(warning)
            continue
        key = content_key(fields["prompt"], fields["image"], fields["cwd"])
        if relocation is not None:
            relocation.see(plan.total + beyond, key)
        if past:
            beyond += 1
            continue
        if others:      # empty unless earlier rows failed: no key built per line for nothing
            others.pop(unit_key(plan.total, key), None)
        any_pending = False
        for sample_index, pending in enumerate(plan.rounds):
            done_key = sample_key(key, sample_index)
            if own.pop(unit_key(plan.total, done_key), 0):
                plan.already_done += 1
            elif moved.get(done_key):
                written = moved[done_key].pop()
                if relocation is not None:
                    relocation.count(written, done_key, plan.total)
                plan.already_done += 1
            else:
                pending.offsets.append(offset)
                pending.occurrences.append(seen[key])
                pending.indexes.append(plan.total)
                pending.fingerprints.append(content_fingerprint(key))
                plan.pending_chars += len(fields["prompt"])
                any_pending = True
        plan.pending_with_image += any_pending and fields["image"] is not None
        seen[key] += 1
        plan.total += 1
    skipped.finish()
    plan.skipped_lines = skipped.count
    left: dict[str, list[int]] = {}
    for unit, count in own.items():
        index, done_key = split_unit(unit)
        left.setdefault(done_key, []).extend([index] * count)
        others.setdefault(unit_key(index, content_key_of_sample(done_key)), set()).add(done_key)
    for indexes in left.values():
        indexes.sort(reverse=True)
    return plan, left, others


def iter_pending(plan: DatasetPlan, *, only: Container[int] | None = None) -> Iterator[DatasetRecord]:
    """The pending samples of a plan, read from disk one at a time: every prompt's first sample in
    dataset order, then every second sample, and so on, so that a run stopped early leaves each prompt
    with as many samples as the next, give or take one. ``only``: the units to read (all when None).

    Raises DatasetChanged at the first line that is not the one planned, or that cannot be read (the file
    removed, or replaced by what is not a regular file, since it was planned): a file rewritten during the
    run moves its lines, and a read can join old bytes to new ones, so no line re-read is trusted unless
    its content key is the planned one. Each line is read from the file when its prompt is handed out, never
    from bytes read for an earlier one (see _line_at)."""
    # Unbuffered: a buffered reader serves a seek into the chunk it last read from memory, so every line
    # of a dataset under its 8 KiB buffer (and the lines near one read before) would be the bytes read
    # before a rewrite, and a stale prompt would run unnoticed.
    with open(_open_planned(plan.path), "rb", buffering=0) as handle:
        descriptor = handle.fileno()
        for sample_index, pending in enumerate(plan.rounds):
            for offset, occurrence, index, fingerprint in zip(pending.offsets, pending.occurrences, pending.indexes,
                                                              pending.fingerprints, strict=True):
                if only is not None and plan.unit(index, sample_index) not in only:
                    continue
                try:
                    raw = _line_at(descriptor, offset)
                except OSError as exc:      # EIO: a failing disk, a network file system gone
                    raise DatasetChanged(f"{plan.path} could no longer be read: {exc.strerror}") from None
                fields, _warning = parse_line(raw, 0)
                if fields is None or content_fingerprint(
                        key := content_key(fields["prompt"], fields["image"], fields["cwd"])) != fingerprint:
                    raise DatasetChanged(f"{plan.path} changed while the run read it: the line of prompt {index} "
                                         f"(at byte {offset:,}) is no longer the prompt planned")
                yield DatasetRecord(index, fields["prompt"], fields["image"], fields["cwd"], key, occurrence,
                                    sample_index)


def _open_planned(path: Path) -> int:
    """A descriptor of the dataset, to read its planned lines again. The file may have been removed or
    replaced since it was planned (the pool's start takes seconds): that is said as a DatasetChanged,
    and the open never waits, as it would for a writer to a FIFO put in its place."""
    try:
        return open_regular(path)
    except NotRegularFile as exc:
        raise DatasetChanged(f"{path} could no longer be read: it is {exc.kind} now, not the file planned") from None
    except OSError as exc:
        raise DatasetChanged(f"{path} could no longer be read: {exc.strerror}") from None


def _line_at(descriptor: int, offset: int) -> bytes | None:
    """The line that starts at ``offset`` as the file holds it now (with its newline, if it has one), read
    with os.pread: one system call for most lines, nothing kept between calls, and no file position shared
    with another reader. None for a line longer than LONGEST_LINE, as _lines says of one: no planned line
    is, so the file changed."""
    chunks: list[bytes] = []
    size = 0
    want = _FIRST_READ
    while size <= LONGEST_LINE:
        chunk = os.pread(descriptor, min(want, LONGEST_LINE + 1 - size), offset + size)
        if not chunk:                           # the end of the file: its last line has no newline
            break
        if (end := chunk.find(b"\n")) >= 0:
            chunks.append(chunk[:end + 1])
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        want *= 2                               # a long line in a few reads, not thousands
    return b"".join(chunks) if size <= LONGEST_LINE else None
