"""The run report: ``data/<run_name>/report.html``, one self-contained page that says at a glance
whether a run's data is good — tools and their failures, reasoning, outcomes, tokens and cost,
throughput — and lets a person open trajectories and read them the way the model lived them.

It is built from the run directory alone, during a run or after it, and streams every batch file
once: the figures come from each row's few facts read by :func:`rows.read_stored_row` and counted
by :mod:`batchrun.report_summary` (a million rows are never decoded whole), and only a bounded,
stratified sample of rows is decoded, trimmed and embedded for the trajectory browser. The page needs
no network: CSS, JS, data and the matplotlib plots (inline SVG, see :mod:`batchrun.report_plots`) are
all inside it.
"""

from __future__ import annotations

import html
import itertools
import json
import math
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any

from batchrun import distributions, report_plots, rows
from batchrun.install_hint import install_hint, program
from batchrun.report_summary import CORRUPTED, SUPERSEDED, RunSummary, Timeline
from batchrun.run_dir import (
    CHECKPOINT,
    STATISTICS,
    RunDirectory,
    line_number,
    lines_at,
    replacing,
    superseded_corrupted,
)

REPORT_FILE = "report.html"
SAMPLE_LIMIT = 500              # trajectories embedded in the page at most
TEXT_LIMIT = 2500               # characters kept of one text of a sampled row (reasoning, reply, result)
SYSTEM_TEXT_LIMIT = 1200        # the system turn is the same long tool list in every row
ROW_BUDGET = 24_000             # characters of turns kept per sampled row; the middle turns go first
CALLS_PER_TURN = 20             # tool calls / results kept per turn
# Said (as HTML) in place of each plot where matplotlib is missing, and where a plot has no rows to draw.
PLOTS_HINT = ("This plot needs matplotlib: <code>{install}</code>, "
              "then <code>{program} --report --run_name={run_name}</code>")
NOTHING_TO_PLOT = "Nothing to plot yet."

# How many rows of each kind the sample keeps, and which kinds are shown first when it is full.
QUOTAS = {"failed": 30, "corrupted": 30, "partial": 30, "tool_failed": 20, "discarded": 30, "tool": 20,
          "completed": 120}
PRIORITY = tuple(QUOTAS)


# ---------------------------------------------------------------------------------------------
# The trajectory sample: stratified reservoirs, so rare kinds (failures, each tool, each end
# reason) are always represented, in memory bounded by the quotas, never by the run's size.


def _categories(status: str, facts: dict) -> list[tuple[str, str]]:
    if status == rows.FAILED:
        return [("failed", facts["cause"])]
    if status in (rows.DISCARDED, CORRUPTED):
        return [(status, "")]
    if status == SUPERSEDED:
        return []
    found = [("partial", facts["end_reason"])] if status == rows.PARTIAL else [("completed", "")]
    found += [("tool", name) for name in facts["tools"]]
    found += [("tool_failed", name) for name in facts["tools_failed"]]
    return found


@dataclass
class _Reservoir:
    quota: int
    seen: int = 0
    ids: list[int] = field(default_factory=list)


