"""The command line, through the real CLI.

Every bad input ends with exit code 1 and one `error:` line that names the flag and what is allowed,
before any model call and before data/<run_name>/ exists.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    REPO,
    HeldReplies,
    batch_rows,
    batch_runner_command,
    cli_environment,
    endpoint_args,
    human_prompt,
    mounted_tmpfs,
    obeying_file_modes,
    read_jsonl,
    run_cli,
    write_dataset,
)

from batchrun import flags
from batchrun.config import build_config, provider_routing_note
from batchrun.dataset import DatasetError, check_dataset_file, parse_line
from batchrun.install_hint import install_hint

DEFAULTS = flags.defaults()
DISTRIBUTION_NAMES = ("default", "image_gen", "research", "science", "development", "safe", "balanced", "minimal",
                      "terminal_only", "terminal_web", "creative", "reasoning", "browser_use", "browser_only",
                      "browser_tasks", "terminal_tasks", "mixed_tasks")


def good_args(tmp_path, endpoint, *extra, prompts=("q",), run_name="run"):
    """A complete, valid command line; a later flag of the same name in `extra` wins (fire keeps the last)."""
    dataset = write_dataset(tmp_path / "dataset.jsonl", list(prompts))
    return [f"--dataset_file={dataset}", "--batch_size=2", f"--run_name={run_name}", "--distribution=terminal_only",
            *endpoint_args(endpoint), *extra]


def error_line(result) -> str:
    """The run failed cleanly: exit 1, no traceback, and exactly one `error:` line on stderr."""
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def assert_rejected_before_anything(result, tmp_path, endpoint, *fragments: str) -> None:
    line = error_line(result)
    assert result.stderr.strip() == line          # nothing else: a single clear line
    for fragment in fragments:
        assert fragment in line, line
    assert endpoint.requests == []
    assert not (tmp_path / "data").exists()


# -- bad flag values ------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "-1", "1.5", "abc"])
def test_batch_size_must_be_a_positive_integer(tmp_path, endpoint, value):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--batch_size={value}"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--batch_size", "positive integer")


def test_batch_size_is_required(tmp_path, endpoint):
    args = [arg for arg in good_args(tmp_path, endpoint) if not arg.startswith("--batch_size")]
    result = run_cli(tmp_path, *args)
    assert_rejected_before_anything(result, tmp_path, endpoint, "--batch_size", "required")


@pytest.mark.parametrize("value", ["0", "-3", "x"])
def test_max_samples_must_be_a_positive_integer(tmp_path, endpoint, value):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--max_samples={value}"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--max_samples", "positive integer")


@pytest.mark.parametrize("flag", ["num_workers", "max_turns", "max_tokens"])
def test_count_flags_reject_zero(tmp_path, endpoint, flag):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--{flag}=0"))
    assert_rejected_before_anything(result, tmp_path, endpoint, f"--{flag}", "positive integer")


# Fire reads 1e309 as the float inf, and 1 with 400 zeros as an int no float holds: numbers too big to be
# one, never "no limit".
@pytest.mark.parametrize("value", ["1e309", "1" + "0" * 400])
@pytest.mark.parametrize("flag", ["request_timeout", "tool_timeout", "command_timeout", "prompt_timeout", "max_cost"])
def test_a_number_too_big_for_a_float_is_rejected_not_taken_as_infinite(tmp_path, endpoint, flag, value):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--{flag}={value}", "--price_per_mtok=0,0"))
    assert_rejected_before_anything(result, tmp_path, endpoint, f"--{flag}", "positive number")


def test_a_request_rate_too_big_for_a_float_is_rejected(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--requests_per_minute={'1' + '0' * 400}"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--requests_per_minute", "positive integer")


def test_a_price_too_big_for_a_float_is_rejected(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--price_per_mtok={'1' + '0' * 400},1"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--price_per_mtok takes INPUT,OUTPUT[,CACHED]")


# A byte that is not UTF-8 arrives as a lone surrogate, which no row, checkpoint or request can hold: the run
# crashed once its directory was made.
@pytest.mark.parametrize("flag", ["model", "dataset_file"])
def test_a_text_flag_that_is_not_utf8_is_rejected_before_anything(tmp_path, endpoint, flag):
    dataset = write_dataset(tmp_path / "data\udcff.jsonl", ["q"])
    value = str(dataset) if flag == "dataset_file" else "model\udcff"
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint), f"--{flag}={value}")
    assert_rejected_before_anything(result, tmp_path, endpoint, f"--{flag}", "not valid UTF-8")


def test_log_prefix_chars_rejects_a_negative_value(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, "--log_prefix_chars=-1"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--log_prefix_chars", ">= 0")


def test_reasoning_effort_lists_the_allowed_levels(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, "--reasoning_effort=bogus"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--reasoning_effort", "bogus",
                                    "none", "minimal", "low", "medium", "high", "xhigh")


def test_provider_sort_lists_the_allowed_orders(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, "--provider_sort=bogus"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--provider_sort", "price", "throughput", "latency")


def test_unknown_distribution_lists_the_available_ones(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, "--distribution=nope"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--distribution", "nope", *DISTRIBUTION_NAMES)


# "--distribution is required", of a flag that has a default.
def test_a_flag_given_empty_is_named_as_empty_not_as_missing(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, "--distribution="))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--distribution is empty; give it a value")


@pytest.mark.parametrize("value", ["ftp://example.com/v1", "localhost:8000/v1", "http://"])
def test_base_url_must_be_http_or_https(tmp_path, endpoint, value):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--base_url={value}"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--base_url", "http(s)")


# Each reached the HTTP client unchecked: a traceback, or a failure row for every prompt.
@pytest.mark.parametrize("value", ["http://[::1/v1", "http://127.0.0.1:99999/v1", "http://127.0.0.1:1/v1\nx",
                                   "http://127.0.0.1:1/\udcff"])
def test_a_base_url_no_http_client_can_use_is_rejected_before_anything(tmp_path, endpoint, value):
    argument = f"--base_url={value}".encode("utf-8", "surrogateescape")
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint), os.fsdecode(argument))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--base_url")


# A user and password in the URL failed every prompt (the client refuses them beside the key's header),
# a query or fragment every request (the API path is appended after it); and each was printed as typed.
URL_SECRET = "url-secret-0123456789abcdef"


@pytest.mark.parametrize("credentials", [f"user:{URL_SECRET}@", f"{URL_SECRET}@"])
def test_a_base_url_with_a_user_or_password_is_rejected_without_showing_it(tmp_path, endpoint, credentials):
    value = endpoint.base_url.replace("http://", f"http://{credentials}")
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--base_url={value}"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--base_url", "--api_key")
    assert URL_SECRET not in result.stdout + result.stderr


@pytest.mark.parametrize("rest", [f"?api_key={URL_SECRET}", f"#{URL_SECRET}"])
def test_a_base_url_with_a_query_or_fragment_is_rejected_without_showing_it(tmp_path, endpoint, rest):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--base_url={endpoint.base_url}{rest}"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--base_url", "/v1")
    assert URL_SECRET not in result.stdout + result.stderr


def test_a_password_in_a_base_url_that_is_not_http_is_not_shown(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--base_url=ftp://user:{URL_SECRET}@example.com/v1"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--base_url")
    assert URL_SECRET not in result.stdout + result.stderr


@pytest.mark.parametrize("key", ["sk-pasted-0123456789abcdef", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                                 "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.SflKxwRJSMeKKF2QT4fwpMeJf36"],
                         ids=["plain", "aws_style", "jwt"])
def test_a_key_given_as_the_base_url_is_not_shown(tmp_path, endpoint, key):
    # A key in --base_url's place (another runner's order of flags given by place) was quoted whole; one with a
    # "/" or "." (AWS's secret keys, JWTs) still was, taken for a path or a host.
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--base_url={key}"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--base_url", f"{key[:4]!r}… (the rest not shown")
    assert key[4:12] not in result.stdout + result.stderr


@pytest.mark.parametrize("url", ["localhost:8000/v1", "api.example.com/v1", "127.0.0.1:8000"])
def test_a_base_url_without_a_scheme_is_quoted_whole(tmp_path, endpoint, url):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--base_url={url}"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--base_url", repr(url))


@pytest.mark.parametrize("value", ["a/b", "../escape", "/abs"])
def test_run_name_must_be_a_plain_name(tmp_path, endpoint, value):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--run_name={value}"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--run_name", "plain name")
    assert not (tmp_path.parent / "escape").exists()


@pytest.mark.parametrize("content, complaint", [
    (None, "not found"),
    ("{not json", "not valid JSON"),
    ('{"role": "user", "content": "hi"}', "JSON array"),
    ('[{"role": "robot", "content": "hi"}]', "system, user, assistant"),
    ('[{"role": "user", "content": 5}]', "content"),
], ids=["missing", "not-json", "not-an-array", "bad-role", "non-text-content"])
def test_prefill_messages_file_must_be_a_json_array_of_role_content_messages(tmp_path, endpoint, content, complaint):
    path = tmp_path / "prefill.json"
    if content is not None:
        path.write_text(content)
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--prefill_messages_file={path}"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--prefill_messages_file", complaint)


# A byte order mark, as Windows' Notepad writes, made it "not valid JSON" (a dataset's is read past).
def test_a_prefill_messages_file_with_a_utf8_byte_order_mark_is_read(tmp_path, endpoint):
    path = tmp_path / "prefill.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps([{"role": "user", "content": "EXAMPLE-Q"}]).encode())
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--prefill_messages_file={path}"))
    assert result.returncode == 0, result.stderr
    [request] = endpoint.requests
    assert request["messages"][1]["content"] == "EXAMPLE-Q"


# It was read whole: a big file named by mistake (the dataset, say) took gigabytes of memory before its
# JSON was found wanting, or the run died of a MemoryError traceback.
def test_a_prefill_messages_file_larger_than_any_context_is_refused_unread(tmp_path, endpoint):
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux) to bound the run's memory")
    path = tmp_path / "prefill.json"
    with path.open("wb") as handle:
        handle.truncate(4 * 1024**3)           # a hole: 4 GiB that take no disk
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--prefill_messages_file={path}"),
                     prefix=("prlimit", f"--as={2 * 1024**3}"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--prefill_messages_file", "64 MiB")


@pytest.mark.parametrize("argument", ["--providers_allowed=", "--providers_allowed= , ", "--providers_allowed"],
                         ids=["empty", "only-commas", "no-value"])
def test_providers_allowed_needs_at_least_one_name(tmp_path, endpoint, argument):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, argument))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--providers_allowed", "comma-separated")


# Either read as "not that mode": a run, whose first complaint was "--dataset_file is required".
@pytest.mark.parametrize("argument", ["--report=maybe", "--list_distributions=2"])
def test_a_mode_switch_given_a_value_other_than_true_or_false_is_refused_naming_it(tmp_path, endpoint, argument):
    result = run_cli(tmp_path, argument, "--run_name=run")
    flag = argument.partition("=")[0]
    assert_rejected_before_anything(result, tmp_path, endpoint, f"{flag} is a switch")


@pytest.mark.parametrize("typo, meant", [("--num_worker=3", "--num_workers"), ("--batchsize=2", "--batch_size"),
                                         ("--resmue", "--resume")])
def test_unknown_flag_suggests_the_close_real_flag(tmp_path, endpoint, typo, meant):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, typo))
    assert_rejected_before_anything(result, tmp_path, endpoint, typo.split("=")[0], f"did you mean {meant}?")


def test_missing_dataset_file_is_a_clear_error(tmp_path, endpoint):
    args = [arg for arg in good_args(tmp_path, endpoint) if not arg.startswith("--dataset_file")]
    result = run_cli(tmp_path, *args, f"--dataset_file={tmp_path / 'nowhere.jsonl'}")
    assert_rejected_before_anything(result, tmp_path, endpoint, "--dataset_file", "not found", "nowhere.jsonl")


# No shell expands "~" after "=": "not found" alone left the user to find why a file that is there is not.
@pytest.mark.parametrize("flag", ["--dataset_file", "--prefill_messages_file"])
def test_a_file_named_with_a_tilde_the_shell_left_says_how_to_write_it(tmp_path, endpoint, flag):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"{flag}=~/prompts.jsonl"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "~/prompts.jsonl", "not found",
                                    "the shell expands ~ only at the start of a word", f"{flag} ~/prompts.jsonl")


def test_a_fifo_as_dataset_is_named_as_what_it_is(tmp_path):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DatasetError, match="must be a regular file .* is a FIFO"):
        check_dataset_file(fifo)


def test_a_dataset_the_runner_may_not_read_is_a_clear_error(tmp_path):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["hi"])
    dataset.chmod(0)
    # Root reads any file; without the capabilities that let it, it obeys the file's mode as anyone does.
    prefix = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    if prefix and shutil.which("setpriv") is None:
        pytest.skip("root without setpriv reads every file")
    check = f"from batchrun.dataset import check_dataset_file; check_dataset_file(__import__('pathlib').Path({str(dataset)!r}))"
    result = subprocess.run([*prefix, sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO)
    assert "DatasetError: cannot read" in result.stderr and "Permission denied" in result.stderr, result.stderr


# Both read "file not found" (a loop) or ended in a traceback (a directory above that may not be searched).
@pytest.mark.parametrize("flag", ["--dataset_file", "--prefill_messages_file"])
def test_a_symlink_loop_as_an_input_file_is_named_as_one(tmp_path, endpoint, flag):
    (tmp_path / "loop").symlink_to("loop")
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"{flag}={tmp_path / 'loop'}"))
    assert_rejected_before_anything(result, tmp_path, endpoint, flag, "Too many levels of symbolic links")


@pytest.mark.parametrize("flag", ["--dataset_file", "--prefill_messages_file"])
def test_an_input_file_under_a_directory_this_user_may_not_search_is_one_clear_error(tmp_path, endpoint, flag):
    prefix = obeying_file_modes()
    args = good_args(tmp_path, endpoint, f"{flag}={tmp_path / 'locked' / 'input.json'}")
    (tmp_path / "locked").mkdir(mode=0)
    result = run_cli(tmp_path, *args, prefix=prefix)
    assert_rejected_before_anything(result, tmp_path, endpoint, flag, "Permission denied")


def test_a_utf8_byte_order_mark_before_the_first_line_is_not_part_of_it(tmp_path, endpoint):
    args = good_args(tmp_path, endpoint)
    (tmp_path / "dataset.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "p0"}\n{"prompt": "p1"}\n')
    result = run_cli(tmp_path, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning" not in result.stderr
    rows = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert sorted((row["prompt_index"], human_prompt(row)) for row in rows) == [(0, "p0"), (1, "p1")]


def test_a_line_that_is_not_json_is_named_with_where_it_goes_wrong():
    fields, warning = parse_line(b'{"prompt": "a\x00b"}\n', 3)
    assert fields is None and warning == "line 3: not valid JSON (Invalid control character at column 14); skipped"


# Read with its newline, json named the column after it: "column 1" of the next line, for the cut line
# that is the commonest bad line of all.
@pytest.mark.parametrize("end", [b"\n", b"\r\n", b""], ids=["newline", "crlf", "last-line"])
def test_a_line_cut_short_is_named_at_its_end(end):
    fields, warning = parse_line(b'{"prompt": "B"' + end, 2)
    assert fields is None and warning == "line 2: not valid JSON (Expecting ',' delimiter at column 15); skipped"


# Sent as "?" without a word: two lines with two prompts reached the model as one, and the row's human
# turn was not the dataset's prompt.
def test_a_prompt_holding_a_lone_surrogate_is_skipped_with_a_warning():
    fields, warning = parse_line(b'{"prompt": "lone \\ud800 A"}\n', 4)
    assert fields is None and warning == 'line 4: "prompt" is not valid Unicode (a lone surrogate); skipped'


def test_a_directory_as_prefill_messages_file_is_named_as_a_directory(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--prefill_messages_file={tmp_path}"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--prefill_messages_file", "is a directory")


# Read whole: a FIFO with no writer blocked the run forever, /dev/zero filled memory until the OOM killer came.
def test_a_fifo_as_prefill_messages_file_is_named_as_what_it_is(tmp_path, endpoint):
    fifo = tmp_path / "prefill.json"
    os.mkfifo(fifo)
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, f"--prefill_messages_file={fifo}"), timeout=30)
    assert_rejected_before_anything(result, tmp_path, endpoint, "--prefill_messages_file", "must be a regular file",
                                    "is a FIFO")


def test_a_dataset_that_fails_to_read_is_a_clear_error(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint), "--dataset_file=/proc/self/mem")    # EIO at 0
    assert_rejected_before_anything(result, tmp_path, endpoint, "cannot read /proc/self/mem", "Input/output error")


def test_dataset_without_a_valid_line_is_a_clear_error(tmp_path, endpoint):
    args = good_args(tmp_path, endpoint)
    (tmp_path / "dataset.jsonl").write_text('not json\n\n[1, 2]\n{"prompt": ""}\n')
    result = run_cli(tmp_path, *args)
    line = error_line(result)
    assert "no valid prompt" in line and "dataset.jsonl" in line
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert [w.split(":")[1].strip() for w in warnings] == ["line 1", "line 3", "line 4"]
    assert endpoint.requests == []
    assert not (tmp_path / "data").exists()


# Each was a warning per line of bytes that are not UTF-8 or not JSON, then "no valid prompt": nothing said
# what the file was, nor how to make JSONL of it.
@pytest.mark.parametrize("content, kind, remedy", [
    (gzip.compress(b'{"prompt": "q"}\n'), "gzip-compressed", "gunzip -c"),
    (b"\x28\xb5\x2f\xfd" + b"\x00\x01\x02" * 20, "zstd-compressed", "zstd -dc"),
    ('{"prompt": "q"}\n'.encode("utf-16"), "UTF-16", "iconv"),
    ('{"prompt": "q"}\n'.encode("utf-16-le"), "UTF-16", "iconv -f UTF-16LE"),
    ('{"prompt": "q"}\n'.encode("utf-16-be"), "UTF-16", "iconv -f UTF-16BE"),
    (b'{"prompt": "a"}\r{"prompt": "b"}\r', "carriage return", "tr '\\r' '\\n'"),
    (b'{\n  "prompt": "a"\n}\n{\n  "prompt": "b"\n}\n', "over several lines", "jq -c ."),
], ids=["gzip", "zstd", "utf-16", "utf-16le-without-bom", "utf-16be-without-bom", "carriage-returns",
        "pretty-printed"])
def test_a_dataset_that_is_not_jsonl_text_is_named_as_what_it_is_with_how_to_convert_it(tmp_path, endpoint, content,
                                                                                       kind, remedy):
    args = good_args(tmp_path, endpoint)
    (tmp_path / "dataset.jsonl").write_bytes(content)
    result = run_cli(tmp_path, *args)
    assert_rejected_before_anything(result, tmp_path, endpoint, "dataset.jsonl", kind, remedy)


def test_a_dataset_saved_as_one_json_array_is_named_as_one_with_how_to_convert_it(tmp_path, endpoint):
    args = good_args(tmp_path, endpoint)
    (tmp_path / "dataset.jsonl").write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=2))
    result = run_cli(tmp_path, *args)
    assert_rejected_before_anything(result, tmp_path, endpoint, "dataset.jsonl", "one JSON array", "jq -c")


# Each prompt's environment failed to start, a failure row each that every --resume ran again; a Ray
# node so placed stopped the run before any model call, naming what is missing.
def test_a_container_cli_that_is_not_there_stops_the_run_at_start(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint),
                     env={"TERMINAL_ENV": "docker", "TERMINAL_CONTAINER_CLI": "no-such-container-program"})
    assert_rejected_before_anything(result, tmp_path, endpoint, "TERMINAL_ENV=docker",
                                    "`no-such-container-program` was not found on PATH")


# The prompts' directories are bound at /workspace by a --bind, which splits at commas: under /tmp/a,b
# it bound the host's /tmp/a into every container.
@pytest.mark.parametrize("separator", [",", ":"])
def test_a_tmpdir_that_singularity_cannot_bind_stops_the_run_at_start(tmp_path, endpoint, separator):
    temporary = tmp_path / f"a{separator}b"
    temporary.mkdir()
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint),
                     env={"TERMINAL_ENV": "singularity", "TMPDIR": str(temporary)})
    assert_rejected_before_anything(result, tmp_path, endpoint, "TERMINAL_ENV=singularity", f"holds {separator!r}",
                                    "set TMPDIR")


def test_the_ray_backend_without_ray_installed_is_named_with_the_command_that_installs_it(tmp_path, endpoint):
    without_ray = (f"import runpy, sys; sys.path.insert(0, {str(REPO)!r}); sys.modules['ray'] = None; "
                   f"sys.argv = ['batch_runner.py', *sys.argv[1:]]; "
                   f"runpy.run_path({str(REPO / 'batch_runner.py')!r}, run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", without_ray, *good_args(tmp_path, endpoint, "--backend=ray")],
                            cwd=tmp_path, env=cli_environment(tmp_path), capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert_rejected_before_anything(result, tmp_path, endpoint,
                                    f"error: --backend=ray needs Ray, an optional extra: {install_hint('ray')}")


def test_a_container_engine_that_does_not_answer_stops_the_run_at_start(tmp_path, endpoint):
    engine = tmp_path / "down-engine"
    engine.write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon' >&2\nexit 1\n")
    engine.chmod(0o755)
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint),
                     env={"TERMINAL_ENV": "docker", "TERMINAL_CONTAINER_CLI": str(engine)})
    assert_rejected_before_anything(result, tmp_path, endpoint, "TERMINAL_ENV=docker", "not reachable",
                                    "Cannot connect to the Docker daemon")


# -- fire quirks that must be accepted ----------------------------------------------------------

def test_providers_allowed_given_as_a_comma_list_reaches_the_request(tmp_path, endpoint):
    # fire turns a,b into the tuple ('a', 'b')
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, "--providers_allowed=a,b"))
    assert result.returncode == 0, result.stderr
    [request] = endpoint.requests
    assert request["provider"] == {"only": ["a", "b"]}


def test_provider_routing_sent_to_an_endpoint_that_is_not_openrouter_is_said_once_at_start(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, "--provider_sort=price", "--providers_ignored=x"))
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stderr.split())
    assert said.count("OpenRouter's provider routing") == 1
    assert "--providers_ignored, --provider_sort" in said and endpoint.base_url in said
    assert endpoint.requests[0]["provider"] == {"ignore": ["x"], "sort": "price"}     # sent all the same


def test_no_word_about_provider_routing_without_its_flags(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint))
    assert result.returncode == 0 and "provider routing" not in result.stderr


def test_provider_routing_to_openrouter_needs_no_word():
    config = build_config(**{**DEFAULTS, "dataset_file": "d.jsonl", "batch_size": 1, "run_name": "r",
                             "base_url": "https://openrouter.ai/api/v1", "api_key": "k", "provider_sort": "price"})
    assert config.endpoint.extra_body["provider"] == {"sort": "price"} and provider_routing_note(config.endpoint) is None


def test_numeric_run_name_is_accepted(tmp_path, endpoint):
    # fire turns 123 into an int
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, run_name="123"))
    assert result.returncode == 0, result.stderr
    assert len(read_jsonl(tmp_path / "data" / "123" / "trajectories.jsonl")) == 1


def test_run_name_that_reads_as_a_python_literal_keeps_its_spelling(tmp_path, endpoint):
    # fire turns 1_000 into the int 1000; the directory must still be named as typed
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, run_name="1_000"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "data" / "1_000" / "trajectories.jsonl").exists()
    assert not (tmp_path / "data" / "1000").exists()


def test_run_name_spelled_as_a_python_constant_is_taken_as_typed(tmp_path, endpoint):
    # fire turns None into None, which read as "not given": "--run_name is required"
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, run_name="None"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "data" / "None" / "trajectories.jsonl").exists()


def test_free_text_with_a_comma_is_passed_through_as_typed(tmp_path, endpoint):
    # fire turns "Hello, world" into the tuple ('Hello', 'world')
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, "--ephemeral_system_prompt=Hello, world"))
    assert result.returncode == 0, result.stderr
    [request] = endpoint.requests
    assert "Hello, world" in request["messages"][0]["content"]


# fire takes "-0x10" as the flag's value (only "-" and a letter starts a flag) and reads it as the int -16.
def test_a_space_separated_free_text_value_that_starts_with_a_dash_keeps_its_spelling(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, "--ephemeral_system_prompt", "-0x10"))
    assert result.returncode == 0, result.stderr
    [request] = endpoint.requests
    assert request["messages"][0]["content"].endswith("-0x10")


# fire puts a word without a flag in the first place no flag named, however far down the table: here the
# API key's, which silently replaced the one the environment holds.
def test_a_word_without_a_flag_after_named_flags_is_refused_saying_where_it_would_go(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint), "stray")
    assert_rejected_before_anything(result, tmp_path, endpoint, "'stray'", "--api_key")


@pytest.mark.parametrize("before", [(), ("--api_key=",)], ids=["in-the-keys-place", "after-an-empty-api-key"])
def test_a_word_without_a_flag_that_may_be_the_key_is_refused_without_showing_it(tmp_path, endpoint, before):
    # A key pasted as a word of its own, or after "--api_key=" with a space, was quoted whole in the refusal.
    key = "sk-pasted-0123456789abcdef"
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint), *before, key)
    assert_rejected_before_anything(result, tmp_path, endpoint, "--api_key", "'sk-p'… (the rest not shown")
    assert key[3:11] not in result.stdout + result.stderr


def test_an_unquoted_value_with_a_space_is_refused_not_split(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, "--ephemeral_system_prompt", "Be", "brief"))
    assert_rejected_before_anything(result, tmp_path, endpoint, "'brief'", "quote")


def test_the_first_flags_may_be_given_by_place_as_the_reference_runner_takes_them(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["q"])
    result = run_cli(tmp_path, str(dataset), "2", "run", "terminal_only", *endpoint_args(endpoint))
    assert result.returncode == 0, result.stderr
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 1


def test_space_separated_flag_values_are_accepted(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["first", "second", "third"])
    result = run_cli(tmp_path, "--dataset_file", str(dataset), "--batch_size", "2", "--run_name", "spaced",
                     "--distribution", "terminal_only", "--base_url", endpoint.base_url, "--model", "scripted-model",
                     "--max_samples", "2")
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "data" / "spaced"
    assert [p.name for p in run_dir.glob("batch_*.jsonl")] == ["batch_0.jsonl"]
    assert sorted(human_prompt(row) for row in read_jsonl(run_dir / "trajectories.jsonl")) == ["first", "second"]


# -- dataset lines --------------------------------------------------------------------

def run_dataset_lines(tmp_path, endpoint, lines: list[str], *extra: str):
    args = good_args(tmp_path, endpoint, *extra)
    (tmp_path / "dataset.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return run_cli(tmp_path, *args)


def test_blank_lines_are_ignored_silently(tmp_path, endpoint):
    result = run_dataset_lines(tmp_path, endpoint, ['{"prompt": "one"}', "", "   ", '{"prompt": "two"}', ""])
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr
    rows = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert sorted((row["prompt_index"], human_prompt(row)) for row in rows) == [(0, "one"), (1, "two")]


@pytest.mark.parametrize("bad_line, complaint", [
    ("this is not json", "not valid JSON"),
    ('["prompt", "in an array"]', "JSON object"),
    ('{"question": "no prompt key"}', '"prompt"'),
    ('{"prompt": ""}', '"prompt"'),
    ('{"prompt": "   "}', '"prompt"'),
    ('{"prompt": 42}', '"prompt"'),
    ('{"prompt": "with image", "image": 7}', '"image"'),
], ids=["not-json", "array", "no-prompt", "empty-prompt", "blank-prompt", "non-string-prompt", "non-string-image"])
def test_unusable_line_is_skipped_with_a_warning_naming_its_line_number(tmp_path, endpoint, bad_line, complaint):
    result = run_dataset_lines(tmp_path, endpoint, ['{"prompt": "before"}', "", bad_line, '{"prompt": "after"}'])
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "line 3" in warnings[0] and complaint in warnings[0], result.stderr
    rows = batch_rows(tmp_path / "data" / "run")
    # the prompt index is the position among valid rows, so the bad line takes no index
    assert sorted((row["prompt_index"], human_prompt(row)) for row in rows) == [(0, "before"), (1, "after")]
    assert len(endpoint.requests) == 2


def test_many_bad_lines_are_named_a_few_at_a_time_then_counted_and_recorded(tmp_path, endpoint):
    lines = ['{"prompt": "good"}'] + ["not json"] * 500 + ['{"prompt": "also good"}']
    result = run_dataset_lines(tmp_path, endpoint, lines)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert [w.split(":")[1].strip() for w in warnings[:5]] == ["line 2", "line 3", "line 4", "line 5", "line 6"]
    assert len(warnings) == 6 and "495 more bad lines skipped (500 in all)" in warnings[5]
    assert "500 bad lines skipped" in result.stdout
    statistics = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    assert statistics["skipped_dataset_lines"] == 500


def test_max_samples_uses_only_the_first_valid_prompts(tmp_path, endpoint):
    lines = ["broken", '{"prompt": "p0"}', '{"prompt": "p1"}', '{"prompt": "p2"}', '{"prompt": "p3"}']
    result = run_dataset_lines(tmp_path, endpoint, lines, "--max_samples=2")
    assert result.returncode == 0, result.stderr
    rows = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    assert sorted(human_prompt(row) for row in rows) == ["p0", "p1"]
    assert len(endpoint.requests) == 2
    statistics = json.loads((tmp_path / "data" / "run" / "statistics.json").read_text())
    assert statistics["total_prompts"] == 2


# -- first run: no key, no endpoint --------------------------------------------------

def test_no_key_and_no_base_url_stops_with_setup_guidance(tmp_path):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["q"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                     "--distribution=terminal_only")
    line = error_line(result)
    assert line.startswith("error:")
    guidance = result.stderr
    assert "OPENROUTER_API_KEY" in guidance and "OPENAI_API_KEY" in guidance
    for server in ("Ollama", "vLLM", "llama.cpp"):
        assert server in guidance
    assert "--base_url=http://localhost" in guidance
    assert not (tmp_path / "data").exists()


def test_a_keyless_local_endpoint_needs_no_api_key(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint))     # cli_environment drops both key variables
    assert result.returncode == 0, result.stderr
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 1


# A key pasted with a carriage return, or with a character that is not ASCII, failed every prompt's request.
@pytest.mark.parametrize("key", ["sk-secret-key\r", "sk-secret-kéy"])
@pytest.mark.parametrize("source", ["OPENAI_API_KEY", "--api_key"])
def test_an_api_key_no_http_header_can_carry_is_rejected_without_showing_it(tmp_path, endpoint, key, source):
    flag = [f"--api_key={key}"] if source == "--api_key" else []
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, *flag), env={"OPENAI_API_KEY": key})
    assert_rejected_before_anything(result, tmp_path, endpoint, f"the API key from {source}", "HTTP header")
    assert "secret" not in result.stdout + result.stderr


# -- --list_distributions -----------------------------------------------------------------------

def test_list_distributions_prints_every_distribution_with_probabilities(tmp_path):
    result = run_cli(tmp_path, "--list_distributions")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    headers = [line.split(":")[0] for line in result.stdout.split("\nunavailable: ")[0].splitlines()
               if line and not line.startswith(" ")]
    assert headers == list(DISTRIBUTION_NAMES)
    assert "All available tools, all the time" in result.stdout
    assert "97%  browser+search" in result.stdout
    terminal_only = result.stdout.split("terminal_only:")[1].split("\n\n")[0]
    assert [line.split() for line in terminal_only.splitlines()[1:]] == [["100%", "terminal"], ["100%", "file"]]
    assert not (tmp_path / "data").exists()


def test_list_distributions_marks_the_toolsets_this_machine_cannot_offer_and_says_why(tmp_path):
    result = run_cli(tmp_path, "--list_distributions",
                     env={"BROWSER_EXECUTABLE": str(tmp_path / "no-chromium"), "SEARXNG_URL": "http://127.0.0.1:9"})
    assert result.returncode == 0, result.stderr

    def entries(name: str) -> list[str]:
        return [" ".join(line.split()) for line in result.stdout.split(f"\n{name}:")[1].split("\n\n")[0].splitlines()[1:]]

    assert entries("browser_only") == ["100% browser (unavailable here)"]
    assert entries("browser_tasks")[0] == "97% browser+search (browser unavailable here)"
    assert "100% terminal" in entries("terminal_web") and "100% web" in entries("terminal_web")
    why = " ".join(result.stdout.split("\nunavailable: browser_navigate, ")[1].split("\nunavailable: ")[0].split())
    assert "BROWSER_EXECUTABLE" in why and "[browser]" in why


# -- an existing run directory ----------------------------------------

def test_rerun_without_resume_refuses_and_leaves_results_untouched(tmp_path, endpoint):
    args = good_args(tmp_path, endpoint, prompts=("one", "two"))
    assert run_cli(tmp_path, *args).returncode == 0
    batch = tmp_path / "data" / "run" / "batch_0.jsonl"
    before = batch.read_bytes()
    merged_before = (tmp_path / "data" / "run" / "trajectories.jsonl").read_bytes()
    requests_before = len(endpoint.requests)
    result = run_cli(tmp_path, *args)
    line = error_line(result)
    assert "batch_0.jsonl" in line and "--resume" in line and "--run_name" in line
    assert batch.read_bytes() == before
    assert (tmp_path / "data" / "run" / "trajectories.jsonl").read_bytes() == merged_before
    assert len(endpoint.requests) == requests_before


# -- two runs on one run name ---------------------------------------------------------

@pytest.mark.parametrize("in_the_way", ["data/run", "data"], ids=["the-run-directory", "its-parent"])
def test_a_file_where_the_run_directory_goes_is_one_clear_error_and_stays(tmp_path, endpoint, in_the_way):
    (tmp_path / "data").mkdir(exist_ok=in_the_way == "data/run")
    if in_the_way == "data":
        (tmp_path / "data").rmdir()
    (tmp_path / in_the_way).write_text("mine")
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    error_line(result)
    assert "is not a directory" in said(result) and "--run_name" in said(result)
    assert (tmp_path / in_the_way).read_text() == "mine"
    assert endpoint.requests == []


# It was called "a file in the way".
def test_a_symlink_loop_where_the_run_directory_goes_is_named_as_one(tmp_path, endpoint):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "run").symlink_to("run")
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    error_line(result)
    assert "Too many levels of symbolic links" in said(result) and "--run_name" in said(result)
    assert "file in the way" not in said(result)
    assert (tmp_path / "data" / "run").is_symlink() and endpoint.requests == []


# It was called "a file in the way" too.
@pytest.mark.parametrize("in_the_way", ["data/run", "data"], ids=["the-run-directory", "its-parent"])
def test_a_dangling_symlink_where_the_run_directory_goes_is_named_as_one(tmp_path, endpoint, in_the_way):
    (tmp_path / "data").mkdir(exist_ok=in_the_way == "data/run")
    if in_the_way == "data":
        (tmp_path / "data").rmdir()
    (tmp_path / in_the_way).symlink_to(tmp_path / "gone")
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint))
    error_line(result)
    assert f"{in_the_way} is a symbolic link to {tmp_path / 'gone'}, which does not exist" in said(result)
    assert "--run_name" in said(result) and "file in the way" not in said(result)
    assert (tmp_path / in_the_way).is_symlink() and not (tmp_path / "gone").exists() and endpoint.requests == []


def said(result) -> str:
    """The run's stderr as one line (the console wraps long lines at 80 columns in a log)."""
    return " ".join(result.stderr.split())


