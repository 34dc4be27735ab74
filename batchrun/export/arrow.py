"""--export=parquet and --export=hf: the rows in one Arrow schema, as a Parquet file or as a datasets
folder made from one. Together because hf is Parquet read back by datasets; pyarrow and datasets (the
``export`` extra) are imported only when one of them is written.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from batchrun.export.conversations import Candidate
from batchrun.export.files import write_file
from batchrun.export.options import ExportError, ExportOptions, refused_line
from batchrun.run_dir import remove_temps_of_gone_writers, temp_beside

ROW_GROUP_ROWS = 1000
ROW_GROUP_BYTES = 64 << 20      # a row group is held in memory while it fills: bound it for big rows too


def write_parquet(options: ExportOptions, candidates: Iterable[Candidate]) -> None:
    write_file(options.out, lambda temp: _parquet_file(temp, candidates))


def arrow_schema() -> Any:
    """The one Arrow schema of the parquet and hf formats: the ShareGPT row, its registry-wide tool map
    as a list (so the columns do not change with the registry), every field typed."""
    import pyarrow as pa

    counts = [pa.field(name, pa.int64()) for name in ("count", "success", "failure")]
    usage = [pa.field(name, pa.int64()) for name in ("prompt_tokens", "completion_tokens", "reasoning_tokens",
                                                     "cached_tokens")] + [pa.field("cost", pa.float64())]
    return pa.schema([
        pa.field("prompt_index", pa.int64()), pa.field("sample_index", pa.int64()),
        pa.field("content_key", pa.string()),
        pa.field("conversations", pa.list_(pa.struct([pa.field("from", pa.string()),
                                                      pa.field("value", pa.string())]))),
        pa.field("gpt_turns", pa.list_(pa.struct([pa.field("reasoning_chars", pa.int64()),
                                                  pa.field("tool_calls", pa.int64())]))),
        pa.field("model", pa.string()), pa.field("timestamp", pa.string()), pa.field("batch_num", pa.int64()),
        pa.field("completed", pa.bool_()), pa.field("partial", pa.bool_()), pa.field("end_reason", pa.string()),
        pa.field("api_calls", pa.int64()),
        pa.field("toolsets_used", pa.list_(pa.string())), pa.field("toolsets_sampled", pa.list_(pa.string())),
        pa.field("tool_stats", pa.list_(pa.struct([pa.field("tool", pa.string()), *counts]))),
        pa.field("invented_tool_calls", pa.int64()), pa.field("usage", pa.struct(usage)),
        pa.field("wall_time_seconds", pa.float64()),
    ])


def arrow_record(candidate: Candidate) -> dict:
    row = candidate.row
    metadata = row.get("metadata") or {}
    return {**{key: row.get(key) for key in ("prompt_index", "sample_index", "content_key", "gpt_turns", "completed",
                                             "partial",
                                             "end_reason", "api_calls", "toolsets_used", "toolsets_sampled",
                                             "invented_tool_calls", "usage", "wall_time_seconds")},
            "conversations": [{"from": turn["from"], "value": turn["value"]} for turn in row["conversations"]],
            "model": metadata.get("model"), "timestamp": metadata.get("timestamp"),
            "batch_num": metadata.get("batch_num"),
            "tool_stats": [{"tool": name, **counts} for name, counts in (row.get("tool_stats") or {}).items()]}


def _row_groups(candidates: Iterable[Candidate]) -> Iterator[list[Candidate]]:
    """Rows in groups of at most ROW_GROUP_ROWS rows and about ROW_GROUP_BYTES of row text."""
    group: list[Candidate] = []
    size = 0
    for candidate in candidates:
        group.append(candidate)
        size += len(candidate.stored.line)
        if len(group) >= ROW_GROUP_ROWS or size >= ROW_GROUP_BYTES:
            yield group
            group, size = [], 0
    if group:
        yield group


def _row_group(group: list[Candidate], schema: Any) -> Any:
    """The rows as one Arrow table. The row reader checks only the fields every reader needs, so a row
    edited by hand may hold a value its column cannot (a count as text, or beyond int64): that stops
    the export naming the row's file, line and field, as a line that is not a row does."""
    import pyarrow as pa

    records = [arrow_record(candidate) for candidate in group]
    counted = [column for column in schema if _holds_integers(column.type)]
    for candidate, record in zip(group, records, strict=True):
        if cut := next((column for column in counted if not _whole(record[column.name], column.type)), None):
            raise _unfit(candidate, cut)
    try:
        return pa.Table.from_pylist(records, schema=schema)
    except (pa.ArrowException, OverflowError):
        for candidate, record in zip(group, records, strict=True):
            for column in schema:
                try:
                    pa.array([record[column.name]], type=column.type)
                except (pa.ArrowException, OverflowError):
                    raise _unfit(candidate, column) from None
        raise


