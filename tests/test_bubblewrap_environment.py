"""The bubblewrap environment with real sandboxes: isolation, the long-lived shell, the file tools, beyond
the environment contract (test_environment_contract.py holds it to that with the other backends)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import http.server
import itertools
import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from conftest import REPO, live_processes_mentioning, wait_for

from batchrun.config import terminal_environment
from batchrun.environments import create_environment, default_environment_kind
from batchrun.environments.base import EnvironmentSettings, EnvironmentSetupError, ToolError
from batchrun.environments.bubblewrap import BubblewrapEnvironment, bubblewrap_problem
from batchrun.environments.bubblewrap import environment as environment_module
from batchrun.environments.bubblewrap import program as program_module
from batchrun.environments.bubblewrap import sandbox as sandbox_module
from batchrun.environments.bubblewrap.program import Bwrap, Descriptors, root_descriptor, spaced_apart
from batchrun.environments.seccomp import filter_program
from batchrun.flag_values import UsageError
from batchrun.tools import ToolContext
from batchrun.tools.files import search_files, write_file

pytestmark = pytest.mark.bubblewrap

SECRETS = {"OPENAI_API_KEY": "sk-test-openai-0123456789", "OPENROUTER_API_KEY": "sk-or-test-0123456789",
           "AWS_SECRET_ACCESS_KEY": "aws-test-secret-0123456789", "GITHUB_TOKEN": "ghp_test0123456789"}


def make_settings(home: Path, **overrides: object) -> EnvironmentSettings:
    return EnvironmentSettings(work_root=home / "work", run_label="test", **overrides)


@contextlib.asynccontextmanager
async def sandbox(settings: EnvironmentSettings, cwd: str | None = None,
                  prompt_index: int = 0) -> AsyncIterator[BubblewrapEnvironment]:
    env = BubblewrapEnvironment(settings, prompt_index=prompt_index, cwd=cwd)
    await env.start()
    try:
        yield env
    finally:
        await env.close()


def run_commands(settings: EnvironmentSettings, *commands: str, timeout: float | None = None,
                 cwd: str | None = None) -> list:
    async def scenario():
        async with sandbox(settings, cwd) as env:
            return [await env.run(command, timeout=timeout) for command in commands]
    return asyncio.run(scenario())


@pytest.fixture
def host_server() -> Iterator[int]:
    """An HTTP server on the host's 127.0.0.1; yields its port."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def http_get(port: int) -> str:
    """A request with bash's own /dev/tcp, so the test needs no curl or python inside the sandbox."""
    return (f"exec 3<>/dev/tcp/127.0.0.1/{port} && printf 'GET / HTTP/1.0\\r\\n\\r\\n' >&3 "
            "&& head -n 1 <&3")


def wait_for_count(argument: str, count: int, seconds: float = 3.0) -> list[int]:
    """The host processes with ``argument``, once there are ``count`` of them (or time is up)."""
    deadline = time.monotonic() + seconds
    while len(pids := host_processes_with(argument)) != count and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids


def host_processes_with(argument: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if argument.encode() in (entry / "cmdline").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
    return pids


# --- availability -------------------------------------------------------------------------------

def test_bubblewrap_is_usable_here_and_the_default_kind(sandbox_home):
    assert bubblewrap_problem() is None
    kind, why = default_environment_kind()
    assert kind == "bubblewrap" and why.startswith("isolated sandbox, ") and "bwrap" in why
    env = create_environment("bubblewrap", make_settings(sandbox_home), prompt_index=0)
    assert isinstance(env, BubblewrapEnvironment) and env.kind == "bubblewrap"


def test_a_run_choosing_bubblewrap_where_it_cannot_sandbox_stops_at_start_up(monkeypatch):
    monkeypatch.setattr(environment_module, "working_bwrap", lambda: "bubblewrap is not installed: ...")
    monkeypatch.setenv("TERMINAL_ENV", "bubblewrap")
    with pytest.raises(UsageError, match=r"^TERMINAL_ENV=bubblewrap: bubblewrap is not installed: \.\.\.$"):
        terminal_environment("terminal_only")


@pytest.mark.parametrize("said, advice", [
    ("bwrap: No permissions to create a new namespace, likely because the kernel does not allow "
     "non-privileged user namespaces", True),
    ("bwrap: setting up uid map: Permission denied", True),
    ("as root, sandboxed commands drop to a user of their own with setpriv, which is missing: "
     "apt-get install util-linux, or run batch_runner as an ordinary user", False),
    ("does not run: [Errno 8] Exec format error", False),
])
def test_the_advice_on_user_namespaces_comes_only_with_a_namespace_problem(monkeypatch, said, advice):
    monkeypatch.setattr(program_module, "bwrap_candidates", lambda: [Bwrap("/usr/bin/bwrap", "system bwrap")])
    monkeypatch.setattr(program_module, "candidate_problem", lambda path: said)
    message = program_module.working_bwrap.__wrapped__()      # not the answer cached for this machine
    assert isinstance(message, str) and said in message
    assert ("unprivileged_userns_clone" in message) == advice


# --- isolation ----------------------------------------------------------------------------------

ROOT_RUN_UID = 0x40000000 + 7


def descriptors_in(directory: Path, uid: int | None) -> Descriptors:
    """The descriptors a sandbox around a new workspace in ``directory`` would be started with."""
    (directory / "workspace").mkdir()
    return Descriptors(asyncio.run(root_descriptor(directory / "work", False)), directory / "workspace", uid)


@pytest.mark.parametrize("uid", [None, ROOT_RUN_UID], ids=["own-user-namespace", "root-run"])
def test_the_descriptors_a_sandbox_starts_with_are_never_3_nor_next_to_each_other(tmp_path, uid):
    # Python 3.11's subprocess would list /proc/self/fd and close every descriptor of the worker one by
    # one (program.py says why).
    descriptors = descriptors_in(tmp_path, uid)
    passed = sorted(descriptors.passed())
    descriptors.close()
    assert len(passed) == 2 + (filter_program() is not None) + (0 if uid is None else 2)
    assert passed[0] > 3 and all(later - earlier > 1 for earlier, later in itertools.pairwise(passed)), passed


def test_a_pipe_made_while_a_sandbox_starts_is_next_to_none_of_its_descriptors(tmp_path):
    # As subprocess makes its error pipe, whose end it keeps open in the child with the passed ones.
    descriptors = descriptors_in(tmp_path, ROOT_RUN_UID)
    with descriptors.guarded() as passed:
        pipe = os.pipe()
    descriptors.close()
    for end in pipe:
        os.close(end)
    assert not {end + step for end in pipe for step in (-1, 1)} & set(passed), (pipe, passed)


def test_descriptors_with_no_free_number_above_them_under_the_limit_stay_where_they_are(tmp_path):
    descriptors = descriptors_in(tmp_path, ROOT_RUN_UID)
    passed = descriptors.passed()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(passed) + 1, hard))
    try:
        with descriptors.guarded() as held:     # the highest one's upper neighbour is beyond the limit
            pass
        opened = os.open(tmp_path, os.O_PATH | os.O_CLOEXEC)
        [kept] = spaced_apart([opened], above=max(passed))
        os.close(kept)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        descriptors.close()
    assert held == passed and kept == opened


def test_commands_cannot_write_outside_the_workspace(sandbox_home):
    name = f"batchrun-sandbox-{secrets.token_hex(8)}"
    result, = run_commands(make_settings(sandbox_home),
                           f"for dir in /usr /etc / /bin; do touch $dir/{name} 2>/dev/null && echo wrote $dir; done; "
                           f"echo inside > /tmp/{name} && cat /tmp/{name}")
    assert result.output == "inside\n"
    assert not Path(f"/tmp/{name}").exists()
    assert not any(Path(place, name).exists() for place in ("/usr", "/etc", "/", "/usr/bin"))


def test_commands_cannot_read_host_files_outside_what_is_bound(tmp_path, monkeypatch, sandbox_home):
    users_dir = tmp_path / "users-project"
    users_dir.mkdir()
    (users_dir / "notes.txt").write_text("private notes")
    monkeypatch.chdir(users_dir)
    result, = run_commands(make_settings(sandbox_home),
                           f"cat /etc/shadow /root/.bashrc {users_dir}/notes.txt; ls /root /home; "
                           f"ls -A /; ls -A /etc")
    assert "private notes" not in result.output
    assert "root:" not in result.output         # /etc/shadow's first line
    listing = result.output.splitlines()
    assert "root" not in listing and "home" not in listing and "shadow" not in listing
    assert "workspace" in listing and "usr" in listing


def test_the_users_secrets_are_not_in_the_sandbox(monkeypatch, sandbox_home):
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    result, = run_commands(make_settings(sandbox_home),
                           "env; for f in /proc/[0-9]*/environ /proc/[0-9]*/cmdline; do tr '\\0' '\\n' < $f; done")
    assert "HOME=/workspace" in result.output
    for value in SECRETS.values():
        assert value not in result.output


def test_no_network_not_even_the_hosts_loopback(host_server, sandbox_home):
    result, = run_commands(make_settings(sandbox_home), http_get(host_server))
    assert result.exit_code != 0 and "200" not in result.output


def test_network_allowed_reaches_the_hosts_loopback(host_server, sandbox_home):
    result, = run_commands(make_settings(sandbox_home, allow_network=True), http_get(host_server))
    assert result.exit_code == 0 and "200 OK" in result.output


def test_state_does_not_leak_between_prompts(sandbox_home):
    async def scenario():
        settings = make_settings(sandbox_home)
        async with sandbox(settings, prompt_index=1) as first, sandbox(settings, prompt_index=2) as second:
            await first.run("echo first-prompt > /tmp/mark; echo first-prompt > /workspace/mark; "
                            "sleep 54321.5 &")
            return await second.run("cat /tmp/mark /workspace/mark; ps -e -o args 2>/dev/null "
                                    "|| cat /proc/[0-9]*/cmdline")
    result = asyncio.run(scenario())
    assert "first-prompt" not in result.output and "54321.5" not in result.output