def without_root_file_access() -> list[str]:
    """A command prefix under which even root obeys file modes (it drops the capabilities to ignore them)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv writes everywhere")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


def test_a_run_directory_the_runner_may_not_write_is_one_clear_error(tmp_path, endpoint):
    run_dir = tmp_path / "data" / "run"
    run_dir.mkdir(parents=True)
    run_dir.chmod(0o555)
    command = [*without_root_file_access(), *batch_runner_command(*good_args(tmp_path, endpoint))]
    result = subprocess.run(command, cwd=tmp_path, env=cli_environment(tmp_path), capture_output=True, text=True,
                            timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    error_line(result)
    assert "cannot write" in said(result) and "Permission denied" in said(result)
    assert list(run_dir.iterdir()) == []


def test_report_in_a_run_directory_the_runner_may_not_write_is_one_clear_line(tmp_path, endpoint):
    assert run_cli(tmp_path, *good_args(tmp_path, endpoint)).returncode == 0
    run_dir = tmp_path / "data" / "run"
    page = (run_dir / "report.html").read_bytes()
    run_dir.chmod(0o555)
    command = [*without_root_file_access(), *batch_runner_command("--report", "--run_name=run")]
    result = subprocess.run(command, cwd=tmp_path, env=cli_environment(tmp_path), capture_output=True, text=True,
                            timeout=120, stdin=subprocess.DEVNULL)
    run_dir.chmod(0o755)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    error_line(result)
    assert "cannot write" in said(result) and "Permission denied" in said(result)
    assert (run_dir / "report.html").read_bytes() == page


@contextlib.contextmanager
def run_made_then_read_only(tmp_path, endpoint) -> Iterator[Path]:
    """A finished run whose data/ then lies on a filesystem mounted read-only (a snapshot, a full
    disk's emergency remount), where even root cannot write; ``tmp_path`` is the working directory."""
    with mounted_tmpfs(tmp_path / "data", "size=64m") as data:
        assert run_cli(tmp_path, *good_args(tmp_path, endpoint)).returncode == 0
        subprocess.run(["mount", "-o", "remount,ro", str(data)], check=True)
        yield data / "run"


@pytest.mark.parametrize("command", [["--resume"], ["--report", "--run_name=run"]], ids=["resume", "report"])
def test_a_run_directory_on_a_read_only_filesystem_is_one_clear_error(tmp_path, endpoint, command):
    with run_made_then_read_only(tmp_path, endpoint) as run_dir:
        before = {path.name: path.read_bytes() for path in run_dir.iterdir()}
        args = good_args(tmp_path, endpoint, *command) if command == ["--resume"] else command
        result = run_cli(tmp_path, *args)
        after = {path.name: path.read_bytes() for path in run_dir.iterdir()}
    error_line(result)
    assert "cannot write" in said(result) and "Read-only file system" in said(result), said(result)
    assert after == before


def test_an_export_to_a_place_the_runner_may_not_write_is_one_clear_line(tmp_path, endpoint):
    assert run_cli(tmp_path, *good_args(tmp_path, endpoint)).returncode == 0
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o555)
    command = [*without_root_file_access(),
               *batch_runner_command("--run_name=run", "--export=sharegpt", f"--out={closed / 'out.jsonl'}")]
    result = subprocess.run(command, cwd=tmp_path, env=cli_environment(tmp_path), capture_output=True, text=True,
                            timeout=120, stdin=subprocess.DEVNULL)
    error_line(result)
    assert "cannot write" in said(result) and "Permission denied" in said(result) and "--out" in said(result)
    assert list(closed.iterdir()) == []


