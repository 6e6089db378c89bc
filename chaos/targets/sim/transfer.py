"""The KV transfer channel: prefill writes KV straight into decode's pool over TCP.

It behaves like an RDMA write: the sender names destination slots and the receiver stores the
bytes there without asking who owns those slots now. Only a terminal frame closes a room's stream
(DONE after the last chunk, ABORTED when the sender stops early); the receiver acknowledges it so
the sender knows its writes landed. A fault proxy can sit on this link: decode advertises the
address prefill must connect to.

Frame: `!4sBQI` header (magic, kind, bootstrap room, payload length) + payload.
- WRITE payload: count (u32), then slots, tokens, positions (int64) and ctx (uint64), little-endian.
- DONE payload: JSON `{"first_token", "num_tokens", "checksum", "cached_tokens"}`.
- ABORTED: empty, or a UTF-8 reason when prefill rejected the request before any write
  (`send_rejection`); ACK: empty.
"""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

import numpy as np

from chaos.targets.sim.aio import within
from chaos.targets.sim.kvpool import KVPool, KVSlots

log = logging.getLogger("sglang.disaggregation")

MAGIC = b"PDKV"
HEADER = struct.Struct("!4sBQI")
MAX_PAYLOAD = 64 * 1024 * 1024
CONNECT_TIMEOUT_S = 5.0  # Mooncake's MC_HANDSHAKE_CONNECT_TIMEOUT
ACK_TIMEOUT_S = 30.0  # Mooncake's MC_TRANSFER_TIMEOUT floor


class Kind(IntEnum):
    WRITE = 1
    DONE = 2
    ABORTED = 3
    ACK = 4


class ProtocolViolation(Exception):
    pass


@dataclass(frozen=True)
class Done:
    first_token: int
    num_tokens: int
    checksum: int | None
    cached_tokens: int = 0  # prefill's prefix-cache hit, reported in decode's usage


def kv_checksum(kv: KVSlots) -> int:
    """Adler-32 over the transferred KV, like SGLang's `--disaggregation-enable-kv-checksum`."""
    return zlib.adler32(kv.tokens.astype("<i8").tobytes() + kv.ctx.astype("<u8").tobytes())


