"""The toolset distributions, as the Hermes runner's users know them: ``DISTRIBUTIONS``,
``sample_toolsets``, and the reference's own functions (``get_distribution``, which returns None for an
unknown name, ``list_distributions``, ``validate_distribution``, ``sample_toolsets_from_distribution``,
``print_distribution_info``). They live in :mod:`batchrun.distributions`, inside the package, so that the
runner's own modules never import this public face. Loads no tool registry."""

from batchrun.distributions import (
    COMBO_SEPARATOR,
    DISTRIBUTIONS,
    UnknownDistributionError,
    distribution,
    entry_members,
    format_distributions,
    get_distribution,
    list_distributions,
    possible_toolsets,
    print_distribution_info,
    rng_for_prompt,
    sample_toolsets,
    sample_toolsets_from_distribution,
    validate_distribution,
)

__all__ = [
    "COMBO_SEPARATOR",
    "DISTRIBUTIONS",
    "UnknownDistributionError",
    "distribution",
    "entry_members",
    "format_distributions",
    "get_distribution",
    "list_distributions",
    "possible_toolsets",
    "print_distribution_info",
    "rng_for_prompt",
    "sample_toolsets",
    "sample_toolsets_from_distribution",
    "validate_distribution",
]