def files_of(run_dir: Path) -> dict[str, bytes]:
    """What a run directory holds, but its lock (which takes each runner's pid)."""
    return {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file() and path.name != ".lock"}


def half_done_run(tmp_path, endpoint, *, all_done: bool = False) -> Path:
    """A run of four prompts in two batch files; all done, or two left for --resume."""
    done = [] if all_done else ["--max_samples=2"]
    assert run_cli(tmp_path, *good_args(tmp_path, endpoint, *done, prompts=("a", "b", "c", "d"))).returncode == 0
    endpoint.reset()
    return tmp_path / "data" / "run"


def resumed_obeying_file_modes(tmp_path, endpoint, *extra: str) -> subprocess.CompletedProcess:
    return run_cli(tmp_path, *good_args(tmp_path, endpoint, "--resume", *extra, prompts=("a", "b", "c", "d")),
                   prefix=tuple(without_root_file_access()))


# The resume cut torn tails off every batch file, and the merge appended to trajectories.jsonl, through
# a write that ended in a PermissionError traceback: with every prompt done, or after the prompts ran.
@pytest.mark.parametrize("name", ["batch_0.jsonl", "trajectories.jsonl"])
@pytest.mark.parametrize("all_done", [False, True], ids=["prompts-left", "all-done"])
def test_a_resume_that_may_not_write_a_file_it_writes_in_place_is_one_clear_error(tmp_path, endpoint, name,
                                                                                   all_done):
    run_dir = half_done_run(tmp_path, endpoint, all_done=all_done)
    before = files_of(run_dir)
    (run_dir / name).chmod(0o444)
    result = resumed_obeying_file_modes(tmp_path, endpoint)
    assert error_line(result) == (f"error: cannot write in data/run: Permission denied (data/run/{name}). Run as a "
                                  "user who may write there, or choose another --run_name.")
    assert files_of(run_dir) == before and endpoint.requests == []


