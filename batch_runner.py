"""batch_runner: run a tool-using LLM agent over a JSONL dataset and write ShareGPT trajectories.

    python batch_runner.py --dataset_file=data/example.jsonl --batch_size=5 --run_name=example

This module is the command line: the flags (declared in batchrun/flags.py), --help, and which command runs —
a listing, --report, --export, or a run (batchrun/runner.py). Data flows one way: dataset -> planned tasks
(prompt + sampled toolsets) -> sessions in worker processes -> rows -> the parent's single writer -> batch
files / checkpoint -> merge -> trajectories.jsonl + statistics.json. See README.md for every flag.
"""

from __future__ import annotations

import io
import itertools
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn

from batchrun import stop_signals

# The imports below take about half a second; Ctrl-C meanwhile ends in one line, not an import's traceback.
# Only where this file is the program (run by path, or as the installed `batch_runner`), never where
# another program imports it.
if __name__ == "__main__" or Path(sys.argv[0]).name == "batch_runner":
    stop_signals.end_quietly_while_loading()

# isort: split
import fire

import model_tools
import toolset_distributions
from batchrun import flags, report
from batchrun.config import build_config
from batchrun.console import RunConsole
from batchrun.console.layout import shown_block
from batchrun.console.streams import OutputStream
from batchrun.dataset import DatasetError, require_valid_prompt
from batchrun.environments import ENVIRONMENT_KINDS
from batchrun.export import (
    BEST_OF_RULES,
    EXPORT_FORMATS,
    REASONING_MODES,
    ExportError,
    ExportOptions,
    export_options,
    export_run,
)
from batchrun.flag_values import UsageError, boolean, validate_run_name
from batchrun.install_hint import program
from batchrun.run_dir import RunDirectoryError, WriteFailed, require_readable, write_failure_named, write_refusal_remedy
from batchrun.runner import EXIT_ERROR, EXIT_OK, BatchRunner
from batchrun.security import Redactor, shown_unless_a_key
from batchrun.stop_signals import STOP_SIGNALS, Interrupted, interrupts_unwrapped, stopped_line


# Fire reads every value as a Python literal, so `--ephemeral_system_prompt="Hello, world"` arrives as
# ('Hello', 'world') and `--run_name=1_000` as 1000; for the free-text flags the text as typed is what counts.
def _typed_text_values(argv: list[str]) -> dict[str, str]:
    """`--name=value` / `--name value` of the free-text flags, exactly as given on the command line."""
    named, _words = _split_arguments(argv)
    return {name: value for name, value in named.items() if name in flags.TEXT_FLAGS and value is not None}


def _split_arguments(argv: list[str]) -> tuple[dict[str, str | None], list[str]]:
    """The command line as fire splits it: each flag's value as typed (None for a switch given bare), and
    the words no flag took, in order. As fire, a flag takes the next word for its value unless that word is
    a flag too: "--" or "-" and a letter starts one, so "-5" or "-0x10" is a value."""
    named: dict[str, str | None] = {}
    words: list[str] = []
    position = 0
    while position < len(argv):
        argument = argv[position]
        if argument == "--":
            break
        if _is_flag(argument):
            name, equals, value = argument.lstrip("-").partition("=")
            if not equals and position + 1 < len(argv) and not _is_flag(argv[position + 1]):
                position += 1
                value, equals = argv[position], "="
            named[name.replace("-", "_")] = value if equals else None
        else:
            words.append(argument)
        position += 1
    return named, words


def _is_flag(argument: str) -> bool:
    return argument.startswith("--") or re.match(r"-[A-Za-z]", argument) is not None


