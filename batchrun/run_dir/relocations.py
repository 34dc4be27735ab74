"""relocations.json: where the rows written for lines that hold other content now belong.

A resumed run whose dataset was reordered or edited meets rows that name a line holding other content now
(dataset.plan_dataset finds where each such unit went). Those rows stay as they were written, since batch
files only grow; the run records each unit's place now instead, and the merge, the report and the export
read the rows through it (StoredRow.relocate), so that every row of one prompt names one place:
trajectories.jsonl and the exports carry the place now, the statistics count each prompt once, --best_of
keeps one sample of it. A row the dataset holds no place for is recorded with none (null): every reader
leaves it out, rather than count it with the prompt now at the place it names. Each resumed run writes the
file anew from every row and the dataset as it is then.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from batchrun.run_dir.durable import atomic_write_json, fsync_dir
from batchrun.run_dir.errors import RunDirectoryError
from batchrun.run_dir.reading import read_whole, record_json

RELOCATIONS = "relocations.json"
_REMEDY = ("run again with --resume, which writes it anew from the rows and the dataset, or remove it (each row "
           "then names the place it was written with)")


def write_relocations(directory: Path, places: Mapping[str, int | None]) -> None:
    """Record ``places`` (rows.unit_key as rows name it -> the prompt index now, or None); none, no file."""
    path = directory / RELOCATIONS
    if places:
        atomic_write_json(path, {"places": dict(places)})
    elif path.exists():
        path.unlink()
        fsync_dir(directory)


def read_relocations(directory: Path) -> dict[str, int | None]:
    """What the last resumed run recorded (see write_relocations); empty where it recorded nothing."""
    path = directory / RELOCATIONS
    try:
        places = record_json(read_whole(path))["places"]
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise RunDirectoryError(f"cannot read {path} ({exc}); {_REMEDY}") from None
    if not isinstance(places, dict) or not all(index is None or isinstance(index, int) for index in places.values()):
        raise RunDirectoryError(f"{path} is not a record of relocated prompts; {_REMEDY}")
    return places


def relocations_digest(places: Mapping[str, int | None]) -> str:
    """Tells one record from another: a merge done under other places is not appended to."""
    return hashlib.sha256(json.dumps(sorted(places.items())).encode()).hexdigest() if places else ""