# The lock opened, the ledger of what was spent could not be written beside it: a traceback.
def test_a_resume_in_a_run_directory_it_may_not_add_files_to_is_one_clear_error(tmp_path, endpoint):
    run_dir = half_done_run(tmp_path, endpoint)
    before = files_of(run_dir)
    run_dir.chmod(0o555)
    try:
        result = resumed_obeying_file_modes(tmp_path, endpoint)
    finally:
        run_dir.chmod(0o755)
    assert error_line(result) == ("error: cannot write in data/run: Permission denied (data/run). Run as a user who "
                                  "may write there, or choose another --run_name.")
    assert files_of(run_dir) == before and endpoint.requests == []


# --export blamed --out ("cannot write data/run/batch_1.jsonl"), --report said it could not write the
# report, and --resume ended in a traceback.
@pytest.mark.parametrize("command", [["--export=sharegpt", "--run_name=run"], ["--report", "--run_name=run"],
                                     ["--resume"]], ids=["export", "report", "resume"])
def test_a_batch_file_this_user_may_not_read_is_named_as_one_it_cannot_read(tmp_path, endpoint, command):
    run_dir = half_done_run(tmp_path, endpoint, all_done=True)
    before = files_of(run_dir)
    (run_dir / "batch_1.jsonl").chmod(0)
    if command == ["--resume"]:
        result = resumed_obeying_file_modes(tmp_path, endpoint)
    else:
        result = run_cli(tmp_path, *command, prefix=tuple(without_root_file_access()))
    (run_dir / "batch_1.jsonl").chmod(0o644)
    assert error_line(result) == ("error: cannot read data/run/batch_1.jsonl: Permission denied. Run as a user who "
                                  "may read it.")
    assert result.stderr.strip() == error_line(result)
    assert files_of(run_dir) == before and endpoint.requests == []


