"""Toolset distributions: which toolsets each prompt is offered, sampled per prompt.

Kept free of imports beyond the stdlib so the CLI can list or validate distributions without
loading the tool registry; the tests check every name here against ``batchrun.registry.TOOLSETS``.
"""

from __future__ import annotations

import random
from collections.abc import Callable

COMBO_SEPARATOR = "+"

DISTRIBUTIONS: dict[str, dict] = {
    "default": {
        "description": "All available tools, all the time",
        "toolsets": {"web": 100, "vision": 100, "image_gen": 100, "terminal": 100, "file": 100, "browser": 100},
    },
    "image_gen": {
        "description": "Heavy focus on image generation with vision and web support",
        "toolsets": {"image_gen": 90, "vision": 90, "web": 55, "terminal": 45},
    },
    "research": {
        "description": "Web research with vision analysis and reasoning",
        "toolsets": {"web": 90, "browser": 70, "vision": 50, "terminal": 10},
    },
    "science": {
        "description": "Scientific research with web, terminal, file, and browser capabilities",
        "toolsets": {"web": 94, "terminal": 94, "file": 94, "vision": 65, "browser": 50, "image_gen": 15},
    },
    "development": {
        "description": "Terminal, file tools, and reasoning with occasional web lookup",
        "toolsets": {"terminal": 80, "file": 80, "web": 30, "vision": 10},
    },
    "safe": {
        "description": "All tools except terminal for safety",
        "toolsets": {"web": 80, "browser": 70, "vision": 60, "image_gen": 60},
    },
    "balanced": {
        "description": "Equal probability of all toolsets",
        "toolsets": {"web": 50, "vision": 50, "image_gen": 50, "terminal": 50, "file": 50, "browser": 50},
    },
    "minimal": {
        "description": "Only web tools for basic research",
        "toolsets": {"web": 100},
    },
    "terminal_only": {
        "description": "Terminal and file tools for code execution tasks",
        "toolsets": {"terminal": 100, "file": 100},
    },
    "terminal_web": {
        "description": "Terminal and file tools with web search for documentation lookup",
        "toolsets": {"terminal": 100, "file": 100, "web": 100},
    },
    "creative": {
        "description": "Image generation and vision analysis focus",
        "toolsets": {"image_gen": 90, "vision": 90, "web": 30},
    },
    "reasoning": {
        "description": "Heavy research/reasoning distribution with minimal other tools",
        "toolsets": {"web": 90, "file": 60, "terminal": 20},
    },
    "browser_use": {
        "description": "Full browser-based web interaction with search, vision, and page control",
        "toolsets": {"browser": 100, "web": 80, "vision": 70},
    },
    "browser_only": {
        "description": "Only browser automation tools for pure web interaction tasks",
        "toolsets": {"browser": 100},
    },
    "browser_tasks": {
        "description": "Browser-focused distribution with web_search for finding URLs",
        "toolsets": {"browser+search": 97, "vision": 12, "terminal": 15},
    },
    "terminal_tasks": {
        "description": "Terminal-focused distribution with high terminal/file availability",
        "toolsets": {"terminal": 97, "file": 97, "web": 97, "browser": 75, "vision": 50, "image_gen": 10},
    },
    "mixed_tasks": {
        "description": "Mixed distribution with high browser, terminal, and file availability",
        "toolsets": {"browser": 92, "terminal": 92, "file": 92, "web": 35, "vision": 15, "image_gen": 15},
    },
}


class UnknownDistributionError(ValueError):
    """A name that is not built in; the message lists the valid ones so the user can fix the flag."""

    def __init__(self, name: object) -> None:
        available = ", ".join(DISTRIBUTIONS)
        super().__init__(
            f"unknown distribution {name!r}; available: {available} "
            "(--list_distributions shows details)"
        )
        self.name = name


def entry_members(entry: str) -> tuple[str, ...]:
    """The toolsets one entry enables together (``browser+search`` -> both, so they always co-occur)."""
    return tuple(entry.split(COMBO_SEPARATOR))


def distribution(name: str) -> dict:
    """The distribution called ``name``; non-str input (e.g. a tuple from fire) is unknown too."""
    if not isinstance(name, str) or name not in DISTRIBUTIONS:
        raise UnknownDistributionError(name)
    return DISTRIBUTIONS[name]


def possible_toolsets(name: str) -> set[str]:
    """Every toolset a prompt of this distribution may be offered."""
    return {member for entry, percent in distribution(name)["toolsets"].items() if percent > 0
            for member in entry_members(entry)}


def _fallback_entry(toolsets: dict[str, int]) -> str:
    """Highest-probability entry, first in table order on ties (max() keeps the first maximum)."""
    return max(toolsets, key=toolsets.__getitem__)


def sample_toolsets(name: str, rng: random.Random) -> list[str]:
    """Roll every entry once; fall back to the likeliest entry if none hit, so a prompt always has tools.

    Returns toolset names de-duplicated, in table order of their entries, so equal draws give equal rows.
    """
    toolsets = distribution(name)["toolsets"]
    chosen = [entry for entry, percent in toolsets.items() if rng.random() * 100 < percent]
    if not chosen:
        chosen = [_fallback_entry(toolsets)]
    return list(dict.fromkeys(member for entry in chosen for member in entry_members(entry)))


def rng_for_prompt(seed: int | None, prompt_key: str) -> random.Random:
    """Per-prompt generator: seeded from ``"seed:key"`` so a resumed or reordered run draws the same toolsets.

    String seeding is stable across processes (unlike ``hash()``); without a seed the OS seeds it.
    """
    if seed is None:
        return random.Random()
    return random.Random(f"{seed}:{prompt_key}")


def format_distributions(note: Callable[[str], str | None] = lambda entry: None) -> str:
    """Plain-text listing for ``--list_distributions``: each distribution, likeliest toolsets first, an
    entry followed by ``note(entry)`` in parentheses where that says something."""
    return "\n".join(_described(name, note) for name in DISTRIBUTIONS)


def _described(name: str, note: Callable[[str], str | None]) -> str:
    toolsets = DISTRIBUTIONS[name]["toolsets"]
    lines = [f"{name}: {DISTRIBUTIONS[name]['description']}"]
    # sorted() is stable, so entries with equal probability keep table order.
    for entry in sorted(toolsets, key=lambda e: -toolsets[e]):
        said = note(entry)
        lines.append(f"    {toolsets[entry]:>3}%  {entry}" + (f"  ({said})" if said else ""))
    return "\n".join(lines) + "\n"


# The Hermes runner's own functions, for scripts written against its toolset_distributions module.

def get_distribution(name: str) -> dict | None:
    """The distribution called ``name``, or None: the reference's lookup (``distribution`` raises instead)."""
    return DISTRIBUTIONS.get(name) if isinstance(name, str) else None


def list_distributions() -> dict[str, dict]:
    return DISTRIBUTIONS.copy()


def validate_distribution(name: str) -> bool:
    return get_distribution(name) is not None


def sample_toolsets_from_distribution(name: str) -> list[str]:
    """One draw, as sample_toolsets makes it, from a generator seeded by the ``random`` module's, so that
    ``random.seed(N)`` repeats a script's draws as it did with the reference; UnknownDistributionError (a
    ValueError, as the reference raises) for a name that is not built in."""
    return sample_toolsets(name, random.Random(random.random()))


def print_distribution_info(name: str) -> None:
    """One distribution as --list_distributions shows it, or the one line saying it is unknown."""
    known = validate_distribution(name)
    print(_described(name, lambda entry: None) if known else f"{UnknownDistributionError(name)}\n", end="")
