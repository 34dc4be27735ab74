"""The redactor: the user's secrets never survive into anything written, whole or cut by a cap."""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from conftest import endpoint_args, read_jsonl, run_cli, write_dataset

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


MARK = "sk-or-v1-"      # the public mark of SECRET's kind of key


@pytest.mark.parametrize("cut", range(len(MARK) + 8, len(SECRET)))
def test_a_secret_cut_by_an_output_cap_leaves_no_usable_prefix(cut):
    redacted = Redactor([SECRET])("the key is " + SECRET[:cut] + CAP_NOTE)
    assert not any(piece in redacted for piece in pieces_of(SECRET[len(MARK):cut], 8)), redacted
    assert MARK not in redacted
    assert redacted.startswith("the key is ") and redacted.endswith(CAP_NOTE)


@pytest.mark.parametrize("text", ["keys of this kind look like sk-proj-…", "export OPENAI_API_KEY=sk-proj-xxxx",
                                  "sk-proj-0123456 is seven characters past the mark"])
def test_text_naming_a_keys_kind_is_left_as_it_is(text):
    # Before, any 8 characters of a key's start counted, and "sk-proj-" is 8: every mention of OpenAI's
    # project keys in a row became [REDACTED], also in commands before they ran.
    assert Redactor(["sk-proj-Ab3dEfGh1234567890XyZ0123456789"])(text) == text


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


# --- credentials in URLs and in variables named for passwords ------------------------------------------

@contextlib.contextmanager
def credential_echo(status: int) -> Iterator[int]:
    """A server on 127.0.0.1 (its port) that answers every request ``status`` with the credentials it was
    sent, decoded, then every header, as a proxy or service reporting what it refused may: the Basic
    credentials of a proxy's or a service's URL come back in the body."""
    class Echo(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            basic = [value.split()[-1] for value in self.headers.values() if value.startswith("Basic ")]
            decoded = [base64.b64decode(value).decode() for value in basic]
            body = json.dumps({"error": f"refused {decoded} {dict(self.headers.items())}"}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def written_and_said(tmp_path: Path, result: subprocess.CompletedProcess) -> bytes:
    """Every file of the run directory and everything the run printed."""
    written = [path for path in (tmp_path / "data").rglob("*") if path.is_file()]
    return b"".join(path.read_bytes() for path in written) + (result.stdout + result.stderr).encode()


PASSWORD = "pr0xy-PASSWORD-0123456789"
BASIC = base64.b64encode(f"user:{PASSWORD}".encode()).decode()


# Before, the password of a proxy variable (HTTP_PROXY=http://user:PASSWORD@host) was no secret to the
# redactor, whose name patterns it does not match: a proxy that quoted the credentials it refused put
# them, and their Basic form, into the failure rows and the report (HTTP 502), or the run's error line (407).
@pytest.mark.parametrize("status", [502, 407])
def test_what_a_proxy_echoes_of_its_credentials_reaches_no_row_report_or_console(tmp_path, endpoint, status):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["hello"])
    with credential_echo(status) as port:
        result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                         "--distribution=terminal_only", "--max_retries=0", *endpoint_args(endpoint),
                         env={"HTTP_PROXY": f"http://user:{PASSWORD}@127.0.0.1:{port}", "NO_PROXY": "", "no_proxy": ""})
    assert result.returncode == (2 if status == 502 else 1), result.stderr[-2000:]
    said = written_and_said(tmp_path, result)
    assert b"Proxy-Authorization" in said
    assert not any(piece.encode() in said for secret in (PASSWORD, BASIC) for piece in pieces_of(secret, 8))