# A checkpoint this user may not read was taken for none and replaced: the corrupted rows a
# --rerun_corrupted resume had replaced counted as done again, and no warning said the arguments changed.
@pytest.mark.parametrize("name", ["checkpoint.json", "spent.jsonl"])
def test_a_file_the_resume_reads_that_this_user_may_not_read_is_one_clear_error(tmp_path, endpoint, name):
    run_dir = half_done_run(tmp_path, endpoint)
    before = files_of(run_dir)
    (run_dir / name).chmod(0)
    result = resumed_obeying_file_modes(tmp_path, endpoint)
    (run_dir / name).chmod(0o644)
    assert error_line(result) == f"error: cannot read data/run/{name}: Permission denied. Run as a user who may read it."
    assert files_of(run_dir) == before and endpoint.requests == []


# The export's filters read which corrupted rows were replaced from the checkpoint alone.
def test_an_export_from_a_run_whose_checkpoint_this_user_may_not_read_is_one_clear_error(tmp_path, endpoint):
    run_dir = half_done_run(tmp_path, endpoint, all_done=True)
    (run_dir / "checkpoint.json").chmod(0)
    result = run_cli(tmp_path, "--export=sharegpt", "--run_name=run", prefix=tuple(without_root_file_access()))
    (run_dir / "checkpoint.json").chmod(0o644)
    assert error_line(result) == ("error: cannot read data/run/checkpoint.json: Permission denied. Run as a user who "
                                  "may read it.")


