"""The redactor: the user's secrets never survive into anything written, whole or cut by a cap."""

from __future__ import annotations

import json

import pytest
from conftest import endpoint_args, run_cli, write_dataset

from batchrun.security import REDACTED, Redactor, canonical_json_escapes

SECRET = "sk-or-v1-0123456789abcdef0123456789abcdef0123456789abcdef"
CAP_NOTE = "\n[output truncated: 9000 more characters not shown]"


def pieces_of(secret: str, shortest: int) -> list[str]:
    """Every piece of ``secret`` at least ``shortest`` characters long that a cap could leave."""
    return [secret[start:end] for start in range(len(secret)) for end in range(start + shortest, len(secret) + 1)]


def test_a_whole_secret_is_replaced_wherever_it_appears():
    redact = Redactor([SECRET])
    assert redact(f"key={SECRET}; again {SECRET}.") == f"key={REDACTED}; again {REDACTED}."


def test_text_without_a_secret_is_left_as_it_is():
    text = "an ordinary line of output, with numbers 0123 4567 89ab and a key= that is empty"
    assert Redactor([SECRET])(text) == text


@pytest.mark.parametrize("cut", range(8, len(SECRET)))
def test_a_secret_cut_by_an_output_cap_leaves_no_usable_prefix(cut):
    redacted = Redactor([SECRET])("the key is " + SECRET[:cut] + CAP_NOTE)
    assert not any(piece in redacted for piece in pieces_of(SECRET[:cut], 8)), redacted
    assert redacted.startswith("the key is ") and redacted.endswith(CAP_NOTE)


@pytest.mark.parametrize("cut", range(1, len(SECRET) - 7))
def test_a_secret_whose_start_a_cap_cut_off_leaves_no_usable_suffix(cut):
    redacted = Redactor([SECRET])("…" + SECRET[cut:] + " was in the log")
    assert SECRET[-8:] not in redacted and redacted.endswith(" was in the log")


def test_pieces_shorter_than_a_secret_can_be_are_kept():
    """Seven characters are kept: that many of a key are its public prefix ("sk-or-v"), and an
    ordinary word matching them is no reason to mangle text."""
    assert Redactor([SECRET])("sk-or-v and 0123456") == "sk-or-v and 0123456"


def test_several_secrets_and_overlapping_pieces_are_all_replaced():
    other = "ghp_abcdefghijklmnopqrstuvwxyz0123"
    redacted = Redactor([SECRET, other])(SECRET[:20] + other[10:] + " " + other + SECRET[-12:])
    assert not any(piece in redacted for secret in (SECRET, other) for piece in pieces_of(secret, 8))


def test_a_secret_thousands_of_characters_long_is_replaced_whole_and_cut():
    # Session tokens and keys in PEM or JWT form run to thousands of characters.
    token = "".join(chr(ord("a") + (i * 7) % 26) for i in range(5000))
    redact = Redactor([token])
    assert redact(f"[{token}]") == f"[{REDACTED}]"
    assert redact("cut: " + token[:3000]) == f"cut: {REDACTED}"


def test_a_run_starts_with_a_long_secret_in_its_environment(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["hello"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                     "--distribution=terminal_only", *endpoint_args(endpoint),
                     env={"AWS_SESSION_TOKEN": "IQoJb3JpZ2luX2VjE" * 60, "TERMINAL_ENV": "local"})
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("secret", ['Abcdefgh"IJKLMNOPQRS"tuvwxyz12', "Abcdefgh\\IJKLMNOPQRS\\tuvwxyz12",
                                    "Abcdefgh\nIJKLMNOPQRSé\ttuvwxyz12"], ids=["quotes", "backslashes", "controls"])
def test_a_secret_is_replaced_in_json_text_where_its_characters_are_escaped(secret):
    redact = Redactor([secret])
    for ascii_only in (False, True):
        text = json.dumps({"output": f"pw={secret} done"}, ensure_ascii=ascii_only)
        redacted = redact(text)
        assert json.loads(redacted) == {"output": f"pw={REDACTED} done"}, redacted


def test_json_text_finds_a_secret_whose_characters_are_written_as_escapes():
    hidden = json.dumps({"command": f"echo {SECRET}"}, ensure_ascii=False).replace("s", "\\u0073").replace("-", "\\u002d")
    assert json.loads(hidden) == {"command": f"echo {SECRET}"}
    assert json.loads(Redactor([SECRET]).json_text(hidden)) == {"command": f"echo {REDACTED}"}


def test_json_text_finds_a_secret_at_any_depth_of_nesting():
    hidden = "[" * 5000 + json.dumps(SECRET, ensure_ascii=True).replace("k", "\\u006b") + "]" * 5000
    assert SECRET[:8] not in Redactor([SECRET]).json_text(hidden)[:6000]


def test_an_escaped_backslash_before_u_is_not_read_as_an_escape():
    text = json.dumps({"path": "C:\\u0073ecret"})          # the characters backslash, u, 0, 0, 7, 3
    assert canonical_json_escapes(text) == text
    assert json.loads(canonical_json_escapes('"\\ud83d\\ude00 \\ud800 \\n \\u0022"')) == "\U0001f600 \ud800 \n \""


def test_json_text_without_a_secret_is_left_as_the_model_wrote_it():
    text = '{"command":  "echo \\u0068i"}'
    assert Redactor([SECRET]).json_text(text) == text


# --- end to end: an endpoint that echoes the key -----------------------------------------------------

def echoing(key: str):
    """A server hook that writes the key into every part of its replies: text, reasoning, a call's id,
    name and arguments, and the text of its final answer."""
    def reply(body: dict) -> tuple[int, dict, dict]:
        answered = any(message["role"] == "tool" for message in body["messages"])
        message: dict = {"role": "assistant", "content": f"The key is {key}.", "reasoning": f"I was told {key}"}
        if not answered:
            message["tool_calls"] = [{"id": f"call-{key}", "type": "function", "function": {
                "name": "terminal", "arguments": json.dumps({"command": f"echo {key[:30]}"})}}]
        usage = {"prompt_tokens": 1, "completion_tokens": 1}
        return 200, {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": message,
                     "finish_reason": "stop" if answered else "tool_calls"}], "usage": usage}, {}
    return reply