def test_close_kills_everything_in_the_sandbox_and_removes_the_directory(sandbox_home):
    argument = f"{secrets.randbelow(10**6) + 10**6}.5"

    async def scenario():
        env = BubblewrapEnvironment(make_settings(sandbox_home), prompt_index=0)
        await env.start()
        await env.run(f"setsid sleep {argument} >/dev/null 2>&1 & nohup sleep {argument} >/dev/null 2>&1 &")
        assert len(wait_for_count(argument, 2)) == 2
        await env.close()
        await env.close()   # idempotent
        return env
    env = asyncio.run(scenario())
    assert wait_for_count(argument, 0) == []
    assert not env.prompt_dir.exists()


def test_a_sandbox_start_cancelled_at_any_point_leaves_no_process_behind(tmp_path, sandbox_home):
    settings = make_settings(sandbox_home)

    async def cancel_after(turns: int) -> None:
        env = BubblewrapEnvironment(settings, prompt_index=turns)
        starting = asyncio.ensure_future(env.start())
        for _ in range(turns):          # each turn of the loop is one step further into the start
            await asyncio.sleep(0)
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting
        await env.close()
    def every_point() -> None:
        for turns in range(40):
            asyncio.run(cancel_after(turns))
    # In a thread, so that a start which never ends fails the test instead of hanging it.
    runner = threading.Thread(target=every_point, daemon=True)
    runner.start()
    runner.join(timeout=60)
    assert not runner.is_alive(), "a cancelled sandbox start never ended"
    wait_for(lambda: live_processes_mentioning(str(tmp_path)) == [], timeout=3, what="every sandbox to be gone")


# --- the shell ----------------------------------------------------------------------------------

def test_output_exit_codes_and_multi_line_commands(sandbox_home):
    results = run_commands(make_settings(sandbox_home), "printf 'no newline'", "exit 3",
                           "echo 'it'\"'\"'s' \\\\ $'\\t'x\necho second line >&2", "printf 'caf\\xc3\\xa9 \\xff'",
                           "echo 'naïve — 日本'")
    assert (results[0].output, results[0].exit_code) == ("no newline", 0)
    assert (results[1].output, results[1].exit_code) == ("", 3)
    assert results[2].output == "it's \\ \tx\nsecond line\n"
    assert results[3].output == "café \ufffd"
    assert results[4].output == "naïve — 日本\n"


def test_commands_start_in_the_working_directory_without_carry_over(sandbox_home):
    results = run_commands(make_settings(sandbox_home), "cd /tmp && export X=1 && pwd", "pwd; echo ${X:-unset}")
    assert results[0].output == "/tmp\n"
    assert results[1].output == "/workspace\nunset\n"


@pytest.mark.parametrize("cwd", ["/workspace/repo/src", "repo/src"])
def test_rows_cwd_is_honoured_inside_the_workspace(cwd, sandbox_home):
    async def scenario():
        async with sandbox(make_settings(sandbox_home), cwd=cwd) as env:
            result = await env.run("pwd; echo made > here.txt")
            return result, (env.prompt_dir / "repo" / "src" / "here.txt").read_text()
    result, written = asyncio.run(scenario())
    assert result.output == "/workspace/repo/src\n" and written == "made\n"


def test_rows_cwd_escaping_the_workspace_fails_setup_and_leaves_nothing(tmp_path, sandbox_home):
    env = BubblewrapEnvironment(make_settings(sandbox_home), prompt_index=0, cwd="/workspace/../elsewhere")
    with pytest.raises(EnvironmentSetupError, match="outside"):
        asyncio.run(env.start())
    assert [path.name for path in (sandbox_home / "work").iterdir() if not path.name.startswith(".root")] == []


def test_time_out_kills_the_command_and_its_background_child_and_the_next_command_works(sandbox_home):
    started = time.monotonic()
    results = run_commands(make_settings(sandbox_home, command_timeout=1),
                           "sleep 1000 & echo $! > /tmp/child; echo started; sleep 30",
                           "kill -0 $(cat /tmp/child) && echo alive || echo gone")
    assert results[0].timed_out and results[0].exit_code is None and results[0].output == "started\n"
    assert results[1].output.endswith("gone\n") and not results[1].timed_out
    assert time.monotonic() - started < 10


def test_a_command_the_stopped_shell_cannot_take_in_ends_at_its_time_limit(sandbox_home):
    # A command stopped its own shell; the next command's line is longer than the pipe holds. Before, its
    # delivery waited outside the time limit, for ever (or until the tool's limit, 120 s by default).
    async def scenario():
        async with sandbox(make_settings(sandbox_home)) as env:
            await env.run("(sleep 0.5; kill -STOP $PPID) & echo armed")
            await asyncio.sleep(1.5)
            started = time.monotonic()
            stuck = await asyncio.wait_for(env.run("echo " + "x" * 200_000, timeout=2), 30)
            return stuck, time.monotonic() - started, await env.run("echo next")
    stuck, took, after = asyncio.run(scenario())
    assert stuck.timed_out and stuck.exit_code is None and took < 10, (stuck, took)
    assert after.output == "next\n"