class TrajectorySample:
    """Keeps, per category, a uniform random sample of its rows (reservoir sampling); a row is
    decoded and trimmed only when some reservoir takes it, and dropped when none holds it any more."""

    def __init__(self, limit: int = SAMPLE_LIMIT, seed: int = 0) -> None:
        self.limit = limit
        self._rng = random.Random(seed)
        self._reservoirs: dict[tuple[str, str], _Reservoir] = {}
        self._rows: dict[int, dict] = {}
        self._holders: Counter = Counter()

    def offer(self, row_id: int, categories: list[tuple[str, str]], build: Callable[[], dict]) -> None:
        for category in categories:
            reservoir = self._reservoirs.get(category)
            if reservoir is None:
                reservoir = self._reservoirs[category] = _Reservoir(QUOTAS[category[0]])
            reservoir.seen += 1
            if len(reservoir.ids) < reservoir.quota:
                self._hold(reservoir.ids, len(reservoir.ids), row_id, build)
            elif (slot := self._rng.randrange(reservoir.seen)) < reservoir.quota:
                self._release(reservoir.ids[slot])
                self._hold(reservoir.ids, slot, row_id, build)

    def _hold(self, ids: list[int], slot: int, row_id: int, build: Callable[[], dict]) -> None:
        if row_id not in self._rows:
            self._rows[row_id] = build()
        self._holders[row_id] += 1
        if slot == len(ids):
            ids.append(row_id)
        else:
            ids[slot] = row_id

    def _release(self, row_id: int) -> None:
        self._holders[row_id] -= 1
        if not self._holders[row_id]:
            del self._holders[row_id]
            del self._rows[row_id]

    def chosen(self) -> list[dict]:
        """Up to ``limit`` rows, taken round-robin over the categories (most telling kinds first)
        so every category is represented before any gets a second row; in row order."""
        ordered = self._ordered()
        picked: dict[int, None] = {}
        for position in range(max((len(r.ids) for _, r in ordered), default=0)):
            for _, reservoir in ordered:
                if len(picked) >= self.limit:
                    break
                if position < len(reservoir.ids):
                    picked.setdefault(reservoir.ids[position])
        return [self._rows[row_id] for row_id in sorted(picked)]

    def coverage(self) -> list[tuple[str, str, int, int]]:
        """(kind, detail, rows held, rows seen) per category, for the page's sampling note."""
        return [(kind, detail, len(r.ids), r.seen) for (kind, detail), r in self._ordered()]

    def _ordered(self) -> list[tuple[tuple[str, str], _Reservoir]]:
        return sorted(self._reservoirs.items(), key=lambda item: (PRIORITY.index(item[0][0]), item[0][1]))


# ---------------------------------------------------------------------------------------------
# Turning a sampled row into what the browser renders: parsed turns, long texts trimmed.


def clip(text: str, limit: int = TEXT_LIMIT) -> str:
    """Head and tail of a long text with a visible note of what was left out."""
    if len(text) <= limit:
        return text
    head, tail = limit * 3 // 4, limit // 4
    return f"{text[:head]}\n… [{len(text) - head - tail:,} characters not shown] …\n{text[-tail:]}"


def _clip_value(value: Any) -> Any:
    """A JSON value kept as structure when small (the page pretty-prints it), else trimmed text."""
    if isinstance(value, str):
        return clip(value)
    encoded = json.dumps(value, ensure_ascii=False, indent=2)
    return value if len(encoded) <= TEXT_LIMIT else clip(encoded)


def _system_turn(text: str) -> dict:
    return {"r": "system", "t": clip(text, SYSTEM_TEXT_LIMIT), "tools": rows.offered_tool_names(text)}


def _gpt_turn(turn: dict, offered: list[str], layout: rows.GptLayout | None) -> dict:
    text = turn.get("value") or ""
    try:
        read = rows.read_gpt_turn(text, layout)
    except rows.LayoutError:        # a row edited by hand: shown as the text it is
        read = rows.ReadGptTurn(reasoning="", text=text, calls=[], shown=text)
    reasoning, visible, found = read.reasoning, read.text, read.calls
    calls = [{"n": call["name"], "a": _clip_value(call.get("arguments")),
              "inv": rows.is_invented(call["name"], offered)}
             for call in found[:CALLS_PER_TURN]]
    return {"r": "gpt", "think": clip(reasoning), "t": clip(visible.strip()), "calls": calls,
            "more": max(0, len(found) - CALLS_PER_TURN)}


def _tool_turn(turn: dict) -> dict:
    results = []
    blocks = rows.rendered_tool_responses(turn.get("value") or "")
    for block in blocks[:CALLS_PER_TURN]:
        payload = rows.parsed_or_raw(block)
        if not isinstance(payload, dict):
            results.append({"id": None, "n": None, "c": clip(block), "x": False})
            continue
        content = payload.get("content")
        raw = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        results.append({"id": payload.get("tool_call_id"), "n": payload.get("name"), "c": _clip_value(content),
                        "x": rows.tool_result_failed(raw)})
    return {"r": "tool", "res": results, "more": max(0, len(blocks) - CALLS_PER_TURN)}