def _misplaced_word(argv: list[str]) -> tuple[str, str] | None:
    """(word, flag) for the first word without a flag that fire would take as a flag given by place after
    one given by name: fire fills the first place no flag named, however far down the table, so an
    unquoted value's second word silently became the API key. Words in the first places, the reference
    runner's `FILE N NAME`, are the flags they stand for."""
    named, words = _split_arguments(argv)
    by_name = {name[2:] if name not in flags.BY_NAME and name.startswith("no") and value is None else name
               for name, value in named.items()}
    open_places = [name for name in flags.NAMES if name not in by_name]
    for word, place, in_order in zip(words, open_places, flags.NAMES, strict=False):
        if place != in_order:
            return word, place
    return None


def _stray_word_refusal(argv: list[str], word: str, place: str) -> str:
    """The one line refusing a word without a flag. A word that may be the API key (one in the key's place,
    or one after an empty "--api_key=", a space typed after the "=") is shown only by its start: the
    redactor knows the key the run was given, not one pasted by mistake."""
    after_empty_key = any(before in ("--api_key=", "--api-key=") and after == word
                          for before, after in itertools.pairwise(argv))
    shown = shown_unless_a_key(word) if after_empty_key or place == "api_key" else repr(word)
    if after_empty_key:
        return f"--api_key= is empty and the word after it, {shown}, comes without a flag: write --api_key=KEY " \
               "with no space after the \"=\""
    return (f"{shown} comes without a flag, and would be taken as --{place}: write --{place}=VALUE if that is what "
            "it is, or quote a value that holds spaces (--name=\"two words\")")


def main(*args: Any, **kwargs: Any) -> None:
    """Run an agent over every prompt of DATASET_FILE and write data/RUN_NAME/: README.md; every flag in
    docs/command-line.md, or --help. Fire reads the flags by the signature batchrun/flags.py makes, and
    a Python caller passes them as that signature says."""
    STOP_SIGNALS.install()
    bound = _SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    unknown_flags = bound.arguments.pop("unknown_flags")
    given = dict(bound.arguments)
    for name, typed in _typed_text_values(sys.argv[1:]).items():
        if not isinstance(given[name], str):     # None too: "--run_name=None" is a name, not "not given"
            given[name] = typed
    try:
        code = run_cli(given, unknown_flags)
    except Exception:
        # A bug: its traceback, then the exit every command takes. Interpreter teardown would SIGTERM
        # the helper processes still running and wait for them, but they outlive SIGTERM (the parent
        # stops them, see stop_signals); they end by themselves once this process is gone. The
        # traceback's text may hold what a model or an endpoint wrote, and a secret: shown as every line.
        redact = Redactor.from_environment(str(given.get("api_key") or ""))
        print(shown_block(redact(traceback.format_exc())), end="", file=sys.stderr)
        code = EXIT_ERROR
    # Everything is said and the exit code decided: a stop signal while the process exits changes neither
    # (a run marks this itself, at its last line; a listing, a report or an export here).
    STOP_SIGNALS.ended()
    exit_without_teardown(code)


_SIGNATURE = flags.signature()
main.__signature__ = _SIGNATURE     # type: ignore[attr-defined]


def exit_without_teardown(code: int) -> NoReturn:
    """Exit once everything is written, synced and closed. What a normal exit would do next is tear
    down the module graph of openai, pydantic and matplotlib object by object: 0.3-0.45 s on this
    machine, at the end of every run, for nothing anyone keeps."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_cli(given: dict[str, Any], unknown_flags: dict[str, Any]) -> int:
    """One command: a listing, a report, an export, or a run; its exit code. A stop signal (Ctrl-C,
    SIGTERM) that interrupts it ends it with one line and the signal's exit code, never a traceback."""
    redact = Redactor.from_environment(str(given.get("api_key") or ""))
    console = RunConsole(redact, verbose=bool(given.get("verbose")))
    try:
        with interrupts_unwrapped():
            return _run_command(given, unknown_flags, console)
    except Interrupted as exc:     # a listing, a report or an export: nothing to resume
        console.print(stopped_line(exc.signum, resume=False), style="yellow")
        return exc.exit_code


