"""The report's page: the header, the cards, the panels with their plots and tables, and the
trajectory browser's data, put into template.html (its CSS and JS) as one self-contained page."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path

from batchrun.install_hint import install_hint, program
from batchrun.report.cards import cards_html
from batchrun.report.markup import number, text
from batchrun.report.plots import draw
from batchrun.report.sample import TrajectorySample
from batchrun.report.scan import read_json
from batchrun.report.summary import RunSummary
from batchrun.report.tables import (
    expected_toolset_shares,
    outcome_tables,
    reasoning_table,
    tool_table,
    toolset_table,
    usage_table,
)
from batchrun.report.trajectory import clip_name
from batchrun.run_dir import CHECKPOINT, STATISTICS

# Said (as HTML) in place of each plot where matplotlib is missing, and where a plot has no rows to draw.
PLOTS_HINT = ("This plot needs matplotlib: <code>{install}</code>, "
              "then <code>{program} --report --run_name={run_name}</code>")
NOTHING_TO_PLOT = "Nothing to plot yet."

# A lone surrogate: JSON may carry one ("\ud800", as a model can send it), but UTF-8 cannot write it.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _json_escaped(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def _section(title: str, figure: str, body: str, note: str = "") -> str:
    note_html = f'<p class="muted">{text(note)}</p>' if note else ""
    return f'<section class="panel"><h2>{text(title)}</h2>{note_html}{figure}{body}</section>'


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
             ("batch files", number(summary.batch_files)), ("last checkpoint", info.get("last_updated") or "–"),
             ("report generated", datetime.now().isoformat(timespec="seconds"))]
    if summary.unreadable_lines:
        facts.append(("unreadable lines", number(summary.unreadable_lines)))
    if summary.repeated_rows:
        facts.append(("repeated rows", number(summary.repeated_rows)))
    items = "".join(f"<span><b>{text(k)}</b> {text(clip_name(str(v)))}</span>" for k, v in facts)
    return f'<header><h1>Run report · {text(run_dir.name)}</h1><div class="facts">{items}</div></header>'


def _notices(summary: RunSummary) -> str:
    texts = []
    if summary.refused_lines:
        texts.append(f"{summary.refused_lines:,} line(s) of the batch files are JSON but not rows this version of "
                     f"batch_runner reads: no figure below counts them, and --resume stops on them. The first: "
                     f"{summary.first_refused}")
    if summary.repeated_rows:
        texts.append(f"{summary.repeated_rows:,} finished row(s) repeat a row read before them (appended twice, by "
                     "hand or by a restored copy): no figure below counts them, as --resume and trajectories.jsonl "
                     "count each prompt's finished row once.")
    return "".join(f'<p class="notice">{text(notice)}</p>' for notice in texts)


@dataclass(frozen=True)
class Plots:
    """The page's figures (SVG text by name; None without matplotlib) and what they were drawn from.
    They need only the rows and the distribution, so a run has them drawn while it ends."""

    svg: dict[str, str] | None
    distribution: str
    rows: int


def draw_plots(summary: RunSummary, distribution: str) -> Plots:
    expected = expected_toolset_shares(distribution) if distribution else None
    return Plots(draw(summary, expected, distribution), distribution, summary.row_count)


def render(run_dir: Path, summary: RunSummary, sample: TrajectorySample, drawn: Plots | None = None) -> str:
    """The whole page as text; ``drawn`` plots are used if they show these rows and distribution."""
    info = {**read_json(run_dir / CHECKPOINT), **read_json(run_dir / STATISTICS)}
    named = info.get("distribution")
    distribution = clip_name(named) if isinstance(named, str) else ""     # the files may be edited by hand
    expected = expected_toolset_shares(distribution) if distribution else None
    if drawn is None or (drawn.distribution, drawn.rows) != (distribution, summary.row_count):
        drawn = draw_plots(summary, distribution)
    plots = drawn.svg
    shown = sample.chosen()
    missing = (NOTHING_TO_PLOT if plots is not None else
               PLOTS_HINT.format(**{key: text(value) for key, value in (
                   ("install", install_hint("report")), ("program", program()), ("run_name", run_dir.name))}))

    def plot(name: str) -> str:
        return _figure((plots or {}).get(name), missing)

    body = "".join([
        _header(run_dir, summary, info), _notices(summary),
        f'<div class="cards">{cards_html(summary, info)}</div>',
        '<div class="grid">',
        _section("Tool calls", plot("tools"), tool_table(summary),
                 "Calls per tool in kept trajectories; a failure is a result with an error "
                 "(a non-zero exit code is not)."),
        _section("Toolsets sampled", plot("toolsets"), toolset_table(summary, expected),
                 f"Share of kept trajectories that drew each toolset, against distribution '{distribution}', and "
                 "share whose model was offered its tools (a toolset with nothing available on the machine is "
                 "drawn but not offered)." if distribution else
                 "Share of kept trajectories that drew each toolset (no distribution recorded), and share whose "
                 "model was offered its tools."),
        _section("Reasoning", plot("reasoning"), reasoning_table(summary)),
        _section("Outcomes", plot("outcomes"), outcome_tables(summary),
                 "Every failed attempt leaves a row; a prompt counts as still failing until a later row "
                 "shows it done."),
        _section("Turns per trajectory", plot("turns"), ""),
        _section("Tokens and cost", plot("usage"), usage_table(summary)),
        _section("Throughput", plot("timeline"), "",
                 "Kept trajectories over time, from each row's timestamp (failed and discarded rows carry none)."),
        "</div>",
        f'<section class="panel browser-panel"><h2>Trajectories</h2>'
        f'<p class="muted">{text(_sample_note(summary, sample, len(shown)))}</p>'
        '<div id="browser"></div></section>',
    ])
    data = json.dumps({"rows": shown, "total": summary.row_count}, ensure_ascii=False, separators=(",", ":"))
    # No text can close the script element; lone surrogates stay in the data as JSON escapes (JSON.parse
    # gives them back); the markup's texts show them as escapes (markup.text), and any the plots' SVG
    # carried becomes U+FFFD: either way the page can be written as UTF-8.
    values = {"TITLE": text(f"Run report · {run_dir.name}"),
              "BODY": _LONE_SURROGATE.sub("\ufffd", body),
              "DATA": _LONE_SURROGATE.sub(_json_escaped, data.replace("<", "\\u003c"))}
    template = resources.files("batchrun.report").joinpath("template.html").read_text(encoding="utf-8")
    return re.sub(r"\{\{(TITLE|BODY|DATA)\}\}", lambda m: values[m.group(1)], template)

