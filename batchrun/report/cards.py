"""The cards across the top of the report: the run's few numbers a person reads first (rows, kept,
failed, discarded, corrupted, reasoning, tool calls, tokens, cost, throughput, and success per prompt
where prompts run several times), each toned good, warn or bad."""

from __future__ import annotations

from batchrun import rows
from batchrun.report.markup import card, money, number, percent
from batchrun.report.summary import CORRUPTED, PROMPT_GONE, SUPERSEDED, RunSummary, Timeline

# The largest count read from statistics.json: a file edited by hand may hold any number, and a larger one is
# neither a count a run could reach nor one the page's arithmetic (in floats) can hold.
_LARGEST_COUNT = 2**53


def _count(value: object) -> int | None:
    """A count as statistics.json holds it; None for anything else (a file edited by hand), which its card
    then leaves out."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _LARGEST_COUNT:
        return value
    return None


def cards_html(summary: RunSummary, info: dict) -> str:
    calls = sum(entry[0] for entry in summary.tools.values())
    failures = sum(entry[2] for entry in summary.tools.values())
    turns = summary.turns_with_reasoning + summary.turns_without_reasoning
    open_failures = sum(summary.open_failure_causes().values())
    total_prompts = _count(info.get("total_prompts"))
    kept = summary.kept
    tokens = summary.usage["prompt_tokens"] + summary.usage["completion_tokens"]
    cost = summary.usage["cost"]
    minutes = active_minutes(summary.timeline)
    statuses = summary.statuses
    return "".join([
        *_samples_cards(info),
        card("rows in batch files", number(summary.row_count),
              f"dataset: {number(total_prompts)} prompts" if total_prompts is not None else ""),
        card("kept trajectories", number(kept),
              f"{number(statuses[rows.COMPLETED])} completed · {number(statuses[rows.PARTIAL])} partial"
              + (f" · {number(statuses[PROMPT_GONE])} more rows left out: their prompts are no longer in the dataset"
                 if statuses[PROMPT_GONE] else ""),
              "good" if kept else ""),
        card("failed attempts", number(statuses[rows.FAILED]),
              f"{number(open_failures)} still failing (--resume retries them)", "bad" if open_failures else ""),
        card("discarded", number(statuses[rows.DISCARDED]), "no reasoning in any turn",
              "warn" if statuses[rows.DISCARDED] else ""),
        card("corrupted", number(statuses[CORRUPTED]), "invented tool names; not merged"
              + (f" ({number(statuses[SUPERSEDED])} more run again)" if statuses[SUPERSEDED] else ""),
              "warn" if statuses[CORRUPTED] else ""),
        card("reasoning coverage", percent(summary.turns_with_reasoning, turns),
              f"of {number(turns)} assistant turns"),
        card("tool calls", number(calls), f"{percent(failures, calls)} failed",
              "bad" if failures * 5 > calls else ""),          # more than one call in five failing
        card("tokens", number(tokens), f"{number(summary.usage['reasoning_tokens'])} reasoning · "
              f"{number(summary.usage['cached_tokens'])} cached"),
        _cost_card(cost, kept, info),
        card("throughput", f"{kept / minutes:,.1f}/min" if minutes else "–", "kept trajectories per active minute"),
    ])


def _cost_card(cost: float, kept: int, info: dict) -> str:
    """What the rows cost; when replies had no price, that it says less than was spent. Statistics of a
    version before they counted every invocation's replies count the last invocation's."""
    this_run = info.get("this_run")       # statistics.json may have been edited by hand: read what fits
    sources = info.get("replies_by_cost_source",
                       this_run.get("replies_by_cost_source") if isinstance(this_run, dict) else None) or {}
    unpriced = _count(sources.get("unknown", 0)) if isinstance(sources, dict) else None
    if unpriced:
        replies = "reply" if unpriced == 1 else "replies"
        return card("cost", f"≥ {money(cost)}" if cost else "unknown",
                     f"{number(unpriced)} {replies} without a price: give --price_per_mtok", "warn")
    return card("cost", money(cost), f"{money(cost / kept)} per kept trajectory" if kept else "")


def _samples_cards(info: dict) -> list[str]:
    """Success per prompt over its samples, from statistics.json, when prompts run several times."""
    samples = info.get("samples")
    if not isinstance(samples, dict):
        return []
    solved, prompts = _count(samples.get("prompts_with_a_completed_sample")), _count(samples.get("prompts_with_rows"))
    by_completed = samples.get("prompts_by_completed_samples")
    if solved is None or prompts is None or not isinstance(by_completed, dict):
        return []
    counts = {key: _count(count) for key, count in by_completed.items()}
    if None in counts.values():
        return []
    spread = ", ".join(f"{number(count)} with {key}" for key, count in counts.items() if count is not None)
    return [card("prompts with a completed sample", percent(solved, prompts),
                  f"{number(solved)} of {number(prompts)} prompts ({info.get('samples_per_prompt', '?')} samples "
                  f"asked each); by completed samples: {spread}", "good" if solved else "bad")]


def active_minutes(timeline: Timeline) -> float:
    """Minutes the run was working on rows (gaps between invocations are not counted)."""
    return timeline.active_seconds() / 60