def _turn(turn: dict, offered: list[str], layouts: Iterator[rows.GptLayout | None]) -> dict:
    role = turn.get("from")
    if role == "system":
        return _system_turn(turn.get("value") or "")
    if role == "gpt":
        return _gpt_turn(turn, offered, next(layouts, None))
    if role == "tool":
        return _tool_turn(turn)
    return {"r": "human" if role == "human" else str(role), "t": clip(turn.get("value") or "")}


def _within_budget(turns: list[dict]) -> list[dict]:
    """First turns (system, prompt, ...) and the last two (how it ended) always; the middle ones
    while the row's budget lasts, then one marker saying how many were left out."""
    sizes = [len(json.dumps(turn, ensure_ascii=False)) for turn in turns]
    if sum(sizes) <= ROW_BUDGET or len(turns) <= 4:
        return turns
    spent = sizes[0] + sizes[1] + sizes[-1] + sizes[-2]
    keep = 2
    while keep < len(turns) - 2 and spent + sizes[keep] <= ROW_BUDGET:
        spent += sizes[keep]
        keep += 1
    return turns[:keep] + [{"r": "gap", "n": len(turns) - 2 - keep}] + turns[-2:]


def sampled_row(row: rows.StoredRow, status: str, batch_file: str) -> dict:
    """A row as the browser needs it: its facts, and its turns parsed and trimmed."""
    data = json.loads(row.line)
    item: dict[str, Any] = {"id": row.prompt_index, "si": row.sample_index, "s": status, "e": data.get("end_reason"),
                            "f": batch_file, "u": data.get("usage") or {}, "calls": data.get("api_calls"),
                            "wall": data.get("wall_time_seconds")}
    if "conversations" not in data:               # failure rows and tombstones keep only the prompt
        item.update(p=clip(data.get("prompt") or ""), err=data.get("error"), et=data.get("error_type"),
                    dr=data.get("discarded"), turns=[], tools=[], tf=[], inv=[])
        return item
    conversations = [turn for turn in data["conversations"] if isinstance(turn, dict)]
    system = next((turn.get("value") or "" for turn in conversations if turn.get("from") == "system"), "")
    recorded = row.layouts()      # None for a row of format 1 or 2: its turns are read by their text
    layouts: Iterator[rows.GptLayout | None] = iter(recorded) if recorded is not None else itertools.repeat(None)
    turns = [_turn(turn, rows.offered_tool_names(system), layouts) for turn in conversations]
    stats = data.get("tool_stats") or {}
    item.update(p=next((t["t"] for t in turns if t["r"] == "human"), ""), turns=_within_budget(turns),
                tools=[n for n, e in stats.items() if isinstance(e, dict) and e.get("count")],
                tf=[n for n, e in stats.items() if isinstance(e, dict) and e.get("failure")],
                inv=row.invented_tools(), ts=data.get("toolsets_used") or [],
                time=(data.get("metadata") or {}).get("timestamp"), model=(data.get("metadata") or {}).get("model"))
    return item


# ---------------------------------------------------------------------------------------------
# Streaming the run directory


class RunScan:
    """The report's pass over the batch files, in as many steps as needed: each
    :meth:`read_new_rows` reads the complete rows written since the last one, so a run can keep the
    figures current while it writes rows (batchrun.report_follower) and draw the page at the end
    without reading everything again."""

    def __init__(self, run_dir: Path, sample_limit: int = SAMPLE_LIMIT) -> None:
        self.run_dir = RunDirectory(run_dir)
        self.summary, self.sample = RunSummary(), TrajectorySample(sample_limit)
        self.summary.superseded = superseded_corrupted(_read_json(run_dir / CHECKPOINT))
        self._read_up_to: dict[Path, int] = {}     # per batch file: the end of its last complete row read
        self._row_id = 0

    def read_new_rows(self) -> None:
        files = self.run_dir.batch_files()
        self.summary.batch_files = len(files)
        for path in files:
            self._read_up_to[path] = self.read_rows(path, self._read_up_to.get(path, 0))

    def read_rows(self, path: Path, start: int) -> int:
        """Count the complete rows of one batch file from byte ``start`` on; returns where they end
        (a row still being written is read next time)."""
        position = start
        for offset, line in lines_at(path, start):
            self._add(line, path, offset)
            position = offset + len(line)
        return position

    def _add(self, line: bytes, path: Path, offset: int) -> None:
        try:
            row = rows.read_stored_row(line)
        except rows.RowError as exc:
            # A run stops on such a line; the page still shows every other row, and names this one.
            self.summary.refused_lines += 1
            if not self.summary.first_refused:
                self.summary.first_refused = f"{path.name} line {line_number(path, offset)}: {exc}"
            return
        if row is None:
            self.summary.unreadable_lines += 1
            return
        status, facts = self.summary.add(row)
        self.sample.offer(self._row_id, _categories(status, facts),
                          lambda: sampled_row(row, status, path.name))
        self._row_id += 1


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------------------------------------
# The page


