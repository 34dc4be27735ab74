"""What one export was asked to do (ExportOptions), and the error for an export that cannot be done as
asked. Apart from the flags that build them (flags.py) so that the writers, the filters and the summary
can all read the options without depending on the table of formats that validation consults."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchrun.run_dir import line_number

# Where a turn's reasoning goes in a chat-message format: inline as the row's own think block, a
# `reasoning_content` field, or nowhere (the default: a model trained on OpenAI's format must not
# learn to print it).
REASONING_MODES = ("think", "field", "drop")


class ExportError(Exception):
    """The export cannot be done as asked (an --out it must not overwrite, a line of
    the run that is JSON but not a row); one line for the user."""


def refused_line(path: Path, offset: int, why: str) -> ExportError:
    """The one error for a line of the run the export cannot take (``why``: what it is, and to fix or remove
    it), named by file and line: as resume and the merge do, the export stops rather than leave it out."""
    return ExportError(f"{path} line {line_number(path, offset)}: {why}. The export stopped here rather than leave "
                       "the row out without a word.")


@dataclass(frozen=True)
class ExportOptions:
    format: str
    run_dir: Path
    out: Path
    reasoning: str = "drop"
    discard_no_reasoning: bool | None = None       # None: each row as the run decided (see filters.drop_reason)
    discard_invented: bool = True
    end_reasons: frozenset[str] | None = None      # None: every end reason
    min_tool_calls: int = 0
    last_call_succeeded: bool = False
    best_of: str | None = None                     # None: every sample (see best_of.BEST_OF_RULES)
