"""The run report's plots, drawn with matplotlib (the optional ``report`` extra) as inline SVG.

matplotlib is imported only here and only when a report is drawn, so runs never pay for it and the
report still renders its tables where it is not installed. Figures are built with
``matplotlib.figure.Figure`` directly (no pyplot): no global state, no GUI backend.
"""

from __future__ import annotations

import io
import json
import os
import re
import threading
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from batchrun.console.layout import shown

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.typing import RcKeyType

    from batchrun.report.summary import LogHistogram, RunSummary

GREEN, RED, BLUE, GREY, AMBER, PURPLE, ORANGE = ("#2f9e63", "#d9534f", "#3b73d1", "#aab3c2", "#e3a21a",
                                                  "#7b5cc4", "#e8743b")
STYLE: dict[RcKeyType, Any] = {
    "svg.fonttype": "none",          # real text: small, selectable, in the page's font
    "font.family": "sans-serif",
    "font.size": 9,
    "text.parse_math": False,        # '$' in an error type is text, not math
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.edgecolor": "#9aa4b2",
    "axes.titlesize": 10,
    "axes.titleweight": "bold",
    "axes.titlelocation": "left",
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.color": "#e6e9ef",
    "xtick.color": "#4a5568",
    "ytick.color": "#4a5568",
    "legend.frameon": False,
    "figure.facecolor": "white",
    "figure.constrained_layout.use": True,
}
WIDTH = 6.4                          # inches; the page scales every SVG to its column
_SVG_METADATA = dict.fromkeys(("Creator", "Date", "Format", "Type"))
_GROUP_ID = re.compile(r'<g id="[^"]*"')


