"""--estimate: run a sample of the dataset, then project what the rest will cost and how long it will take.

The sample is drawn across the dataset (every k-th pending sample, in dataset order, from a random
start), so that a dataset sorted by length or topic is sampled from end to end, however many samples
each prompt has. Tokens and cost are projected with the prompt's
length as a helper (a regression estimator: what a sample used, corrected by how much longer or shorter
the remaining prompts are than the sampled ones), since longer prompts cost more; wall time per sample and
model calls and the duration by their means. Each interval is the 10th to 90th percentile of the projection
over bootstrap resamples of the sample: it says how sure the estimate is, given what the sample saw.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from batchrun.concurrency import ConcurrencyFigures

DEFAULT_SAMPLE = 20
BOOTSTRAP_ROUNDS = 2000
# Each round redraws the sample: a large one (a whole dataset run under --estimate) gets fewer rounds, never
# fewer than keep the percentiles steady, and past LARGEST_RESAMPLE fewer draws than it has samples, so that
# the end of its run does not take minutes here.
BOOTSTRAP_DRAWS = 1_000_000
FEWEST_ROUNDS = 200
LARGEST_RESAMPLE = BOOTSTRAP_DRAWS // FEWEST_ROUNDS
INTERVAL = (0.1, 0.9)            # the projection's 80% interval

T = TypeVar("T")

# A projection: "estimate", and "low" and "high", its interval (None from a single sample).
Projection = dict[str, float | None]


@dataclass(frozen=True)
class SampledRun:
    """What one sampled session used, and how long its prompt is."""

    prompt_chars: int
    tokens: int                  # prompt + completion
    cost: float
    model_calls: int
    tool_calls: int
    wall_time: float
    failed: bool                 # its row is a failure: --resume runs it again, so it is still to run


def chosen_units(units: Sequence[int], size: int, rng: random.Random) -> set[int]:
    """``size`` of ``units`` (in dataset order: DatasetPlan.pending_units_in_dataset_order), evenly spaced
    from a random start."""
    if size >= len(units):
        return set(units)
    step = len(units) / size
    start = rng.random() * step
    return {units[int(start + index * step)] for index in range(size)}


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and the 10th and 90th percentiles."""
    ordered = sorted(values)
    return {"median": round(statistics.median(ordered), 6), "p10": round(_quantile(ordered, 0.1), 6),
            "p90": round(_quantile(ordered, 0.9), 6)}


def _quantile(ordered: Sequence[float], fraction: float) -> float:
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def regression_total(xs: Sequence[float], ys: Sequence[float], count: int, x_total: float) -> float:
    """The total of y over ``count`` units whose x sum to ``x_total``, from a sample of (x, y): the
    sample's mean of y, moved along the least-squares slope to the units' mean x (the plain mean when x
    does not vary, or the sample is too small to fit a slope)."""
    if count == 0:
        return 0.0
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread_x = sum((x - mean_x) ** 2 for x in xs)
    slope = 0.0
    if len(xs) >= 3 and spread_x > 0:
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread_x
    return max(0.0, count * (mean_y + slope * (x_total / count - mean_x)))


def projected(xs: Sequence[float], ys: Sequence[float], count: int, x_total: float,
              rng: random.Random) -> Projection:
    """The regression total with its bootstrap interval."""
    estimate = regression_total(xs, ys, count, x_total)
    if count == 0:
        return _with_interval(estimate, [estimate], len(xs), digits=6)     # nothing to resample for

    def total(drawn: Sequence[tuple[float, float]]) -> float:
        return regression_total([x for x, _ in drawn], [y for _, y in drawn], count, x_total)
    return _with_interval(estimate, bootstrap(list(zip(xs, ys, strict=True)), total, rng), len(xs), digits=6)