# --report ended in a traceback (IsADirectoryError from the rename), which the run's warning had just
# said would write the report.
def test_a_directory_where_the_report_goes_is_named_by_the_run_and_by_report(tmp_path, endpoint):
    (tmp_path / "data" / "run" / "report.html").mkdir(parents=True)
    message = "data/run/report.html is not a regular file: the run writes it. Move it out of data/run/."
    run = run_cli(tmp_path, *good_args(tmp_path, endpoint))
    assert run.returncode == 0 and message in said(run), run.stderr
    result = run_cli(tmp_path, "--report", "--run_name=run")
    assert error_line(result) == f"error: {message}"
    assert (tmp_path / "data" / "run" / "report.html").is_dir()


def linked_copy(source: Path, target: Path) -> None:
    """What `cp -al` makes: every file of ``source`` a second name of the same file, in ``target``."""
    shutil.copytree(source, target, copy_function=os.link)


# A copy made with hard links (cp -al, to branch a run cheaply) was resumed into the original: its batch
# files and trajectories.jsonl grew with the copy's rows, and the two runs shared one lock.
@pytest.mark.parametrize("linked", ["whole-directory", ".lock", "batch_0.jsonl", "trajectories.jsonl"])
def test_a_file_the_run_writes_in_place_that_has_another_name_is_refused_and_that_name_left_as_it_was(
        tmp_path, endpoint, linked):
    orig = half_done_run(tmp_path, endpoint)
    if linked == "whole-directory":
        linked_copy(orig, tmp_path / "data" / "branch")
        run_name, named = "branch", ".lock"
    else:
        os.link(orig / linked, tmp_path / "elsewhere")
        run_name, named = "run", linked
    before = files_of(orig)
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, "--resume", f"--run_name={run_name}",
                                          prompts=("a", "b", "c", "d")))
    assert error_line(result) == (f"error: data/{run_name}/{named} is one file with 2 names (hard links, as cp -al "
                                  "makes): the run writes it in place, so it would write under the other name too. "
                                  "Copy the run directory without links (cp -a, without -l).")
    assert files_of(orig) == before and endpoint.requests == []


