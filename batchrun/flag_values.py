"""What a flag's value may be: one function per kind of value, each turning what Fire parsed into the
value the run uses, or raising one UsageError line that names the flag and what is allowed.

Kept apart from the table of flags (batchrun/flags.py) and from the configs built of the values
(batchrun/config.py) because both, and --export's own options, use the same checks.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Literal, overload
from urllib.parse import urlsplit

from batchrun import distributions
from batchrun.env_vars import usable_http_url, yes_or_no
from batchrun.estimate import DEFAULT_SAMPLE
from batchrun.install_hint import install_hint
from batchrun.paths import NotRegularFile, lookup_error, open_regular, unexpanded_home
from batchrun.security import shown_unless_a_key

DEFAULT_MODEL = "anthropic/claude-sonnet-4.6"
DEFAULT_BASE_URL = "https://openrouter.ai/api/v1"
# The reference runner's list; each is passed through to the endpoint as it is.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max", "ultra")
PROVIDER_SORTS = ("price", "throughput", "latency")
PREFILL_ROLES = ("system", "user", "assistant")
BACKENDS = ("local", "ray")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# No text a model's context holds comes near this (a million tokens are about 4 MB): the most a dataset's
# line or a prefill file may be, so that neither is read whole when it is something else (a binary file,
# a dataset named by mistake), which would hold gigabytes in memory, several times over once decoded.
MOST_TEXT_BYTES = 64 * 1024 * 1024


class UsageError(Exception):
    """A flag or input value the run cannot start with; the message is shown as one line."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(flag: str, value: Any) -> int:
    if _is_int(value) and value > 0:
        return value
    raise UsageError(f"--{flag} must be a positive integer, got {value!r}")


# The plan keeps a round of pending prompts per sample; far beyond any best-of or pass@k a run draws.
MAX_SAMPLES_PER_PROMPT = 100_000


def samples_per_prompt(flag: str, value: Any) -> int:
    """A positive integer the plan can hold: a larger one sat silent for minutes, filling memory."""
    samples = positive_int(flag, value)
    if samples > MAX_SAMPLES_PER_PROMPT:
        shown = f"a {len(str(samples))}-digit number" if samples >= 10**18 else f"{samples:,}"
        raise UsageError(f"--{flag} is at most {MAX_SAMPLES_PER_PROMPT:,}, got {shown}")
    return samples


def optional_positive_int(flag: str, value: Any) -> int | None:
    return None if value is None else positive_int(flag, value)


def non_negative_int(flag: str, value: Any) -> int:
    if _is_int(value) and value >= 0:
        return value
    raise UsageError(f"--{flag} must be an integer >= 0, got {value!r}")


def _positive_number(value: Any) -> float | None:
    """The value as a finite float above 0, else None: Fire reads 1e309 as inf and 1 followed by 400 zeros as
    an int no float holds, neither of them a number of seconds or dollars."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if 0 < number < math.inf else None


def positive_seconds(flag: str, value: Any) -> float:
    if (number := _positive_number(value)) is not None:
        return number
    raise UsageError(f"--{flag} must be a positive number of seconds, got {value!r}")


def optional_positive_number(flag: str, value: Any) -> float | None:
    if value is None:
        return None
    if (number := _positive_number(value)) is not None:
        return number
    raise UsageError(f"--{flag} must be a positive number, got {value!r}")


# A dollar a token, far above any model's price: with a reply's counts at most a billion (as the endpoint
# replies are checked), no reply's cost can then overflow a float into inf, and the run's sums into NaN.
MOST_PER_MTOK = 1_000_000


def prices_per_mtok(flag: str, value: Any) -> tuple[float, float, float] | None:
    """--price_per_mtok=INPUT,OUTPUT[,CACHED] (USD per million tokens; fire may already have made it a
    tuple) -> (input, output, cached input); cached input costs what input does unless given."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, (tuple, list)) else [value]
    numbers = []
    for item in items:
        try:
            number = float(item) if not isinstance(item, bool) else math.nan
        except (TypeError, ValueError, OverflowError):     # OverflowError: an int no float holds
            number = math.nan
        numbers.append(number)
    if len(numbers) not in (2, 3) or not all(0 <= number <= MOST_PER_MTOK for number in numbers):
        raise UsageError(f"--price_per_mtok takes INPUT,OUTPUT[,CACHED]: USD per million prompt, completion and "
                         f"cached prompt tokens, each at most ${MOST_PER_MTOK:,}, e.g. --price_per_mtok=0.6,2.4; "
                         f"got {value!r}")
    return numbers[0], numbers[1], numbers[2] if len(numbers) == 3 else numbers[0]