def _number(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "–"


def _money(value: float) -> str:
    return f"${value:,.4f}" if value < 1 else f"${value:,.2f}"


def _table(headers: Iterable[str], body: Iterable[Iterable[Any]], *, numeric_from: int = 1) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    lines = []
    for cells in body:
        tds = "".join(f'<td{" class=num" if i >= numeric_from else ""}>{html.escape(str(c))}</td>'
                      for i, c in enumerate(cells))
        lines.append(f"<tr>{tds}</tr>")
    if not lines:
        return '<p class="muted">None.</p>'
    return f'<table><thead><tr>{head}</tr></thead><tbody>{"".join(lines)}</tbody></table>'


def _card(label: str, value: str, note: str = "", tone: str = "") -> str:
    return (f'<div class="card {tone}"><div class="label">{html.escape(label)}</div>'
            f'<div class="value">{html.escape(value)}</div><div class="note">{html.escape(note)}</div></div>')


def _cards(summary: RunSummary, info: dict) -> str:
    calls = sum(entry[0] for entry in summary.tools.values())
    failures = sum(entry[2] for entry in summary.tools.values())
    turns = summary.turns_with_reasoning + summary.turns_without_reasoning
    open_failures = sum(summary.open_failure_causes().values())
    total_prompts = info.get("total_prompts")
    kept = summary.kept
    tokens = summary.usage["prompt_tokens"] + summary.usage["completion_tokens"]
    cost = summary.usage["cost"]
    minutes = _active_minutes(summary.timeline)
    statuses = summary.statuses
    return "".join([
        *_samples_cards(info),
        _card("rows in batch files", _number(summary.row_count),
              f"dataset: {_number(total_prompts)} prompts" if isinstance(total_prompts, int) else ""),
        _card("kept trajectories", _number(kept),
              f"{_number(statuses[rows.COMPLETED])} completed · {_number(statuses[rows.PARTIAL])} partial",
              "good" if kept else ""),
        _card("failed attempts", _number(statuses[rows.FAILED]),
              f"{_number(open_failures)} still failing (--resume retries them)", "bad" if open_failures else ""),
        _card("discarded", _number(statuses[rows.DISCARDED]), "no reasoning in any turn",
              "warn" if statuses[rows.DISCARDED] else ""),
        _card("corrupted", _number(statuses[CORRUPTED]), "invented tool names; not merged"
              + (f" ({_number(statuses[SUPERSEDED])} more run again)" if statuses[SUPERSEDED] else ""),
              "warn" if statuses[CORRUPTED] else ""),
        _card("reasoning coverage", _percent(summary.turns_with_reasoning, turns),
              f"of {_number(turns)} assistant turns"),
        _card("tool calls", _number(calls), f"{_percent(failures, calls)} failed",
              "bad" if failures * 5 > calls else ""),          # more than one call in five failing
        _card("tokens", _number(tokens), f"{_number(summary.usage['reasoning_tokens'])} reasoning · "
              f"{_number(summary.usage['cached_tokens'])} cached"),
        _cost_card(cost, kept, info),
        _card("throughput", f"{kept / minutes:,.1f}/min" if minutes else "–", "kept trajectories per active minute"),
    ])


def _cost_card(cost: float, kept: int, info: dict) -> str:
    """What the rows cost; when replies of the last invocation had no price, that it says less than was spent."""
    sources = (info.get("this_run") or {}).get("replies_by_cost_source") or {}
    unpriced = sources.get("unknown", 0) if isinstance(sources, dict) else 0
    if isinstance(unpriced, int) and unpriced > 0:
        return _card("cost", f"≥ {_money(cost)}" if cost else "unknown",
                     f"{_number(unpriced)} replies without a price: give --price_per_mtok", "warn")
    return _card("cost", _money(cost), f"{_money(cost / kept)} per kept trajectory" if kept else "")


def _samples_cards(info: dict) -> list[str]:
    """Success per prompt over its samples, from statistics.json, when prompts run several times."""
    samples = info.get("samples")
    if not isinstance(samples, dict):
        return []
    try:
        solved, prompts = int(samples["prompts_with_a_completed_sample"]), int(samples["prompts_with_rows"])
        spread = ", ".join(f"{_number(int(count))} with {k}"
                           for k, count in samples["prompts_by_completed_samples"].items())
    except (KeyError, TypeError, ValueError, AttributeError):
        return []
    return [_card("prompts with a completed sample", _percent(solved, prompts),
                  f"{_number(solved)} of {_number(prompts)} prompts ({info.get('samples_per_prompt', '?')} samples "
                  f"asked each); by completed samples: {spread}", "good" if solved else "bad")]


def _active_minutes(timeline: Timeline) -> float:
    """Minutes the run was working on rows (gaps between invocations are not counted)."""
    return timeline.active_seconds() / 60


def _tool_table(summary: RunSummary) -> str:
    used = sorted(((n, e) for n, e in summary.tools.items() if e[0]), key=lambda item: -item[1][0])
    return _table(("tool", "calls", "success", "failure", "failure rate", "trajectories using it"),
                  [(n, _number(c), _number(s), _number(f), _percent(f, c), _number(t)) for n, (c, s, f, t) in used])


def expected_toolset_shares(distribution: str) -> dict[str, float] | None:
    """Probability that a prompt's toolsets include each toolset, from the distribution's table:
    each entry rolled independently, the likeliest entry used when none hit (as the sampler does)."""
    table = distributions.DISTRIBUTIONS.get(distribution)
    if table is None:
        return None
    entries = {tuple(distributions.entry_members(entry)): percent / 100
               for entry, percent in table["toolsets"].items()}
    none_hit = math.prod(1 - p for p in entries.values())
    fallback = max(entries, key=entries.__getitem__)
    members = dict.fromkeys(member for entry in entries for member in entry)
    return {member: 1 - math.prod(1 - p for entry, p in entries.items() if member in entry)
            + (none_hit if member in fallback else 0.0) for member in members}


def _toolset_table(summary: RunSummary, expected: dict[str, float] | None) -> str:
    names = list(dict.fromkeys([*(expected or {}), *sorted(summary.toolsets)]))
    return _table(("toolset", "trajectories", "sampled", "expected", "offered to the model"),
                  [(n, _number(summary.toolsets[n]), _percent(summary.toolsets[n], summary.toolset_rows),
                    f"{100 * expected[n]:.1f}%" if expected and n in expected else "–",
                    _percent(summary.toolsets_offered[n], summary.toolset_rows)) for n in names])


def _outcome_tables(summary: RunSummary) -> str:
    open_causes = summary.open_failure_causes()
    failures = _table(("cause", "failure rows", "prompts still failing"),
                      [(c, _number(n), _number(open_causes[c]) + ("" if summary.open_failures_exact else "+"))
                       for c, n in summary.failure_causes.most_common()])
    end_reasons = _table(("end reason", "trajectories", "share"),
                         [(r, _number(n), _percent(n, summary.kept)) for r, n in summary.end_reasons.most_common()])
    discarded = _table(("reason", "rows"), [(r, _number(n)) for r, n in summary.discard_reasons.most_common()])
    invented = _table(("tool name", "rows"), [(r, _number(n)) for r, n in summary.invented_tools.most_common(20)])
    return (f"<h3>End reasons of kept trajectories</h3>{end_reasons}<h3>Failures by cause</h3>{failures}"
            f"<h3>Discarded</h3>{discarded}<h3>Invented tool names (corrupted rows)</h3>{invented}")


def _usage_table(summary: RunSummary) -> str:
    kept = summary.kept or 1
    body = [(key.replace("_", " "), _money(value) if key == "cost" else _number(value),
             _money(value / kept) if key == "cost" else _number(round(value / kept)))
            for key, value in summary.usage.items()]
    body.append(("tokens per kept trajectory, median ≈", "", _number(round(summary.tokens.quantile(0.5)))))
    body.append(("wall time per trajectory, median ≈", "", f"{summary.wall_time.quantile(0.5):.1f}s"))
    return _table(("", "all rows", "per kept trajectory"), body)


def _reasoning_table(summary: RunSummary) -> str:
    with_reasoning, without = summary.turns_with_reasoning, summary.turns_without_reasoning
    trajectories = sum(summary.trajectory_reasoning.values())
    return _table(("", "count", "share"), [
        ("assistant turns with reasoning", _number(with_reasoning), _percent(with_reasoning, with_reasoning + without)),
        ("assistant turns without", _number(without), _percent(without, with_reasoning + without)),
        *[(f"trajectories: reasoning in {kind}", _number(n), _percent(n, trajectories))
          for kind, n in summary.trajectory_reasoning.most_common()]])


def _section(title: str, figure: str, body: str, note: str = "") -> str:
    note_html = f'<p class="muted">{html.escape(note)}</p>' if note else ""
    return f'<section class="panel"><h2>{html.escape(title)}</h2>{note_html}{figure}{body}</section>'


def _figure(svg: str | None, missing: str) -> str:
    """A plot, or in its place (a panel would otherwise stand empty) ``missing``: HTML saying what keeps
    it from being drawn."""
    if svg:
        return f'<div class="plot">{svg}</div>'
    return f'<div class="plot missing">{missing}</div>'


def _sample_note(summary: RunSummary, sample: TrajectorySample, shown: int) -> str:
    parts = [f"{kind}{': ' + detail if detail else ''} {held}/{seen:,}"
             for kind, detail, held, seen in sample.coverage()]
    return (f"Showing {shown:,} of {summary.row_count:,} rows: a sample chosen to cover every kind of row (failures, "
            f"partials, discards, corrupted rows, each tool and its failures), so it over-represents problems. "
            f"Long texts and the middle of long trajectories are trimmed. Sampled per kind: {'; '.join(parts)}.")


def _header(run_dir: Path, summary: RunSummary, info: dict) -> str:
    models = ", ".join(m for m, _ in summary.models.most_common(3)) or info.get("model") or "–"
    facts = [("model", models), ("distribution", info.get("distribution") or "–"),
             ("batch files", _number(summary.batch_files)), ("last checkpoint", info.get("last_updated") or "–"),
             ("report generated", datetime.now().isoformat(timespec="seconds"))]
    if summary.unreadable_lines:
        facts.append(("unreadable lines", _number(summary.unreadable_lines)))
    items = "".join(f"<span><b>{html.escape(k)}</b> {html.escape(str(v))}</span>" for k, v in facts)
    return f'<header><h1>Run report · {html.escape(run_dir.name)}</h1><div class="facts">{items}</div></header>'


def _notices(summary: RunSummary) -> str:
    texts = []
    if summary.refused_lines:
        texts.append(f"{summary.refused_lines:,} line(s) of the batch files are JSON but not rows this version of "
                     f"batch_runner reads: no figure below counts them, and --resume stops on them. The first: "
                     f"{summary.first_refused}")
    return "".join(f'<p class="notice">{html.escape(text)}</p>' for text in texts)


@dataclass(frozen=True)
class Plots:
    """The page's figures (SVG text by name; None without matplotlib) and what they were drawn from.
    They need only the rows and the distribution, so a run has them drawn while it ends."""

    svg: dict[str, str] | None
    distribution: str
    rows: int


def draw_plots(summary: RunSummary, distribution: str) -> Plots:
    expected = expected_toolset_shares(distribution) if distribution else None
    return Plots(report_plots.draw(summary, expected, distribution), distribution, summary.row_count)


def render(run_dir: Path, summary: RunSummary, sample: TrajectorySample, drawn: Plots | None = None) -> str:
    """The whole page as text; ``drawn`` plots are used if they show these rows and distribution."""
    info = {**_read_json(run_dir / CHECKPOINT), **_read_json(run_dir / STATISTICS)}
    named = info.get("distribution")
    distribution = named if isinstance(named, str) else ""
    expected = expected_toolset_shares(distribution) if distribution else None
    if drawn is None or (drawn.distribution, drawn.rows) != (distribution, summary.row_count):
        drawn = draw_plots(summary, distribution)
    plots = drawn.svg
    shown = sample.chosen()
    missing = (NOTHING_TO_PLOT if plots is not None else
               PLOTS_HINT.format(**{key: html.escape(value) for key, value in (
                   ("install", install_hint("report")), ("program", program()), ("run_name", run_dir.name))}))

    def plot(name: str) -> str:
        return _figure((plots or {}).get(name), missing)

    body = "".join([
        _header(run_dir, summary, info), _notices(summary),
        f'<div class="cards">{_cards(summary, info)}</div>',
        '<div class="grid">',
        _section("Tool calls", plot("tools"), _tool_table(summary),
                 "Calls per tool in kept trajectories; a failure is a result with an error "
                 "(a non-zero exit code is not)."),
        _section("Toolsets sampled", plot("toolsets"), _toolset_table(summary, expected),
                 f"Share of kept trajectories that drew each toolset, against distribution '{distribution}', and "
                 "share whose model was offered its tools (a toolset with nothing available on the machine is "
                 "drawn but not offered)." if distribution else
                 "Share of kept trajectories that drew each toolset (no distribution recorded), and share whose "
                 "model was offered its tools."),
        _section("Reasoning", plot("reasoning"), _reasoning_table(summary)),
        _section("Outcomes", plot("outcomes"), _outcome_tables(summary),
                 "Every failed attempt leaves a row; a prompt counts as still failing until a later row "
                 "shows it done."),
        _section("Turns per trajectory", plot("turns"), ""),
        _section("Tokens and cost", plot("usage"), _usage_table(summary)),
        _section("Throughput", plot("timeline"), "",
                 "Kept trajectories over time, from each row's timestamp (failed and discarded rows carry none)."),
        "</div>",
        f'<section class="panel browser-panel"><h2>Trajectories</h2>'
        f'<p class="muted">{html.escape(_sample_note(summary, sample, len(shown)))}</p>'
        '<div id="browser"></div></section>',
    ])
    data = json.dumps({"rows": shown, "total": summary.row_count}, ensure_ascii=False, separators=(",", ":"))
    values = {"TITLE": html.escape(f"Run report · {run_dir.name}"), "BODY": body,
              "DATA": data.replace("<", "\\u003c")}     # no text can close the script element
    template = resources.files("batchrun").joinpath("report_template.html").read_text(encoding="utf-8")
    return re.sub(r"\{\{(TITLE|BODY|DATA)\}\}", lambda m: values[m.group(1)], template)


def write_report(run_dir: Path, sample_limit: int = SAMPLE_LIMIT) -> Path:
    """Build data/<run_name>/report.html from the run directory in one pass."""
    scan = RunScan(run_dir, sample_limit)
    scan.read_new_rows()
    return save(scan)


def save(scan: RunScan, drawn: Plots | None = None) -> Path:
    """Write the page of what ``scan`` has read; replaced atomically so an open page never sees half a file."""
    run_dir = scan.run_dir.path
    page = render(run_dir, scan.summary, scan.sample, drawn)
    target = run_dir / REPORT_FILE
    data = page.encode("utf-8")
    with replacing(target, needed=len(data), durable=False) as handle:    # a page, not a record: no fsync
        handle.write(data)
    return target
