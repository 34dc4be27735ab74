"""One prompt can never change what the next sees: a conformance test for every isolating backend.

A fingerprint of everything a command can observe about its sandbox (identity, limits and scheduling of
itself and of the processes that outlive commands, keyrings, mounts, control groups, the mode, owner and
xattrs of every writable place and what is in it, processes, IPC, sockets, host name, its own pid, the
tmpfs inode counter) is taken as the first command of a prompt in a new sandbox. Then a hostile prompt runs, of each
kind below, and is released as a finished session's is; the next prompt of the same worker -- its
sandbox one of the spares started while the hostile prompt ran -- takes the fingerprint again. The two
must be equal. A backend that ever hands anything of one prompt to the next fails here first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import textwrap
from pathlib import Path

import pytest

from batchrun.environments.base import EnvironmentSettings
from batchrun.environments.bubblewrap import BubblewrapEnvironment

pytestmark = pytest.mark.bubblewrap

FINGERPRINT = textwrap.dedent(r"""
    section() { printf '\n## %s\n' "$1"; }
    section identity; id; umask; pwd; echo "pid $$"; hostname; cat /proc/sys/kernel/hostname /proc/sys/kernel/domainname
    section limits; cat /proc/self/limits; ulimit -a
    section attributes
    for pid in self $PPID 1; do
        cat /proc/$pid/oom_score_adj
        grep -E '^(Cpus_allowed_list|Mems_allowed_list|NoNewPrivs|Seccomp|Cap(Inh|Prm|Eff|Bnd|Amb))' /proc/$pid/status
        cut -d' ' -f18,19,41 /proc/$pid/stat      # priority, nice, policy
    done
    for pid in $PPID 1; do cat /proc/$pid/limits; done
    # The keys this sandbox can see, by type and description. Left out: usage counts, /proc/key-users, the
    # anonymous session keyrings ("_ses") that the run's workers (and, on this machine, other runs of the
    # same uid) make and drop while the test runs, and the empty ones container runtimes name for their
    # containers ("_ses.<id>"); no prompt can make a key of any kind.
    section keys
    awk '!($8 == "keyring" && ($9 == "_ses:" || ($9 ~ /^_ses\./ && $10 == "empty"))) { $1 = $3 = ""; print }' \
        /proc/keys 2>&1
    section mounts; cut -d' ' -f4- /proc/self/mountinfo
    section groups; cat /proc/self/cgroup
    section places
    for place in / /workspace /tmp /dev /dev/shm; do
        stat -c '%n %F %a %U %G' "$place"
        python3 -c 'import os, sys; print(sorted(os.listxattr(sys.argv[1])))' "$place" 2>&1
    done
    stat -c '%n inode %i' /tmp /dev /dev/shm       # the host's /workspace has the host's inode numbers
    touch /tmp/.probe && stat -c 'next tmp inode %i' /tmp/.probe && rm /tmp/.probe
    section files; find / -xdev \( -path /proc -o -path /usr \) -prune -o -mindepth 1 -printf '%p %y %m %u\n' 2>&1 | sort
    find /tmp /dev/shm /workspace -mindepth 1 -printf '%p %y %m %u\n' 2>&1 | sort
    section processes
    for status in /proc/[0-9]*/status; do
        pid=${status#/proc/}; pid=${pid%/status}
        [ "$(cut -d' ' -f5 /proc/$pid/stat 2>/dev/null)" = "$(cut -d' ' -f5 /proc/$$/stat)" ] && continue   # this command's own
        tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null | head -c 120; echo
    done
    section ipc; cat /proc/sysvipc/shm /proc/sysvipc/msg /proc/sysvipc/sem | wc -l
    python3 -c '
    import ctypes, os
    rt = ctypes.CDLL("librt.so.1", use_errno=True)
    rt.mq_open.restype = ctypes.c_int
    print("queue", "present" if rt.mq_open(b"/batchrun-leak", os.O_RDONLY) >= 0 else os.strerror(ctypes.get_errno()))'
    section sockets
    for table in tcp tcp6 udp udp6 raw; do echo "$table $(tail -n +2 /proc/net/$table | wc -l)"; done
    tail -n +2 /proc/net/unix | wc -l
    section environment; env | sort
""")

HOSTILE = {
    # Rewrites the shell it is a child of, in place: the words of its functions (the kill that a reset
    # of a reused sandbox relied on, the printf that frames every answer), then leaves a spy behind.
    "rewrites its shell's memory": textwrap.dedent(r"""
        python3 - $PPID <<'EOF'
        import re, sys
        pid = sys.argv[1]
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "r+b", buffering=0) as mem:
            for line in maps:
                start, end = (int(part, 16) for part in line.split()[0].split("-"))
                if "rw" not in line.split()[1]:
                    continue
                try:
                    mem.seek(start); data = mem.read(end - start)
                except OSError:
                    continue
                for word, other in ((b"kill -9 -1", b"true #  -1"), (b"ipcrm", b"true ")):
                    for found in re.finditer(re.escape(word), data):
                        mem.seek(start + found.start()); mem.write(other)
        print("rewritten")
        EOF
        (while :; do ls /workspace /tmp > /dev/shm/spy 2>&1; echo poisoned > /workspace/marker; sleep 0.01; done) &
        """),
    "changes the limits of what outlives it": "prlimit --pid $PPID --nofile=64:64 --fsize=1000:1000 --nproc=8:8; "
                                              "prlimit --pid 1 --nofile=64:64 --fsize=1000:1000; true",
    "changes the scheduling of what outlives it": "for pid in $PPID 1; do echo 1000 > /proc/$pid/oom_score_adj; "
                                                  "renice -n 19 -p $pid; taskset -pc 0 $pid; ionice -c 3 -p $pid; "
                                                  "done; true",
    "adds keys to every keyring it can name": textwrap.dedent("""
        python3 -c '
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        for ring in (-3, -4, -5):        # session, user, user-session keyring
            print(libc.syscall(248 if ctypes.sizeof(ctypes.c_void_p) == 8 else 286, b"user", b"leak", b"secret", 6,
                               ctypes.c_int(ring)), ctypes.get_errno())'
        """),
    "changes the workspace and the mount points themselves": "python3 -c 'import os; [os.setxattr(p, \"user.leak\", b\"x\") "
                                                             "for p in (\"/workspace\", \"/tmp\", \"/dev/shm\")]'; "
                                                             "touch -d 2000-01-01 /workspace; "
                                                             "chmod 000 /workspace /tmp /dev/shm; true",
    "leaves files in every writable place": "for d in /workspace /tmp /dev/shm /dev; do echo x > $d/left; "
                                            "echo y > $d/.hidden; mkdir -p $d/deep/er; chmod 000 $d/deep; mkfifo $d/fifo; "
                                            "done 2>/dev/null; true",
    "leaves processes behind": "(setsid sleep 1000 &); nohup sleep 1001 >/dev/null 2>&1 & "
                               "(trap '' TERM HUP; exec -a innocent sleep 1002) & disown; true",
    "leaves ipc objects": textwrap.dedent("""
        ipcmk -M 4096 && ipcmk -Q && ipcmk -S 1
        python3 -c '
        import ctypes, os
        rt = ctypes.CDLL("librt.so.1", use_errno=True)
        print(rt.mq_open(b"/batchrun-leak", os.O_CREAT | os.O_RDWR, 0o666, None))'
        """),
    "leaves sockets": textwrap.dedent("""
        python3 -c '
        import socket, os
        server = socket.socket(); server.bind(("127.0.0.1", 5555)); server.listen()
        client = socket.create_connection(("127.0.0.1", 5555)); accepted, _ = server.accept()
        accepted.close(); client.close()                     # TIME_WAIT on the server port
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); udp.bind(("127.0.0.1", 5556))
        abstract = socket.socket(socket.AF_UNIX); abstract.bind(b"\\0batchrun-leak"); abstract.listen()
        if os.fork() == 0:
            os.setsid(); import time; time.sleep(1000)'
        """),
    "leaves a tree deeper than any path": "for i in $(seq 1100); do mkdir d && cd d || break; done; echo deep > f; true",
    "kills its shell": "kill -9 $PPID",
    "stops its shell": "kill -STOP $PPID",
}


def normalised(fingerprint: str) -> str:
    """What may differ between two sandboxes no prompt touched: their host directory's name, the uid
    the kernel gives each outside (which a sandbox without a user namespace sees as its own), and the
    file that names that uid."""
    fingerprint = re.sub(r"\b(sandbox|prompt-\d+)-[A-Za-z0-9_]+", "DIRECTORY", fingerprint)
    fingerprint = re.sub(r"\buid=\d+,gid=\d+", "uid=OUTSIDE,gid=OUTSIDE", fingerprint)
    fingerprint = re.sub(r"=\d+\(sandbox\)", "=OUTSIDE(sandbox)", fingerprint)
    return re.sub(r"/bindfile\S*", "/BINDFILE", fingerprint)


def fingerprints_around(settings: EnvironmentSettings, hostile: str) -> tuple[str, str]:
    """The fingerprint of a new sandbox, and that of the prompt after a hostile one in the same worker."""
    settings = dataclasses.replace(settings, spare_sandboxes=2, command_timeout=10)

    async def prompt(index: int, commands: list[str]) -> list[str]:
        env = BubblewrapEnvironment(settings, prompt_index=index)
        await env.start()
        try:
            return [(await env.run(command)).output for command in commands]
        finally:
            await env.release()

    async def scenario() -> tuple[str, str]:
        try:
            [fresh] = await prompt(0, [FINGERPRINT])
            await prompt(1, [hostile, "echo still here"])
            [after] = await prompt(2, [FINGERPRINT])
            return fresh, after
        finally:
            await BubblewrapEnvironment.close_idle()
    return asyncio.run(scenario())


def test_the_fingerprint_sees_what_it_should(sandbox_home: Path) -> None:
    fresh, _ = fingerprints_around(EnvironmentSettings(work_root=sandbox_home / "work", run_label="test"), "true")
    for section in ("identity", "limits", "attributes", "keys", "mounts", "places", "files", "processes", "ipc",
                    "sockets", "environment"):
        assert f"## {section}" in fresh
    assert "queue No such file or directory" in fresh and "/workspace" in fresh and "Max open files" in fresh


@pytest.mark.parametrize("hostile", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_prompt_leaves_the_next_one_a_sandbox_like_new(sandbox_home: Path, hostile: str) -> None:
    settings = EnvironmentSettings(work_root=sandbox_home / "work", run_label="test")
    fresh, after = fingerprints_around(settings, hostile)
    assert normalised(after) == normalised(fresh)