# The files the run replaces whole (written beside, renamed over) are left to their other names as they
# were, and a run and its resume make no second name for any file.
def test_files_the_run_replaces_whole_may_have_other_names_which_keep_what_they_held(tmp_path, endpoint):
    run_dir = half_done_run(tmp_path, endpoint)
    assert all(path.stat().st_nlink == 1 for path in run_dir.iterdir() if path.is_file())
    backup = tmp_path / "backup"
    backup.mkdir()
    replaced = ["checkpoint.json", "statistics.json", "spent.jsonl", ".merge.json", "report.html"]
    for name in replaced:
        os.link(run_dir / name, backup / name)
    kept = {name: (backup / name).read_bytes() for name in replaced}
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, "--resume", prompts=("a", "b", "c", "d")))
    assert result.returncode == 0, result.stderr
    assert len(endpoint.requests) == 2
    assert {name: (backup / name).read_bytes() for name in replaced} == kept
    assert all(path.stat().st_nlink == 1 for path in run_dir.iterdir() if path.is_file())


# The export wrote over the run's own rows, or replaced a device node with its file (as root).
@pytest.mark.parametrize("out", ["data/run/batch_0.jsonl", "data/run/trajectories.jsonl", "data/run/checkpoint.json",
                                 "FIFO"])
def test_an_export_over_the_runs_own_files_or_a_non_regular_file_is_refused_and_nothing_changes(tmp_path, endpoint,
                                                                                               out):
    assert run_cli(tmp_path, *good_args(tmp_path, endpoint)).returncode == 0
    if out == "FIFO":
        out = str(tmp_path / "fifo")
        os.mkfifo(out)
    run_dir = tmp_path / "data" / "run"
    before = {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file()}
    result = run_cli(tmp_path, "--run_name=run", "--export=sharegpt", f"--out={out}", timeout=30)
    assert "--out" in error_line(result)
    assert {path.name: path.read_bytes() for path in run_dir.iterdir() if path.is_file()} == before
    assert (tmp_path / out).is_fifo() or (tmp_path / out).is_relative_to(run_dir)


# The export replaced it: the run's prompts were gone, and --resume could run nothing more.
@pytest.mark.parametrize("spelled", ["as-given", "another-way"])
def test_an_export_over_the_runs_dataset_is_refused_and_the_dataset_stays(tmp_path, endpoint, spelled):
    assert run_cli(tmp_path, *good_args(tmp_path, endpoint)).returncode == 0
    dataset = tmp_path / "dataset.jsonl"
    before = dataset.read_bytes()
    out = dataset if spelled == "as-given" else Path("tmp") / ".." / "dataset.jsonl"
    result = run_cli(tmp_path, "--run_name=run", "--export=sharegpt", f"--out={out}")
    assert "the run's dataset" in error_line(result) and "--out" in error_line(result)
    assert dataset.read_bytes() == before


def test_an_export_to_a_place_no_file_can_be_made_is_one_clear_line(tmp_path, endpoint):
    assert run_cli(tmp_path, *good_args(tmp_path, endpoint)).returncode == 0
    result = run_cli(tmp_path, "--run_name=run", "--export=sharegpt", "--out=/proc/self/mem")    # /proc: ENOENT
    assert "cannot write" in error_line(result) and "--out" in error_line(result)


def test_second_run_on_a_busy_run_directory_is_refused_and_the_first_finishes(tmp_path, endpoint):
    held = HeldReplies(endpoint, {"take your time": 0})     # the first run holds the directory until then
    args = good_args(tmp_path, endpoint, prompts=("take your time",))
    first = subprocess.Popen(batch_runner_command(*args), cwd=tmp_path, env=cli_environment(tmp_path),
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lock = tmp_path / "data" / "run" / ".lock"
        deadline = time.monotonic() + 30
        # the holder writes its pid once it holds the lock
        while not (lock.exists() and lock.read_text().strip()):
            assert first.poll() is None and time.monotonic() < deadline, "first run never took the lock"
            time.sleep(0.05)
        second = run_cli(tmp_path, *args)
        held.open_all()
        line = error_line(second)
        assert "in use" in line and "--run_name" in line
        out, err = first.communicate(timeout=60)
    finally:
        held.open_all()
        if first.poll() is None:
            first.kill()
            first.communicate()
    assert first.returncode == 0, err
    assert "Traceback" not in out + err
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 1
    assert len(endpoint.requests) == 1


def test_a_run_directory_removed_during_the_run_is_one_clear_error(tmp_path, endpoint):
    prompts = [f"[[sleep 0.3]] question {number}" for number in range(12)]
    args = good_args(tmp_path, endpoint, "--num_workers=2", prompts=prompts)
    run = subprocess.Popen(batch_runner_command(*args), cwd=tmp_path, env=cli_environment(tmp_path),
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = tmp_path / "data" / "run"
        deadline = time.monotonic() + 60
        while not (run_dir / "batch_0.jsonl").exists():
            assert run.poll() is None and time.monotonic() < deadline, "the run never wrote a row"
            time.sleep(0.02)
        # as `rm -rf` again would: the run may make a file between the listing and the directory's removal
        while run_dir.exists():
            shutil.rmtree(run_dir, ignore_errors=True)
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    result = subprocess.CompletedProcess(run.args, run.returncode, out, err)
    line = error_line(result)
    # the run may meet the removal half done, its files gone and the directory not yet
    assert "removed while the run was writing" in line and str(Path("data") / "run") in line, line


# -- --reasoning_disabled -----------------------------------------------------------------------

def test_reasoning_disabled_warns_about_the_filter_and_turns_reasoning_off(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, "--reasoning_disabled", "--reasoning_effort=high"))
    assert result.returncode == 0, result.stderr
    warning = " ".join(result.stderr.split())      # a log file gets it wrapped at 80 columns
    assert "warning: --reasoning_disabled" in warning and "discard every sample" in warning
    assert "--discard_no_reasoning=False" in warning
    [request] = endpoint.requests
    assert request["reasoning"] == {"enabled": False}      # wins over --reasoning_effort


# -- bad inputs that once ended in a traceback ----------------------------------------------------

@pytest.mark.parametrize("mode", [[], ["--report"]], ids=["run", "report"])
def test_run_name_longer_than_a_directory_name_may_be_is_one_clear_error(tmp_path, endpoint, mode):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, *mode, run_name="r" * 300))
    assert_rejected_before_anything(result, tmp_path, endpoint, "--run_name is 300 characters long; at most 128")
    assert "r" * 129 not in result.stderr


def test_a_dataset_line_nested_100000_deep_is_skipped_with_a_warning_naming_it(tmp_path, endpoint):
    deep = '{"prompt": "deep", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    result = run_dataset_lines(tmp_path, endpoint, ['{"prompt": "before"}', "", deep, '{"prompt": "after"}'])
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "line 3" in warnings[0] and "nested too deeply" in warnings[0], result.stderr
    assert sorted(human_prompt(row) for row in batch_rows(tmp_path / "data" / "run")) == ["after", "before"]


# A file without a newline in gigabytes (a binary file, a dataset saved as one JSON array) was read as one
# line, held in memory whole and then several times over: the run died of it, or took the machine's memory.
def test_a_line_longer_than_any_prompt_can_be_is_skipped_unread_with_a_warning(tmp_path, endpoint):
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux) to bound the run's memory")
    dataset = tmp_path / "dataset.jsonl"
    with dataset.open("wb") as handle:
        handle.write(b'{"prompt": "before"}\n')
        handle.seek(4 * 1024**3, os.SEEK_CUR)          # a hole: 4 GiB of NUL bytes that take no disk
        handle.write(b'\n{"prompt": "after"}\n')
    args = [f"--dataset_file={dataset}", "--batch_size=2", "--run_name=run", "--distribution=terminal_only",
            *endpoint_args(endpoint)]
    result = run_cli(tmp_path, *args, prefix=("prlimit", f"--as={2 * 1024**3}"))
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "line 2: longer than 64 MiB" in warnings[0], result.stderr
    assert sorted(human_prompt(row) for row in batch_rows(tmp_path / "data" / "run")) == ["after", "before"]


