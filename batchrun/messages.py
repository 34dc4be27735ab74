"""What crosses the boundary between the parent and the worker processes (pickled over pipes)."""

from __future__ import annotations

from dataclasses import dataclass

from batchrun.rows.outcome import RowStatus


@dataclass(frozen=True)
class Task:
    """A planned unit of work: one sample of one dataset occurrence, with its sampled toolsets."""

    prompt_index: int
    prompt: str
    image: str | None
    cwd: str | None
    content_key: str
    toolsets: tuple[str, ...]
    # Names the task while it runs (the pool's bookkeeping, spent.jsonl, batch files): unique in this
    # invocation and rising in the order tasks are handed out; the prompt's index itself when each
    # prompt runs once (see DatasetPlan.unit).
    unit: int
    sample_index: int = 0


@dataclass
class Finished:
    """One prompt's outcome as the parent sees it: the encoded row plus what the console shows."""

    prompt_index: int
    unit: int                                  # the Task's
    batch_num: int
    status: RowStatus
    row: bytes
    api_calls: int
    usage: dict
    wall_time: float
    end_reason: str
    error: str | None
    error_type: str | None
    prompt_preview: str
    toolsets: tuple[str, ...]                  # toolsets whose tools the model was offered (for --verbose)
    tool_calls: tuple[tuple[str, int, int], ...]    # (tool, calls, failed calls) of the tools it used
    call_previews: tuple[str, ...] = ()        # each tool call and its result, cut (--verbose only)
    sample_index: int = 0
    unpriced_replies: int = 0                  # replies whose cost is unknown: usage's cost leaves them out


@dataclass
class Spent:
    """What one model call of a session still running cost, sent as its reply arrives. The row
    carries a session's whole usage, but a session cut off (kill -9, a stop, a worker that died)
    never has one: these let the parent count what it spent all the same."""

    unit: int                                  # the Task's
    usage: dict
    cost_source: str = "endpoint"              # see pricing.COST_SOURCES


@dataclass
class Fatal:
    message: str