def _whole(value: Any, kind: Any) -> bool:
    """Whether ``value`` holds no fraction where ``kind`` (an Arrow type) holds a whole number: pyarrow
    writes 2.5 to an integer column as 2, without a word."""
    import pyarrow as pa

    if pa.types.is_integer(kind):
        return not isinstance(value, float) or value.is_integer()
    if pa.types.is_struct(kind) and isinstance(value, dict):
        return all(_whole(value.get(field.name), field.type) for field in kind)
    if pa.types.is_list(kind) and isinstance(value, list):
        return all(_whole(item, kind.value_type) for item in value)
    return True


def _holds_integers(kind: Any) -> bool:
    """Whether an Arrow type has an integer anywhere in it (the columns _whole need look at)."""
    import pyarrow as pa

    if pa.types.is_struct(kind):
        return any(_holds_integers(field.type) for field in kind)
    if pa.types.is_list(kind):
        return _holds_integers(kind.value_type)
    return bool(pa.types.is_integer(kind))


def _unfit(candidate: Candidate, column: Any) -> Exception:
    return refused_line(candidate.path, candidate.offset, f"not a batch_runner row (its {column.name!r} does not fit "
                                                          f"the column's type, {column.type}); fix or remove this line")


def _parquet_file(path: Path, candidates: Iterable[Candidate]) -> int:
    """The rows as one Parquet file, a row group at a time; how many were written."""
    import pyarrow.parquet as pq

    schema = arrow_schema()
    written = 0
    with pq.ParquetWriter(path, schema) as writer:      # an export with no rows is still a valid file
        for group in _row_groups(candidates):
            writer.write_table(_row_group(group, schema))
            written += len(group)
            del group       # held by the loop's name, it would stay while the next group fills: two at once
    return written


def write_hf(options: ExportOptions, candidates: Iterable[Candidate]) -> None:
    """A ``datasets`` folder (save_to_disk), made from a Parquet file of the rows in a temporary folder
    beside --out: datasets reads it in batches, its cache lives and dies in that folder (so a stale one
    never stands in for the rows), and the folder is renamed into place only once it is whole. The folder
    has temp_beside's name, so that the next export removes one that a killed export left."""
    import datasets

    out = options.out
    if out.exists() and not _is_saved_dataset(out):
        raise ExportError(f"--out={out} exists and is not a datasets folder; remove it or choose another --out")
    # What an hf export killed before its rename left beside --out: a whole copy, and datasets' cache.
    remove_temps_of_gone_writers(out.parent, {out.name})
    work = temp_beside(out)
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()        # the export prints its own summary
    try:
        work.mkdir()
        schema = arrow_schema()
        features = datasets.Features.from_arrow_schema(schema)
        if _parquet_file(work / "rows.parquet", candidates):
            dataset = datasets.Dataset.from_parquet(f"{work}/rows.parquet", features=features,
                                                    cache_dir=f"{work}/cache")
            dataset.save_to_disk(f"{work}/saved")
        else:     # datasets reads no rows from an empty file, and loads no folder of 0 shards
            empty = datasets.Dataset.from_dict({name: [] for name in schema.names}, features=features)
            empty.save_to_disk(f"{work}/saved", num_shards=1)
        _rename_folder_over(work / "saved", out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if bars:
            datasets.enable_progress_bars()


def _rename_folder_over(folder: Path, out: Path) -> None:
    """Put ``folder`` at ``out`` in place of an earlier export. A folder cannot be renamed over one that
    holds files, so the earlier one is first renamed aside (to temp_beside's name, which the next export
    removes if this one is killed) and removed only once the new one is in: removed at --out, a kill
    during the removal left half a folder there, which datasets would not load and the next export
    refused. Stopped between the two renames, --out holds nothing, the earlier export beside it."""
    if out.is_symlink():    # replaced, as the file formats replace one; what it points to is left
        out.unlink()
    if not out.exists():
        os.replace(folder, out)
        return
    aside = temp_beside(out)
    os.replace(out, aside)
    try:
        os.replace(folder, out)
    except BaseException:
        os.replace(aside, out)      # the earlier export back at --out, where the new one failed to go
        raise
    shutil.rmtree(aside, ignore_errors=True)        # what a failure leaves, the next export removes


def _is_saved_dataset(path: Path) -> bool:
    """Whether ``path`` is what save_to_disk writes, and so safe to replace."""
    return path.is_dir() and (path / "dataset_info.json").is_file() and (path / "state.json").is_file()