# No path or image name can hold either; a lone surrogate (JSON's \ud800 escape, which no command line can
# carry either) failed its prompt with a traceback in its row, and every --resume ran it again.
@pytest.mark.parametrize("field", ["cwd", "image"])
@pytest.mark.parametrize("character, complaint", [("\0", "contains a NUL character"),
                                                  ("\ud800", "is not valid Unicode (a lone surrogate)")],
                         ids=["nul", "lone_surrogate"])
def test_a_path_no_system_can_hold_in_cwd_or_image_skips_the_line_with_a_warning_and_no_resume_retries_it(
        tmp_path, endpoint, field, character, complaint):
    bad = json.dumps({"prompt": "with it", field: f"/tmp/a{character}b"})
    args = good_args(tmp_path, endpoint)
    (tmp_path / "dataset.jsonl").write_text("\n".join(['{"prompt": "before"}', bad, '{"prompt": "after"}']) + "\n")
    for attempt in (args, [*args, "--resume"]):
        endpoint.reset()
        result = run_cli(tmp_path, *attempt)
        assert result.returncode == 0, result.stderr
        output = result.stdout + result.stderr
        assert "Traceback" not in output and character not in output
        warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
        assert warnings == [f'warning: line 2: "{field}" {complaint}; skipped'], result.stderr
    assert endpoint.requests == []                      # the resume found nothing to run, nor to retry
    assert sorted(human_prompt(row) for row in batch_rows(tmp_path / "data" / "run")) == ["after", "before"]


# A container engine reads such a name as one of its options ("--privileged"); no image name starts so.
def test_an_image_that_starts_with_a_dash_skips_the_line_with_a_warning(tmp_path, endpoint):
    args = good_args(tmp_path, endpoint)
    bad = json.dumps({"prompt": "privileged", "image": "--privileged"})
    (tmp_path / "dataset.jsonl").write_text("\n".join(['{"prompt": "before"}', bad]) + "\n")
    result = run_cli(tmp_path, *args)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ['warning: line 2: "image" starts with "-", as no image name does; skipped'], result.stderr
    assert [human_prompt(row) for row in batch_rows(tmp_path / "data" / "run")] == ["before"]


@pytest.mark.parametrize("asking", [["--help"], ["-h"], [], ["--run_name=x", "--help"]])
def test_help_and_no_arguments_print_the_usage_page(tmp_path, asking):
    result = run_cli(tmp_path, *asking)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python batch_runner.py --dataset_file=FILE --batch_size=N --run_name=NAME")
    assert "--list_distributions" in result.stdout and "README.md" in result.stdout
    assert not (tmp_path / "data").exists()


def test_help_names_the_installed_command_when_run_as_it(tmp_path):
    command = Path(sys.executable).parent / "batch_runner"
    if not command.exists():
        pytest.skip(f"no {command}: pip install -e . installs it")
    result = subprocess.run([str(command), "--help"], cwd=tmp_path, env=cli_environment(tmp_path),
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: batch_runner --dataset_file=FILE")
    assert "python batch_runner.py" not in result.stdout


def test_help_lists_every_terminal_env_kind(tmp_path):
    from batchrun.environments import ENVIRONMENT_KINDS
    result = run_cli(tmp_path, "--help")
    [line] = [line for line in result.stdout.splitlines() if "TERMINAL_ENV=" in line]
    assert line.split("TERMINAL_ENV=")[1].split()[0] == "|".join(ENVIRONMENT_KINDS)
    assert {"bubblewrap", "modal", "apptainer"} <= set(ENVIRONMENT_KINDS)


# -- closed standard streams ----------------------------------------------------------------

def closed(descriptor: int) -> tuple[str, ...]:
    """A command prefix that runs the CLI with ``descriptor`` closed, as ``>&-`` in a shell does."""
    return ("sh", "-c", f'exec "$@" {descriptor}>&-', "sh")


def test_a_run_with_its_stdout_closed_completes_with_exit_0(tmp_path, endpoint):
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint), prefix=closed(1))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 1


@pytest.mark.parametrize("descriptor", [0, 1, 2])
def test_a_closed_standard_stream_is_no_run_file_for_the_workers(tmp_path, endpoint, descriptor):
    """Closed, its descriptor went to the first file the run opened (its directory's lock), and every
    worker inherited that as its stdin, stdout or stderr."""
    prompt = f'[[call terminal {{"command": "readlink /proc/$PPID/fd/{descriptor}"}}]] where'
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint, prompts=(prompt,)), prefix=closed(descriptor),
                     env={"TERMINAL_ENV": "local"})
    assert result.returncode == 0, result.stdout + result.stderr
    [row] = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    [response] = [turn["value"] for turn in row["conversations"] if turn["from"] == "tool"]
    assert "/dev/null" in response and str(tmp_path / "data") not in response, response


# -- output that cannot be written --------------------------------------------------------

def test_a_run_whose_stdout_is_a_full_disk_completes_and_says_so_once_on_stderr(tmp_path, endpoint):
    args = good_args(tmp_path, endpoint, prompts=("q1", "q2", "q3"))
    result = run_cli(tmp_path, *args, prefix=("sh", "-c", 'exec "$@" >/dev/full', "sh"))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert [line for line in result.stderr.splitlines() if "stdout" in line] == [
        "warning: stdout cannot be written (No space left on device): nothing more is printed there"]
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 3


def test_a_run_whose_stdout_reader_goes_away_completes(tmp_path, endpoint):
    """As `batch_runner ... | head -1`: the pipe's reader takes one line and closes it."""
    args = good_args(tmp_path, endpoint, prompts=("q1", "q2", "q3"))
    process = subprocess.Popen(batch_runner_command(*args), cwd=tmp_path, env=cli_environment(tmp_path),
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline().startswith(b"batch_runner")
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=120) == 0, stderr
    assert "Traceback" not in stderr and "stdout" not in stderr
    assert len(read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")) == 3


def test_a_run_started_in_a_directory_since_removed_says_so_in_one_line(tmp_path, endpoint):
    # Before: three chained tracebacks, the last of RunDirectory.acquire making data/ (FileNotFoundError).
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["a"])
    gone = tmp_path / "gone"
    gone.mkdir()
    command = shlex.join(batch_runner_command(f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                                              *endpoint_args(endpoint)))
    result = subprocess.run(["bash", "-c", f'rmdir "$PWD" && exec {command}'], cwd=gone,
                            env=cli_environment(tmp_path), capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: the working directory was removed after this command's shell entered it, and data/ is made there: "
        "cd to a directory that exists and run the command again"]
    assert not endpoint.requests


def test_a_umask_that_denies_the_owner_everything_is_one_clear_error_and_leaves_nothing_in_tmp(tmp_path, endpoint):
    # Before: the sandbox's start-up check made its scratch directory mode 000 and could not enter it: a
    # traceback, and that directory left in $TMPDIR by every try.
    prefix = ("bash", "-c", 'umask 0700 && exec "$@"', "bash", *obeying_file_modes())
    result = run_cli(tmp_path, *good_args(tmp_path, endpoint), prefix=prefix)
    assert error_line(result).startswith("error: the umask (0700) takes from the owner the permissions it masks")
    assert not (tmp_path / "data").exists()
    assert endpoint.requests == []
    assert list((tmp_path / "tmp").iterdir()) == []
