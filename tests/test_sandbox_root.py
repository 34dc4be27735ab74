"""The read-only root a bubblewrap sandbox sees: what of the host's configuration it keeps."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from pathlib import Path

import pytest
from conftest import on_event_loop

from batchrun.environments.base import EnvironmentSetupError
from batchrun.environments.bubblewrap import program
from batchrun.environments.bubblewrap import root as root_module
from batchrun.environments.bubblewrap.root import sandbox_name_service, system_root

DEBIAN = "passwd:         files systemd\ngroup:          files systemd\nhosts:          files dns\n"
FEDORA = ("passwd: files systemd\ngroup: files [SUCCESS=merge] systemd\n"
          "hosts: files myhostname resolve [!UNAVAIL=return] dns\n")
UBUNTU = "hosts:          files mdns4_minimal [NOTFOUND=return] dns # mDNS first\n"


def hosts_line(config: str) -> str:
    return next(line for line in config.splitlines() if line.startswith("hosts:"))


def test_users_and_groups_come_from_the_sandbox_files_alone():
    config = sandbox_name_service(FEDORA, allow_network=True)
    assert {line for line in config.splitlines() if not line.startswith("hosts:")} == {
        "passwd: files", "group: files", "shadow: files", "gshadow: files"}


@pytest.mark.parametrize(("host", "allow_network", "hosts"), [
    (DEBIAN, False, "hosts: files"),
    (DEBIAN, True, "hosts: files dns"),
    (FEDORA, False, "hosts: files myhostname"),
    (FEDORA, True, "hosts: files myhostname dns"),
    (UBUNTU, True, "hosts: files dns"),
    ("", True, "hosts: files dns"),
    ("hosts: dns files\n", True, "hosts: files dns"),
])
def test_host_names_come_from_the_hosts_sources_that_need_no_service_and_dns_with_a_network(host, allow_network,
                                                                                           hosts):
    assert hosts_line(sandbox_name_service(host, allow_network=allow_network)) == hosts


def _build_slowly_noting_each(record: Path):
    """root._build that takes long enough for every worker to come while it runs, and notes each build."""
    build = root_module._build

    def noted(target: Path, *, allow_network: bool) -> None:
        with record.open("a") as notes:
            notes.write(f"{os.getpid()}\n")
        time.sleep(0.5)
        build(target, allow_network=allow_network)
    return noted


# Every worker process of a run built its own copy (hundreds of files: /etc/ssl/certs, /etc/alternatives)
# at the same moment, and all but one threw theirs away: on a disk where making a file costs half a
# millisecond of CPU, seconds of the run's start.
def test_the_workers_of_a_run_build_the_sandbox_root_once(tmp_path, monkeypatch):
    record = tmp_path / "builds"
    monkeypatch.setattr(root_module, "_build", _build_slowly_noting_each(record))
    work_root = tmp_path / "work"
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=system_root, args=(work_root,), kwargs={"allow_network": False})
               for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    assert [worker.exitcode for worker in workers] == [0, 0, 0, 0]
    assert len(record.read_text().split()) == 1
    assert sorted(path.name for path in work_root.iterdir()) == [".root", ".root-lock"]
    assert (work_root / ".root" / "etc" / "passwd").is_file()


# The first sandbox of each worker built the root on the event loop every session of the worker shares,
# and waiting there for another worker's build would hold them all as long.
def test_the_root_is_built_off_the_event_loop_and_opened_once_per_process(tmp_path, monkeypatch):
    built_on_loop: list[bool] = []

    def noting(work_root: Path, *, allow_network: bool) -> Path:
        built_on_loop.append(on_event_loop())
        return system_root(work_root, allow_network=allow_network)

    monkeypatch.setattr(program, "system_root", noting)

    async def two_sandboxes_at_once() -> list[int]:
        return list(await asyncio.gather(*(program.root_descriptor(tmp_path, False) for _ in range(2))))

    try:
        first, second = asyncio.run(two_sandboxes_at_once())
        assert first == second and os.path.samefile(f"/proc/self/fd/{first}", tmp_path / ".root")
        assert asyncio.run(two_sandboxes_at_once()) == [first, first]
    finally:
        program.close_root_descriptors()
    assert built_on_loop and not any(built_on_loop)


# The probe at the start builds a root without the /etc directories of hundreds of files; where the run's
# own root cannot be built (an unreadable TLS root, a full disk), each prompt's first sandbox said so as an
# internal error with a traceback's words, not as the environment's failure that --resume retries.
def test_a_root_that_cannot_be_built_fails_the_sandbox_start_saying_why(tmp_path, monkeypatch):
    copy = root_module._copy_etc_entry

    def unreadable_certs(source: Path, target: Path) -> None:
        if source.name == "certs":
            raise PermissionError(13, "Permission denied", str(source))
        copy(source, target)

    monkeypatch.setattr(root_module, "_copy_etc_entry", unreadable_certs)
    try:
        with pytest.raises(EnvironmentSetupError, match=r"cannot prepare the sandboxes' root.*Permission denied.*certs"):
            asyncio.run(program.root_descriptor(tmp_path, False))
    finally:
        program.close_root_descriptors()
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".root-building")]


# A probe whose sandbox's descriptors could not be made (no memory for a memfd, no seccomp filter) let the
# error out of the start-up check and kept the root's descriptor open.
def test_a_probe_that_cannot_make_its_descriptors_says_so_and_keeps_none_open(monkeypatch):
    def no_memory(*args: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(program, "Descriptors", no_memory)
    before = sorted(os.listdir("/proc/self/fd"))
    said = program.candidate_problem(program.bwrap_candidates()[0].path)
    assert said == "cannot prepare a sandbox: [Errno 12] Cannot allocate memory"
    assert sorted(os.listdir("/proc/self/fd")) == before
