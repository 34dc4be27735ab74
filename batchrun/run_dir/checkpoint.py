"""checkpoint.json: what the runner writes every batch (Checkpoint), and what resume reads back.

Apart from the scan because resume takes nothing it counts from here (see Checkpoint), only the
arguments and which corrupted rows a --rerun_corrupted resume replaced.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

CHECKPOINT = "checkpoint.json"


@dataclass
class Checkpoint:
    """checkpoint.json, the same size however long the run: prompts done as a count, and rows per
    outcome. Resume finds done prompts, and counts rows per outcome, in the batch files, never here
    (rows written after the last checkpoint, before a kill, are there only); it reads the arguments
    here, to warn when they changed."""

    run_name: str
    dataset_file: str
    distribution: str
    model: str
    batch_size: int
    total_prompts: int
    completed_samples: int          # samples done (completed, partial or discarded), every invocation
    batch_stats: Counter            # rows written per outcome (completed, partial, failed, discarded)
    # Per sample key, how many of its corrupted rows a --rerun_corrupted resume has replaced: those
    # are attempts, like failure rows, and no longer count as done or as filtered_corrupted.
    superseded_corrupted: Counter = field(default_factory=Counter)
    samples_per_prompt: int = 1
    total_samples: int = 0

    def as_json(self) -> dict[str, Any]:
        # With one sample per prompt, samples are prompts and the file keeps the keys it always had.
        done = ({"completed_prompts": self.completed_samples} if self.samples_per_prompt == 1 else
                {"samples_per_prompt": self.samples_per_prompt, "total_samples": self.total_samples,
                 "completed_samples": self.completed_samples})
        return {"run_name": self.run_name, "dataset_file": self.dataset_file, "distribution": self.distribution,
                "model": self.model, "batch_size": self.batch_size, "total_prompts": self.total_prompts,
                **done, "batch_stats": dict(self.batch_stats),
                "superseded_corrupted": dict(self.superseded_corrupted),
                "last_updated": datetime.now().isoformat(timespec="seconds")}


def superseded_corrupted(checkpoint: dict[str, Any]) -> Counter:
    """The checkpoint's superseded corrupted rows per sample key (none in an older checkpoint)."""
    recorded = checkpoint.get("superseded_corrupted")
    return Counter({key: count for key, count in recorded.items() if isinstance(key, str) and isinstance(count, int)}
                   if isinstance(recorded, dict) else {})
