"""The run directory, data/<run_name>/: everything a run writes there and reads back.

Only the parent process writes these files, and a write that fails (a full disk above all) leaves
every file as it was. The package's faces are re-exported here; each module does one job:

- ``directory.py``   RunDirectory: the lock, the start's checks of its files, batch file names, appends, the
                     files rewritten whole
- ``durable.py``     writes that leave files whole: appends of whole lines, torn tails cut, atomic rewrites
- ``reading.py``     streaming the JSONL files in byte ranges shared out over processes; a bad line named
- ``errors.py``      RunDirectoryError and WriteFailed (DiskFull names the filesystem and what is free);
                     the one line for a file that may not be read or written, or is no regular file
- ``checkpoint.py``  checkpoint.json (Checkpoint) and what resume reads back from it
- ``scan.py``        the resume scan (ScanResult): what is done, failed, corrupted, repeated
- ``merge.py``       trajectories.jsonl and its statistics input, appended to from where the last merge stopped
- ``relocations.py`` relocations.json: where the prompts of earlier rows are now, after the dataset changed
- ``spent.py``       spent.jsonl (SpentLedger, RowPlace): what sessions cut off before their rows spent
"""

from batchrun.run_dir.checkpoint import CHECKPOINT, Checkpoint, superseded_corrupted
from batchrun.run_dir.directory import BATCH_FILE, STATISTICS, RunDirectory, require_readable, require_regular_files
from batchrun.run_dir.durable import atomic_write_json, remove_temps_of_gone_writers, replacing, temp_beside
from batchrun.run_dir.errors import (
    DiskFull,
    RunDirectoryError,
    WriteFailed,
    size_text,
    write_failure_named,
    write_refusal_remedy,
)
from batchrun.run_dir.merge import MERGE_RECORD, TRAJECTORIES
from batchrun.run_dir.reading import line_number, lines_at, split_ranges
from batchrun.run_dir.scan import ScanResult, scan_ranges
from batchrun.run_dir.spent import SPENT, SpentLedger

__all__ = [
    "BATCH_FILE", "CHECKPOINT", "MERGE_RECORD", "SPENT", "STATISTICS", "TRAJECTORIES",
    "Checkpoint", "DiskFull", "RunDirectory", "RunDirectoryError", "ScanResult", "SpentLedger", "WriteFailed",
    "atomic_write_json", "write_failure_named", "line_number", "lines_at", "replacing", "require_readable",
    "require_regular_files",
    "scan_ranges",
    "remove_temps_of_gone_writers", "size_text", "split_ranges", "superseded_corrupted", "temp_beside",
    "write_refusal_remedy",
]
