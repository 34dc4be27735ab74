"""The toolset distributions, as the Hermes runner's users know them: ``DISTRIBUTIONS``,
``sample_toolsets``... They live in :mod:`batchrun.distributions`, inside the package, so that the
runner's own modules never import this public face. Loads no tool registry."""

from batchrun.distributions import (
    COMBO_SEPARATOR,
    DISTRIBUTIONS,
    UnknownDistributionError,
    entry_members,
    format_distributions,
    get_distribution,
    possible_toolsets,
    rng_for_prompt,
    sample_toolsets,
)

__all__ = [
    "COMBO_SEPARATOR",
    "DISTRIBUTIONS",
    "UnknownDistributionError",
    "entry_members",
    "get_distribution",
    "possible_toolsets",
    "sample_toolsets",
    "rng_for_prompt",
    "format_distributions",
]