def test_a_time_out_keeps_the_sandboxs_shell(sandbox_home):
    async def scenario():
        async with sandbox(make_settings(sandbox_home, command_timeout=1)) as env:
            shell = env._shell
            timed_out = await env.run("sleep 1000 & echo started; sleep 30")
            return timed_out, await env.run("pgrep -c -x sleep || true"), env._shell is shell
    timed_out, after, same_shell = asyncio.run(scenario())
    assert timed_out.timed_out and timed_out.output == "started\n"
    assert after.output == "0\n" and same_shell


def test_a_time_limit_that_ends_before_the_shell_starts_the_command_still_kills_it(sandbox_home):
    async def scenario():
        async with sandbox(make_settings(sandbox_home)) as env:
            shell = env._shell
            started = time.monotonic()
            results = [await env.run("sleep 5", timeout=0.0001) for _ in range(20)]
            elapsed = time.monotonic() - started
            return results, await env.run("echo next"), env._shell is shell, elapsed
    results, after, same_shell, elapsed = asyncio.run(scenario())
    assert all(result.timed_out for result in results) and elapsed < 10
    assert after.output == "next\n" and same_shell


def test_a_command_that_stops_itself_is_killed_at_its_time_limit(sandbox_home):
    started = time.monotonic()
    results = run_commands(make_settings(sandbox_home), "echo before; kill -STOP $$; echo after", "echo next", timeout=1)
    assert results[0].timed_out and results[0].output == "before\n"
    assert results[1].output == "next\n" and not results[1].timed_out
    assert time.monotonic() - started < 10


def test_a_time_out_that_comes_as_the_command_ends_changes_nothing(sandbox_home):
    # The runner's signal reaches the shell after the command's end, while it waits for the next line:
    # neither the shell nor what the command left running in the background is touched.
    async def scenario():
        async with sandbox(make_settings(sandbox_home)) as env:
            first = await env.run("sleep 1000 & echo first > /tmp/mark; exit 3")
            shell = env._shell
            assert shell is not None and shell.signal(signal.SIGUSR1)
            await asyncio.sleep(0.2)
            return first, await env.run("cat /tmp/mark; pgrep -c -x sleep"), env._shell is shell
    first, second, same_shell = asyncio.run(scenario())
    assert (first.exit_code, first.timed_out) == (3, False)
    assert (second.output, second.exit_code, same_shell) == ("first\n1\n", 0, True)


def test_a_command_that_exits_with_the_killed_status_early_is_not_a_time_out(sandbox_home):
    result, = run_commands(make_settings(sandbox_home), "kill -9 $$")
    assert (result.exit_code, result.timed_out) == (137, False)


def test_background_child_does_not_hang_the_call_and_late_output_is_dropped(sandbox_home):
    # The child writes only once released from outside, after the call returned and before the next
    # one: the call cannot have waited for it.
    async def scenario():
        async with sandbox(make_settings(sandbox_home)) as env:
            first = await env.run("mkfifo go; (read line < go; echo late; : > written) & echo now")
            await asyncio.to_thread((env.prompt_dir / "go").write_text, "go\n")
            await asyncio.to_thread(wait_for, (env.prompt_dir / "written").exists, 30, "the late output")
            return first, await env.run("echo next")
    first, second = asyncio.run(scenario())
    assert (first.output, first.exit_code, first.timed_out) == ("now\n", 0, False)
    assert second.output == "next\n"


def test_a_dead_shell_is_replaced_and_the_workspace_kept(sandbox_home):
    results = run_commands(make_settings(sandbox_home), "echo kept > file", "kill -9 -1", "cat file")
    assert results[1].error and "died" in results[1].error
    assert (results[2].output, results[2].exit_code) == ("kept\n", 0)


def test_a_stuck_shell_is_replaced_after_the_deadline(sandbox_home):
    stop_shell = "kill -STOP $PPID"     # the sandbox's shell itself, whose child this bash is
    started = time.monotonic()
    results = run_commands(make_settings(sandbox_home), stop_shell, "echo fresh", timeout=1)
    assert results[0].timed_out
    assert results[1].output == "fresh\n"
    assert time.monotonic() - started < 10


def test_many_commands_in_a_row(sandbox_home):
    async def scenario():
        async with sandbox(make_settings(sandbox_home)) as env:
            return [await env.run(f"echo {number}") for number in range(200)]
    results = asyncio.run(scenario())
    assert [result.output for result in results] == [f"{number}\n" for number in range(200)]


def test_a_nul_byte_in_a_command_is_an_error(sandbox_home):
    result, = run_commands(make_settings(sandbox_home), "echo a\0b")
    assert result.error and "NUL" in result.error


# --- files --------------------------------------------------------------------------------------

def test_files_written_inside_are_readable_by_the_file_tools_and_back(sandbox_home):
    async def scenario():
        async with sandbox(make_settings(sandbox_home), cwd="/workspace/repo") as env:
            await env.run("echo from-command > made.txt")
            read_relative = await env.read_file("made.txt")
            read_absolute = await env.read_file("/workspace/repo/made.txt")
            written = await env.write_file("sub/new.txt", b"from-tool\n")
            seen = await env.run("cat /workspace/repo/sub/new.txt")
            ctx = ToolContext(env=env, settings=env.settings)
            await write_file({"path": "notes.md", "content": "needle here\n"}, ctx)
            found = await search_files({"pattern": "needle"}, ctx)
            return read_relative, read_absolute, written, seen.output, found
    read_relative, read_absolute, written, seen, found = asyncio.run(scenario())
    assert read_relative == read_absolute == b"from-command\n"
    assert written == "sub/new.txt" and seen == "from-tool\n"
    assert found["matches"] == [{"path": "notes.md", "line": 1, "text": "needle here"}]


