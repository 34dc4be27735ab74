"""What an export says when it is done (ExportSummary): what was kept, in which format, and what was
left out, by reason."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from batchrun.export.best_of import BestOf
from batchrun.export.filters import DROP_REASONS
from batchrun.export.formats import EXPORT_FORMATS
from batchrun.export.options import ExportOptions

# How a chat-message format's summary says where the reasoning went (--reasoning).
REASONING_WORDS = {"think": "inline as <think> blocks", "field": "as reasoning_content",
                   "drop": "dropped (--reasoning=think or field keeps it)"}


@dataclass
class ExportSummary:
    options: ExportOptions
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)
    best_of: BestOf | None = None

    def lines(self) -> list[str]:
        options = self.options
        spec = EXPORT_FORMATS[options.format]
        described = (f"{spec.description}, reasoning {REASONING_WORDS[options.reasoning]}" if spec.chat_messages
                     else spec.description)
        total = self.kept + sum(self.dropped.values())
        lines = [f"exported {self.kept} of {total} rows of {options.run_dir}/ to {options.out}",
                 f"format: {described}"]
        if spec.manifest is not None:
            lines.append(f"manifest: {spec.manifest(options.out)} (the run row of each line)")
        if self.best_of is not None:
            lines += self.best_of.lines(options)
        if self.dropped:
            lines.append("left out:")
            width = max(len(str(count)) for count in self.dropped.values())
            name_width = max(len(reason) for reason in self.dropped)
            order = list(DROP_REASONS)
            for reason, count in sorted(self.dropped.items(),
                                        key=lambda item: order.index(item[0]) if item[0] in order else len(order)):
                lines.append(f"  {count:>{width}} {reason:<{name_width}}  "
                             f"{DROP_REASONS.get(reason, 'discarded by the run')}")
        return lines