def test_a_key_the_endpoint_echoes_reaches_no_row_report_or_export(tmp_path, endpoint):
    key = "sk-test-ECHOED-0123456789abcdef0123"
    endpoint.script = echoing(key)
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["say the key"])
    args = [f"--dataset_file={dataset}", "--batch_size=2", "--run_name=run", "--distribution=terminal_only",
            *endpoint_args(endpoint)]
    result = run_cli(tmp_path, *args, env={"OPENAI_API_KEY": key})
    assert result.returncode == 0, result.stderr
    for fmt in ("openai", "sharegpt", "parquet"):
        assert run_cli(tmp_path, "--run_name=run", f"--export={fmt}", "--reasoning=think" * (fmt == "openai"),
                       env={"OPENAI_API_KEY": key}).returncode == 0
    written = [path for path in (tmp_path / "data").rglob("*") if path.is_file()]
    assert {path.name for path in written} >= {"batch_0.jsonl", "trajectories.jsonl", "report.html", "openai.jsonl",
                                               "sharegpt.jsonl", "trajectories.parquet"}
    everything = b"".join(path.read_bytes() for path in written) + (result.stdout + result.stderr).encode()
    assert not any(piece.encode() in everything for piece in pieces_of(key, 8))
    assert b"[REDACTED]" in everything


@pytest.mark.parametrize("prompt", ["Use the key {key} to call the API.", "[[fail 400 always]] Use {key}."],
                         ids=["trajectory", "failure_row"])
def test_a_key_in_a_dataset_prompt_reaches_no_row_or_report(tmp_path, endpoint, prompt):
    # Before, the human turn (and a failure row's prompt) kept it: datasets are often made from logs and
    # tickets where a key was pasted, and the rows are training data that travels further than the dataset.
    key = "sk-test-IN-PROMPT-0123456789abcdef0123"
    dataset = write_dataset(tmp_path / "dataset.jsonl", [prompt.format(key=key)])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=2", "--run_name=run",
                     "--distribution=terminal_only", *endpoint_args(endpoint), env={"OPENAI_API_KEY": key})
    assert result.returncode in (0, 2), result.stderr
    written = [path for path in (tmp_path / "data").rglob("*") if path.is_file()]
    everything = b"".join(path.read_bytes() for path in written) + (result.stdout + result.stderr).encode()
    assert not any(piece.encode() in everything for piece in pieces_of(key, 8))
    assert b"[REDACTED]" in everything


# A bug's traceback went to stderr as Python prints it: a key in the exception's text whole, and the
# control characters a model or an endpoint wrote into it raw.
def test_the_traceback_of_a_bug_shows_no_secret_and_no_control_character(monkeypatch, capsys):
    import batch_runner

    def failing(given, unknown):
        raise RuntimeError(f"a bug while holding {given['api_key']} and \x1b]52;c;aGk=\x07")

    exits: list[int] = []
    monkeypatch.setattr(batch_runner, "run_cli", failing)
    monkeypatch.setattr(batch_runner, "exit_without_teardown", exits.append)
    monkeypatch.setattr("sys.argv", ["batch_runner.py"])
    batch_runner.main("d.jsonl", 3, api_key=SECRET)
    said = capsys.readouterr().err
    assert exits == [1]
    assert "Traceback" in said and "RuntimeError: a bug while holding [REDACTED] and \\x1b]52;c;aGk=\\x07" in said
    assert SECRET not in said and "\x1b" not in said