def bootstrap_rounds(sampled: int) -> int:
    return max(FEWEST_ROUNDS, min(BOOTSTRAP_ROUNDS, BOOTSTRAP_DRAWS // max(1, min(sampled, LARGEST_RESAMPLE))))


def bootstrap(items: Sequence[T], statistic: Callable[[Sequence[T]], float], rng: random.Random) -> list[float]:
    """``statistic`` over bootstrap_rounds resamples of ``items``, each of at most LARGEST_RESAMPLE draws. Where
    it draws fewer than there are items, each value's distance from the statistic of all of them shrinks by
    the square root of the fraction drawn: a mean of fewer items spreads that much wider."""
    drawn = min(len(items), LARGEST_RESAMPLE)
    center, shrink = statistic(items), math.sqrt(drawn / len(items))
    return [center + (statistic([items[rng.randrange(len(items))] for _ in range(drawn)]) - center) * shrink
            for _ in range(bootstrap_rounds(len(items)))]


def _with_interval(estimate: float, resampled: list[float], sampled: int, *, digits: int) -> Projection:
    """The estimate, and the 10th to 90th percentile of its resampled values as its interval; none from a
    single sample, whose every resample is that sample: a range as wide as nothing would claim a
    certainty one sample cannot give."""
    if sampled < 2:
        return {"estimate": round(estimate, digits), "low": None, "high": None}
    resampled.sort()
    return {"estimate": round(estimate, digits), "low": round(_quantile(resampled, INTERVAL[0]), digits),
            "high": round(_quantile(resampled, INTERVAL[1]), digits)}


def _plus(figures: Projection, amount: float) -> Projection:
    return {key: None if value is None else round(value + amount, 6) for key, value in figures.items()}


def report_lines(report: dict) -> list[str]:
    """The estimate as the console prints it."""
    per, rest, whole = report["per_sample"], report["remaining"], report["whole_run"]

    def figure(name: str, unit: str = "") -> str:
        values = per[name]
        return f"{unit}{values['median']:,.4g} (80% between {unit}{values['p10']:,.4g} and {unit}{values['p90']:,.4g})"

    def shown(figures: Projection | None, text: Callable[[float], str]) -> str:
        if figures is None:
            return "unknown"
        if figures["low"] is None or figures["high"] is None:
            return f"{text(figures['estimate'] or 0)} (no range from one sample)"
        return f"{text(figures['estimate'] or 0)} ({text(figures['low'])} to {text(figures['high'])})"

    def tokens(figures: Projection | None) -> str:
        return shown(figures, lambda value: f"{value:,.0f}")

    def cost(figures: Projection | None) -> str:
        # Four decimals, as the live line shows cost: a small projection is not rounded to $0.00.
        return shown(figures, lambda value: f"${value:,.4f}")

    sampled = report["sampled"]
    lines = [f"Estimate from {sampled} sample{'s' if sampled != 1 else ''} drawn across the dataset "
             "(their rows are kept):",
             *([f"  {report['sampled_failed']} of them failed: --resume runs them again, among the other samples"]
               if report["sampled_failed"] else []),
             "  per sample: " + (f"tokens {figure('tokens')}, " if per["tokens"] is not None else "")
             + f"model calls {figure('model_calls')}, "
             f"tool calls {figure('tool_calls')}, wall time {figure('wall_time_seconds')} s"
             + (f", cost {figure('cost', '$')}" if per["cost"] is not None else "")]
    if rest["samples"]:
        duration = rest["duration_seconds"]
        lines += [f"  the other {rest['samples']:,} samples: tokens {tokens(rest['tokens'])}, "
                  f"cost {cost(rest['cost'])}",
                  f"  whole run: tokens {tokens(whole['tokens'])}, cost {cost(whole['cost'])}",
                  f"  duration: {shown(duration, _clock)} at {rest['samples_per_second']:.2f} samples/s, bounded by "
                  f"{rest['bounds'][rest['bounded_by']]['why']}"]
    if report["tokens_unknown_replies"]:
        lines.append(f"  tokens unknown: {report['tokens_unknown_replies']} replies reported no usage "
                     "(nor can a price cost them)")
    if report["cost_unknown_replies"]:
        lines.append(f"  cost unknown: {report['cost_unknown_replies']} replies had no price (--price_per_mtok)")
    lines.append(f"  ranges: {report['interval']}")
    return lines


def _clock(seconds: float) -> str:
    whole = int(round(seconds))
    return f"{whole // 3600}:{whole // 60 % 60:02d}:{whole % 60:02d}"


def throughput_bounds(runs: Sequence[SampledRun], *, sessions: int, requests_per_minute: int | None,
                      concurrency: ConcurrencyFigures | None) -> dict[str, dict]:
    """Samples per second that each limit allows, with what sets it."""
    mean_wall = max(statistics.fmean(run.wall_time for run in runs), 1e-6)
    mean_calls = max(statistics.fmean(run.model_calls for run in runs), 1e-6)
    bounds = {"sessions": {"per_second": sessions / mean_wall,
                           "why": f"{sessions} sessions at once, {mean_wall:.2f} s per sample"}}
    if requests_per_minute:
        bounds["rate_limit"] = {"per_second": requests_per_minute / 60 / mean_calls,
                                "why": f"--requests_per_minute={requests_per_minute}, {mean_calls:.2f} model "
                                       "calls per sample"}
    if concurrency is not None and concurrency.rate_limited:
        # The endpoint pushed back: it takes about what adaptive concurrency settled on.
        bounds["endpoint"] = {"per_second": concurrency.limit / mean_wall,
                              "why": f"the endpoint answered {concurrency.rate_limited} requests 429/503; adaptive "
                                     f"concurrency settled at {concurrency.limit} requests at once"}
    return bounds


def estimate_report(runs: Sequence[SampledRun], *, remaining: int, remaining_chars: int, sessions: int,
                    requests_per_minute: int | None, concurrency: ConcurrencyFigures | None,
                    tokenless_replies: int, unpriced_replies: int, spent_tokens: int, spent_cost: float,
                    rng: random.Random) -> dict:
    """estimate.json: the sample's figures per sample, and the projection for the ``remaining`` samples
    (those not run yet and the sample's failed ones, which --resume runs again). ``tokenless_replies`` and
    ``unpriced_replies``: the sample's replies that reported no usage, and those without a cost.
    ``spent_tokens`` and ``spent_cost``: what the run has used so far, earlier invocations and the sample
    included."""
    xs = [float(run.prompt_chars) for run in runs]
    sessions = max(1, min(sessions, remaining))
    bounds = throughput_bounds(runs, sessions=sessions, requests_per_minute=requests_per_minute,
                               concurrency=concurrency)
    limit = min(bounds, key=lambda name: bounds[name]["per_second"])
    rate = bounds[limit]["per_second"]

    def duration(drawn: Sequence[SampledRun]) -> float:
        found = throughput_bounds(drawn, sessions=sessions, requests_per_minute=requests_per_minute,
                                  concurrency=concurrency)
        return remaining / min(bound["per_second"] for bound in found.values())

    durations = bootstrap(runs, duration, rng) if remaining else [0.0]
    # A reply that reported no usage counted 0 tokens, and one without a price $0: a projection of either
    # would be too low by an amount nothing tells.
    tokens_known, cost_known = tokenless_replies == 0, unpriced_replies == 0
    tokens = (projected(xs, [float(run.tokens) for run in runs], remaining, remaining_chars, rng) if tokens_known
              else None)
    cost = projected(xs, [run.cost for run in runs], remaining, remaining_chars, rng) if cost_known else None
    return {
        "sampled": len(runs),
        "sampled_failed": sum(run.failed for run in runs),
        "per_sample": {"tokens": spread([run.tokens for run in runs]) if tokens_known else None,
                       "model_calls": spread([run.model_calls for run in runs]),
                       "tool_calls": spread([run.tool_calls for run in runs]),
                       "wall_time_seconds": spread([run.wall_time for run in runs]),
                       "cost": spread([run.cost for run in runs]) if cost_known else None},
        "remaining": {
            "samples": remaining,
            "tokens": tokens,
            "cost": cost,
            "model_calls": projected(xs, [float(run.model_calls) for run in runs], remaining, remaining_chars, rng),
            # At the rate the tightest limit allows.
            "duration_seconds": _with_interval(remaining / rate, durations, len(runs), digits=1),
            "samples_per_second": round(rate, 3),
            "bounded_by": limit,
            "bounds": {name: {"samples_per_second": round(bound["per_second"], 3), "why": bound["why"]}
                       for name, bound in bounds.items()},
        },
        # What the run has used so far (the sample, and earlier invocations on a resumed run) and the rest
        # together: what the whole run will have used.
        "whole_run": {"tokens": _plus(tokens, spent_tokens) if tokens is not None else None,
                      "cost": _plus(cost, spent_cost) if cost is not None else None},
        "tokens_unknown_replies": tokenless_replies,
        "cost_unknown_replies": unpriced_replies,
        "interval": (f"{int(INTERVAL[0] * 100)}th to {int(INTERVAL[1] * 100)}th percentile of "
                     f"{bootstrap_rounds(len(runs))} bootstrap resamples of the sample" if remaining
                     else "none: nothing is left to project"),
    }