def estimate_size(flag: str, value: Any) -> int | None:
    """--estimate (DEFAULT_SAMPLE samples) or --estimate=N; None when not asked."""
    if value is None or value is False:
        return None
    if value is True:
        return DEFAULT_SAMPLE
    if _is_int(value) and value > 0:
        return value
    raise UsageError(f"--estimate takes the number of samples to run (default {DEFAULT_SAMPLE}), e.g. "
                     f"--estimate=50; got {value!r}")


def boolean(flag: str, value: Any) -> bool:
    """A switch as fire reads it (True, False), or as scripts written for the Hermes runner's ``if flag:``
    pass it: --resume=1 (an int to fire), --resume=true (a string), yes/no, on/off. Fire's ``if`` took
    "false" and "no" for true; here they mean what they say."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and (word := yes_or_no(value)) is not None:
        return word
    raise UsageError(f"--{flag} is a switch: pass --{flag} or --{flag}=False, got {value!r}")


@overload
def text(flag: str, value: Any, *, required: Literal[True]) -> str: ...


@overload
def text(flag: str, value: Any, *, required: bool = False) -> str | None: ...


def text(flag: str, value: Any, *, required: bool = False) -> str | None:
    """Fire turns `--x=123` into an int and `--x=a,b` into a tuple; names and ids are text."""
    if value is None or value == "":
        if required:
            # "is required" misled for a flag with a default, given empty (--distribution=)
            raise UsageError(f"--{flag} is required" if value is None else f"--{flag} is empty; give it a value")
        return None
    if isinstance(value, bool) or isinstance(value, (tuple, list, dict)):
        raise UsageError(f"--{flag} must be a single value, got {value!r}")
    typed = str(value)
    if not is_utf8(typed):     # the value is not shown: it may be the API key
        raise UsageError(f"--{flag} holds a byte that is not valid UTF-8; give it as UTF-8 text")
    return typed


def is_utf8(typed: str) -> bool:
    """Whether UTF-8 can write the text. A byte of the command line that is not UTF-8 arrives as a lone
    surrogate, as does JSON's "\\ud800"; no row, checkpoint, path or request can hold one."""
    try:
        typed.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


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