@pytest.mark.parametrize("path", ["/etc/passwd", "/workspace/../etc/passwd", "/workspacex/a", "../../x",
                                  "escape/passwd"])
def test_file_tools_cannot_escape_the_workspace(path, sandbox_home):
    async def scenario():
        async with sandbox(make_settings(sandbox_home)) as env:
            await env.run("mkdir escape && ln -s /etc/passwd escape/passwd && ln -s / root-link")
            with pytest.raises(ToolError, match="outside the working directory"):
                await env.read_file(path)
            with pytest.raises(ToolError, match="outside the working directory"):
                await env.write_file(path, b"x")
    asyncio.run(scenario())


# --- a runner started as root gives the sandbox none of root's power over the host ---------------------------

def test_a_command_cannot_write_a_kernel_setting_even_when_the_runner_is_root(tmp_path):
    # Writing back the value already there: harmless if the sandbox fails to stop it.
    [result] = run_commands(make_settings(tmp_path),
                            'v=$(cat /proc/sys/vm/swappiness) && printf "%s\\n" "$v" > /proc/sys/vm/swappiness '
                            '&& echo WROTE')
    assert "WROTE" not in result.output


def test_a_command_cannot_change_the_hosts_device_nodes(tmp_path):
    before = Path("/dev/zero").stat()
    [result] = run_commands(make_settings(tmp_path), "touch -m -d @1000000000 /dev/zero; chmod 666 /dev/zero && echo CHMOD")
    assert Path("/dev/zero").stat().st_mtime == before.st_mtime
    assert "CHMOD" not in result.output


@pytest.mark.skipif(os.geteuid() != 0, reason="a runner that is not root hands its sandboxes no privilege to drop")
def test_commands_of_a_root_run_are_an_unprivileged_user_the_sandbox_can_name(tmp_path):
    [result] = run_commands(make_settings(tmp_path), "id -u; whoami; grep CapEff /proc/self/status")
    uid, name, capabilities = result.output.splitlines()
    assert int(uid) != 0 and name == "sandbox" and capabilities.split()[1] == "0000000000000000"


@pytest.mark.skipif(os.geteuid() != 0, reason="a runner that is not root hands its sandboxes no privilege to drop")
def test_a_setuid_program_does_not_give_a_root_runs_commands_root_again(tmp_path):
    [result] = run_commands(make_settings(tmp_path), "su -c 'id -u' root </dev/null 2>&1; "
                            "find /usr/bin -perm -4000 -exec {} --version \\; >/dev/null 2>&1; id -u")
    assert result.output.strip().splitlines()[-1] != "0"
    assert "\n0\n" not in "\n" + result.output


# Every source of names a process loaded after looking up a user and a group that do not exist.
LOOK_UP_MISSING_NAMES = """python3 - <<'EOF'
import grp, pwd
for look_up in (lambda: pwd.getpwnam("nobody-by-this-name"), lambda: grp.getgrgid(4242)):
    try:
        look_up()
    except KeyError:
        pass
print(sorted({line.split()[-1] for line in open("/proc/self/maps") if "libnss_" in line}))
EOF"""


def test_a_name_the_sandbox_does_not_know_is_looked_up_in_its_own_files_alone(tmp_path):
    missing, known = run_commands(make_settings(tmp_path), LOOK_UP_MISSING_NAMES,
                                  'getent passwd "$(id -u)" | cut -d: -f6; getent hosts localhost >/dev/null && echo found')
    assert missing.output == "[]\n", missing
    assert known.output == "/workspace\nfound\n", known


def test_files_the_file_tools_write_are_the_commands_to_change_and_the_other_way_round(sandbox_home):
    async def scenario():
        async with sandbox(make_settings(sandbox_home)) as env:
            await env.write_file("made/by/tool.txt", b"tool\n")
            appended = await env.run("echo command >> made/by/tool.txt && mkdir -p made/by/cmd && "
                                     "echo x > made/by/cmd/new.txt && cat made/by/tool.txt")
            await env.write_file("made/by/cmd/new.txt", b"rewritten by the tool\n")
            again = await env.run("echo more >> made/by/cmd/new.txt && cat made/by/cmd/new.txt")
            return appended, again
    appended, again = asyncio.run(scenario())
    assert appended.exit_code == 0 and appended.output == "tool\ncommand\n", appended
    assert again.exit_code == 0 and again.output == "rewritten by the tool\nmore\n", again


