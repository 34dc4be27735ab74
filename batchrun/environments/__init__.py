"""Environment backends by name (the values of TERMINAL_ENV), imported only when a run selects them."""

from __future__ import annotations

import importlib

from batchrun.environments.base import Environment, EnvironmentSettings

# kind -> "module:Class". Imports are lazy so a backend's dependencies cost nothing unless it is used.
# The default first: the help page and error messages list the kinds in this order.
ENVIRONMENT_KINDS: dict[str, str] = {
    "bubblewrap": "batchrun.environments.bubblewrap:BubblewrapEnvironment",
    "local": "batchrun.environments.local:LocalEnvironment",
    "docker": "batchrun.environments.docker:DockerEnvironment",
    "singularity": "batchrun.environments.singularity:SingularityEnvironment",
    "apptainer": "batchrun.environments.singularity:ApptainerEnvironment",
    "modal": "batchrun.environments.modal:ModalEnvironment",
}


def environment_class(kind: str) -> type[Environment]:
    target = ENVIRONMENT_KINDS.get(kind)
    if target is None:
        known = ", ".join(sorted(ENVIRONMENT_KINDS))
        raise ValueError(f"unknown environment kind {kind!r}; known kinds: {known}")
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def default_environment_kind() -> tuple[str, str]:
    """(kind, why) for runs that leave TERMINAL_ENV unset: isolated where bubblewrap can sandbox here,
    else local, with the reason; the caller decides whether a run may go on without isolation (only
    one that never offers the terminal or file tools may)."""
    from batchrun.environments.bubblewrap import working_bwrap  # runs bwrap once; only when asked

    found = working_bwrap()
    if isinstance(found, str):
        return "local", f"bubblewrap unavailable: {found}"
    return "bubblewrap", f"isolated sandbox, {found.describe()}"


def create_environment(kind: str, settings: EnvironmentSettings, *, prompt_index: int,
                       image: str | None = None, cwd: str | None = None) -> Environment:
    """A new, not yet started environment of the given kind for one prompt."""
    return environment_class(kind)(settings, prompt_index=prompt_index, image=image, cwd=cwd)