def load_prefill(flag: str, path_value: Any) -> tuple[dict, ...]:
    path_text = text(flag, path_value)
    if path_text is None:
        return ()
    path = Path(path_text)
    if problem := lookup_error(path):
        raise UsageError(f"--prefill_messages_file={path} cannot be opened: {problem}")
    if path.is_dir():
        raise UsageError(f"--prefill_messages_file: {path} is a directory; give a JSON file")
    if not path.exists():
        raise UsageError(f"--prefill_messages_file: file not found: {path}{unexpanded_home(path, '--' + flag)}")
    try:
        # Read whole: a FIFO would block for ever, /dev/zero fill memory; the open is the check.
        with open(open_regular(path), "rb") as handle:
            if (size := os.fstat(handle.fileno()).st_size) > MOST_TEXT_BYTES:
                raise UsageError(f"--prefill_messages_file: {path} is {size / 1024**2:,.0f} MiB; it is sent with "
                                 f"every request, and no model's context holds more than "
                                 f"{MOST_TEXT_BYTES // 1024**2} MiB")
            messages = json.loads(handle.read().decode("utf-8-sig"))     # past a byte order mark, as a dataset
    except NotRegularFile as exc:
        raise UsageError(f"--prefill_messages_file must be a regular file, but {path} is {exc.kind}. "
                         "Save it to a file first.") from None
    except OSError as exc:
        raise UsageError(f"--prefill_messages_file: cannot read {path}: {exc.strerror}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"--prefill_messages_file: {path} is not valid JSON ({exc})") from None
    except RecursionError:
        raise UsageError(f"--prefill_messages_file: {path} is nested too deeply to read; it must hold a JSON array "
                         "of {role, content} messages") from None
    if not isinstance(messages, list):
        raise UsageError(f"--prefill_messages_file: {path} must hold a JSON array of {{role, content}} messages")
    for number, message in enumerate(messages, start=1):
        if (not isinstance(message, dict) or message.get("role") not in PREFILL_ROLES
                or not isinstance(message.get("content"), str)):
            raise UsageError(f"--prefill_messages_file: message {number} in {path} must be "
                             f"{{\"role\": one of {', '.join(PREFILL_ROLES)}, \"content\": \"text\"}}")
    return tuple({"role": m["role"], "content": m["content"]} for m in messages)


def validate_base_url(flag: str, value: Any) -> str:
    url = text(flag, value, required=True)
    # Checked first, and the URL not shown: what these parts hold is often a credential.
    if _has_credentials(url):
        raise UsageError("--base_url must not hold a user name or password (USER:PASSWORD@): requests carry the "
                         "API key in a header of their own; give the URL without them, and the key with --api_key "
                         "or OPENAI_API_KEY")
    if "?" in url or "#" in url:    # the client appends the API path (/chat/completions) after them
        raise UsageError("--base_url must end at its path, such as http://localhost:8000/v1, with no ?query or "
                         "#fragment; an API key goes in --api_key or OPENAI_API_KEY")
    if not usable_http_url(url):
        # A key given where the URL goes (by place, in the order of another runner) is not shown whole.
        raise UsageError("--base_url must be an http(s) URL such as http://localhost:8000/v1, got "
                         f"{shown_unless_a_key(url)}")
    return url.rstrip("/")


def _has_credentials(url: str) -> bool:
    """Read as the URL it would be with a scheme too: user:password@host/v1 has no scheme to urlsplit,
    and would be shown whole by the next check."""
    try:
        parsed = urlsplit(url if "://" in url else f"//{url}")
        return parsed.username is not None or parsed.password is not None
    except ValueError:     # no host to read them from (a broken IPv6 bracket): an "@" is reason enough
        return "@" in url


def validate_run_name(flag: str, value: Any) -> str:
    name = text(flag, value, required=True)
    longest = 128    # it names a directory, and file systems allow 255 bytes per name
    if len(name) > longest:
        raise UsageError(f"--run_name is {len(name)} characters long; at most {longest} are allowed")
    if not _RUN_NAME.match(name) or name in (".", ".."):
        raise UsageError(f"--run_name must be a plain name (letters, digits, '.', '_', '-'), got {name!r}")
    return name


def validate_backend(flag: str, value: Any) -> str:
    """--backend: local worker processes, or Ray actors (an optional extra, checked before anything runs)."""
    backend = choice(flag, value, BACKENDS) or "local"
    if backend == "ray":
        if importlib.util.find_spec("ray") is None:
            raise UsageError(f"--backend=ray needs Ray, an optional extra: {install_hint('ray')}")
    return backend


def required_text(flag: str, value: Any) -> str:
    return text(flag, value, required=True)


def required_batch_size(flag: str, value: Any) -> int:
    if value is None:
        raise UsageError(f"--{flag} is required (prompts per output shard), e.g. --{flag}=10")
    return positive_int(flag, value)


def optional_rate(flag: str, value: Any) -> int | None:
    """Requests per minute: a positive integer the pace's arithmetic (in floats) can hold."""
    if value is None:
        return None
    if _is_int(value) and _positive_number(value) is not None:
        return value
    raise UsageError(f"--{flag} must be a positive integer below 1e308, got {value!r}")


def optional_non_negative_int(flag: str, value: Any) -> int | None:
    return None if value is None else non_negative_int(flag, value)


def optional_seconds(flag: str, value: Any) -> float | None:
    return None if value is None else positive_seconds(flag, value)


def run_switch_on(flag: str, value: Any) -> bool:
    """A switch that is on for a run unless turned off; unset (None) means on, since --export reads the same
    flag and there unset means "as each row's run decided"."""
    return value is None or boolean(flag, value)


def distribution_name(flag: str, value: Any) -> str:
    name = text(flag, value, required=True)
    try:
        distributions.distribution(name)
    except distributions.UnknownDistributionError as exc:
        raise UsageError(f"--{flag}: {exc}") from None
    return name


def validate_base_url_given(flag: str, value: Any) -> str | None:
    """None when not given: the default endpoint then also changes where the API key may come from."""
    return None if value is None else validate_base_url(flag, value)
