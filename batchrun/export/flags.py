"""The export's flags (declared in batchrun/flags.py with the run's) validated into ExportOptions: one
UsageError naming the flag, as the run validates its own."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from batchrun import rows
from batchrun.export.best_of import BEST_OF_RULES
from batchrun.export.formats import EXPORT_FOLDER, EXPORT_FORMATS, FORMATS
from batchrun.export.options import REASONING_MODES, ExportOptions
from batchrun.flag_values import UsageError, boolean, choice, non_negative_int, text, validate_run_name
from batchrun.install_hint import install_hint
from batchrun.paths import file_kind, lookup_error
from batchrun.report.scan import read_json
from batchrun.run_dir import CHECKPOINT


def export_options(*, export: Any, run_name: Any, out: Any, reasoning: Any, discard_no_reasoning: Any,
                   discard_invented: Any, end_reasons: Any, min_tool_calls: Any,
                   last_call_succeeded: Any, best_of: Any = None) -> ExportOptions:
    """Validate the export's flags as the run validates its own: one UsageError naming the flag."""
    fmt = None if export is True else choice("export", export, FORMATS)
    if fmt is None:
        raise UsageError(f"--export needs a format: --export={'|'.join(FORMATS)}")
    run_dir = Path("data") / validate_run_name("run_name", run_name)
    spec = EXPORT_FORMATS[fmt]
    for module in spec.modules:
        if importlib.util.find_spec(module) is None:
            raise UsageError(f"--export={fmt} needs {module}, an optional extra: {install_hint('export')}")
    if reasoning is not None and not spec.chat_messages:
        takes = "|".join(name for name, other in EXPORT_FORMATS.items() if other.chat_messages)
        raise UsageError(f"--reasoning applies to --export={takes}; --export={fmt} keeps the rows' own turns")
    out_text = text("out", out)
    return ExportOptions(
        format=fmt, run_dir=run_dir,
        out=_checked_out(Path(out_text), run_dir) if out_text else run_dir / spec.default_out,
        reasoning=choice("reasoning", reasoning, REASONING_MODES) or "drop",
        discard_no_reasoning=None if discard_no_reasoning is None else boolean("discard_no_reasoning",
                                                                                discard_no_reasoning),
        discard_invented=boolean("discard_invented", discard_invented),
        end_reasons=_end_reasons(end_reasons), min_tool_calls=non_negative_int("min_tool_calls", min_tool_calls),
        last_call_succeeded=boolean("last_call_succeeded", last_call_succeeded),
        best_of=choice("best_of", best_of, tuple(BEST_OF_RULES)))


def _checked_out(out: Path, run_dir: Path) -> Path:
    """--out, where the export may write: the rename that puts its file there would replace whatever is
    there, so never a file of the run directory outside its export folder (the run's own rows), never a
    FIFO or a device (as root, the device node itself), and never a path without a file name. Its folders
    that are not there yet are made."""
    if not out.name:
        raise UsageError(f"--out={out} names no file; give a file path, e.g. --out=rows.jsonl")
    if problem := lookup_error(out):
        raise UsageError(f"--out={out} cannot be reached: {problem}; choose another --out")
    if blocking := next((folder for folder in out.parents if folder.exists() and not folder.is_dir()), None):
        kind = "a file" if blocking.is_file() else file_kind(blocking)
        raise UsageError(f"--out={out} goes through {blocking}, which is {kind}, not a directory; choose another --out")
    if _among_the_runs_files(out, run_dir):
        raise UsageError(f"--out={out} is inside the run directory {run_dir}/, whose files the export must not "
                         f"replace; write under {run_dir / EXPORT_FOLDER}/ or outside the run directory")
    if out.exists() and not (out.is_file() or out.is_dir()):
        raise UsageError(f"--out={out} is {file_kind(out)}; --export writes a regular file there")
    if _is_the_runs_dataset(out, run_dir):
        raise UsageError(f"--out={out} is the run's dataset, which the export must not replace (--resume reads "
                         "it again); choose another --out")
    return out


def _among_the_runs_files(out: Path, run_dir: Path) -> bool:
    """Whether ``out`` is in the run directory outside its export folder. Resolved first (its ".." after a
    folder not made yet is where the kernel will take it), then its folders are compared with the run
    directory as files (device and inode), not as paths: a bind mount of the run directory is another
    path to it that resolve() cannot see through."""
    resolved = out.resolve()
    child = None        # the name under which the walk came up to ``folder``
    for folder in (resolved, *resolved.parents):
        try:
            if folder.samefile(run_dir):
                return child != EXPORT_FOLDER
        except OSError:     # not there yet: the export makes it
            pass
        child = folder.name
    return False


def _is_the_runs_dataset(out: Path, run_dir: Path) -> bool:
    """Whether ``out`` is the file the run's checkpoint names as its dataset (given relative to where the
    run started, the directory data/ is in)."""
    dataset = read_json(run_dir / CHECKPOINT).get("dataset_file")
    try:
        return isinstance(dataset, str) and bool(dataset) and out.exists() and out.samefile(dataset)
    except OSError:     # the dataset is gone, or cannot be looked up: nothing of it to replace
        return False


def _end_reasons(value: Any) -> frozenset[str] | None:
    """'a,b' (fire may already have made it a tuple) -> the set, each a reason a trajectory row can have."""
    if value is None:
        return None
    allowed = [reason for reason in rows.END_REASONS if reason != "error"]    # "error" leaves no trajectory
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (tuple, list)) else [value]
    names = [item.strip() for item in items if isinstance(item, str) and item.strip()]
    if not names or len(names) != len(items) or any(name not in allowed for name in names):
        raise UsageError(f"--end_reasons takes comma-separated end reasons from {', '.join(allowed)}; got {value!r}")
    return frozenset(names)

