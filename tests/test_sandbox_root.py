"""The read-only root a bubblewrap sandbox sees: what of the host's configuration it keeps."""

from __future__ import annotations

import pytest

from batchrun.environments.bubblewrap.root import sandbox_name_service

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
