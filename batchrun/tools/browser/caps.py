"""What one browser result may hold: every text cut to a fixed size, the whole result too, and notes
saying what was cut.

A page chooses its title, URLs and texts (an AI snapshot of a big page runs to hundreds of kilobytes, a
script can make a title or an image URL megabytes long), so nothing it wrote reaches the model uncut.
Apart from the actions because the rules are one table that every action's result passes through.
"""

from __future__ import annotations

import json
import re
from typing import Any

# What one result may hold. Each text is cut to its limit, then the whole result, as the JSON the model
# reads, to RESULT_CHARS: images are dropped from the end of the list, then the snapshot is cut further.
SNAPSHOT_CHARS = 20_000
TITLE_CHARS = 500
URL_CHARS = 2_000             # the page's URL and each image's
ALT_CHARS = 300
TEXT_CHARS = 1_000            # any other text: a message, a note
RESULT_CHARS = 30_000
NOTES_CHARS = 1_000           # kept free in RESULT_CHARS for the notes on what was cut
MAX_IMAGES = 50
_FIELD_CHARS = {"title": TITLE_CHARS, "url": URL_CHARS, "src": URL_CHARS, "alt": ALT_CHARS}


def cap_result(result: dict) -> dict:
    """``result`` with every text within its limit and the whole within RESULT_CHARS as JSON, and a
    ``truncated`` list saying what was cut."""
    cut: set[str] = set()

    def text(field: str, value: object) -> object:
        limit = _FIELD_CHARS.get(field, TEXT_CHARS)
        if not isinstance(value, str) or len(value) <= limit:
            return value
        cut.add(field)
        return value[:limit]

    capped: dict[str, Any] = {key: value if key == "snapshot" else text(key, value)
                              for key, value in result.items()}
    if "images" in capped:
        capped["images"] = [{field: text(field, value) for field, value in image.items()}
                            for image in capped["images"]]
    snapshot_chars = len(capped.get("snapshot", ""))
    if snapshot_chars > SNAPSHOT_CHARS:
        capped["snapshot"] = _cut_at_line(capped["snapshot"], SNAPSHOT_CHARS)
    _fit(capped)
    notes = [f"{'image ' * (field in ('src', 'alt'))}{field} cut to {_FIELD_CHARS.get(field, TEXT_CHARS)} "
             f"characters{' where longer' * (field in ('src', 'alt'))}" for field in sorted(cut)]
    if "images" in capped and len(capped["images"]) < capped.get("count", 0):
        notes.append(f"{len(capped['images'])} of {capped['count']} images listed (at most {MAX_IMAGES}, and "
                     f"as many as fit in {RESULT_CHARS} characters)")
    if len(capped.get("snapshot", "")) < snapshot_chars:
        notes.append(f"snapshot cut to {len(capped['snapshot'])} of {snapshot_chars} characters; elements "
                     f"further down the page are not listed")
    if notes:
        capped["truncated"] = notes
    return capped


def _fit(result: dict) -> None:
    """Drop images from the end of the list, then cut the snapshot, until the result (with room for
    the notes) fits RESULT_CHARS: escaped characters make JSON longer than the texts it holds."""
    room = RESULT_CHARS - NOTES_CHARS
    images = result.get("images")
    if images:
        size, kept = _json_chars({**result, "images": []}), 0
        for image in images:
            size += _json_chars(image) + 2          # and the ", " before it
            if size > room:
                break
            kept += 1
        del images[kept:]
    excess = _json_chars(result) - room
    if excess > 0 and result.get("snapshot"):
        result["snapshot"] = _cut_at_line(result["snapshot"], max(0, len(result["snapshot"]) - excess))


def _json_chars(value: object) -> int:
    return len(json.dumps(value, ensure_ascii=False))


def cut_text(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _cut_at_line(text: str, limit: int) -> str:
    """At most ``limit`` characters of ``text``, ending after a whole line where that keeps at least half
    of them: a page's one long line (a paragraph, an editable element) must not take the rest with it."""
    line_end = text.rfind("\n", 0, limit) + 1
    return text[:line_end if line_end >= limit // 2 else limit]


def first_line(exc: BaseException) -> str:
    """Playwright's message without its call log (and without its 'Page.goto: ' prefix), cut to size:
    it may quote what the page made (a thrown error, a long URL)."""
    line = str(exc).strip().split("\n", 1)[0]
    return cut_text(re.sub(r"^\w+\.\w+: ", "", line), TEXT_CHARS)