def preload() -> None:
    """Load matplotlib and draw one tiny figure (its SVG backend, fonts and caches load on first use),
    so that a later :func:`draw` pays for the drawing alone. Nothing happens without matplotlib."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        return
    with matplotlib.rc_context(STYLE):
        figure = Figure(figsize=(1, 1))
        figure.subplots().bar(["warm-up"], [1], label="warm-up")
        figure.legend(loc="outside lower center")
        figure.savefig(io.StringIO(), format="svg")


def draw(summary: RunSummary, expected: dict[str, float] | None, distribution: str) -> dict[str, str] | None:
    """Every plot that has data, as SVG text by name; None when matplotlib is not installed."""
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        return None
    figures: dict[str, Callable[[], Figure | None]] = {
        "tools": lambda: _tools(Figure, summary),
        "toolsets": lambda: _toolsets(Figure, summary, expected, distribution),
        "reasoning": lambda: _reasoning(Figure, summary),
        "outcomes": lambda: _outcomes(Figure, summary),
        "turns": lambda: _turns(Figure, summary),
        "usage": lambda: _usage(Figure, summary),
        "timeline": lambda: _timeline(Figure, summary),
    }
    with matplotlib.rc_context(STYLE):
        return _draw_in_two_processes(matplotlib, figures)


def _draw_in_two_processes(matplotlib: Any, figures: dict[str, Callable[[], Figure | None]]) -> dict[str, str]:
    """Every other figure is drawn in a forked child meanwhile: drawing is pure Python, so one process
    draws on one core, and the end of a run waits for every figure. Not where another thread runs (a
    fork copies its locks in whatever state they are), nor without fork; a child that fails leaves its
    figures to us."""
    names = list(figures)
    if not hasattr(os, "fork") or threading.active_count() > 1:
        return _draw(matplotlib, figures, names)
    theirs, ours = names[::2], names[1::2]
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:
        status = 1
        try:
            os.close(read_fd)
            with os.fdopen(write_fd, "w", encoding="utf-8") as out:
                json.dump(_draw(matplotlib, figures, theirs), out)
            status = 0
        finally:
            os._exit(status)
    os.close(write_fd)
    try:
        drawn = _draw(matplotlib, figures, ours)
    finally:    # the child is reaped whatever happens here
        with os.fdopen(read_fd, encoding="utf-8") as source:
            sent = source.read()
        _, wait_status = os.waitpid(child, 0)
    drawn.update(json.loads(sent) if wait_status == 0 else _draw(matplotlib, figures, theirs))
    return {name: drawn[name] for name in names if name in drawn}


def _draw(matplotlib: Any, figures: dict[str, Callable[[], Figure | None]], names: list[str]) -> dict[str, str]:
    drawn = {}
    with warnings.catch_warnings():
        # matplotlib warns on stderr of each character its font lacks, quoting it raw (a name's ESC went
        # to the user's terminal), and a name in any script has some; the SVG holds the text itself, and
        # the page's fonts draw it.
        warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font")
        for name in names:
            figure = figures[name]()
            if figure is not None:
                drawn[name] = _svg(matplotlib, figure, name)
    return drawn


def _svg(matplotlib: Any, figure: Figure, name: str) -> str:
    """The figure as an <svg> element for inline use: no XML prolog, no date, ids unique per plot."""
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": name}):        # clip-path ids differ between plots
        figure.savefig(buffer, format="svg", metadata=_SVG_METADATA)
    text = buffer.getvalue()
    text = _GROUP_ID.sub("<g", text[text.index("<svg"):])      # matplotlib repeats figure_1, axes_1, ...
    return text.replace("<svg ", f'<svg class="chart" role="img" aria-label="{name} plot" ', 1)


def _counts_axis(axis: Any) -> None:
    """Ticks at whole numbers: there is no half of a call."""
    from matplotlib.ticker import MaxNLocator
    axis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))


def _bar_labels(axes: Axes, bars: Any, labels: list[str]) -> None:
    axes.bar_label(bars, labels=labels, padding=3, fontsize=8, color="#4a5568")


def _tools(Figure: type[Figure], summary: RunSummary) -> Figure | None:
    used = sorted(((n, e) for n, e in summary.tools.items() if e[0]), key=lambda item: item[1][0])
    if not used:
        return None
    names = [shown(n) for n, _ in used]
    success = [e[1] for _, e in used]
    failure = [e[2] for _, e in used]
    figure = Figure(figsize=(WIDTH, 0.9 + 0.32 * len(used)))
    axes = figure.subplots()
    axes.barh(names, success, color=GREEN, label="success")
    bars = axes.barh(names, failure, left=success, color=RED, label="failure")
    _bar_labels(axes, bars, [f"{f / (s + f):.0%} failed" if f else "" for s, f in zip(success, failure, strict=True)])
    axes.set_title("Tool calls by result")
    axes.set_xlabel("calls")
    _counts_axis(axes.xaxis)
    axes.grid(axis="y", visible=False)
    figure.legend(loc="outside lower center", ncols=2)
    axes.margins(x=0.15)
    return figure


def _toolsets(Figure: type[Figure], summary: RunSummary, expected: dict[str, float] | None,
              distribution: str) -> Figure | None:
    if not summary.toolset_rows:
        return None
    names = list(dict.fromkeys([*(expected or {}), *sorted(summary.toolsets)]))[::-1]
    observed = [100 * summary.toolsets[n] / summary.toolset_rows for n in names]
    positions = range(len(names))
    figure = Figure(figsize=(WIDTH, 1.0 + 0.42 * len(names)))
    axes = figure.subplots()
    height = 0.4 if expected else 0.6
    bars = axes.barh([p + (height / 2 if expected else 0) for p in positions], observed, height, color=BLUE,
                     label=f"sampled ({summary.toolset_rows:,} trajectories)")
    _bar_labels(axes, bars, [f"{v:.0f}%" for v in observed])
    if expected:
        axes.barh([p - height / 2 for p in positions], [100 * expected.get(n, 0) for n in names], height,
                  color=GREY, label=f"expected from '{shown(distribution)}'")
    axes.set_yticks(list(positions), [shown(n) for n in names])
    axes.set_xlim(0, 112)
    axes.set_xlabel("% of trajectories offered the toolset")
    axes.set_title("Toolsets: sampled vs distribution")
    axes.grid(axis="y", visible=False)
    figure.legend(loc="outside lower center", ncols=2)
    return figure


def _stacked_share(axes: Axes, row: str, parts: list[tuple[str, int, str]]) -> None:
    """One 100% bar made of labelled parts; a part wide enough shows its share inside."""
    total = sum(count for _, count, _ in parts) or 1
    left = 0.0
    for label, count, color in parts:
        if not count:
            continue
        share = 100 * count / total
        bars = axes.barh([row], [share], left=left, color=color, label=label)
        if share >= 8:
            axes.bar_label(bars, labels=[f"{share:.0f}%"], label_type="center", color="white", fontsize=8)
        left += share


def _reasoning(Figure: type[Figure], summary: RunSummary) -> Figure | None:
    turns = summary.turns_with_reasoning + summary.turns_without_reasoning
    if not turns and not summary.trajectory_reasoning:
        return None
    figure = Figure(figsize=(WIDTH, 2.4))
    axes = figure.subplots()
    kinds = summary.trajectory_reasoning
    _stacked_share(axes, "trajectories", [("reasoning in all turns", kinds["all turns"], PURPLE),
                                          ("in some turns", kinds["some turns"], "#a994e0"),
                                          ("in no turn", kinds["no turn"], AMBER),
                                          ("none: discarded", kinds["none (discarded)"], GREY)])
    _stacked_share(axes, "assistant turns", [("turn with reasoning", summary.turns_with_reasoning, "#5b3fb0"),
                                             ("turn without", summary.turns_without_reasoning, "#f0c96a")])
    axes.set_xlim(0, 100)
    axes.set_xlabel("%")
    axes.set_title("Reasoning coverage")
    axes.grid(False)
    figure.legend(loc="outside lower center", ncols=3, fontsize=8)
    return figure


def _outcomes(Figure: type[Figure], summary: RunSummary) -> Figure | None:
    bars = [(f"kept · {shown(reason)}", count, GREEN if reason == "final_answer" else AMBER)
            for reason, count in summary.end_reasons.most_common()]
    bars += [("corrupted · invented tools", summary.statuses["corrupted"], ORANGE)] \
        if summary.statuses["corrupted"] else []
    bars += [(f"discarded · {shown(reason)}", count, GREY) for reason, count in summary.discard_reasons.most_common()]
    bars += [(f"failed · {shown(cause)}", count, RED) for cause, count in summary.failure_causes.most_common(12)]
    if not bars:
        return None
    bars.reverse()
    figure = Figure(figsize=(WIDTH, 0.9 + 0.3 * len(bars)))
    axes = figure.subplots()
    drawn = axes.barh([label for label, _, _ in bars], [count for _, count, _ in bars],
                      color=[color for _, _, color in bars])
    _bar_labels(axes, drawn, [f"{count:,} ({count / summary.row_count:.0%})" for _, count, _ in bars])
    axes.set_title("How sessions ended")
    axes.set_xlabel("rows")
    _counts_axis(axes.xaxis)
    axes.grid(axis="y", visible=False)
    axes.margins(x=0.18)
    return figure


def _turns(Figure: type[Figure], summary: RunSummary) -> Figure | None:
    if not summary.turns:
        return None
    figure = Figure(figsize=(WIDTH, 2.6))
    axes = figure.subplots()
    counts = sorted(summary.turns.items())
    axes.bar([turns for turns, _ in counts], [n for _, n in counts], width=0.8, color=BLUE)
    axes.set_title("Assistant turns per kept trajectory")
    axes.set_xlabel("assistant turns (model calls)")
    axes.set_ylabel("trajectories")
    _counts_axis(axes.xaxis)
    _counts_axis(axes.yaxis)
    axes.grid(axis="x", visible=False)
    return figure


def _short(value: float) -> str:
    """1500 -> 1.5k, 2e6 -> 2M, 0.004 -> 0.004: compact labels without mathtext."""
    for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= size:
            return f"{value / size:.3g}{suffix}"
    return f"{value:.3g}"


def _log_histogram(axes: Axes, histogram: LogHistogram, title: str, unit: str, color: str) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    axes.set_title(title)
    if not histogram.bins:
        axes.text(0.5, 0.5, "not reported" if histogram.count else "no data", ha="center", va="center",
                  transform=axes.transAxes, color="#718096")
        axes.set_xticks([])
        axes.set_yticks([])
        return
    for index, count in histogram.bins.items():
        low, high = histogram.edges(index)
        axes.bar(low, count, width=high - low, align="edge", color=color)
    axes.set_xscale("log")
    axes.xaxis.set_major_locator(LogLocator(numticks=4))
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: _short(value)))   # no mathtext
    axes.xaxis.set_minor_formatter(NullFormatter())
    _counts_axis(axes.yaxis)
    zeros = f" · {histogram.zeros:,} at 0" if histogram.zeros else ""
    axes.set_xlabel(f"{unit}\nmean {_short(histogram.mean)}{zeros}")


def _usage(Figure: type[Figure], summary: RunSummary) -> Figure | None:
    if not summary.tokens.count:
        return None
    figure = Figure(figsize=(WIDTH, 2.5))
    tokens, cost, wall = figure.subplots(1, 3)
    _log_histogram(tokens, summary.tokens, "Tokens / trajectory", "prompt + completion", BLUE)
    _log_histogram(cost, summary.cost, "Cost / trajectory", "USD", GREEN)
    _log_histogram(wall, summary.wall_time, "Wall time / trajectory", "seconds", PURPLE)
    tokens.set_ylabel("trajectories")
    return figure


def _timeline(Figure: type[Figure], summary: RunSummary) -> Figure | None:
    points = summary.timeline.points()
    if not points:
        return None
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter
    step = timedelta(seconds=summary.timeline.width)
    times, kept, completed = [points[0][0]], [0], [0]       # a bucket's rows count once it has ended
    for start, done, partial in points:
        if start > times[-1]:                               # a pause (between invocations): flat, not a slope
            times.append(start)
            completed.append(completed[-1])
            kept.append(kept[-1])
        times.append(start + step)
        completed.append(completed[-1] + done)
        kept.append(kept[-1] + done + partial)
    figure = Figure(figsize=(WIDTH, 2.6))
    axes = figure.subplots()
    # matplotlib plots datetimes (through its unit converters), but its stubs admit only numbers for x.
    axes.fill_between(times, kept, color=AMBER, alpha=0.35,  # type: ignore[arg-type]
                      label="kept (completed + partial)")
    axes.plot(times, kept, color=AMBER)  # type: ignore[arg-type]
    axes.fill_between(times, completed, color=GREEN, alpha=0.45, label="completed")  # type: ignore[arg-type]
    axes.plot(times, completed, color=GREEN)  # type: ignore[arg-type]
    pad = max((times[-1] - times[0]) * 0.03, timedelta(seconds=5))   # a short run must not span years of axis
    axes.set_xlim(times[0] - pad, times[-1] + pad)  # type: ignore[arg-type]
    locator = AutoDateLocator()
    axes.xaxis.set_major_locator(locator)
    axes.xaxis.set_major_formatter(ConciseDateFormatter(locator))
    axes.set_ylim(bottom=0)
    _counts_axis(axes.yaxis)
    axes.set_ylabel("cumulative trajectories")
    axes.set_title("Trajectories over time" + (f" ({summary.timeline.width}s buckets)"
                                                 if summary.timeline.width > 1 else ""))
    axes.legend(loc="upper left")
    return figure
