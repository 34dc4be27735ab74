"""Text the model, the endpoint or the dataset wrote, on the console: escaped, laid out as it is shown,
one line where it was meant to be one, bounded in length, and printed as written."""

from __future__ import annotations

import io
import json

import pytest
from conftest import endpoint_args, run_cli, write_dataset
from rich.cells import cell_len
from rich.console import Console

from batchrun import rows
from batchrun.console import RunConsole
from batchrun.console.layout import MAX_MESSAGE_CHARS
from batchrun.messages import Finished
from batchrun.stats import ThisRun

CLEAR_SCREEN = "\x1b[2J"


def recording(*, terminal: bool) -> Console:
    return Console(file=io.StringIO(), width=80, force_terminal=terminal, force_interactive=False)


def run_console(*, terminal: bool = False, verbose: bool = False) -> RunConsole:
    return RunConsole(lambda text: text, verbose=verbose, out=recording(terminal=terminal),
                      err=recording(terminal=terminal))


def written(console: RunConsole) -> str:
    return console.out.file.getvalue() + console.err.file.getvalue()


def finished(*, preview: str = "a prompt", error: str | None = None) -> Finished:
    status = rows.FAILED if error else rows.COMPLETED
    return Finished(prompt_index=0, unit=0, batch_num=0, status=status, row=b"", api_calls=1,
                    usage={"prompt_tokens": 1, "completion_tokens": 1, "cost": 0.0}, wall_time=0.1,
                    end_reason="final_answer", error=error, error_type="http_400" if error else None,
                    prompt_preview=preview, toolsets=("terminal",), tool_calls=())


def show_finished(console: RunConsole, outcome: Finished) -> None:
    console.start_progress(1, 0, ThisRun())
    console.prompt_finished(outcome)
    console.stop_progress()


# Words with an escape sequence in each: raw, each sequence measures 0 or 1 cell; shown, 7.
HOSTILE_WORDS = " ".join(f"word{CLEAR_SCREEN}{n}" for n in range(40))

SURFACES = {
    "prompt preview": lambda console: show_finished(console, finished(preview=HOSTILE_WORDS)),
    "error under a failed prompt": lambda console: show_finished(console, finished(error=HOSTILE_WORDS)),
    "prose line": lambda console: console.print(f"calls invented tool(s) {HOSTILE_WORDS}"),
}


@pytest.mark.parametrize("surface", SURFACES)
def test_escaped_control_characters_are_measured_as_shown_so_lines_fit_80_columns(surface):
    console = run_console()
    SURFACES[surface](console)
    printed = written(console).splitlines()
    assert "\\x1b[2J" in "".join(printed)
    assert max(cell_len(line) for line in printed) <= 80


FORGED = "x\nBATCH PROCESSING COMPLETE"


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "log file"])
@pytest.mark.parametrize("method", ["print", "warn"])
def test_a_newline_in_untrusted_text_does_not_start_a_line_of_its_own(method, terminal):
    console = run_console(terminal=terminal)
    getattr(console, method)(f"calls invented tool(s) {FORGED}")
    printed = written(console)
    assert not any(line.startswith("BATCH") for line in printed.splitlines())
    assert "x\\x0aBATCH PROCESSING COMPLETE" in printed


# Left raw before: the line and paragraph separators, which some terminals and every log viewer break a
# line at, and the directional marks, which reorder the neutral characters around them.
@pytest.mark.parametrize("mark", ["\u2028", "\u2029", "\u200e", "\u200f", "\u061c"])
def test_separators_and_directional_marks_in_untrusted_text_are_shown_escaped(mark):
    console = run_console()
    console.print(f"calls invented tool(s) a{mark}b")
    printed = written(console)
    assert mark not in printed and f"a\\u{ord(mark):04x}b" in printed


@pytest.mark.parametrize("method", ["print", "warn", "error"])
def test_a_huge_message_keeps_its_start_and_end_and_says_how_much_was_left_out(method):
    console = run_console()
    getattr(console, method)("start " + "N" * 1_000_000 + " end")
    printed = written(console)
    assert len(printed) < 2 * MAX_MESSAGE_CHARS
    assert "start" in printed and printed.rstrip().endswith("end")
    assert "characters left out" in printed


def test_a_huge_traceback_under_verbose_is_bounded_too():
    console = run_console(verbose=True)
    show_finished(console, finished(error="Traceback (most recent call last):\n" + "x" * 1_000_000))
    assert len(written(console)) < 2 * MAX_MESSAGE_CHARS


@pytest.mark.parametrize("method", ["warn", "error"])
def test_emoji_codes_and_markup_in_a_message_are_printed_as_written(method):
    console = run_console()
    getattr(console, method)("the endpoint said :skull: [bold]no[/bold]")
    assert ":skull: [bold]no[/bold]" in written(console)


def invented_tool_reply(name: str) -> dict:
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": "{}"}}
    message = {"role": "assistant", "content": "", "reasoning": "r", "tool_calls": [call]}
    return {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": message}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1}}


def test_a_100_kb_tool_name_the_model_invents_is_not_printed_whole(tmp_path, endpoint):
    name = "N" * 100_000
    endpoint.script = lambda body: (200, invented_tool_reply(name), {})
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["any prompt"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=5", "--run_name=run",
                     "--distribution=terminal_only", *endpoint_args(endpoint))
    assert result.returncode == 0, result.stderr
    assert "left out of trajectories.jsonl" in result.stdout
    assert len(result.stdout + result.stderr) < 20_000
    assert json.dumps(name) not in result.stdout
