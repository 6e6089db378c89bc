"""An opt-in per-request timing log: the worker's own receive and first-token times.

With `--timing-log PATH` (WorkerSettings.timing_log) the worker appends one JSON line per
generation request it answered, to compare the latencies a client journals with the server's
(benchmarks/ttft_overhead.py). Times are `time.time()`, the wall clock the load users stamp
their records with, so on one machine the two subtract. Off by default: then the API takes no
timestamps and writes nothing.

A line: `role`, `rid` (the engine's request id), `request_id` (the `X-Request-ID` header the
router passes on; the load users send their record id in it, on every route, while a `rid` in
the body only rides on `/generate`), `api`, `stream`, `status`, `output_tokens`, and
- `t_recv`: the handler started (the request's headers were in);
- `t_first_token`: the first bytes carrying a generated token were handed to the socket: the
  first such chunk of a stream, or the whole reply when not streaming (what the client's
  `t_first_token` marks on its side); null when none left;
- `t_end`: the reply was complete, or the handler ended.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass


@dataclass
class RequestTiming:
    t_recv: float
    request_id: str | None
    t_first_token: float | None = None

    def first_token_sent(self) -> None:
        if self.t_first_token is None:
            self.t_first_token = time.time()


class TimingLog:
    """Appends lines with one write() each to an O_APPEND file: a reader sees whole lines."""

    def __init__(self, path: str, role: str) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self.path = path
        self.role = role
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def start(self, request_id: str | None) -> RequestTiming:
        return RequestTiming(time.time(), request_id)

    def write(
        self, timing: RequestTiming, *, rid: str, api: str, stream: bool, status: int | None, output_tokens: int
    ) -> None:
        line = {
            "role": self.role,
            "rid": rid,
            "request_id": timing.request_id,
            "api": api,
            "stream": stream,
            "status": status,
            "output_tokens": output_tokens,
            "t_recv": timing.t_recv,
            "t_first_token": timing.t_first_token,
            "t_end": time.time(),
        }
        if self._fd >= 0:
            os.write(self._fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
