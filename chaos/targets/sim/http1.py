"""A small keep-alive HTTP/1.1 client for the one POST decode makes per request (`/bootstrap`).

aiohttp's client cost the decode worker more CPU per request than the rest of that handshake
(request and response objects, timers, a connection pool with limits and cookies). This one
writes the request in one piece and reads a `Content-Length` body back, over connections it
keeps open per address. Anything else it meets (chunked bodies, a bad status line, a closed
connection) is an `HttpError` or an OSError, which the caller treats as a failed attempt, as it
did aiohttp's errors.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from chaos.targets.sim.aio import within

MAX_IDLE_PER_ADDRESS = 64
MAX_HEADER_LINES = 100

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class HttpError(Exception):
    """The server's answer was not a response this client reads."""


class Response:
    def __init__(self, status: int, content_type: str, body: bytes) -> None:
        self.status = status
        self.content_type = content_type
        self.body = body


class KeepAliveClient:
    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[Connection]] = {}

    async def post_json(self, host: str, port: int, path: str, payload: Any, timeout: float) -> Response:
        """POST `payload` as JSON; the whole exchange (connect included) within `timeout` seconds."""
        body = json.dumps(payload).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        return await within(self._exchange((host, port), head + body), timeout)

    async def _exchange(self, address: tuple[str, int], request: bytes) -> Response:
        conn = self._take(address) or await asyncio.open_connection(*address)
        reader, writer = conn
        try:
            writer.write(request)
            version, status = _status_line(await reader.readuntil(b"\r\n"))
            keep_alive = version == b"HTTP/1.1"
            length: int | None = None
            content_type = ""
            for _ in range(MAX_HEADER_LINES):
                line = await reader.readuntil(b"\r\n")
                if line == b"\r\n":
                    break
                name, _, value = line.partition(b":")
                name, value = name.strip().lower(), value.strip()
                if name == b"content-length":
                    length = int(value)
                elif name == b"content-type":
                    content_type = value.decode("latin-1")
                elif name == b"connection" and value.lower() in (b"close", b"keep-alive"):
                    keep_alive = value.lower() == b"keep-alive"
                elif name == b"transfer-encoding":
                    raise HttpError(f"unsupported transfer-encoding {value!r}")
            else:
                raise HttpError("too many header lines")
            if length is None or length < 0:
                raise HttpError("response without a content-length")
            data = await reader.readexactly(length)
        except BaseException:  # a timeout or cancellation too: the connection is mid-exchange
            writer.close()
            raise
        if keep_alive:
            self._put(address, conn)
        else:
            writer.close()
        return Response(status, content_type, data)

    def _take(self, address: tuple[str, int]) -> Connection | None:
        idle = self._idle.get(address)
        while idle:
            reader, writer = idle.pop()
            if reader.at_eof() or writer.is_closing():  # the server closed it while it sat here
                writer.close()
                continue
            return reader, writer
        return None

    def _put(self, address: tuple[str, int], conn: Connection) -> None:
        idle = self._idle.setdefault(address, [])
        if len(idle) >= MAX_IDLE_PER_ADDRESS:
            conn[1].close()
        else:
            idle.append(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for _, writer in idle:
                writer.close()
        self._idle.clear()


def _status_line(line: bytes) -> tuple[bytes, int]:
    parts = line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise HttpError(f"bad status line {line[:80]!r}")
    return parts[0], int(parts[1])
