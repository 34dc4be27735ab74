"""The export formats, one entry each in EXPORT_FORMATS: everything the rest of the export asks of a
format. A new format is one entry here and its writer, a function of the options and the rows that
passed the filters."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from batchrun.export.arrow import write_hf, write_parquet
from batchrun.export.conversations import Candidate
from batchrun.export.openai_chat import manifest_path, write_openai
from batchrun.export.options import ExportOptions
from batchrun.export.sharegpt import write_sharegpt


@dataclass(frozen=True)
class ExportFormat:
    default_out: str                    # under the run directory, where --out is not given
    description: str                    # what the summary calls it
    write: Callable[[ExportOptions, Iterable[Candidate]], None]
    modules: tuple[str, ...] = ()       # what it needs of the optional ``export`` extra
    # Rows become chat messages: each must read back as a conversation that ends on an answer (strict
    # validators and chat templates refuse any other), and --reasoning says where reasoning goes.
    chat_messages: bool = False
    # For a format whose lines cannot name the run row they came from: where the file that does goes.
    manifest: Callable[[Path], Path] | None = None


# The run directory's folder for exports: the one place in it an --out may write.
EXPORT_FOLDER = "export"
# The order is the one the help page and error messages list them in.
EXPORT_FORMATS: dict[str, ExportFormat] = {
    "openai": ExportFormat(f"{EXPORT_FOLDER}/openai.jsonl", "OpenAI chat JSONL", write_openai, chat_messages=True,
                           manifest=manifest_path),
    "sharegpt": ExportFormat(f"{EXPORT_FOLDER}/sharegpt.jsonl", "ShareGPT JSONL", write_sharegpt),
    "parquet": ExportFormat(f"{EXPORT_FOLDER}/trajectories.parquet", "Parquet", write_parquet, modules=("pyarrow",)),
    "hf": ExportFormat(f"{EXPORT_FOLDER}/hf", "a datasets folder (load_from_disk)", write_hf,
                       modules=("pyarrow", "datasets")),
}
FORMATS = tuple(EXPORT_FORMATS)