def test_a_work_directory_under_one_only_root_may_enter_still_works(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    [result] = run_commands(EnvironmentSettings(work_root=private / "work", run_label="test"), "echo hi > f && cat f")
    assert (result.exit_code, result.output) == (0, "hi\n")


# --- every prompt gets a sandbox no earlier prompt used ------------------------------------------------------------

SANDBOX_ID = "readlink /proc/self/ns/net /proc/self/ns/pid /proc/self/ns/ipc /proc/self/ns/mnt"


def hold_namespaces(environment: BubblewrapEnvironment) -> list[int]:
    """Descriptors of the namespaces of the sandbox's shell (those SANDBOX_ID names). The kernel gives a
    freed namespace's number to the next new one: a sandbox started after the first is gone could show
    the first's numbers though it shares nothing, unless something holds the first's namespaces."""
    shell = environment._shell
    assert shell is not None
    return [os.open(f"/proc/{shell.sandbox_pids[-1]}/ns/{kind}", os.O_RDONLY) for kind in ("net", "pid", "ipc", "mnt")]


def after_release(settings: EnvironmentSettings, first: list[str], second: list[str]) -> tuple[list, list]:
    """Run ``first`` in one prompt's sandbox, release it as a finished session does, run ``second`` in the
    next prompt's, taken from the spares a worker keeps; each list ends with SANDBOX_ID's output."""
    settings = dataclasses.replace(settings, spare_sandboxes=2)

    async def scenario():
        try:
            one = BubblewrapEnvironment(settings, prompt_index=0)
            await one.start()
            before = [await one.run(command) for command in [*first, SANDBOX_ID]]
            held = hold_namespaces(one)
            assert [os.readlink(f"/proc/self/fd/{fd}") for fd in held] == before[-1].output.split()
            await one.release()
            two = BubblewrapEnvironment(settings, prompt_index=1)
            await two.start()
            try:
                after = [await two.run(command) for command in [*second, SANDBOX_ID]]
            finally:
                await two.close()
                for fd in held:
                    os.close(fd)
            return before, after
        finally:
            await BubblewrapEnvironment.close_idle()
    return asyncio.run(scenario())


def test_the_next_prompt_gets_a_sandbox_of_its_own(sandbox_home):
    before, after = after_release(make_settings(sandbox_home), ["true"], ["true"])
    assert not set(before[-1].output.split()) & set(after[-1].output.split())


def test_the_next_prompt_finds_none_of_the_files_the_first_left(sandbox_home):
    plant = ("echo a > /workspace/left.txt && echo b > /tmp/left.txt && echo c > /tmp/.hidden && "
             "echo d > /dev/shm/left && mkdir -p /tmp/locked/in /workspace/locked && echo e > /tmp/locked/in/f && "
             "chmod 000 /tmp/locked /workspace/locked")
    before, after = after_release(make_settings(sandbox_home), [plant], ["find /workspace /tmp /dev/shm -mindepth 1"])
    assert before[0].exit_code == 0, before[0]
    assert (after[0].exit_code, after[0].output) == (0, "")


def test_the_next_prompt_finds_none_of_the_processes_the_first_left(sandbox_home):
    plant = "(setsid sleep 1000 &) ; nohup sleep 1001 >/dev/null 2>&1 & (sleep 1002 & disown) ; true"
    before, after = after_release(make_settings(sandbox_home), [plant], ["cat /proc/[0-9]*/cmdline | tr '\\0' ' '"])
    assert "sleep 100" not in after[0].output, after[0].output


def test_the_next_prompt_finds_none_of_the_ipc_objects_or_sockets_the_first_left(sandbox_home):
    listen = ("python3 -c 'import socket, time; s = socket.socket(); s.bind((\"127.0.0.1\", 5555)); s.listen(); "
              "c = socket.create_connection((\"127.0.0.1\", 5555)); a, _ = s.accept(); a.close(); c.close(); "
              "print(\"listening\", flush=True); time.sleep(1000)' > /workspace/log 2>&1 &"
              " for i in $(seq 100); do grep -q listening /workspace/log && break; sleep 0.05; done")
    before, after = after_release(make_settings(sandbox_home), ["ipcmk -M 4096 && ipcmk -Q && ipcmk -S 1", listen],
                                  ["ipcs -m -q -s | grep -c '^0x' ; tail -n +2 /proc/net/tcp | wc -l; "
                                   "python3 -c 'import socket; s = socket.socket(); "
                                   "s.bind((\"127.0.0.1\", 5555)); print(\"bound\")'"])
    assert before[0].exit_code == 0, before[0]
    assert after[0].output.split() == ["0", "0", "bound"], after[0].output


def test_a_changed_dev_does_not_reach_the_next_prompt(sandbox_home):
    # Commands own /dev in a sandbox with a user namespace; without one they cannot change it at all.
    _, after = after_release(make_settings(sandbox_home), ["rm -f /dev/fd; ln -s /tmp /dev/fd"], ["readlink /dev/fd"])
    assert after[0].output.strip() == "/proc/self/fd"


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root run's sandbox keeps its commands out of /dev")
def test_a_root_runs_commands_cannot_change_dev(tmp_path):
    [result] = run_commands(make_settings(tmp_path), "(rm -f /dev/fd; ln -s /tmp /dev/x; touch /dev/y; "
                            "mkdir /dev/z) 2>/dev/null; readlink /dev/fd; ls /dev")
    assert result.output.splitlines()[0] == "/proc/self/fd"
    assert not {"x", "y", "z"} & set(result.output.split())


def test_the_prompt_after_one_that_killed_its_sandboxs_shell_runs(sandbox_home):
    kill_shell = "kill -9 $PPID"      # the sandbox's shell
    before, after = after_release(make_settings(sandbox_home), [kill_shell, "echo again"], ["echo fine"])
    assert before[1].output == "again\n"
    assert after[0].output == "fine\n"


def test_kept_directories_are_named_after_their_prompt_and_left(sandbox_home):
    settings = make_settings(sandbox_home, keep_workdirs=True)
    before, after = after_release(settings, ["echo kept > /workspace/f"], ["ls /workspace"])
    assert after[0].output == ""
    assert [path.read_text() for path in (sandbox_home / "work").glob("prompt-0-*/f")] == ["kept\n"]


# --- what the runner reads from a sandbox is bounded ----------------------------------------------------------------

# Reads the current command's marker out of the shell's memory, as a command that took its shell over can,
# and answers in the shell's place, with the status that STATUS writes to ``out``.
FORGED_END = r"""python3 - $PPID <<'EOF'
import os, re, sys
pid = sys.argv[1]
markers = set()
with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
    for line in maps:
        start, end = (int(part, 16) for part in line.split()[0].split("-"))
        if "rw" in line.split()[1]:
            try:
                mem.seek(start)
                markers.update(re.findall(rb"batchrun-[0-9a-f]{32}", mem.read(end - start)))
            except OSError:
                pass
out = os.fdopen(1, "wb", buffering=0)
for marker in markers:
    out.write(b"\n" + marker + b" ")
STATUS
EOF"""
# A status line that never ends: 128 MB of it, no newline.
FORGED_ENDLESS_STATUS = FORGED_END.replace("STATUS", 'for _ in range(2000):\n    out.write(b"9" * 65536)')


def test_a_shell_that_answers_without_end_is_not_read_without_end(sandbox_home):
    async def scenario():
        async with sandbox(make_settings(sandbox_home, command_timeout=60)) as env:
            started = time.monotonic()
            forged = await env.run(FORGED_ENDLESS_STATUS)
            return forged, time.monotonic() - started, await env.run("echo next")
    forged, elapsed, after = asyncio.run(scenario())
    assert forged.exit_code is None and "shell" in (forged.error or "")
    assert elapsed < 30
    assert after.output == "next\n"


@pytest.mark.parametrize("status", ["9" * 5000, "256", "0255"])
def test_a_shell_that_answers_a_status_no_shell_gives_is_replaced(sandbox_home, status):
    # One of 5,000 digits raised ValueError in the runner (Python's limit on converting digits).
    forging = FORGED_END.replace("STATUS", f'out.write(b"{status}\\n")')
    [forged, after] = run_commands(make_settings(sandbox_home), forging, "echo next")
    assert forged.exit_code is None and "shell" in (forged.error or "")
    assert after.output == "next\n"


# --- spares: sandboxes started ahead of need ----------------------------------------------------------------------

def spare_pids() -> list[int]:
    return [spare.shell.process.pid for spare in sandbox_module.spares.ready()]


async def spares_once_there_are(count: int) -> list[int]:
    """The spares' pids once the worker has ``count``; if it never does, the failed starts say why."""
    try:
        async with asyncio.timeout(30):
            while len(spare_pids()) < count:
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"{len(spare_pids())} spares after 30 s, not {count}; the latest failed starts: "
                             f"{list(sandbox_module.spares.failed_starts)}") from None
    return spare_pids()


