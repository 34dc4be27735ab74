"""Which Ray a run uses: a private one started on this machine, or the cluster at RAY_ADDRESS joined.

Apart from the pool because it is about Ray itself, not the sessions: the environment Ray must find
when it is imported, the check that a head answers before Ray retries it for minutes, and ray.init
with Ctrl-C kept away from Ray's processes.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from typing import Any

from batchrun.install_hint import install_hint
from batchrun.stop_signals import HANDLED
from batchrun.workers import PoolStartError

INSTALL_HINT = install_hint("ray")
# A private Ray stays on the loopback interface: with this, Ray takes 127.0.0.1 as the node's address
# (otherwise it binds every interface and advertises the external address), and it reports nothing.
LOCAL_RAY_ENVIRONMENT = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
LOOPBACK_PREFIXES = ("127.", "::1", "::ffff:127.")
# Ray's socket paths ($TMPDIR/ray/session_<date>_<pid>/sockets/plasma_store) must fit in 107 bytes.
MAX_TMPDIR_LENGTH = 36
PROBE_TIMEOUT = 5.0             # seconds for a TCP connection to RAY_ADDRESS's head before Ray is asked
# Ray retries an unreachable head for many minutes by default. One attempt with a short connection
# timeout bounds a head that accepts connections but does not answer as Ray (docs/performance.md has
# the figures); a user's own setting of either variable wins.
JOIN_ENVIRONMENT = {"RAY_NUM_REDIS_GET_RETRIES": "1", "RAY_py_gcs_connect_timeout_s": "10"}


def cluster_address() -> str | None:
    """The cluster RAY_ADDRESS names, or None for the private Ray. Ray reads ``local`` as "start a new
    Ray on this machine": that is the private Ray, which alone stays on 127.0.0.1 and is stopped even
    after a ``kill -9`` of the runner."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    return None if address in ("", "local") else address


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise PoolStartError(f"--backend=ray needs Ray, an optional extra: {INSTALL_HINT}") from None
    return ray


def set_local_environment() -> None:
    """What a private Ray reads when it is imported: call before :func:`import_ray`."""
    os.environ.update(LOCAL_RAY_ENVIRONMENT)
    if "RAY_TMPDIR" not in os.environ and len(os.environ.get("TMPDIR", "")) > MAX_TMPDIR_LENGTH:
        os.environ["RAY_TMPDIR"] = "/tmp"   # Ray's session sockets live under $TMPDIR/ray/session_*/


def set_join_environment() -> None:
    """What Ray reads when it is imported to join a cluster: call before :func:`import_ray`."""
    for name, value in JOIN_ENVIRONMENT.items():
        os.environ.setdefault(name, value)


def set_output_environment() -> None:
    """Ray prints its processes' log lines (a node marked dead, say) on the runner's stdout and stderr, each
    behind a coloured prefix; where those are not a terminal the run's output holds no terminal control
    characters (docs/layout.md), so the prefix goes plain there. Ray reads it as it prints; your own
    RAY_COLOR_PREFIX wins."""
    if not (sys.stdout.isatty() and sys.stderr.isatty()):
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def head_endpoint(address: str) -> tuple[str, int] | None:
    """(host, port) of a RAY_ADDRESS such as ``10.0.0.5:6379`` or ``ray://head:10001``; None for the
    forms Ray resolves itself (``auto``)."""
    host, separator, port = address.split("://", 1)[-1].rpartition(":")
    if not separator or not port.isdigit() or not host:
        return None
    return host.strip("[]"), int(port)


def unreachable(host: str, port: int) -> str | None:
    """Why no TCP connection to host:port opens within PROBE_TIMEOUT, or None when one does."""
    try:
        socket.create_connection((host, port), timeout=PROBE_TIMEOUT).close()
    except TimeoutError:
        return f"no answer within {PROBE_TIMEOUT:.0f} s"
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def check_head_answers(address: str) -> None:
    """A plain TCP connection first: where nothing listens, Ray would retry for 13 minutes."""
    endpoint = head_endpoint(address)
    if endpoint is not None and (why := unreachable(*endpoint)) is not None:
        # A ray:// address names the head's Ray Client server, which has a port of its own.
        option = "--ray-client-server-port" if address.startswith("ray://") else "--port"
        raise PoolStartError(f"nothing answers at RAY_ADDRESS={address} ({why}): start the cluster's head node "
                             f"there (ray start --head {option}={endpoint[1]}) or unset RAY_ADDRESS to run on a "
                             "private local Ray")


def init(ray: Any, address: str | None) -> None:
    """Start the private Ray (``address`` None) or join the cluster at ``address``."""
    logging.getLogger("ray").setLevel(logging.ERROR)   # "started a local instance", token notices
    # ray.init puts its own SIGTERM handler in this process (a stack dump, then abort), in place of the
    # run's stop in order: the run's handlers are put back after it.
    handlers = {signum: signal.getsignal(signum) for signum in HANDLED}
    # Ray's processes must outlive a Ctrl-C, which reaches the whole process group: the parent
    # stops the run and then Ray. They inherit an ignored SIGINT from here.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if address is None:
            ray.init(address="local", num_cpus=os.cpu_count() or 1, num_gpus=0, include_dashboard=False,
                     logging_level=logging.ERROR, namespace="batch_runner")
            node_address = ray.util.get_node_ip_address()
            if not node_address.startswith(LOOPBACK_PREFIXES):
                raise PoolStartError(f"the local Ray took the address {node_address} instead of 127.0.0.1 (was "
                                     "Ray imported before the runner set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0?)")
        else:
            ray.init(address=address, logging_level=logging.ERROR, namespace="batch_runner")
    except PoolStartError:
        raise
    except Exception as exc:
        where = f"the Ray cluster at RAY_ADDRESS={address}" if address else "a local Ray"
        raise PoolStartError(f"could not start {where}: {type(exc).__name__}: {exc}") from None
    finally:
        for signum, handler in handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
