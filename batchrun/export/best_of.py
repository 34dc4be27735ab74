"""--best_of: one row per prompt, chosen among its samples (--samples_per_prompt) that pass the filters,
by a named rule, in two passes over the run; and what the choice records beside the export."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from batchrun import rows
from batchrun.export.conversations import Candidate, ConversionError, layouts_of
from batchrun.export.files import beside
from batchrun.export.filters import selected_rows
from batchrun.export.options import ExportOptions

# Each rule names which samples are good, and the best of those; ties go to the lower sample index.
BEST_OF_RULES = {
    "first_completed": "the completed sample with the lowest sample index",
    "fewest_calls": "of the completed samples whose last tool call succeeded (or that called no tool), the one "
                    "with the fewest model calls",
    "longest_reasoning": "of the completed samples, the one with the most reasoning",
}


def sample_rank(candidate: Candidate, rule: str) -> tuple[int, ...] | None:
    """Where a sample stands under ``rule`` (lower is better), or None when it is not good."""
    stored = candidate.stored
    if stored.status != rows.COMPLETED:
        return None
    if rule == "first_completed":
        return (stored.sample_index,)
    if rule == "fewest_calls":
        try:
            calls = candidate.conversation.calls()
        except ConversionError:
            return None
        if calls and (calls[-1].result is None or rows.tool_result_failed(calls[-1].result)):
            return None
        # A count edited by hand into something else ranks after every sample that has one.
        made = candidate.row.get("api_calls", 0)
        counted = isinstance(made, int) and not isinstance(made, bool)
        return (0, made, stored.sample_index) if counted else (1, 0, stored.sample_index)
    return (-sum(reasoning for reasoning, _calls in layouts_of(candidate.row)), stored.sample_index)


@dataclass
class BestOf:
    """What --best_of found: the chosen line of each prompt, and how many good samples each prompt had."""

    rule: str
    chosen: dict[str, tuple[tuple[int, ...], tuple[str, int]]] = field(default_factory=dict)  # rank, place
    good: Counter = field(default_factory=Counter)        # per prompt (StoredRow.prompt_key), 0 for none

    def see(self, stored: rows.StoredRow) -> None:
        self.good[stored.prompt_key] += 0

    def consider(self, candidate: Candidate) -> None:
        try:
            rank = sample_rank(candidate, self.rule)
        except ConversionError:
            rank = None
        if rank is None:
            return
        key = candidate.stored.prompt_key
        self.good[key] += 1
        if key not in self.chosen or rank < self.chosen[key][0]:
            self.chosen[key] = (rank, candidate.place)

    def places(self) -> set[tuple[str, int]]:
        return {place for _rank, place in self.chosen.values()}

    def spread(self) -> dict[str, int]:
        """Prompts by how many good samples they had."""
        counts = Counter(self.good.values())
        return {str(count): counts[count] for count in sorted(counts)}

    def as_json(self) -> dict:
        return {"best_of": self.rule, "rule": BEST_OF_RULES[self.rule], "prompts": len(self.good),
                "prompts_kept": len(self.chosen), "prompts_by_good_samples": self.spread()}

    def lines(self, options: ExportOptions) -> list[str]:
        spread = ", ".join(f"{prompts} with {count}" for count, prompts in self.spread().items())
        return [f"best of samples: {self.rule} ({BEST_OF_RULES[self.rule]})",
                f"  {len(self.chosen)} of {len(self.good)} prompts kept; prompts by good samples: {spread or 'none'}",
                f"  record: {best_of_path(options.out)}"]


def best_of_path(out: Path) -> Path:
    """Where the record of a --best_of choice goes: beside the export, ``openai.jsonl`` -> ``openai.best_of.json``."""
    return beside(out, "best_of.json")



def chosen_samples(options: ExportOptions, best: BestOf, dropped: Counter) -> Iterator[Candidate]:
    """One row per prompt, as ``best``'s rule says: a first pass over the run ranks every sample that
    passes the filters (holding one entry per prompt), a second yields the chosen ones in batch file
    order; the others are counted in ``dropped``."""
    for candidate in selected_rows(options, Counter(), on_row=best.see):
        best.consider(candidate)
    places = best.places()
    for candidate in selected_rows(options, dropped):
        if candidate.place in places:
            yield candidate
        else:
            dropped["best_of"] += 1
