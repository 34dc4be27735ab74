"""Every flag of the command line, declared once: its name, default, how --help shows it, and what its value
may be. ``batch_runner.main``'s signature, the --help page and the names a run, --report and --export accept
are made from this table; docs/command-line.md and the README are checked against it by the tests. A flag
not in the table is an unknown flag, said as an error, never dropped.

Adding a flag: one entry here, then its use (a field of a config part in batchrun/config.py, or an option of
--export), and its row in docs/command-line.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchrun.flag_values import (
    DEFAULT_MODEL,
    PROVIDER_SORTS,
    REASONING_EFFORTS,
    UsageError,
    boolean,
    choice,
    distribution_name,
    estimate_size,
    load_prefill,
    name_list,
    non_negative_int,
    optional_non_negative_int,
    optional_positive_int,
    optional_positive_number,
    optional_rate,
    optional_seconds,
    positive_int,
    positive_seconds,
    prices_per_mtok,
    required_batch_size,
    required_text,
    run_switch_on,
    samples_per_prompt,
    text,
    validate_backend,
    validate_base_url_given,
    validate_run_name,
)

Parse = Callable[[str, Any], Any]

# The --help page: its groups, and the flags each shows in the order it shows them (every flag with a usage
# line, once; tests/test_flags.py checks).
HELP_PAGE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("endpoint", ("model", "base_url", "api_key", "max_tokens", "reasoning_effort", "request_timeout", "max_retries")),
    ("run", ("num_workers", "resume", "max_samples", "seed", "verbose", "estimate", "samples_per_prompt", "backend",
             "report")),
    ("export", ("export", "out", "reasoning", "end_reasons", "min_tool_calls", "last_call_succeeded",
                "discard_invented", "discard_no_reasoning", "best_of")),
    ("tools", ("distribution", "max_turns")),
    ("limits", ("prompt_timeout", "tool_timeout", "command_timeout", "max_cost", "price_per_mtok", "max_total_tokens",
                "requests_per_minute", "adaptive_concurrency")),
)


@dataclass(frozen=True)
class Flag:
    name: str
    default: Any
    # How --help shows it ("--model=ID"); None keeps it off the one-screen page (docs/command-line.md has it).
    # {formats}, {kinds} and the like (the names of other tables) are filled in as the page is printed.
    usage: str | None
    # Fire's value -> the value the run uses, or a UsageError naming the flag. None: not a run's value (a
    # mode such as --report, or an option --export checks itself).
    parse: Parse | None = None
    # Free text: the value as typed counts, not Fire's reading of it as a Python literal.
    text: bool = False
    # Read only by --export: a run refuses it when set, as it would do nothing there.
    export_only: bool = False


# The table's order is main's positional order. Its first 23 flags are the Hermes runner's `main(...)`
# parameters in that runner's order (api_key before base_url), so that words given without a flag land
# where they land there; a key in the sixth place taken as --base_url was refused and shown in the error.
FLAGS: tuple[Flag, ...] = (
    Flag("dataset_file", None, None, required_text, text=True),
    Flag("batch_size", None, None, required_batch_size),
    Flag("run_name", None, None, validate_run_name, text=True),
    Flag("distribution", "default", "--distribution=NAME (--list_distributions shows them all)",
         distribution_name, text=True),
    Flag("model", DEFAULT_MODEL, "--model=ID", required_text, text=True),
    Flag("api_key", None, "--api_key=KEY (else OPENROUTER_API_KEY / OPENAI_API_KEY)", text,
         text=True),
    Flag("base_url", None, "--base_url=URL", validate_base_url_given, text=True),
    Flag("max_turns", 10, "--max_turns=N", positive_int),
    Flag("num_workers", 4, "--num_workers=N (sessions at once)", positive_int),
    Flag("resume", False, "--resume", boolean),
    Flag("verbose", False, "--verbose", boolean),
    Flag("list_distributions", False, None),
    Flag("ephemeral_system_prompt", None, None, text, text=True),
    Flag("log_prefix_chars", 100, None, non_negative_int),
    Flag("providers_allowed", None, None, name_list),
    Flag("providers_ignored", None, None, name_list),
    Flag("providers_order", None, None, name_list),
    Flag("provider_sort", None, None, lambda flag, value: choice(flag, value, PROVIDER_SORTS)),
    Flag("max_tokens", None, "--max_tokens=N", optional_positive_int),
    Flag("reasoning_effort", None, "--reasoning_effort=LEVEL",
         lambda flag, value: choice(flag, value, REASONING_EFFORTS)),
    Flag("reasoning_disabled", False, None, boolean),
    Flag("prefill_messages_file", None, None, load_prefill, text=True),
    Flag("max_samples", None, "--max_samples=N", optional_positive_int),
    Flag("seed", None, "--seed=N", optional_non_negative_int),
    Flag("discard_no_reasoning", None, "--discard_no_reasoning=False", run_switch_on),
    Flag("rerun_corrupted", False, None, boolean),
    Flag("max_retries", 6, "--max_retries=N", non_negative_int),
    Flag("request_timeout", 600, "--request_timeout=SECONDS", positive_seconds),
    Flag("prompt_timeout", None, "--prompt_timeout", optional_seconds),
    Flag("tool_timeout", 120, "--tool_timeout", positive_seconds),
    Flag("command_timeout", 60, "--command_timeout (seconds)", positive_seconds),
    Flag("keep_workdirs", False, None, boolean),
    Flag("requests_per_minute", None, "--requests_per_minute=N", optional_rate),
    Flag("max_cost", None, "--max_cost=USD", optional_positive_number),
    Flag("max_total_tokens", None, "--max_total_tokens=N", optional_positive_int),
    Flag("report", False, "--report (rewrite data/NAME/report.html and exit)"),
    Flag("backend", "local", "--backend=local|ray", validate_backend),
    Flag("adaptive_concurrency", True,
         "--adaptive_concurrency=False (requests at once stay at --num_workers, 429s or not)", boolean),
    Flag("samples_per_prompt", 1, "--samples_per_prompt=K (K rows per prompt)", samples_per_prompt),
    Flag("price_per_mtok", None, "--price_per_mtok=INPUT,OUTPUT[,CACHED] (prices replies that carry "
                                           "no cost)", prices_per_mtok),
    Flag("estimate", None, "--estimate[=N] (run N samples, project the cost and time of the rest, and "
                                  "stop)", estimate_size),
    Flag("export", None, "--export={formats} --run_name=NAME (write the rows for training and exit)"),
    Flag("out", None, "--out=PATH", text=True, export_only=True),
    Flag("reasoning", None, "--reasoning={reasoning_modes}", export_only=True),
    Flag("end_reasons", None, "--end_reasons=R,...", export_only=True),
    Flag("min_tool_calls", 0, "--min_tool_calls=N", export_only=True),
    Flag("last_call_succeeded", False, "--last_call_succeeded", export_only=True),
    Flag("discard_invented", True, "--discard_invented=False", export_only=True),
    Flag("best_of", None, "--best_of={best_of_rules} (one sample per prompt) (docs/export.md)",
         export_only=True),
)

BY_NAME: dict[str, Flag] = {flag.name: flag for flag in FLAGS}
NAMES: tuple[str, ...] = tuple(BY_NAME)
TEXT_FLAGS: tuple[str, ...] = tuple(flag.name for flag in FLAGS if flag.text)
# What --export reads besides --run_name and --discard_no_reasoning (which a run reads too).
EXPORT_OPTIONS: tuple[str, ...] = ("export", *(flag.name for flag in FLAGS if flag.export_only))

# Lines of the help page that are not flags: the environment variables that choose and limit the sandbox.
VARIABLE_LINES = {"tools": ("TERMINAL_ENV={kinds} (where commands run)",),
                  "limits": ("TERMINAL_MEMORY_MB, TERMINAL_MAX_PROCESSES, TERMINAL_TMP_MB, TERMINAL_WORKSPACE_MB,",
                             "TERMINAL_DISK_RESERVE_MB")}


def defaults() -> dict[str, Any]:
    """Every flag at its default: what a command line that sets none of them gives."""
    return {flag.name: flag.default for flag in FLAGS}


def signature() -> inspect.Signature:
    """``main``'s signature, for Fire: every flag a keyword (or positional, as the Hermes runner's were) with
    its default, then the rest as unknown flags, which the CLI names as an error."""
    return inspect.Signature(
        [inspect.Parameter(flag.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=flag.default)
         for flag in FLAGS]
        + [inspect.Parameter("unknown_flags", inspect.Parameter.VAR_KEYWORD)])


def run_values(given: dict[str, Any]) -> dict[str, Any]:
    """The run's value of every flag it reads, each checked by its table entry, in table order (the first
    bad one is the one reported)."""
    unknown = set(given) - set(NAMES)
    if unknown:
        raise UsageError(f"unknown flag --{sorted(unknown)[0]}")
    values = {**defaults(), **given}
    return {flag.name: flag.parse(flag.name, values[flag.name]) for flag in FLAGS if flag.parse is not None}


def options_set_without_export(given: dict[str, Any]) -> list[str]:
    """Export-only flags given a value on a command that exports nothing."""
    return [name for name in EXPORT_OPTIONS[1:] if given.get(name, BY_NAME[name].default) != BY_NAME[name].default]


def help_page(*, program: str, choices: dict[str, str]) -> str:
    """The one-screen --help page: each group's flags as HELP_PAGE orders them, wrapped; ``choices``
    fills in the values other tables hold ({formats}: the export formats, {kinds}: TERMINAL_ENV's...)."""
    lines = [f"usage: {program} --dataset_file=FILE --batch_size=N --run_name=NAME [options]", "",
             "Runs a tool-using agent over every prompt of FILE (JSONL, one {\"prompt\": ...} per line) and writes",
             "ShareGPT trajectories to data/NAME/ (trajectories.jsonl, batch_*.jsonl, statistics.json).", ""]
    for section, names in HELP_PAGE:
        shown = [str(BY_NAME[name].usage).format(**choices) for name in names]
        body = [*_packed(shown, width=97), *(line.format(**choices) for line in VARIABLE_LINES.get(section, ()))]
        lines += [f"{section if number == 0 else '':<11}{line}" for number, line in enumerate(body)]
    lines += ["", "Start with README.md; every flag, the row format and the environments: docs/ "
                  "(e.g. docs/command-line.md).",
              "Exit codes: 0 done, 2 some prompts failed (--resume retries them), 1 stopped, 130 Ctrl-C, 143 SIGTERM."]
    return "\n".join(lines)


def _packed(items: list[str], *, width: int) -> list[str]:
    """Items two spaces apart, as many to a line as fit; an item is never split."""
    lines: list[str] = []
    for item in items:
        if lines and len(lines[-1]) + 2 + len(item) <= width:
            lines[-1] += "  " + item
        else:
            lines.append(item)
    return lines
