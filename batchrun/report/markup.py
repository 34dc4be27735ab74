"""How the report's HTML writes a number, a share, a sum of money, a table and a card, every text
escaped: the pieces the cards and the tables are made of."""

from __future__ import annotations

import html
from collections.abc import Iterable
from typing import Any

from batchrun.console.layout import shown


def text(value: str) -> str:
    """``value`` as HTML text: its markup escaped, and its control characters written as escapes, as the
    console writes them. A name edited into a batch file (a tool's, an end reason) can hold a bidirectional
    override, which would show the rest of its table row backwards."""
    return html.escape(shown(value))


def number(value: float) -> str:
    return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.2f}"


def percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "–"


def money(value: float) -> str:
    return f"${value:,.4f}" if value < 1 else f"${value:,.2f}"


def table(headers: Iterable[str], body: Iterable[Iterable[Any]], *, numeric_from: int = 1) -> str:
    head = "".join(f"<th>{text(h)}</th>" for h in headers)
    lines = []
    for cells in body:
        tds = "".join(f'<td{" class=num" if i >= numeric_from else ""}>{text(str(c))}</td>'
                      for i, c in enumerate(cells))
        lines.append(f"<tr>{tds}</tr>")
    if not lines:
        return '<p class="muted">None.</p>'
    return f'<table><thead><tr>{head}</tr></thead><tbody>{"".join(lines)}</tbody></table>'


def card(label: str, value: str, note: str = "", tone: str = "") -> str:
    return (f'<div class="card {tone}"><div class="label">{text(label)}</div>'
            f'<div class="value">{text(value)}</div><div class="note">{text(note)}</div></div>')

