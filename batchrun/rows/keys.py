"""What identifies a unit of work across runs: a prompt's content key, one sample's key and a unit's key. Apart
because the dataset planner needs them without anything of the row format."""

from __future__ import annotations

import hashlib
import json


def content_key(prompt: str, image: str | None, cwd: str | None) -> str:
    """Identifies a prompt by what it is, not where it sits, so resume survives reordered datasets."""
    canonical = json.dumps([prompt, image, cwd], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def sample_key(key: str, sample_index: int) -> str:
    """What resume counts done: one sample of a prompt. Sample 0 is the prompt's content key itself, so
    a run of one sample per prompt (and every row written before samples existed) counts as it always has."""
    return key if sample_index == 0 else f"{key}#{sample_index}"


def unit_key(prompt_index: int, sample_key: str) -> str:
    """Names one unit of work as its row records it: the place of its prompt among the dataset's valid lines,
    with its sample key. Resume counts a row done for its own unit while the line there still holds the
    row's content, so that of two lines with one prompt, the one without a row is the one that runs."""
    return f"{prompt_index}:{sample_key}"


def sample_index_of(key: str) -> int:
    """The sample index within a sample key (see sample_key)."""
    return int(key.partition("#")[2] or 0)


def content_key_of_sample(key: str) -> str:
    """The content key within a sample key (see sample_key)."""
    return key.partition("#")[0]


def split_unit(unit: str) -> tuple[int, str]:
    """The prompt index and the sample key within a unit key (see unit_key); a prompt key (the unit key of a
    prompt's first sample) gives its prompt index and content key."""
    index, _, key = unit.partition(":")
    return int(index), key


def sample_key_of_unit(unit: str) -> str:
    """The sample key within a unit key (see unit_key)."""
    return unit.partition(":")[2]