# Before, a SearXNG behind a password (SEARXNG_URL=http://user:PASSWORD@host) that answered 401 quoting
# the Authorization header it got put the start of the Basic credentials (its first 300 bytes cut them)
# into the tool's result, the trajectory and the report: most of the password, once decoded.
def test_a_password_in_a_services_url_that_the_service_echoes_reaches_no_row(tmp_path, endpoint):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ['[[call web_search {"query": "x"}]] search'])
    with credential_echo(401) as port:
        result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                         "--distribution=terminal_web", *endpoint_args(endpoint),
                         env={"SEARXNG_URL": f"http://user:{PASSWORD}@127.0.0.1:{port}"})
    assert result.returncode == 0, result.stderr[-2000:]
    said = written_and_said(tmp_path, result)
    assert b"searxng search failed: HTTP 401" in said
    assert not any(piece.encode() in said for secret in (PASSWORD, BASIC) for piece in pieces_of(secret, 8))


# Before, under TERMINAL_ENV=local a command reading the runner's environment got the values of
# SMTP_PASS and SESSION_COOKIE, and a password in DATABASE_URL, into the trajectory as they were: no
# name pattern matched them.
def test_a_command_reading_the_runners_environment_under_local_gets_no_password(tmp_path, endpoint):
    secrets = {"SMTP_PASS": "smtp-pass-0123456789", "SESSION_COOKIE": "cookie-0123456789abcdef",
               "DATABASE_URL": "postgres://app:db-PASSWORD-0123456789@db.internal/app"}
    command = json.dumps({"command": "cat /proc/$PPID/environ"})
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"[[call terminal {command}]] read"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                     "--distribution=terminal_only", *endpoint_args(endpoint), env={"TERMINAL_ENV": "local", **secrets})
    assert result.returncode == 0, result.stderr[-2000:]
    said = written_and_said(tmp_path, result)
    assert b"SMTP_PASS=[REDACTED]" in said and b"DATABASE_URL=postgres://app:[REDACTED]@db.internal" in said
    assert not any(piece.encode() in said for secret in ("smtp-pass-0123456789", "cookie-0123456789abcdef",
                                                          "db-PASSWORD-0123456789") for piece in pieces_of(secret, 8))


def test_a_url_password_is_a_secret_as_written_and_decoded(monkeypatch):
    # The URL holds it percent-encoded; the HTTP client sends (and a server echoes) it decoded.
    monkeypatch.setenv("SERVICE_URL", "https://user:p%40ss-word-0123@service.example/api")
    redact = Redactor.from_environment("")
    assert redact("as written p%40ss-word-0123, decoded p@ss-word-0123") == f"as written {REDACTED}, decoded {REDACTED}"


def test_a_proxy_password_given_without_a_scheme_is_a_secret(monkeypatch):
    monkeypatch.setenv("https_proxy", f"user:{PASSWORD}@proxy.internal:3128")
    assert Redactor.from_environment("")(f"got {PASSWORD}") == f"got {REDACTED}"


def test_a_token_given_as_a_urls_user_name_is_a_secret(monkeypatch):
    # GitHub takes https://TOKEN@github.com/..., Sentry's DSNs hold their key the same way.
    monkeypatch.setenv("REPO_REMOTE", "https://ghp_0123456789abcdefghij@github.com/org/repo.git")
    assert Redactor.from_environment("")("ghp_0123456789abcdefghij") == REDACTED


def test_an_e_mail_address_in_the_environment_is_no_secret(monkeypatch):
    monkeypatch.setenv("MAINTAINER_EMAIL", "maintainer.name@example.com")
    assert Redactor.from_environment("")("by maintainer.name@example.com") == "by maintainer.name@example.com"