def test_a_prompt_takes_a_spare_started_before_it_and_the_next_one_is_started(sandbox_home):
    settings = make_settings(sandbox_home, spare_sandboxes=2)

    async def scenario():
        try:
            first = BubblewrapEnvironment(settings, prompt_index=0)
            await first.start()
            ready = await spares_once_there_are(2)
            second = BubblewrapEnvironment(settings, prompt_index=1)
            await second.start()
            taken = second._shell.process.pid
            await spares_once_there_are(2)
            await first.close()
            await second.close()
            return ready, taken, spare_pids()
        finally:
            await BubblewrapEnvironment.close_idle()
    ready, taken, refilled = asyncio.run(scenario())
    assert taken in ready and taken not in refilled


def test_a_spare_that_cannot_start_is_kept_in_the_failed_starts_and_the_prompt_starts_its_own(sandbox_home,
                                                                                             monkeypatch):
    async def broken_start(settings: EnvironmentSettings, prefix: str) -> sandbox_module.Sandbox:
        raise OSError(28, "No space left on device")    # not the setup error the start path expects
    monkeypatch.setattr(sandbox_module, "new_sandbox", broken_start)
    sandbox_module.spares.failed_starts.clear()
    unhandled: list[dict] = []

    async def scenario():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unhandled.append(context))
        try:
            async with sandbox(make_settings(sandbox_home, spare_sandboxes=2)) as env:
                output = (await env.run("echo started")).output
                async with asyncio.timeout(10):
                    while len(sandbox_module.spares.failed_starts) < 2:
                        await asyncio.sleep(0.01)
            gc.collect()    # a task whose exception nobody retrieved reports it when it is collected
            return output
        finally:
            await BubblewrapEnvironment.close_idle()
    assert asyncio.run(scenario()) == "started\n"
    assert list(sandbox_module.spares.failed_starts) == ["OSError: [Errno 28] No space left on device"] * 2
    assert spare_pids() == [] and unhandled == []


