"""--export: a run's rows in the formats trainers load, filtered again without generating again.

Everything streams: rows are read line by line and written as they come (Parquet a row group at a
time), so memory stays bounded however many rows a run has. Every exported row can be traced to the
row it came from: its ``prompt_index`` and ``content_key``, in the row itself, or (``openai``, whose
lines hold only what OpenAI's format defines) in a manifest beside the file.

One job a module: flags.py (the flags -> ExportOptions, in options.py), conversations.py (rows back to
structured conversations), filters.py (which rows are kept), best_of.py (--best_of), formats.py (the
one table of formats), a writer per format family (openai_chat.py, sharegpt.py, arrow.py, on files.py),
summary.py (what the command prints) and run.py (export_run, which ties them together). A new format
is one EXPORT_FORMATS entry and its writer.
"""

from batchrun.export.arrow import arrow_schema
from batchrun.export.best_of import BEST_OF_RULES
from batchrun.export.conversations import conversation, layouts_of
from batchrun.export.flags import export_options
from batchrun.export.formats import EXPORT_FORMATS, FORMATS
from batchrun.export.openai_chat import manifest_path, openai_messages
from batchrun.export.options import REASONING_MODES, ExportError, ExportOptions
from batchrun.export.run import export_run

__all__ = [
    "BEST_OF_RULES", "EXPORT_FORMATS", "FORMATS", "REASONING_MODES",
    "ExportError", "ExportOptions",
    "arrow_schema", "conversation", "export_options", "export_run", "layouts_of",
    "manifest_path", "openai_messages",
]
