"""The merge: trajectories.jsonl holds exactly the kept rows of every batch file, and
statistics.json counts them, whether the merge rewrote the file or only appended what was new."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from conftest import endpoint_args, run_cli, write_dataset

from batchrun.run_dir import MERGE_RECORD, TRAJECTORIES, RunDirectory, RunDirectoryError, reading
from batchrun.stats import MergeStatistics

PROMPTS = ([f"prompt {i}" for i in range(6)] + [f'[[call terminal {{"command": "echo {i}"}}]] command {i}' for i in range(4)]
           + ["[[invent]] inventive", "[[fail 400]] refused", "prompt 3"])


EXIT_SOME_FAILED = 2      # the run finished, and "[[fail 400]] refused" failed


def run(tmp_path: Path, endpoint, *extra: str, exit_code: int = EXIT_SOME_FAILED) -> Path:
    dataset = write_dataset(tmp_path / "dataset.jsonl", PROMPTS)
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=4", "--run_name=run",
                     "--distribution=terminal_only", *endpoint_args(endpoint), *extra)
    assert result.returncode == exit_code, result.stderr
    return tmp_path / "data" / "run"


def merged_lines(run_dir: Path) -> Counter:
    return Counter((run_dir / TRAJECTORIES).read_bytes().splitlines(keepends=True))


def rewritten(run_dir: Path) -> tuple[Counter, dict]:
    """What a merge from nothing makes of the same batch files (the reference)."""
    (run_dir / MERGE_RECORD).unlink()
    statistics = RunDirectory(run_dir).merge(lambda *_: None)
    return merged_lines(run_dir), statistics.to_state()


def test_resumed_run_appends_only_new_rows_and_ends_where_a_full_rewrite_would(tmp_path, endpoint):
    run_dir = run(tmp_path, endpoint, "--max_samples=5", exit_code=0)
    first_inode = (run_dir / TRAJECTORIES).stat().st_ino
    run(tmp_path, endpoint, "--resume")
    assert (run_dir / TRAJECTORIES).stat().st_ino == first_inode       # appended to, not replaced
    appended = merged_lines(run_dir)
    statistics = json.loads((run_dir / "statistics.json").read_text())
    reference, _ = rewritten(run_dir)
    assert appended == reference and sum(appended.values()) == 11      # 13 prompts - failed - corrupted
    assert statistics["trajectories_in_merged_file"] == 11
    assert statistics["filtered_corrupted"] == 1
    assert statistics["tool_statistics"]["terminal"]["count"] == 4


def test_merge_record_carries_the_figures_a_full_rewrite_counts(tmp_path, endpoint):
    run_dir = run(tmp_path, endpoint, "--max_samples=5", exit_code=0)
    run(tmp_path, endpoint, "--resume")
    kept = json.loads((run_dir / MERGE_RECORD).read_text())["statistics"]
    _, reference = rewritten(run_dir)
    assert kept == reference


def test_rows_left_by_a_merge_that_crashed_after_appending_are_not_duplicated(tmp_path, endpoint):
    run_dir = run(tmp_path, endpoint)
    expected = merged_lines(run_dir)
    with (run_dir / TRAJECTORIES).open("ab") as handle:       # appended, then killed before its record
        handle.write(next(iter(expected)) + b'{"prompt_index": 3, "cut')
    RunDirectory(run_dir).merge(lambda *_: None)
    assert merged_lines(run_dir) == expected


def test_a_batch_file_changed_other_than_by_appending_makes_the_merge_rewrite_everything(tmp_path, endpoint):
    run_dir = run(tmp_path, endpoint)
    batch = run_dir / "batch_0.jsonl"
    first, *rest = batch.read_bytes().splitlines(keepends=True)
    batch.write_bytes(b"".join(rest))                          # a row removed by hand
    inode = (run_dir / TRAJECTORIES).stat().st_ino
    statistics = RunDirectory(run_dir).merge(lambda *_: None)
    assert (run_dir / TRAJECTORIES).stat().st_ino != inode
    assert first not in merged_lines(run_dir)
    assert statistics.merged == sum(merged_lines(run_dir).values())


def test_a_row_damaged_in_place_is_merged_once_when_its_prompt_has_run_again(tmp_path, endpoint):
    # Damage that keeps the file's length passes the merge record's checks of where each file ended;
    # the resumed run writes the prompt's row again, and the copy merged before must not stay beside it.
    run_dir = run(tmp_path, endpoint)
    batch = run_dir / "batch_0.jsonl"
    lines = batch.read_bytes().splitlines(keepends=True)
    damaged = next(number for number, line in enumerate(lines) if json.loads(line).get("completed"))
    lines[damaged] = b"#" * (len(lines[damaged]) - 1) + b"\n"
    batch.write_bytes(b"".join(lines))
    run(tmp_path, endpoint, "--resume", exit_code=0)
    merged = merged_lines(run_dir)
    assert Counter(json.loads(line)["prompt_index"] for line in merged.elements()).most_common(1)[0][1] == 1
    assert merged == rewritten(run_dir)[0]


def test_a_deleted_trajectories_file_is_rebuilt_whole(tmp_path, endpoint):
    run_dir = run(tmp_path, endpoint)
    expected = merged_lines(run_dir)
    (run_dir / TRAJECTORIES).unlink()
    statistics = RunDirectory(run_dir).merge(lambda *_: None)
    assert merged_lines(run_dir) == expected and statistics.merged == sum(expected.values())


@pytest.mark.parametrize("damage", [lambda _: None, lambda _: [], lambda _: 5, lambda _: "text",
                                    lambda record: {**record, "files": [], "trajectories": []}],
                         ids=["null", "list", "number", "string", "fields_of_another_shape"])
def test_a_merge_record_of_another_shape_makes_the_merge_rewrite_everything(tmp_path, endpoint, damage):
    # The record is only a shortcut: a damaged one must cost a full merge, never the run's end.
    run_dir = run(tmp_path, endpoint)
    expected = merged_lines(run_dir)
    record = json.loads((run_dir / MERGE_RECORD).read_text())
    (run_dir / MERGE_RECORD).write_text(json.dumps(damage(record)))
    statistics = RunDirectory(run_dir).merge(lambda *_: None)
    assert merged_lines(run_dir) == expected and statistics.merged == sum(expected.values())


@pytest.mark.parametrize("copy", ["batch_00.jsonl", "batch_\u0660.jsonl"], ids=["leading_zero", "other_digit"])
def test_a_copy_of_a_batch_file_under_another_name_for_its_number_is_not_merged_again(tmp_path, endpoint, copy):
    run_dir = run(tmp_path, endpoint)
    expected = merged_lines(run_dir)
    (run_dir / copy).write_bytes((run_dir / "batch_0.jsonl").read_bytes())
    (run_dir / MERGE_RECORD).unlink()
    statistics = RunDirectory(run_dir).merge(lambda *_: None)
    assert merged_lines(run_dir) == expected and statistics.merged == sum(expected.values())


def test_corrupted_rows_are_reported_once_not_at_every_later_merge(tmp_path, endpoint):
    run_dir = run(tmp_path, endpoint)
    reported: list[int] = []
    statistics = RunDirectory(run_dir).merge(lambda _name, index, _invented: reported.append(index))
    assert reported == [] and len(statistics.corrupted) == 1


def test_merge_shared_out_over_processes_writes_exactly_what_one_process_writes(tmp_path, endpoint, monkeypatch):
    run_dir = run(tmp_path, endpoint)
    alone = (run_dir / TRAJECTORIES).read_bytes()
    _, reference = rewritten(run_dir)
    monkeypatch.setattr(reading, "PARALLEL_READ_MIN_BYTES", 0)
    (run_dir / MERGE_RECORD).unlink()
    statistics = RunDirectory(run_dir).merge(lambda *_: None)
    assert (run_dir / TRAJECTORIES).read_bytes() == alone
    assert statistics.to_state() == reference


@pytest.mark.parametrize("encoding", [{"sort_keys": True}, {"separators": (",", ":")}],
                         ids=["sorted_keys", "compact_separators"])
def test_rows_written_by_another_json_encoder_are_merged_and_counted_like_our_own(tmp_path, endpoint, encoding):
    run_dir = run(tmp_path, endpoint)
    expected, reference = rewritten(run_dir)
    for path in run_dir.glob("batch_*.jsonl"):
        path.write_bytes(b"".join(json.dumps(json.loads(line), **encoding).encode() + b"\n"
                                  for line in path.read_bytes().splitlines()))
    statistics = RunDirectory(run_dir).merge(lambda *_: None)
    assert Counter(json.dumps(json.loads(line), sort_keys=True) for line in merged_lines(run_dir).elements()) == \
           Counter(json.dumps(json.loads(line), sort_keys=True) for line in expected.elements())
    assert statistics.to_state() == reference and statistics.merged == 11


def test_a_batch_file_saved_with_a_byte_order_mark_merges_its_first_row_without_it(tmp_path, endpoint):
    # An editor may add the mark when a batch file is saved by hand; copied into the merged file, it
    # would start a line in its middle that json.loads, datasets and pandas refuse.
    run_dir = run(tmp_path, endpoint)
    expected = merged_lines(run_dir)
    batch = run_dir / "batch_0.jsonl"
    batch.write_bytes(b"\xef\xbb\xbf" + batch.read_bytes())
    RunDirectory(run_dir).merge(lambda *_: None)
    assert merged_lines(run_dir) == expected


def test_a_row_holding_a_lone_surrogate_escape_is_merged_as_strict_json(tmp_path, endpoint):
    # Python's json writes and reads "\\udc80", which strict parsers (datasets' pyarrow, msgspec) refuse:
    # copied as written, the line would keep datasets from loading the merged file at all.
    run_dir = run(tmp_path, endpoint)
    batch = run_dir / "batch_0.jsonl"
    lines = batch.read_bytes().splitlines(keepends=True)
    row = json.loads(lines[0])
    row["conversations"][1]["value"] += "\udc80"
    lines[0] = json.dumps(row).encode() + b"\n"
    batch.write_bytes(b"".join(lines))
    statistics = RunDirectory(run_dir).merge(lambda *_: None)
    merged = list(merged_lines(run_dir).elements())
    assert all(msgspec.json.decode(line) for line in merged) and statistics.merged == len(merged) == 11


def test_a_row_of_a_newer_format_stops_the_merge_naming_file_and_line(tmp_path, endpoint):
    run_dir = run(tmp_path, endpoint)
    trajectories = (run_dir / TRAJECTORIES).read_bytes()
    with (run_dir / "batch_1.jsonl").open("ab") as handle:
        handle.write(b'{"format": 5, "prompt_index": 4, "content_key": "ab", "failed": true, "end_reason": "x"}\n')
    with pytest.raises(RunDirectoryError, match=r"batch_1\.jsonl line 5: row format 5 is newer"):
        RunDirectory(run_dir).merge(lambda *_: None)
    assert (run_dir / TRAJECTORIES).read_bytes() == trajectories


def scanned_then_merged(run_dir: Path) -> MergeStatistics:
    """The merge a resumed run makes: after its scan of the batch files."""
    directory = RunDirectory(run_dir)
    directory.scan()
    return directory.merge(lambda *_: None)


def units(run_dir: Path) -> Counter:
    return Counter((row["prompt_index"], row["sample_index"])
                   for row in map(json.loads, (run_dir / TRAJECTORIES).read_bytes().splitlines()))


# Resume counted the prompt done once, but the merge copied both lines: trajectories.jsonl and the
# statistics held that sample twice.
def test_a_row_appended_twice_by_hand_is_merged_once_and_stays_so(tmp_path, endpoint):
    run_dir = run(tmp_path, endpoint)
    batch = run_dir / "batch_0.jsonl"
    with batch.open("ab") as handle:
        handle.write(batch.read_bytes().splitlines(keepends=True)[0])
    run(tmp_path, endpoint, "--resume", exit_code=0)         # the refused prompt is answered this time
    merged = merged_lines(run_dir)
    assert max(units(run_dir).values()) == 1 and sum(merged.values()) == 12
    assert json.loads((run_dir / "statistics.json").read_text())["trajectories_in_merged_file"] == 12
    inode = (run_dir / TRAJECTORIES).stat().st_ino
    run(tmp_path, endpoint, "--resume", exit_code=0)
    assert (run_dir / TRAJECTORIES).stat().st_ino == inode      # appended to again, with nothing to add
    assert merged_lines(run_dir) == merged


def test_a_row_repeated_in_another_batch_file_is_merged_once_by_a_rewrite_shared_out_over_processes(
        tmp_path, endpoint, monkeypatch):
    run_dir = run(tmp_path, endpoint)
    expected, reference = rewritten(run_dir)
    with (run_dir / "batch_3.jsonl").open("ab") as handle:
        handle.write((run_dir / "batch_0.jsonl").read_bytes().splitlines(keepends=True)[0])
    monkeypatch.setattr(reading, "PARALLEL_READ_MIN_BYTES", 0)
    (run_dir / MERGE_RECORD).unlink()
    statistics = scanned_then_merged(run_dir)
    assert merged_lines(run_dir) == expected and statistics.to_state() == reference
