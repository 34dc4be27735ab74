"""Lines laid out for the width they will be read at (the terminal's, or 80 columns in a log file): figures
kept whole and moved to a continuation line when they do not fit, only free text (a prompt preview)
shortened, with an ellipsis. Widths are measured in cells, as rich draws them: an emoji takes two.
And :func:`shown`, which every line passes before it is written: no terminal control characters, and no
line break but those the runner writes."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterable

from rich.cells import cell_len
from rich.text import Text

PLAIN_WIDTH = 80              # a log file has no width of its own; lay it out for an 80-column reader
MIN_PREVIEW = 12              # with less room a preview stub says nothing; leave it out instead
SEPARATOR = " · "
INDENT = "    "               # continuation lines, and the detail lines under a prompt's line
MAX_MESSAGE_CHARS = 4_000     # 50 lines of 80 columns: more of what an endpoint or a model wrote tells nothing
# C0 controls but tab, DEL and C1 controls: what a terminal may take as a command, and the newline,
# with which a tool name or an error would start a line of its own ("BATCH PROCESSING COMPLETE"), and the
# line and paragraph separators, at which log viewers break lines too; the bidirectional embeddings,
# overrides, isolates and marks, which reorder how the rest of a line reads (an endpoint's error shown
# backwards up to the runner's advice after it); and lone surrogates, which no output encoding takes.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069"
                      r"\ud800-\udfff]")


def shown(text: str) -> str:
    r"""``text`` as one line, with its control characters written as escapes (``\x1b``, ``\x0a``,
    ``\u202e``), and lone surrogates too (``\udc80``). Prompts come from downloaded datasets and replies
    from the model: printed raw, ESC[2J would clear the screen and OSC 52 write the user's clipboard, and
    a lone surrogate, which JSON allows and UTF-8 cannot encode, would end the run at the print. Rich's
    markup escaping leaves them be. Escapes are longer than what they stand for: text is shown before it
    is measured for a line."""
    return _CONTROL.sub(_escape, text)


def shown_block(text: str) -> str:
    """``text`` as lines (an error's message and the advice under it, a traceback): its newlines kept,
    every line :func:`shown`."""
    return "\n".join(shown(line) for line in text.split("\n"))


def bounded(text: str) -> str:
    """``text``, or where it is longer than MAX_MESSAGE_CHARS its start and its end, saying how much was
    left out between them (the end of a message is often its advice). A model's 100 KB tool name quoted
    in a message would otherwise fill the screen and the log, and rich took minutes to lay out a line of
    a million characters."""
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    half = MAX_MESSAGE_CHARS // 2
    return f"{text[:half]} … ({len(text) - 2 * half:,} characters left out) … {text[-half:]}"


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def wrapped(text: str) -> list[str]:
    """``text`` in lines of at most PLAIN_WIDTH, continuation lines indented; words are never cut
    (a path or URL longer than a line stays whole)."""
    if len(text) <= PLAIN_WIDTH:
        return [text]
    return textwrap.wrap(text, PLAIN_WIDTH, subsequent_indent=INDENT, break_long_words=False,
                         break_on_hyphens=False) or [text]


def shortened(text: str, most: int) -> str:
    """``text`` cut to at most ``most`` characters at a word boundary, with an ellipsis."""
    if len(text) <= most:
        return text
    cut = text[:most - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut) + "…"


def one_line(text: str) -> str:
    return " ".join(text.split())


def pack(segments: Iterable[str], width: int, indent: str = INDENT) -> list[str]:
    """Join segments with " · ", going on to an indented line where the next segment would not fit.

    A segment is never split, so a figure is never cut in two; one longer than the width stands
    alone on its line.
    """
    lines: list[str] = []
    current = ""
    for segment in segments:
        if not current:
            current = (indent if lines else "") + segment
        elif cell_len(current + SEPARATOR + segment) <= width:
            current += SEPARATOR + segment
        else:
            lines.append(current)
            current = indent + segment
    if current:
        lines.append(current)
    return lines


def shorten(text: str, room: int) -> str:
    """At most ``room`` cells of text, an ellipsis marking a cut."""
    if cell_len(text) <= room:
        return text
    cut = Text(text)
    cut.truncate(room, overflow="ellipsis")
    return cut.plain


def append_tail(lines: list[str], tail: str, width: int) -> list[str]:
    """Free text after the last line's figures, shortened to the room left there (or left out)."""
    room = width - cell_len(lines[-1] + SEPARATOR)
    if tail and room >= MIN_PREVIEW:
        lines[-1] += SEPARATOR + shorten(tail, room)
    return lines


def label_column(entries: list[tuple[str, list[str]]]) -> int:
    """Where values start: after the longest label."""
    return max(cell_len(label) for label, _ in entries) + 3      # "label:" and two spaces


def labelled(entries: list[tuple[str, list[str]]], width: int, label_width: int) -> list[str]:
    """Label/value lines in two columns; a value's continuation lines stay in the value column."""
    lines = []
    for label, segments in entries:
        values = pack(segments, width - label_width, indent="")
        lines.append(f"{label}:".ljust(label_width) + values[0])
        lines.extend(" " * label_width + value for value in values[1:])
    return lines


def clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def usage_segments(usage: dict, unpriced: int = 0) -> list[str]:
    """Reasoning tokens are part of the completion, cached tokens part of the prompt. ``unpriced``:
    replies whose cost is unknown, which the cost then leaves out."""
    return [f"{usage['prompt_tokens']:,} prompt ({usage['cached_tokens']:,} cached)",
            f"{usage['completion_tokens']:,} completion ({usage['reasoning_tokens']:,} reasoning)",
            f"cost {cost_text(usage['cost'], unpriced)}"
            + (f" ({unpriced:,} repl{'ies' if unpriced != 1 else 'y'} without a price)" if unpriced else "")]


def cost_text(cost: float, unpriced: int) -> str:
    """A cost that leaves out replies without a price says so: unknown, or at least what is known."""
    if not unpriced:
        return f"${cost:.4f}"
    return f"≥ ${cost:.4f}" if cost else "unknown"