# Before, a --base_url without a scheme was refused as "not an http(s) URL" and shown whole: the password
# in it went to the console, though a URL with a scheme is refused for its credentials without being shown.
def test_a_password_in_a_base_url_without_a_scheme_is_not_shown(tmp_path):
    dataset = write_dataset(tmp_path / "dataset.jsonl", ["hello"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                     f"--base_url=user:{PASSWORD}@127.0.0.1:8000/v1")
    assert result.returncode == 1 and "must not hold a user name or password" in result.stderr, result.stderr
    assert PASSWORD not in result.stdout + result.stderr


def test_a_git_author_is_no_secret(monkeypatch):
    # "AUTH" in a name marks a secret (GH_AUTH, AUTH_TOKEN); the author of a commit is none, and `git log`
    # output in a row lost its names.
    monkeypatch.setenv("GIT_AUTHOR_NAME", "Ada Lovelace-Byron")
    assert Redactor.from_environment("")("Author: Ada Lovelace-Byron") == "Author: Ada Lovelace-Byron"


# -- what counts as a secret: before, every value of a variable whose name held KEY, PASS or AUTH anywhere, and
# any 8 characters of its start, was replaced in rows and in commands before they ran

def test_a_path_in_a_secret_named_variable_is_no_secret(monkeypatch, tmp_path):
    # SSH_ASKPASS made `ls -l /usr/bin/env` run as `ls -l [REDACTED]env`.
    monkeypatch.setenv("SSH_ASKPASS", "/usr/bin/ssh-askpass-not-installed")
    socket = tmp_path / "agent.sock"
    socket.touch()
    monkeypatch.setenv("SSH_AUTH_SOCK", str(socket))
    text = f"ls -l /usr/bin/env {socket} {tmp_path}/other"
    assert Redactor.from_environment("")(text) == text


def test_an_address_in_a_secret_named_variable_is_no_secret(monkeypatch):
    monkeypatch.setenv("NEXTAUTH_URL", "http://localhost:3000")
    assert Redactor.from_environment("")("curl http://localhost:3000/v1") == "curl http://localhost:3000/v1"


def test_a_url_holding_a_secret_in_its_path_is_one_but_its_host_is_not(monkeypatch):
    # The review of the first version, which took a URL's query alone, found this printed whole.
    monkeypatch.setenv("SLACK_WEBHOOK_TOKEN", "https://hooks.slack.com/services/T0001/B0001/XXXXabcdefgh1234")
    redact = Redactor.from_environment("")
    assert redact("see https://hooks.slack.com/services/T0001/B0001/XXXXabcdefgh1234") == f"see {REDACTED}"
    assert redact("see https://hooks.slack.com/") == "see https://hooks.slack.com/"


def test_a_secret_value_holding_a_url_is_a_secret_whole(monkeypatch):
    credentials = ('{"auth_uri": "https://accounts.google.com/o/oauth2/auth", "private_key": '
                   '"-----BEGIN PRIVATE KEY-----MIIEvgIBADANBgkqhkiG9w0BAQEFAASC-----END PRIVATE KEY-----"}')
    monkeypatch.setenv("GOOGLE_CREDENTIALS", credentials)
    assert Redactor.from_environment("")(f"cat creds.json: {credentials}") == f"cat creds.json: {REDACTED}"


def test_each_key_of_a_list_of_keys_is_a_secret(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEYS", "https://api.openai.com/v1 sk-proj-Ab3dEfGh1234567890XyZ sk-proj-Zz9yXw8v7654")
    redacted = Redactor.from_environment("")("a sk-proj-Ab3dEfGh1234567890XyZ b https://api.openai.com/v1/chat")
    assert redacted == f"a {REDACTED} b https://api.openai.com/v1/chat"


def test_a_key_of_a_list_that_names_a_file_in_the_working_directory_is_still_a_secret(monkeypatch, tmp_path):
    # Before, a word of a list was left out where a file of its name was found relative to the working
    # directory, though a whole value is left out only as an absolute path.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tok-secret-0123456789").touch()
    monkeypatch.setenv("DB_PASSWORDS", "a-secret-11111111 tok-secret-0123456789 c-secret-22222222")
    assert Redactor.from_environment("")("got tok-secret-0123456789") == f"got {REDACTED}"


@pytest.mark.parametrize("secret", ["//8Abc1Def2Ghi3Jkl", "~/Tr0ub4dor&3xyz", "correct-horse-battery-staple"])
def test_a_secret_that_reads_as_a_path_or_words_is_still_one_and_cut_too(monkeypatch, secret):
    monkeypatch.setenv("DB_PASSWORD", secret)
    redact = Redactor.from_environment("")
    assert redact(f"pw={secret}") == f"pw={REDACTED}"
    assert redact(f"pw={secret[:-3]}") == f"pw={REDACTED}"


@pytest.mark.parametrize("name", ["PIP_KEYRING_PROVIDER", "KEYBOARD_LAYOUT", "TOKENIZERS_PARALLELISM",
                                  "GIT_AUTHOR_EMAIL"])
def test_a_name_holding_a_longer_word_that_begins_with_a_secret_word_marks_no_secret(monkeypatch, name):
    monkeypatch.setenv(name, "subprocess.run")
    assert Redactor.from_environment("")("subprocess.run(...)") == "subprocess.run(...)"


@pytest.mark.parametrize("name", ["OPENAI_API_KEY", "APIKEY2", "githubToken", "api-key", "PGPASSWORD", "DB_PASSCODE",
                                  "AWS_SECRET_ACCESS_KEY", "SESSION_COOKIE", "SERVICE_CREDENTIALS", "HTTP_AUTHORIZATION"])
def test_a_name_holding_a_secret_word_marks_a_secret(monkeypatch, name):
    monkeypatch.setenv(name, "value-0123456789abcdef")
    assert Redactor.from_environment("")("got value-0123456789abcdef") == f"got {REDACTED}"


def test_a_token_as_a_proxys_user_name_without_a_scheme_is_a_secret(monkeypatch):
    # The HTTP client reads TOKEN@host:port as http://TOKEN@host:port and sends the token as Basic credentials.
    monkeypatch.setenv("HTTP_PROXY", "tokenABCDEFGH12345@127.0.0.1:3128")
    sent = base64.b64encode(b"tokenABCDEFGH12345:").decode()
    assert Redactor.from_environment("")(f"got tokenABCDEFGH12345 and Basic {sent}") == \
        f"got {REDACTED} and Basic {REDACTED}"


def test_a_key_with_whitespace_around_it_is_found_as_it_is_sent(monkeypatch):
    monkeypatch.setenv("TAVILY_API_KEY", "\ttvly-0123456789abcdef\n")
    assert Redactor.from_environment(" sk-test-SPACED-0123456789 ")("tvly-0123456789abcdef sk-test-SPACED-0123456789") \
        == f"{REDACTED} {REDACTED}"


def test_a_key_a_server_quotes_percent_encoded_or_in_base64_is_replaced():
    key = "sk-test-Q+u/o=te-0123456789"
    encoded = base64.b64encode(key.encode()).decode()
    redacted = Redactor([key])(f"{quote(key, safe='')} and {encoded} and {encoded[:20]}")
    padding = "=" * encoded.count("=")      # not the key's: kept
    assert redacted == f"{REDACTED} and {REDACTED}{padding} and {REDACTED}"


def test_commands_naming_paths_and_urls_of_secret_named_variables_run_as_written(tmp_path, endpoint):
    command = "echo http://localhost:3000/v1 /usr/bin/env subprocess.run"
    dataset = write_dataset(tmp_path / "dataset.jsonl", [f"[[call terminal {json.dumps({'command': command})}]] q"])
    result = run_cli(tmp_path, f"--dataset_file={dataset}", "--batch_size=1", "--run_name=run",
                     "--distribution=terminal_only", *endpoint_args(endpoint),
                     env={"SSH_ASKPASS": "/usr/bin/ssh-askpass", "NEXTAUTH_URL": "http://localhost:3000",
                          "PIP_KEYRING_PROVIDER": "subprocess"})
    assert result.returncode == 0, result.stderr
    [row] = read_jsonl(tmp_path / "data" / "run" / "trajectories.jsonl")
    [output] = [turn["value"] for turn in row["conversations"] if turn["from"] == "tool"]
    assert "http://localhost:3000/v1 /usr/bin/env subprocess.run" in output, output
    assert REDACTED not in json.dumps(row)
