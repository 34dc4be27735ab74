"""The bwrap command lines that isolate Chromium: a network namespace of its own, and a sandbox like
the terminal's inside it.

A proxy setting only covers what Chromium chooses to proxy (WebRTC sent UDP straight to its targets),
so where bubblewrap can make one, Chromium runs in a network namespace that holds nothing but a loopback
interface and the gate's listening socket: no protocol, present or future, has another way out. A page
is as hostile as a command, so Chromium also runs not as root (a root run's Chromium is a user of its
own; an ordinary user's has a user namespace without capabilities), with the system read-only and no
file of the host's beyond what Chromium reads, its profile in a size-capped /tmp of its own, and none
of the runner's environment. Apart from the launch because this is what a reader checks the isolation
against; the launch only runs it.
"""

from __future__ import annotations

import os
from pathlib import Path

from batchrun.environments.base import DEFAULT_PATH, scrubbed_environment
from batchrun.environments.limits import MIB

# Chromium's sandbox keeps its profile (PROFILE) and its pages' shared memory (Playwright passes
# --disable-dev-shm-usage) in a /tmp of its own, in memory: each of /tmp and /dev/shm holds at most this.
SANDBOX_TMP_MB = 1024
PROFILE = "/tmp/profile"
# What of /etc Chromium reads besides what every program does: its policies, the settings Debian's
# launcher sources, fontconfig's, and the order of name services (it resolves on the host's network).
_CHROMIUM_ETC = ("chromium", "chromium.d", "fonts", "nsswitch.conf")
_RUNNING_AS_ROOT = os.geteuid() == 0


def namespace_argv(bwrap: str) -> list[str]:
    """bwrap's options for the network namespace's first process: the host's files as they are, and a
    network of its own."""
    return [bwrap, "--dev-bind", "/", "/", "--unshare-net", "--die-with-parent", "--"]


def sandbox_user() -> int | None:
    """The user Chromium's sandbox runs as: in a root run a user of its own, else None (the runner's,
    in a user namespace)."""
    from batchrun.environments.bubblewrap.program import sandbox_uid

    return sandbox_uid() if _RUNNING_AS_ROOT else None


def sandbox_argv(bwrap: str, uid: int | None, installation: str | None) -> list[str]:
    """The command prefix that runs a program in Chromium's sandbox, inside the network namespace.

    The sandbox sees the system read-only (/usr, and of /etc what Chromium and its libraries read),
    ``installation`` read-only (the directory of a Chromium outside /usr), its own size-capped /tmp and
    /dev/shm, and nothing else of the host: no home, no run directory, none of the runner's environment.
    In a root run (``uid`` given) it has no user namespace, as the terminal sandbox: it runs as ``uid``,
    a user of its own, on nosuid mounts; otherwise in a user namespace without capabilities.
    """
    from batchrun.environments.bubblewrap.program import KEPT_FOR_THE_DROP, as_user
    from batchrun.environments.bubblewrap.root import ETC_ENTRIES, SYSTEM_LINKS

    argv = [bwrap, "--die-with-parent", "--new-session"]
    if uid is None:
        argv += ["--unshare-all", "--share-net", "--cap-drop", "ALL"]
    else:
        argv += ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try", *KEPT_FOR_THE_DROP]
    argv += ["--ro-bind", "/usr", "/usr"]
    for name in SYSTEM_LINKS:
        host = f"/{name}"
        if os.path.islink(host):
            argv += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            argv += ["--ro-bind", host, host]
    # bwrap makes the parents of mount points private (0700), which a root run's sandbox user could not enter.
    argv += ["--perms", "0755", "--dir", "/etc", "--perms", "0755", "--dir", "/etc/ssl"]
    for name in ETC_ENTRIES + _CHROMIUM_ETC:
        argv += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    argv += ["--dev", "/dev", "--proc", "/proc"]
    for place in ("/tmp", "/dev/shm"):     # made by bwrap, so open to all, as on a host
        argv += ["--perms", "1777", "--size", str(SANDBOX_TMP_MB * MIB), "--tmpfs", place]
    if installation is not None:            # after /tmp, which would hide one there
        for parent in reversed(Path(installation).parents[:-1]):
            argv += ["--perms", "0755", "--dir", str(parent)]
        argv += ["--ro-bind", installation, installation]
    # Last, as bwrap creates mount points in order: the root, a tmpfs holding them, read-only.
    argv += ["--remount-ro", "/", "--clearenv"]
    for name, value in {**scrubbed_environment(home="/tmp"), "PATH": DEFAULT_PATH}.items():
        argv += ["--setenv", name, value]
    return [*argv, "--", *as_user(uid)]


def chromium_installation(program: str) -> str | None:
    """The directory to show Chromium's sandbox for ``program`` (a resolved path): none for one in /usr."""
    return None if program.startswith("/usr/") else os.path.dirname(program)

