"""Specification of toolset distributions and the per-prompt sampler."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

import model_tools
import toolset_distributions as td

ROOT = Path(__file__).resolve().parent.parent

# The README's distribution table, copied by hand so a slip in the module cannot hide in the test.
EXPECTED: dict[str, tuple[str, dict[str, int]]] = {
    "default": ("All available tools, all the time",
                {"web": 100, "vision": 100, "image_gen": 100, "terminal": 100, "file": 100, "browser": 100}),
    "image_gen": ("Heavy focus on image generation with vision and web support",
                  {"image_gen": 90, "vision": 90, "web": 55, "terminal": 45}),
    "research": ("Web research with vision analysis and reasoning",
                 {"web": 90, "browser": 70, "vision": 50, "terminal": 10}),
    "science": ("Scientific research with web, terminal, file, and browser capabilities",
                {"web": 94, "terminal": 94, "file": 94, "vision": 65, "browser": 50, "image_gen": 15}),
    "development": ("Terminal, file tools, and reasoning with occasional web lookup",
                    {"terminal": 80, "file": 80, "web": 30, "vision": 10}),
    "safe": ("All tools except terminal for safety",
             {"web": 80, "browser": 70, "vision": 60, "image_gen": 60}),
    "balanced": ("Equal probability of all toolsets",
                 {"web": 50, "vision": 50, "image_gen": 50, "terminal": 50, "file": 50, "browser": 50}),
    "minimal": ("Only web tools for basic research", {"web": 100}),
    "terminal_only": ("Terminal and file tools for code execution tasks", {"terminal": 100, "file": 100}),
    "terminal_web": ("Terminal and file tools with web search for documentation lookup",
                     {"terminal": 100, "file": 100, "web": 100}),
    "creative": ("Image generation and vision analysis focus", {"image_gen": 90, "vision": 90, "web": 30}),
    "reasoning": ("Heavy research/reasoning distribution with minimal other tools",
                  {"web": 90, "file": 60, "terminal": 20}),
    "browser_use": ("Full browser-based web interaction with search, vision, and page control",
                    {"browser": 100, "web": 80, "vision": 70}),
    "browser_only": ("Only browser automation tools for pure web interaction tasks", {"browser": 100}),
    "browser_tasks": ("Browser-focused distribution with web_search for finding URLs",
                      {"browser+search": 97, "vision": 12, "terminal": 15}),
    "terminal_tasks": ("Terminal-focused distribution with high terminal/file availability",
                       {"terminal": 97, "file": 97, "web": 97, "browser": 75, "vision": 50, "image_gen": 10}),
    "mixed_tasks": ("Mixed distribution with high browser, terminal, and file availability",
                    {"browser": 92, "terminal": 92, "file": 92, "web": 35, "vision": 15, "image_gen": 15}),
}


class AlwaysMiss(random.Random):
    """An rng whose every roll fails unless the entry is certain (0.999 * 100 < percent only at 100)."""

    def random(self) -> float:
        return 0.999


def expected_frequency(toolsets: dict[str, int], entry: str) -> float:
    """Exact chance an entry is enabled: its own roll, plus all rolls failing when it is the fallback."""
    fallback = max(toolsets, key=toolsets.__getitem__)  # first maximum = table order on ties
    all_fail = math.prod(1 - p / 100 for p in toolsets.values())
    return toolsets[entry] / 100 + (all_fail if entry == fallback else 0.0)


def test_the_seventeen_spec_distributions_exist_in_table_order_with_exact_numbers() -> None:
    assert list(td.DISTRIBUTIONS) == list(EXPECTED)
    for name, (description, toolsets) in EXPECTED.items():
        assert td.DISTRIBUTIONS[name] == {"description": description, "toolsets": toolsets}
        assert list(td.DISTRIBUTIONS[name]["toolsets"]) == list(toolsets)


def test_every_toolset_named_is_known_to_the_tool_registry() -> None:
    for name, distribution in td.DISTRIBUTIONS.items():
        for entry in distribution["toolsets"]:
            for member in td.entry_members(entry):
                assert member in model_tools.TOOLSETS, f"{name}: {member}"


def test_module_does_not_import_the_tool_registry() -> None:
    code = ("import sys, toolset_distributions; "
            "assert 'model_tools' not in sys.modules and 'batchrun.registry' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_combo_entry_splits_into_its_members() -> None:
    assert td.entry_members("browser+search") == ("browser", "search")
    assert td.entry_members("web") == ("web",)


@pytest.mark.parametrize("name", ["balanced", "science", "browser_tasks", "research", "image_gen"])
def test_sampled_frequencies_match_probabilities_including_fallback(name: str) -> None:
    draws = 20_000
    rng = random.Random(12345)
    toolsets = EXPECTED[name][1]
    counts = dict.fromkeys(toolsets, 0)
    for _ in range(draws):
        enabled = set(td.sample_toolsets(name, rng))
        for entry in toolsets:
            counts[entry] += td.entry_members(entry)[0] in enabled
    for entry, count in counts.items():
        assert abs(count / draws - expected_frequency(toolsets, entry)) < 0.02, entry


def test_combo_members_are_always_enabled_together() -> None:
    rng = random.Random(7)
    for _ in range(5_000):
        enabled = set(td.sample_toolsets("browser_tasks", rng))
        assert ("browser" in enabled) == ("search" in enabled)


@pytest.mark.parametrize(
    ("name", "fallback"),
    [
        ("science", ["web"]),  # three-way tie at 94: first in table order
        ("image_gen", ["image_gen"]),  # tie at 90 with vision
        ("reasoning", ["web"]),
        ("browser_tasks", ["browser", "search"]),  # a combo falls back whole
        ("mixed_tasks", ["browser"]),
    ],
)
def test_when_every_roll_fails_the_highest_probability_entry_is_used(name: str, fallback: list[str]) -> None:
    assert td.sample_toolsets(name, AlwaysMiss()) == fallback


@pytest.mark.parametrize("name", ["default", "minimal", "terminal_only", "terminal_web", "browser_use"])
def test_certain_entries_are_always_present(name: str) -> None:
    certain = {e for e, p in EXPECTED[name][1].items() if p == 100}
    assert certain <= set(td.sample_toolsets(name, AlwaysMiss()))
    rng = random.Random(3)
    for _ in range(1_000):
        assert certain <= set(td.sample_toolsets(name, rng))


def test_sample_is_deduplicated_and_in_table_order() -> None:
    assert td.sample_toolsets("default", random.Random(0)) == list(EXPECTED["default"][1])
    order = ["browser", "search", "vision", "terminal"]
    rng = random.Random(11)
    for _ in range(500):
        sample = td.sample_toolsets("browser_tasks", rng)
        assert len(sample) == len(set(sample))
        assert sample == [t for t in order if t in sample]


def test_seeded_rng_for_prompt_gives_identical_samples_across_calls() -> None:
    first = [td.sample_toolsets("balanced", td.rng_for_prompt(42, f"p{i}")) for i in range(50)]
    again = [td.sample_toolsets("balanced", td.rng_for_prompt(42, f"p{i}")) for i in range(50)]
    assert first == again


def test_seeded_rng_for_prompt_is_stable_across_processes() -> None:
    code = "import toolset_distributions as td; print(td.rng_for_prompt(42, 'p7').random())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True,
                         env={**os.environ, "PYTHONHASHSEED": "random"}).stdout
    assert float(out) == td.rng_for_prompt(42, "p7").random()


def test_different_prompt_keys_and_seeds_give_different_streams() -> None:
    def stream(seed: int | None, key: str) -> list[float]:
        rng = td.rng_for_prompt(seed, key)
        return [rng.random() for _ in range(5)]

    assert stream(42, "a") != stream(42, "b")
    assert stream(42, "a") != stream(43, "a")


def test_unseeded_rng_for_prompt_is_fresh_each_time() -> None:
    assert td.rng_for_prompt(None, "a").random() != td.rng_for_prompt(None, "a").random()


@pytest.mark.parametrize("bad", ["nope", ("balanced",), None, 3])
def test_unknown_distribution_raises_listing_every_name(bad: object) -> None:
    with pytest.raises(td.UnknownDistributionError) as caught:
        td.distribution(bad)  # type: ignore[arg-type]
    message = str(caught.value)
    assert repr(bad) in message
    assert ", ".join(EXPECTED) in message
    assert "--list_distributions" in message
    assert isinstance(caught.value, ValueError)


def test_sampling_an_unknown_distribution_raises() -> None:
    with pytest.raises(td.UnknownDistributionError):
        td.sample_toolsets("nope", random.Random(0))


def test_format_distributions_lists_every_distribution_with_toolsets_highest_first() -> None:
    blocks = td.format_distributions().strip().split("\n\n")
    assert len(blocks) == len(EXPECTED)
    for block, (name, (description, toolsets)) in zip(blocks, EXPECTED.items(), strict=True):
        header, *rows = block.splitlines()
        assert name in header and description in header
        listed = [(row.split()[1], int(row.split()[0].rstrip("%"))) for row in rows]
        highest_first = sorted(toolsets.items(), key=lambda item: -item[1])  # stable: ties keep table order
        assert listed == highest_first


def test_format_distributions_is_plain_text() -> None:
    assert "\x1b" not in td.format_distributions()


# -- the reference runner's functions, for scripts written against its toolset_distributions ----------------

def test_get_distribution_returns_none_for_an_unknown_name_as_the_reference_does() -> None:
    assert td.get_distribution("nope") is None
    assert td.get_distribution("balanced") == td.DISTRIBUTIONS["balanced"]


def test_list_and_validate_distributions_as_the_reference_does() -> None:
    listed = td.list_distributions()
    assert listed == td.DISTRIBUTIONS and listed is not td.DISTRIBUTIONS
    assert td.validate_distribution("balanced") and not td.validate_distribution("nope")


def test_sample_toolsets_from_distribution_follows_the_global_random_seed() -> None:
    random.seed(7)
    first = [td.sample_toolsets_from_distribution("balanced") for _ in range(20)]
    random.seed(7)
    assert [td.sample_toolsets_from_distribution("balanced") for _ in range(20)] == first
    assert all(set(sample) <= td.possible_toolsets("balanced") and sample for sample in first)


def test_sample_toolsets_from_an_unknown_distribution_raises_a_value_error() -> None:
    with pytest.raises(ValueError, match="nope"):
        td.sample_toolsets_from_distribution("nope")


def test_print_distribution_info_prints_one_distribution_likeliest_first(capsys: pytest.CaptureFixture[str]) -> None:
    td.print_distribution_info("image_gen")
    printed = capsys.readouterr().out
    assert printed == td.format_distributions().split("\n\n")[list(td.DISTRIBUTIONS).index("image_gen")] + "\n"
    td.print_distribution_info("nope")
    assert "unknown distribution 'nope'" in capsys.readouterr().out
