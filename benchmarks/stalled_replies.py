"""Memory held by replies that never end: batch_runner against an endpoint that stalls every reply.

    python benchmarks/stalled_replies.py                          # 256 and 1,024 sessions
    python benchmarks/stalled_replies.py --sessions 64 --mib 15

The endpoint (a socket server in this process, on 127.0.0.1) answers each chat call with ``--mib`` MiB of a
reply, gzipped (a few KB on the wire) and declared longer than it is, then sends nothing more. Each session
of the run (one prompt each, no tools) is then stuck reading its reply until --request_timeout. Once every
session has its reply's bytes, or the wait is over, the benchmark prints the sessions, how many replies the
endpoint sent whole, and the PSS of the runner's process tree; then it stops the run (Ctrl-C) and reaps it.

A reply is bounded alone (MAX_REPLY_BYTES) and the replies a worker process reads at once together
(MAX_READING_BYTES): the tree should hold about the workers' share of the latter, not sessions x --mib.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

from throughput import REPO, tree_pss_bytes

_SETTLE_SECONDS = 3.0         # after the last reply went out: the runner inflates what it received


class StallingEndpoint(threading.Thread):
    """Answers every request with the same gzipped start of a reply and holds the connection open."""

    def __init__(self, mib: int) -> None:
        super().__init__(daemon=True)
        deflate = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        self._body = (deflate.compress(b'{"choices":[{"message":{"content":"' + b"a" * (mib * 2**20))
                      + deflate.flush(zlib.Z_SYNC_FLUSH))
        self._socket = socket.create_server(("127.0.0.1", 0), backlog=4096)
        self.sent = 0
        self._lock = threading.Lock()
        self._connections: list[socket.socket] = []

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._socket.getsockname()[1]}/v1"

    def run(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.append(connection)
        try:
            received = b""
            while b"\r\n\r\n" not in received:
                received += connection.recv(65536) or b"\r\n\r\n"
            head, body = received.split(b"\r\n\r\n", 1)
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                body += connection.recv(65536) or b" " * length
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Encoding: gzip\r\n"
                               b"Content-Length: %d\r\n\r\n" % (len(self._body) + 2**20) + self._body)
            with self._lock:
                self.sent += 1
        except OSError:
            pass

    def close(self) -> None:
        self._socket.close()
        with self._lock:
            for connection in self._connections:
                connection.close()


def write_dataset(work: Path, prompts: int) -> Path:
    dataset = work / "dataset.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"stalled {i}"}) + "\n" for i in range(prompts)))
    return dataset


def measure(sessions: int, mib: int, wait: float) -> None:
    endpoint = StallingEndpoint(mib)
    endpoint.start()
    with tempfile.TemporaryDirectory(prefix="stalled-") as work:
        dataset = write_dataset(Path(work), sessions)
        runner = subprocess.Popen(
            [sys.executable, str(REPO / "batch_runner.py"), f"--dataset_file={dataset}", "--run_name=stalled",
             "--batch_size=1000", "--distribution=minimal", f"--num_workers={sessions}", "--max_retries=0",
             "--request_timeout=600", f"--base_url={endpoint.base_url}", "--model=stalled", "--api_key=sk-bench"],
            cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + wait
            while endpoint.sent < sessions and time.monotonic() < deadline and runner.poll() is None:
                time.sleep(0.2)
            time.sleep(_SETTLE_SECONDS)
            pss = tree_pss_bytes(runner.pid)
            print(f"{sessions:8,} {mib:5} {endpoint.sent:10,} {pss / 2**20:12,.0f} {sessions * mib:14,}", flush=True)
        finally:
            runner.send_signal(signal.SIGINT)
            try:
                runner.wait(60)
            except subprocess.TimeoutExpired:
                runner.kill()
                runner.wait()
            endpoint.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--mib", type=int, default=15, help="MiB of each reply before it stalls (default 15)")
    parser.add_argument("--wait", type=float, default=60.0, help="most seconds to wait for the replies to go out")
    args = parser.parse_args()
    os.environ.setdefault("TERMINAL_ENV", "local")      # no tool is called: no sandbox is needed
    print("sessions   MiB replies sent  tree PSS MiB  unbounded MiB")
    for sessions in args.sessions:
        measure(sessions, args.mib, args.wait)


if __name__ == "__main__":
    main()
