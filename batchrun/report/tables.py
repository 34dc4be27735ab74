"""The tables of the report's panels (tools, toolsets against what the distribution expects,
outcomes, tokens and cost, reasoning), each from the RunSummary."""

from __future__ import annotations

import math

from batchrun import distributions
from batchrun.report.markup import money, number, percent, table
from batchrun.report.summary import RunSummary


def tool_table(summary: RunSummary) -> str:
    used = sorted(((n, e) for n, e in summary.tools.items() if e[0]), key=lambda item: -item[1][0])
    return table(("tool", "calls", "success", "failure", "failure rate", "trajectories using it"),
                  [(n, number(c), number(s), number(f), percent(f, c), number(t)) for n, (c, s, f, t) in used])


def expected_toolset_shares(distribution: str) -> dict[str, float] | None:
    """Probability that a prompt's toolsets include each toolset, from the distribution's table:
    each entry rolled independently, the likeliest entry used when none hit (as the sampler does)."""
    listed = distributions.DISTRIBUTIONS.get(distribution)
    if listed is None:
        return None
    entries = {tuple(distributions.entry_members(entry)): share / 100
               for entry, share in listed["toolsets"].items()}
    none_hit = math.prod(1 - p for p in entries.values())
    fallback = max(entries, key=entries.__getitem__)
    members = dict.fromkeys(member for entry in entries for member in entry)
    return {member: 1 - math.prod(1 - p for entry, p in entries.items() if member in entry)
            + (none_hit if member in fallback else 0.0) for member in members}


def toolset_table(summary: RunSummary, expected: dict[str, float] | None) -> str:
    names = list(dict.fromkeys([*(expected or {}), *sorted(summary.toolsets)]))
    return table(("toolset", "trajectories", "sampled", "expected", "offered to the model"),
                  [(n, number(summary.toolsets[n]), percent(summary.toolsets[n], summary.toolset_rows),
                    f"{100 * expected[n]:.1f}%" if expected and n in expected else "–",
                    percent(summary.toolsets_offered[n], summary.toolset_rows)) for n in names])


def outcome_tables(summary: RunSummary) -> str:
    open_causes = summary.open_failure_causes()
    failures = table(("cause", "failure rows", "prompts still failing"),
                      [(c, number(n), number(open_causes[c]) + ("" if summary.open_failures_exact else "+"))
                       for c, n in summary.failure_causes.most_common()])
    end_reasons = table(("end reason", "trajectories", "share"),
                         [(r, number(n), percent(n, summary.kept)) for r, n in summary.end_reasons.most_common()])
    discarded = table(("reason", "rows"), [(r, number(n)) for r, n in summary.discard_reasons.most_common()])
    invented = table(("tool name", "rows"),
                     [(r, number(n)) for r, n in summary.invented_tools.most_common(20)])
    return (f"<h3>End reasons of kept trajectories</h3>{end_reasons}<h3>Failures by cause</h3>{failures}"
            f"<h3>Discarded</h3>{discarded}<h3>Invented tool names (corrupted rows)</h3>{invented}")


def usage_table(summary: RunSummary) -> str:
    kept = summary.kept or 1
    body = [(key.replace("_", " "), money(value) if key == "cost" else number(value),
             money(value / kept) if key == "cost" else number(round(value / kept)))
            for key, value in summary.usage.items()]
    body.append(("tokens per kept trajectory, median ≈", "", number(round(summary.tokens.quantile(0.5)))))
    body.append(("wall time per trajectory, median ≈", "", f"{summary.wall_time.quantile(0.5):.1f}s"))
    return table(("", "all rows", "per kept trajectory"), body)


def reasoning_table(summary: RunSummary) -> str:
    with_reasoning, without = summary.turns_with_reasoning, summary.turns_without_reasoning
    trajectories = sum(summary.trajectory_reasoning.values())
    return table(("", "count", "share"), [
        ("assistant turns with reasoning", number(with_reasoning), percent(with_reasoning, with_reasoning + without)),
        ("assistant turns without", number(without), percent(without, with_reasoning + without)),
        *[(f"trajectories: reasoning in {kind}", number(n), percent(n, trajectories))
          for kind, n in summary.trajectory_reasoning.most_common()]])
