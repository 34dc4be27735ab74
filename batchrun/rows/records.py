"""What one session records and hands back: its turns (with their tool calls), its token usage, and
the SessionResult a worker returns. Plain data, apart so that rendering, judging and building rows all
read one definition."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from batchrun.rows.outcome import EndReason


@dataclass
class ToolCallRecord:
    id: str
    name: str
    arguments: str          # exactly as the model wrote it
    result: str | None = None


@dataclass
class AssistantTurn:
    reasoning: str
    content: str
    tool_calls: list[ToolCallRecord] = field(default_factory=list)


@dataclass
class HumanTurn:
    """A message the runner itself sent the model mid-session (asking it to continue a cut-off reply,
    or to sum up at --max_turns): the model answered it, so the trajectory shows it."""

    text: str


Turn = AssistantTurn | HumanTurn


def calls_of(turns: Iterable[Turn]) -> Iterable[ToolCallRecord]:
    return (call for turn in turns if isinstance(turn, AssistantTurn) for call in turn.tool_calls)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    cost: float = 0.0

    def add(self, other: Usage) -> None:
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.reasoning_tokens += other.reasoning_tokens
        self.cached_tokens += other.cached_tokens
        self.cost += other.cost

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "reasoning_tokens": self.reasoning_tokens, "cached_tokens": self.cached_tokens,
                "cost": round(self.cost, 8)}


@dataclass
class SessionResult:
    """What a worker hands back for one prompt; the parent only persists it."""

    prompt_index: int
    content_key: str
    prompt: str
    toolsets: list[str]
    offered_tools: list[str]
    turns: list[Turn]
    api_calls: int
    usage: Usage
    wall_time: float
    end_reason: EndReason
    error: str | None = None
    error_type: str | None = None
    sample_index: int = 0      # which of the prompt's --samples_per_prompt runs this is
    unpriced_replies: int = 0  # replies whose cost is unknown, which usage.cost leaves out (not in the row)