def _umask() -> int:
    """This process's umask (set back at once: nothing else runs yet)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _working_directory_gone() -> bool:
    """Whether the directory this process started in no longer exists: every run, report and export reads
    or writes data/RUN_NAME there."""
    try:
        os.getcwd()
    except FileNotFoundError:
        return True
    return False


def _run_command(given: dict[str, Any], unknown_flags: dict[str, Any], console: RunConsole) -> int:
    if unknown_flags:
        import difflib
        name = next(iter(unknown_flags))
        close = difflib.get_close_matches(name, flags.NAMES, n=1)
        hint = f" — did you mean --{close[0]}?" if close else f" — {program()} --help lists the main ones"
        console.error(f"unknown flag --{name}{hint}")
        return EXIT_ERROR
    if stray := _misplaced_word(sys.argv[1:]):
        console.error(_stray_word_refusal(sys.argv[1:], *stray))
        return EXIT_ERROR
    try:     # modes: a value that is neither True nor False is no reason to start a run instead
        listing, reporting = (boolean(name, given[name]) for name in ("list_distributions", "report"))
    except UsageError as exc:
        console.error(str(exc))
        return EXIT_ERROR
    if listing:
        list_distributions(console)
        return EXIT_OK
    if (umask := _umask()) & 0o700:
        console.error(f"the umask ({umask:04o}) takes from the owner the permissions it masks on everything this "
                      "command makes (the run directory, the sandboxes' directories, a report, an export), so it "
                      "could not use them: set one that leaves the owner's, such as umask 022 or umask 077, and "
                      "run the command again")
        return EXIT_ERROR
    if _working_directory_gone():
        console.error("the working directory was removed after this command's shell entered it, and data/ is made "
                      "there: cd to a directory that exists and run the command again")
        return EXIT_ERROR
    if reporting:
        return write_report_cli(given["run_name"], console)
    if given["export"] is not None:
        return export_cli(given, console)
    if misplaced := flags.options_set_without_export(given):
        console.error(f"--{misplaced[0]} applies only with --export=FORMAT")
        return EXIT_ERROR
    try:
        with interrupts_unwrapped():
            return run_batch(given, console)
    except Interrupted as exc:
        console.print(stopped_line(exc.signum), style="yellow")
        return exc.exit_code


def run_batch(given: dict[str, Any], console: RunConsole) -> int:
    """A run: its config, a first check of the dataset, then the run itself (batchrun/runner.py)."""
    try:
        config = build_config(**given)
    except UsageError as exc:
        console.error(str(exc))
        return EXIT_ERROR
    try:
        require_valid_prompt(config.dataset_file, warn=console.warn)   # before data/<run_name>/ exists
    except DatasetError as exc:
        console.error(str(exc))
        return EXIT_ERROR
    console.redact = Redactor.from_environment(config.endpoint.api_key)
    console.verbose = config.console.verbose
    return BatchRunner(config, console).run()


def list_distributions(console: RunConsole) -> None:
    """--list_distributions: every distribution, each toolset marked where this machine cannot offer it
    now, then what would enable the tools missing (as the start-up summary says it)."""
    unavailable = model_tools.unavailable_tools()
    listing = toolset_distributions.format_distributions(
        lambda entry: model_tools.unavailable_note(toolset_distributions.entry_members(entry), unavailable))
    console.out.print(listing, markup=False, highlight=False)
    for line in model_tools.unavailable_lines(unavailable):
        console.print(f"unavailable: {line}")


def write_report_cli(run_name: Any, console: RunConsole) -> int:
    """--report: needs only the run directory (no dataset, no key), so it works during a run too."""
    try:
        run_dir = Path("data") / validate_run_name("run_name", run_name)
    except UsageError as exc:
        console.error(str(exc))
        return EXIT_ERROR
    try:
        require_readable(run_dir, "--report")
        path = report.write_report(run_dir)
    except WriteFailed as exc:
        console.error(f"{exc}. The report there is kept as it was. {exc.remedy}, then run --report again.")
        return EXIT_ERROR
    except RunDirectoryError as exc:    # no run directory to read, or a batch file that cannot be read
        console.error(str(exc))
        return EXIT_ERROR
    except OSError as exc:
        if (remedy := write_refusal_remedy(exc)) is None:
            raise
        console.error(f"cannot write the report in {run_dir}: {exc.strerror} ({exc.filename}). The report "
                      f"there is kept as it was; run --report {remedy}.")
        return EXIT_ERROR
    console.print(f"Report: {path} (open it in a browser; it needs no network)")
    return EXIT_OK


def export_cli(given: dict[str, Any], console: RunConsole) -> int:
    """--export: like --report, needs only the run directory, so it works during a run too."""
    options = None
    try:
        options = export_options(run_name=given["run_name"], discard_no_reasoning=given["discard_no_reasoning"],
                                 **{name: given[name] for name in flags.EXPORT_OPTIONS})
        with write_failure_named(options.out):
            summary = export_run(options, waiting=lambda folder: console.print(
                f"another export is writing in {folder}/; this one waits for it to end"))
    except (UsageError, ExportError) as exc:
        console.error(str(exc))
        return EXIT_ERROR
    except WriteFailed as exc:
        console.error(f"{exc}. The file there is kept as it was. {exc.remedy}, then export again.")
        return EXIT_ERROR
    except RunDirectoryError as exc:    # no run directory to read, or a batch file that cannot be read
        console.error(str(exc))
        return EXIT_ERROR
    except PermissionError as exc:
        console.error(f"cannot write {_written(exc, options)}: Permission denied. Choose an --out where this user "
                      "may write.")
        return EXIT_ERROR
    except OSError as exc:     # a place no file can be made in (/proc, a read-only filesystem)
        console.error(f"cannot write {_written(exc, options)}: {exc.strerror or exc}. Choose another --out.")
        return EXIT_ERROR
    for line in summary.lines():
        console.print(line)
    return EXIT_OK


def _written(exc: OSError, options: ExportOptions | None) -> object:
    """The file an export failed to write: the error's, or --out (given or chosen) where it names none
    (pyarrow's)."""
    return exc.filename if exc.filename is not None or options is None else options.out


def escape_what_the_output_cannot_encode() -> None:
    """A character stdout's encoding lacks (PYTHONIOENCODING=ascii, a Latin-1 locale; "✅", "·", a
    prompt's "…") is printed as its escape, \\u2705, as stderr does by default: strict, the first
    one ended the run with a traceback."""
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")


def open_closed_standard_streams() -> None:
    """stdin, stdout or stderr closed (`>&-`) is /dev/null here: left closed, its descriptor went to
    the first file the run opened, its directory's lock, which every worker then inherited as that
    stream, and the end of a complete run flushed a stdout of None (a traceback, exit 1)."""
    for descriptor, name in enumerate(("stdin", "stdout", "stderr")):
        try:
            os.fstat(descriptor)
        except OSError:     # closed: the lowest free descriptor, which os.open takes, is this one
            os.open(os.devnull, os.O_RDWR)
        if getattr(sys, name) is None:
            setattr(sys, name, open(descriptor, "r" if name == "stdin" else "w", closefd=False))


def cli() -> None:
    open_closed_standard_streams()
    escape_what_the_output_cannot_encode()
    sys.stdout, sys.stderr = OutputStream(sys.stdout, "stdout"), OutputStream(sys.stderr, "stderr")
    arguments = sys.argv[1:]
    asked = arguments[:arguments.index("--")] if "--" in arguments else arguments
    if not arguments or "--help" in asked or "-h" in asked:
        choices = {"formats": "|".join(EXPORT_FORMATS), "kinds": "|".join(ENVIRONMENT_KINDS),
                   "reasoning_modes": "|".join(REASONING_MODES), "best_of_rules": "|".join(BEST_OF_RULES)}
        print(flags.help_page(program=program(), choices=choices))
        exit_without_teardown(EXIT_OK)
    fire.Fire(main)


if __name__ == "__main__":
    cli()
