"""Which kind of row a finished session becomes (failure, trajectory, or tombstone), already encoded.
Apart from build.py because the decision reads the built row back with the stored-row reader, which
itself builds on build.py."""

from __future__ import annotations

from typing import cast

from batchrun.rows.build import encode_row, failure_row, tombstone_row, trajectory_row
from batchrun.rows.outcome import NO_REASONING, EndReason
from batchrun.rows.records import SessionResult
from batchrun.rows.stored import StoredRow, read_stored_row


def encode_finished(result: SessionResult, *, batch_num: int, model: str, timestamp: str,
                    discard_no_reasoning: bool) -> bytes:
    """The single decision of which kind of row a finished session becomes, already encoded."""
    if result.end_reason == EndReason.ERROR:
        return encode_row(failure_row(result))
    trajectory = trajectory_row(result, batch_num=batch_num, model=model, timestamp=timestamp)
    line = encode_row(trajectory)
    # A line just encoded from a trajectory is always a row, never None.
    if discard_no_reasoning and cast(StoredRow, read_stored_row(line)).reasoning_counts()[0] == 0:
        return encode_row(tombstone_row(trajectory, NO_REASONING))
    return line
