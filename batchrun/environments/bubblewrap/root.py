"""The read-only root directory every bubblewrap sandbox of a run sees at ``/``.

A sandbox needs a root with mount points for /usr, /dev, /proc, /tmp and /workspace, the merged-/usr
links, and the few /etc files programs read. Making each piece a bind mount per sandbox costs bwrap a
remount and a read of the mount table per mount, about a millisecond each; so the pieces are copied once
per run into one directory, which each sandbox binds read-only as a whole.

Nothing of /etc beyond what programs need goes in: no shadow, no ssh keys, no credentials of services, and
users and groups only as the sandbox knows them (root, nobody, and the sandbox's own user).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from batchrun.environments.base import claim_work_root

#: Who the commands are inside a sandbox with a user namespace (whatever uid the kernel sees outside).
SANDBOX_UID = 1000
SANDBOX_USER = "sandbox"
#: Where the prompt's directory appears inside the sandbox; also the commands' HOME.
MOUNT_POINT = "/workspace"
# Top-level names that merged-/usr systems make symlinks into /usr (directories on older systems).
SYSTEM_LINKS = ("bin", "lib", "lib64", "sbin")
# What of /etc programs need: the loader cache, alternatives, TLS roots, the time zone, localhost.
ETC_ENTRIES = ("ld.so.cache", "alternatives", "ssl/certs", "ssl/openssl.cnf", "localtime", "hosts")
# Those of them that are hundreds of files each, which starting a sandbox does not read (see probe_root).
_ETC_DIRECTORIES = ("alternatives", "ssl/certs")
_NETWORK_ETC_ENTRIES = ("resolv.conf", "host.conf", "gai.conf")
_MOUNT_POINTS = ("usr", "dev", "proc", "tmp", MOUNT_POINT.lstrip("/"))


def user_entries(uid: int) -> tuple[str, str]:
    """(/etc/passwd, /etc/group) of a sandbox whose commands run as ``uid``."""
    passwd = ("root:x:0:0:root:/root:/bin/bash\n"
              "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
              f"{SANDBOX_USER}:x:{uid}:{uid}:{SANDBOX_USER}:{MOUNT_POINT}:/bin/bash\n")
    group = f"root:x:0:\nnogroup:x:65534:\n{SANDBOX_USER}:x:{uid}:\n"
    return passwd, group


def host_directories() -> list[str]:
    """The top-level system directories that are real directories here (not links into /usr): each is a
    read-only bind of its own."""
    return [f"/{name}" for name in SYSTEM_LINKS if not os.path.islink(f"/{name}") and os.path.isdir(f"/{name}")]


def system_root(work_root: Path, *, allow_network: bool) -> Path:
    """The run's root directory for sandboxes, made the first time it is asked for (by any worker process
    of the run: each builds its own copy and renames it into place, and the first one stays)."""
    root = work_root / (".root-network" if allow_network else ".root")
    if root.is_dir():
        return root
    claim_work_root(work_root)
    # The workers start together: one builds while the others wait for its copy. A copy is hundreds of
    # files (/etc/ssl/certs, /etc/alternatives), and on some hosts' disks making a file costs half a
    # millisecond of CPU: each worker building its own took seconds of the run's start.
    with _held(work_root / ".root-lock"):
        if root.is_dir():
            return root
        building = Path(tempfile.mkdtemp(prefix=".root-building-", dir=work_root))
        try:
            _build(building, allow_network=allow_network)
            os.chmod(building, 0o755)
            try:
                os.rename(building, root)
            except OSError:
                if not root.is_dir():   # not a copy of another host's worker (a shared disk) in the way
                    raise
        finally:
            if building.exists():
                shutil.rmtree(building, ignore_errors=True)
    return root


def probe_root(directory: Path) -> Path:
    """A root in ``directory`` for the one sandbox that finds out whether bwrap works here: the run's root
    but for the /etc directories of hundreds of files, which starting a sandbox does not read. On some
    disks making them took a fifth of a second, before the run's first model call and only to be thrown
    away: the run builds its own root."""
    root = directory / ".root-probe"
    root.mkdir(mode=0o700)
    _build(root, allow_network=False, etc_entries=tuple(name for name in ETC_ENTRIES if name not in _ETC_DIRECTORIES))
    os.chmod(root, 0o755)
    return root


@contextlib.contextmanager
def _held(lock: Path) -> Iterator[None]:
    """An exclusive lock on the file ``lock`` (made if missing) while the block runs; freed with its
    process however that ends."""
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _build(root: Path, *, allow_network: bool, etc_entries: tuple[str, ...] = ETC_ENTRIES) -> None:
    for name in _MOUNT_POINTS:
        (root / name).mkdir(mode=0o755)
    for name in SYSTEM_LINKS:
        host = Path("/") / name
        if host.is_symlink():
            (root / name).symlink_to(os.readlink(host))
        elif host.is_dir():
            (root / name).mkdir(mode=0o755)
    etc = root / "etc"
    (etc / "ssl").mkdir(mode=0o755, parents=True)
    os.chmod(etc, 0o755)
    for name in etc_entries + (_NETWORK_ETC_ENTRIES if allow_network else ()):
        _copy_etc_entry(Path("/etc") / name, etc / name)
    passwd, group = user_entries(SANDBOX_UID)
    try:
        host_name_service = Path("/etc/nsswitch.conf").read_text(encoding="utf-8", errors="replace")
    except OSError:
        host_name_service = ""
    name_service = sandbox_name_service(host_name_service, allow_network=allow_network)
    for name, text in (("passwd", passwd), ("group", group), ("nsswitch.conf", name_service)):
        (etc / name).write_text(text)
        os.chmod(etc / name, 0o644)


def sandbox_name_service(host: str, *, allow_network: bool) -> str:
    """The sandbox's nsswitch.conf, from the host's (``host``): users and groups from the sandbox's own
    files; host names from its files first, then, in the host's order, those of the host's sources that
    need no service to answer (the C library's module for the machine's own name, and DNS where the
    sandbox has a network). The other sources (systemd, sssd, LDAP, mDNS) answer over sockets a sandbox
    does not have, and asking them costs every name that misses a library load: setpriv's lookup of the
    uid it is given, in every sandbox."""
    usable = {"files", "myhostname", *(["dns"] if allow_network else [])}
    hosts = ["files", "dns"]     # the C library's order where the host says nothing
    for line in host.splitlines():
        database, _, sources = line.partition("#")[0].partition(":")
        if database.strip() == "hosts":
            hosts = sources.split()
    kept = [source for source in dict.fromkeys(["files", *hosts]) if source in usable]
    return f"passwd: files\ngroup: files\nshadow: files\ngshadow: files\nhosts: {' '.join(kept)}\n"


def _copy_etc_entry(source: Path, target: Path) -> None:
    """A link into /usr stays a link (it resolves inside too); anything else is copied as what it points
    at (resolv.conf often links into /run, which the sandbox does not have). Missing entries are skipped."""
    with contextlib.suppress(FileNotFoundError):
        if source.is_symlink() and os.path.realpath(source).startswith("/usr/"):
            target.symlink_to(os.readlink(source))
        elif source.is_dir():
            shutil.copytree(source, target, symlinks=True)
            _readable(target)
        elif source.is_file():
            shutil.copyfile(source, target)
            os.chmod(target, 0o644)


def _readable(top: Path) -> None:
    """Directories 0755 and files 0644, so that an unprivileged sandbox user can read every copy."""
    for directory, _subdirectories, files in os.walk(top):
        os.chmod(directory, 0o755)
        for name in files:
            path = Path(directory) / name
            if not path.is_symlink():
                os.chmod(path, 0o644)
