"""What keeps a Ray node from running this run's sessions: its TERMINAL_ENV backend, or a tool the run
offers that does not work there.

Apart from the actor because these are plain functions of the node's own environment, asked by each
actor's probe and tested without Ray.
"""

from __future__ import annotations


def node_environment_problem(kind: str) -> str | None:
    """None when TERMINAL_ENV=kind can work on this node, else why not (cheap, once per actor)."""
    from batchrun.environments import environment_class

    return environment_class(kind).node_problem()


def node_tools_problem(distribution: str, available_tools: frozenset[str]) -> str | None:
    """None when every tool the run may offer (available to the parent, in the distribution) works on
    this node too; tools read their configuration from the node's own environment."""
    from batchrun import distributions, registry

    entries = distributions.distribution(distribution)["toolsets"]
    toolsets = sorted({member for entry in entries for member in distributions.entry_members(entry)})
    offered = set(registry.tools_for_toolsets(toolsets)) & available_tools
    missing = {name: reason for name, reason in registry.unavailable_tools().items() if name in offered}
    if not missing:
        return None
    return ("tools that work where the runner started do not work here: "
            + "; ".join(f"{name} ({reason})" for name, reason in missing.items()))
