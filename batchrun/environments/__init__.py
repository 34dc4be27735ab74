"""Environment backends by name (the values of TERMINAL_ENV), imported only when a run selects them."""

from __future__ import annotations

import importlib

from batchrun.environments.base import Environment, EnvironmentSettings

# kind -> "module:Class". Imports are lazy so a backend's dependencies cost nothing unless it is used.
ENVIRONMENT_KINDS: dict[str, str] = {
    "local": "batchrun.environments.local:LocalEnvironment",
}


def environment_class(kind: str) -> type[Environment]:
    target = ENVIRONMENT_KINDS.get(kind)
    if target is None:
        known = ", ".join(sorted(ENVIRONMENT_KINDS))
        raise ValueError(f"unknown environment kind {kind!r}; known kinds: {known}")
    module_name, _, class_name = target.partition(":")
    return getattr(importlib.import_module(module_name), class_name)


def create_environment(kind: str, settings: EnvironmentSettings, *, prompt_index: int,
                       image: str | None = None, cwd: str | None = None) -> Environment:
    """A new, not yet started environment of the given kind for one prompt."""
    return environment_class(kind)(settings, prompt_index=prompt_index, image=image, cwd=cwd)
