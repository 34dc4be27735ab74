"""A lean OpenAI-compatible chat endpoint for benchmarks: asyncio, keep-alive, fixed script.

Every conversation makes ``--tool-turns`` terminal calls and then answers; each reply waits
``--latency`` seconds. It runs in its own process so that its CPU is not counted as the runner's
and so it can serve thousands of requests per second on this machine (the threaded test fixture
cannot). ``GET /stats`` returns the request count, the time (CLOCK_MONOTONIC) of the first request
and of the last response, the server's own CPU seconds so far, and the figures of the concurrency cap
below.

``--max-concurrent K`` serves at most K requests at once, as a per-key concurrency limit does: one
beyond it is answered 429 at once, without Retry-After. ``POST /limit`` with ``{"max_concurrent": K}``
changes K while it runs (0: no cap). ``/stats`` then also holds ``rejected`` (429s so far),
``serving`` (requests being served now) and ``busy_seconds`` (requests being served, summed over time:
its growth over an interval, divided by the interval, is the mean concurrency served).

    python benchmarks/fast_endpoint.py --latency 0.2 --tool-turns 2      # prints the port
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time

FIRST_REQUEST: list[float] = []
LAST_RESPONSE = [0.0]
REQUESTS = [0]
TOO_MANY = (b'{"error": {"message": "Too many requests at once", "type": "requests", "param": null, '
            b'"code": "rate_limit_exceeded"}}')


class Capacity:
    """The concurrency cap, and what was served under it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.serving = 0
        self.rejected = 0
        self._busy = 0.0
        self._since = time.monotonic()

    def _account(self) -> None:
        now = time.monotonic()
        self._busy += self.serving * (now - self._since)
        self._since = now

    def enter(self) -> bool:
        if self.limit and self.serving >= self.limit:
            self.rejected += 1
            return False
        self._account()
        self.serving += 1
        return True

    def leave(self) -> None:
        self._account()
        self.serving -= 1

    def figures(self) -> dict:
        self._account()
        return {"max_concurrent": self.limit, "rejected": self.rejected, "serving": self.serving,
                "busy_seconds": self._busy}


CAPACITY = Capacity(0)


# The server reads only what it needs from a request, without parsing the growing conversation: its
# CPU shares the machine with the runner, and time it spends is time the runner seems to lose.
_ASSISTANT = re.compile(rb'"role":\s*"assistant"')
_MODEL = re.compile(rb'"model":\s*"((?:[^"\\]|\\.)*)"')


def reply_for(body: bytes, tool_turns: int) -> dict:
    turn = len(_ASSISTANT.findall(body))
    model = _MODEL.search(body)
    message: dict = {"role": "assistant", "content": "", "reasoning": f"Thinking about step {turn}."}
    if turn < tool_turns:
        message["tool_calls"] = [{"id": f"call_{turn}", "type": "function",
                                  "function": {"name": "terminal",
                                               "arguments": json.dumps({"command": f"echo step {turn}"})}}]
        finish = "tool_calls"
    else:
        message["content"] = "Done."
        finish = "stop"
    return {"id": "bench", "object": "chat.completion", "created": int(time.time()),
            "model": json.loads(b'"' + model.group(1) + b'"') if model else None,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 10, "total_tokens": 60}}


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, latency: float, jitter: float,
                 tool_turns: int) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            status = b"200 OK"
            if request_line.startswith("GET /stats"):
                payload = {"requests": REQUESTS[0], "first_request": FIRST_REQUEST[0] if FIRST_REQUEST else None,
                           "last_response": LAST_RESPONSE[0], "cpu_seconds": time.process_time(),
                           **CAPACITY.figures()}
            elif request_line.startswith("POST /limit"):
                CAPACITY.limit = int(json.loads(body)["max_concurrent"])
                payload = CAPACITY.figures()
            elif not CAPACITY.enter():
                status, payload = b"429 Too Many Requests", None
            else:
                if not FIRST_REQUEST:
                    FIRST_REQUEST.append(time.monotonic())
                REQUESTS[0] += 1
                try:
                    await asyncio.sleep(latency + random.uniform(-jitter, jitter))
                finally:
                    CAPACITY.leave()
                payload = reply_for(body, tool_turns)
                LAST_RESPONSE[0] = time.monotonic()
            data = TOO_MANY if payload is None else json.dumps(payload).encode()
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(data)).encode() + b"\r\n\r\n" + data)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve(port: int, latency: float, jitter: float, tool_turns: int) -> None:
    server = await asyncio.start_server(lambda r, w: handle(r, w, latency, jitter, tool_turns), "127.0.0.1", port,
                                        backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--jitter", type=float, default=0.0,
                        help="each reply waits latency +/- up to this many seconds (uniform; the mean stays latency)")
    parser.add_argument("--tool-turns", type=int, default=2)
    parser.add_argument("--max-concurrent", type=int, default=0,
                        help="serve at most this many requests at once, answer 429 beyond (0: no cap)")
    args = parser.parse_args()
    CAPACITY.limit = args.max_concurrent
    try:
        asyncio.run(serve(args.port, args.latency, args.jitter, args.tool_turns))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
