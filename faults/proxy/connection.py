"""One proxied connection: per direction, a reader stage feeds a writer stage through a bounded
queue, and the writer applies the faults (a chunk's delay is fixed when it is read, every other
fault is looked up when it is written, so live changes reach open connections)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from faults.proxy.spec import NO_FAULTS, Direction, FaultSpec, StreamFaults
from faults.proxy.stats import ProxyStats

log = logging.getLogger("pdchaos.faults.proxy")

CHUNK = 64 * 1024
QUEUE_CHUNKS = 64  # in flight per direction: bounds memory under latency, keeps backpressure
BANDWIDTH_PIECE_S = 0.02  # pace bandwidth in pieces of 20 ms worth of bytes


class ProxyState(Protocol):
    """What a connection reads from its proxy, at each use: both are replaced while connections run."""

    @property
    def faults(self) -> FaultSpec: ...

    @property
    def stats(self) -> ProxyStats: ...


class _Cut(Exception):
    """A fault ends the connection: reset=True with RST, else with FIN after flushing."""

    def __init__(self, reset: bool) -> None:
        super().__init__("reset" if reset else "truncate")
        self.reset = reset


@dataclass
class _Flow:
    """One direction of one connection: a reader stage feeds a writer stage through a queue."""

    direction: Direction
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    queue: asyncio.Queue[tuple[float, bytes] | None] = field(default_factory=lambda: asyncio.Queue(QUEUE_CHUNKS))
    forwarded: int = 0
    blackholed: bool = False
    last_release: float = 0.0
    next_send: float = 0.0


def _set_rst_on_close(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def close_writer(writer: asyncio.StreamWriter, how: Literal["graceful", "abort", "reset"]) -> None:
    if how == "reset":
        _set_rst_on_close(writer)
    if how == "graceful":
        writer.close()  # flushes what is buffered, then FIN
    else:
        writer.transport.abort()


class Connection:
    """One accepted connection relayed to the upstream: two flows, ended together."""

    def __init__(
        self,
        proxy: ProxyState,
        roll: float,
        rng: random.Random,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        server: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.roll = roll
        self.rng = rng  # jitter draws, seeded per connection for reproducibility
        self.affected = False
        self.blackholed = False
        self.writers = (client[1], server[1])
        self.flows = (_Flow("upstream", client[0], server[1]), _Flow("downstream", server[0], client[1]))
        self.loop = asyncio.get_running_loop()

    @property
    def stats(self) -> ProxyStats:
        return self.proxy.stats

    def faults(self, direction: Direction) -> StreamFaults:
        spec = self.proxy.faults
        return spec.stream(direction) if self.roll < spec.probability else NO_FAULTS

    def touched(self) -> None:
        if not self.affected:
            self.affected = True
            self.stats.affected += 1

    async def run(self) -> None:
        tasks = [
            self.loop.create_task(stage(flow)) for flow in self.flows for stage in (self._read_stage, self._write_stage)
        ]
        how: Literal["graceful", "abort", "reset"] = "abort"  # if cancelled by stop()
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            how = self._closing_mode([t.exception() for t in done if not t.cancelled()])
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for writer in self.writers:
                close_writer(writer, how)

    @staticmethod
    def _closing_mode(errors: Sequence[BaseException | None]) -> Literal["graceful", "abort", "reset"]:
        error = next((e for e in errors if e is not None), None)
        if error is None:
            return "graceful"  # both directions reached EOF
        if isinstance(error, _Cut):
            return "reset" if error.reset else "graceful"
        if not isinstance(error, OSError):
            log.error("fault proxy connection failed: %r", error)
        return "reset"  # a peer reset or broke the link: pass that on to the other peer

    async def _read_stage(self, flow: _Flow) -> None:
        while data := await flow.reader.read(CHUNK):
            await flow.queue.put((self._release_time(flow), data))
        await flow.queue.put(None)

    def _release_time(self, flow: _Flow) -> float:
        """When this chunk may be written; never before the previous one (jitter keeps order)."""
        faults = self.faults(flow.direction)
        delay_ms = faults.latency_ms + (
            self.rng.uniform(-faults.jitter_ms, faults.jitter_ms) if faults.jitter_ms else 0.0
        )
        if delay_ms > 0:
            self.touched()
            self.stats.delayed_chunks += 1
        flow.last_release = max(self.loop.time() + max(delay_ms, 0.0) / 1000, flow.last_release)
        return flow.last_release

    async def _write_stage(self, flow: _Flow) -> None:
        while (item := await flow.queue.get()) is not None:
            release, data = item
            if (wait := release - self.loop.time()) > 0:
                await asyncio.sleep(wait)
            await self._deliver(flow, data)
        if flow.writer.can_write_eof() and not flow.writer.is_closing():
            flow.writer.write_eof()  # pass a half-close on, as the peer sent it

    async def _deliver(self, flow: _Flow, data: bytes) -> None:
        faults = self.faults(flow.direction)
        if flow.blackholed or faults.blackhole:
            self._discard(flow, len(data))
            return
        if faults.reset and faults.truncate_after_bytes is None:
            raise self._cut(reset=True, truncated=False)
        data, cut = self._limit(flow, faults, data)
        await self._send(flow, faults, data)
        if cut:
            raise self._cut(reset=faults.reset, truncated=True)

    def _discard(self, flow: _Flow, size: int) -> None:
        self.touched()
        flow.blackholed = True
        if not self.blackholed:
            self.blackholed = True
            self.stats.blackholed += 1
        self.stats.discarded_bytes += size

    def _cut(self, *, reset: bool, truncated: bool) -> _Cut:
        self.touched()
        self.stats.resets += reset
        self.stats.truncations += truncated
        return _Cut(reset)

    @staticmethod
    def _limit(flow: _Flow, faults: StreamFaults, data: bytes) -> tuple[bytes, bool]:
        """The part of `data` truncate_after_bytes lets through, and whether to cut after it."""
        if faults.truncate_after_bytes is None:
            return data, False
        room = max(faults.truncate_after_bytes - flow.forwarded, 0)
        return data[:room], len(data) >= room

    async def _send(self, flow: _Flow, faults: StreamFaults, data: bytes) -> None:
        rate = faults.bandwidth_bytes_per_s
        step = min(faults.slice_bytes or len(data), max(int(rate * BANDWIDTH_PIECE_S), 1) if rate else len(data)) or 1
        if faults.slice_bytes and (len(data) > faults.slice_bytes or faults.slice_delay_ms):
            self.touched()
            self.stats.sliced_chunks += 1
        for offset in range(0, len(data), step):
            piece = data[offset : offset + step]
            if faults.slice_bytes and faults.slice_delay_ms:
                # Before every piece, not just between: the pause then does not depend on how
                # the kernel happened to chunk the stream.
                await asyncio.sleep(faults.slice_delay_ms / 1000)
            if rate:
                await self._throttle(flow, len(piece), rate)
            flow.writer.write(piece)
            await flow.writer.drain()
            flow.forwarded += len(piece)
            if flow.direction == "upstream":
                self.stats.bytes_up += len(piece)
            else:
                self.stats.bytes_down += len(piece)

    async def _throttle(self, flow: _Flow, size: int, rate: float) -> None:
        # Sleep before the write, so the last byte lands no earlier than total/rate.
        self.touched()
        self.stats.throttled_bytes += size
        now = self.loop.time()
        flow.next_send = max(flow.next_send, now) + size / rate
        await asyncio.sleep(flow.next_send - now)