def test_prompts_started_together_never_share_a_sandbox(sandbox_home):
    settings = make_settings(sandbox_home, spare_sandboxes=2)

    async def scenario():
        try:
            envs = [BubblewrapEnvironment(settings, prompt_index=index) for index in range(8)]
            await asyncio.gather(*(env.start() for env in envs))
            identities = [(await env.run(SANDBOX_ID)).output for env in envs]
            await asyncio.gather(*(env.close() for env in envs))
            return identities
        finally:
            await BubblewrapEnvironment.close_idle()
    identities = asyncio.run(scenario())
    assert len(set(identities)) == 8


def test_the_spares_leave_nothing_behind_when_the_worker_ends(sandbox_home):
    settings = make_settings(sandbox_home, spare_sandboxes=2)

    async def scenario():
        env = BubblewrapEnvironment(settings, prompt_index=0)
        await env.start()
        await env.close()
        await BubblewrapEnvironment.close_idle()
    asyncio.run(scenario())
    assert [path.name for path in (sandbox_home / "work").iterdir() if not path.name.startswith(".root")] == []
    wait_for(lambda: live_processes_mentioning(str(sandbox_home / "work")) == [], timeout=5,
             what="every spare sandbox to be gone")


def test_a_sandbox_killed_and_reaped_is_never_signalled_again(sandbox_home, monkeypatch):
    # Its process group id may name another group by then (another prompt's sandbox, in a root run any
    # host process group): only a group whose leader is not yet reaped is safely still ours.
    signalled: list[int] = []
    real_killpg = os.killpg

    def killpg(pgid: int, signum: int) -> None:
        if signum == signal.SIGKILL:
            signalled.append(pgid)
        real_killpg(pgid, signum)

    async def scenario() -> tuple[int, list[int]]:
        async with sandbox(make_settings(sandbox_home)) as env:
            assert (await env.run("true")).exit_code == 0
            first = env._shell
            assert first is not None
            env.stop_processes()                    # as the workspace limit does
            await first.process.wait()              # killed and reaped
            assert (await env.run("true")).exit_code == 0     # in a new sandbox around the same directory
            monkeypatch.setattr(os, "killpg", killpg)
            env.stop_processes()
        return first.process.pid, signalled
    pid, after_reaping = asyncio.run(scenario())
    assert pid not in after_reaping


def test_a_worker_never_gives_a_uid_still_in_use_to_another_sandbox(monkeypatch):
    # A root run's sandbox has no user namespace: two live sandboxes of one uid would share its process
    # count (ulimit -u), so one could keep the other from forking. A worker makes thousands of sandboxes
    # in a long run while a slow prompt keeps its own.
    from batchrun.environments.bubblewrap import program
    monkeypatch.setattr(program, "_live_uids", {})
    monkeypatch.setattr(program, "_SANDBOX_UIDS", range(1 << 30, (1 << 30) + 8))
    slow = program.sandbox_uid()
    for _ in range(100):
        program.release_sandbox_uid(program.sandbox_uid())
    live = {slow} | {program.sandbox_uid() for _ in range(7)}
    assert len(live) == 8
    with pytest.raises(EnvironmentSetupError, match="no free uid for a sandbox"):
        program.sandbox_uid()


_HOLD_UIDS = """
import os, sys
os.getpid = lambda: 4242
from batchrun.environments.bubblewrap import program
if sys.argv[1] == "few":      # within one network namespace the claims keep them apart, however few the uids
    program._SANDBOX_UIDS = range(1 << 30, (1 << 30) + 100)
print(sorted(program.sandbox_uid() for _ in range(40)), flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("namespaces", ["one", "each its own"])
def test_two_workers_of_the_same_pid_never_hold_the_same_uid(namespaces):
    # The claims are per network namespace; runs in two containers of one host share the kernel's uids, and
    # their workers often have the same small pids. Before, a worker's uids came from a block chosen by its
    # pid: both containers' first sandboxes had the same uid, and one's processes kept the other from forking.
    if namespaces == "each its own" and (os.geteuid() != 0 or shutil.which("unshare") is None):
        pytest.skip("needs root and unshare(1) to make network namespaces")
    prefix = ["unshare", "--net"] if namespaces == "each its own" else []
    uids = "all" if namespaces == "each its own" else "few"
    holders = [subprocess.Popen([*prefix, sys.executable, "-c", _HOLD_UIDS, uids], cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        held = [set(json.loads(holder.stdout.readline())) for holder in holders]   # type: ignore[union-attr]
    finally:
        for holder in holders:
            holder.communicate("", timeout=30)
    assert all(len(uids) == 40 for uids in held)
    assert not held[0] & held[1]