def _frame(kind: Kind, room: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(MAGIC, kind, room, len(payload)) + payload


def _write_payload(dst_slots: np.ndarray, kv: KVSlots) -> bytes:
    return b"".join(
        (
            struct.pack("!I", len(dst_slots)),
            dst_slots.astype("<i8").tobytes(),
            kv.tokens.astype("<i8").tobytes(),
            kv.positions.astype("<i8").tobytes(),
            kv.ctx.astype("<u8").tobytes(),
        )
    )


def _parse_write(payload: bytes) -> tuple[np.ndarray, KVSlots]:
    if len(payload) < 4:
        raise ProtocolViolation("WRITE frame too short")
    (count,) = struct.unpack("!I", payload[:4])
    if len(payload) != 4 + 32 * count:
        raise ProtocolViolation(f"WRITE frame of {len(payload)} bytes does not hold {count} slots")
    arrays = [
        np.frombuffer(payload, dtype=dtype, count=count, offset=4 + 8 * count * i)
        for i, dtype in enumerate(("<i8", "<i8", "<i8", "<u8"))
    ]
    return arrays[0].astype(np.int64), KVSlots(
        arrays[1].astype(np.int64), arrays[2].astype(np.int64), arrays[3].astype(np.uint64)
    )


def _parse_done(payload: bytes) -> Done:
    try:
        info = json.loads(payload)
        return Done(
            int(info["first_token"]), int(info["num_tokens"]), info.get("checksum"), int(info.get("cached_tokens", 0))
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolViolation(f"bad DONE payload: {exc!r}") from None


async def _read_frame(reader: asyncio.StreamReader) -> tuple[Kind, int, bytes]:
    magic, kind, room, length = HEADER.unpack(await reader.readexactly(HEADER.size))
    if magic != MAGIC:
        raise ProtocolViolation(f"bad magic {magic!r}")
    if length > MAX_PAYLOAD:
        raise ProtocolViolation(f"payload of {length} bytes is over the limit")
    try:
        return Kind(kind), room, await reader.readexactly(length)
    except ValueError:
        raise ProtocolViolation(f"unknown frame kind {kind}") from None


# --------------------------------------------------------------------------------- receiver ---


class TransferSink(Protocol):
    """What the decode side does with the frames of one room."""

    def on_done(self, room: int, done: Done) -> None: ...

    def on_aborted(self, room: int, reason: str = "") -> None: ...

    def on_stream_closed(self, room: int, terminated: bool) -> None: ...


class KVReceiver:
    """Decode's transfer server: applies writes to the pool as they arrive."""

    def __init__(self, pool: KVPool, sink: TransferSink) -> None:
        self.pool = pool
        self.sink = sink
        self.bytes_received = 0
        self.open_connections = 0
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open_connections += 1
        rooms: dict[int, bool] = {}  # room -> terminal frame seen
        try:
            while True:
                kind, room, payload = await _read_frame(reader)
                self.bytes_received += HEADER.size + len(payload)
                rooms.setdefault(room, False)
                if kind is Kind.WRITE:
                    slots, kv = _parse_write(payload)
                    if len(slots) and (slots.min() < 0 or slots.max() >= self.pool.capacity_tokens):
                        raise ProtocolViolation("WRITE outside the pool")
                    self.pool.write(slots, kv)  # no ownership check, as with RDMA
                elif kind is Kind.DONE:
                    done = _parse_done(payload)
                    rooms[room] = True
                    self.sink.on_done(room, done)
                    writer.write(_frame(Kind.ACK, room))
                    await writer.drain()
                elif kind is Kind.ABORTED:
                    rooms[room] = True
                    self.sink.on_aborted(room, payload.decode(errors="replace"))
                    writer.write(_frame(Kind.ACK, room))
                    await writer.drain()
                else:
                    raise ProtocolViolation(f"unexpected {kind.name} frame from a sender")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except ProtocolViolation as exc:
            log.warning("Dropping KV transfer connection: %s", exc)
        finally:
            self.open_connections -= 1
            writer.close()
            for room, terminated in rooms.items():
                self.sink.on_stream_closed(room, terminated)


# ----------------------------------------------------------------------------------- sender ---


async def send_rejection(dest: Destination, room: int, reason: str) -> bool:
    """Tell decode that prefill rejected the room's request before writing anything (ABORTED
    with the reason), so decode answers the client's error instead of waiting out its timeout."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(dest.host, dest.port), CONNECT_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return False
    try:
        writer.write(_frame(Kind.ABORTED, room, reason.encode()))
        await writer.drain()
        kind, _, _ = await asyncio.wait_for(_read_frame(reader), ACK_TIMEOUT_S)
        return kind is Kind.ACK
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ProtocolViolation, struct.error):
        return False
    finally:
        writer.close()


class SendState(IntEnum):
    IDLE = 0  # nothing sent; will never send once the room is aborted
    CONNECTING = 1
    SENDING = 2
    FINISHED = 3  # terminal frame acknowledged or connection closed: no more writes
    NEVER_CONNECTED = 4


class TransferFailed(Exception):
    pass


@dataclass
class Destination:
    host: str
    port: int
    pages: list[int]


class KVSender:
    """Prefill's side of one room's transfer."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.state = SendState.IDLE
        self.abort_requested = False
        self.finished = asyncio.Event()

    @property
    def may_still_write(self) -> bool:
        return self.state in (SendState.CONNECTING, SendState.SENDING)

    def _end(self, state: SendState) -> None:
        self.state = state
        self.finished.set()

    async def send(
        self,
        dest: Destination,
        pool: KVPool,
        src_slots: np.ndarray,
        dst_slots: np.ndarray,
        done: Done,
        chunk_tokens: int,
        tokens_per_s: float,
        should_stop: Callable[[], bool],
        fence_done: bool = True,
        drop_last_chunk: bool = False,
    ) -> bool:
        """Write every chunk, then DONE. Returns False when stopped early (ABORTED sent).

        Source KV is read from the pool chunk by chunk at send time, as an RDMA engine reads
        registered memory, not from a snapshot. Two defects bend this: `fence_done=False` sends
        DONE before the chunks (read before ready), `drop_last_chunk` loses the tail but still
        reports the full length (partial handoff reported complete).
        """
        self.state = SendState.CONNECTING
        try:
            reader, writer = await within(asyncio.open_connection(dest.host, dest.port), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            self._end(SendState.NEVER_CONNECTED)
            raise TransferFailed(f"connect to {dest.host}:{dest.port} failed: {exc!r}") from None
        self.state = SendState.SENDING
        stopped = False
        starts = list(range(0, len(src_slots), chunk_tokens))
        if drop_last_chunk and len(starts) > 1:
            starts.pop()
        try:
            if not fence_done:
                writer.write(_frame(Kind.DONE, self.room, json.dumps(done.__dict__).encode()))
            for start in starts:
                if should_stop():
                    stopped = True
                    break
                stop = start + chunk_tokens
                writer.write(
                    _frame(
                        Kind.WRITE, self.room, _write_payload(dst_slots[start:stop], pool.read(src_slots[start:stop]))
                    )
                )
                await writer.drain()
                await asyncio.sleep(len(src_slots[start:stop]) / tokens_per_s)
            if stopped:
                writer.write(_frame(Kind.ABORTED, self.room))
            elif fence_done:
                writer.write(_frame(Kind.DONE, self.room, json.dumps(done.__dict__).encode()))
            await writer.drain()
            kind, room, _ = await within(_read_frame(reader), ACK_TIMEOUT_S)
            if kind is not Kind.ACK or room != self.room:
                raise TransferFailed(f"expected ACK for room {self.room}, got {kind.name} for {room}")
            return not stopped
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ProtocolViolation, struct.error) as exc:
            raise TransferFailed(f"{type(exc).__name__}: {exc}") from None
        finally:
            writer.close()
            self._end(SendState.FINISHED)
