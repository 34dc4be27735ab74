"""The first process of Chromium's network namespace: a program of its own, run by bwrap with
``python -I -S -c`` (Python itself is the one interpreter sure to be there), never imported.

It still sees the host's files. It opens the gate's listening socket in the namespace, hands it to
the worker through a Unix socket (a path, which network namespaces do not separate), and becomes
Chromium's sandbox, given the sandbox's profile directory for the one that Playwright made on the
host (Chromium never sees that directory).

Usage: enter_namespace.py HANDOVER_PATH GATE_PORT PROFILE SANDBOX_COMMAND...
"""

import os
import socket
import sys


def main(handover_path: str, port: int, profile: str, command: list[str]) -> None:
    gate = socket.create_server(("0.0.0.0", port), backlog=socket.SOMAXCONN)
    with socket.socket(socket.AF_UNIX) as handover:
        handover.connect(handover_path)
        socket.send_fds(handover, [b"gate"], [gate.fileno()])
    command = [f"--user-data-dir={profile}" if word.startswith("--user-data-dir=") else word for word in command]
    os.execv(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
