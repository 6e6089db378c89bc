"""An asyncio TCP fault proxy: the suite's stand-in for netem and Toxiproxy.

This kernel has no netem and there is no Toxiproxy binary (docs/architecture.md), so latency, jitter,
bandwidth, black holes, resets, truncation and slicing on a TCP link come from here. It sits on
router<->worker HTTP links and on the embedded engine's KV transfer channel (decode advertises the
proxy's address and prefill connects to it).

Model, after Toxiproxy's toxics:
- faults are per direction: `upstream` is client->server, `downstream` is server->client;
- `probability` is Toxiproxy's toxicity: each accepted connection draws one number from a seeded
  RNG (reseeded by every `set_faults`), and is affected while that number is below the current
  probability. The k-th connection accepted after `set_faults` always gets the same draw;
- faults can change while traffic flows: a chunk's delay is fixed when the proxy reads it, every
  other fault is looked up when the chunk is written, so live changes reach open connections at
  their next chunk; `refuse` and the probability draw apply at accept.

A fault must be confirmed (docs/architecture.md, "Fault"): `ProxyStats` counts what each fault actually did to
traffic, and `affected == 0` means the fault touched nothing and its window is INCONCLUSIVE.

Three ways to run it: `FaultProxy` inside a running loop, `ProxyThread` from sync code, and
`python -m faults.proxy` as its own process (so `pdchaos heal` can kill a leftover by PID).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import signal
import socket
import struct
import sys
import threading
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

log = logging.getLogger("pdchaos.faults.proxy")

Direction = Literal["upstream", "downstream"]
DIRECTIONS: tuple[Direction, Direction] = ("upstream", "downstream")
CHUNK = 64 * 1024
QUEUE_CHUNKS = 64  # in flight per direction: bounds memory under latency, keeps backpressure
BANDWIDTH_PIECE_S = 0.02  # pace bandwidth in pieces of 20 ms worth of bytes
T = TypeVar("T")


class FaultSpecError(ValueError):
    """A fault spec that cannot be applied; the message names the field."""


# ------------------------------------------------------------------------------- fault spec ---


def _check_number(where: str, value: Any, *, minimum: float = 0.0, integer: bool = False, optional: bool = False) -> None:
    if value is None and optional:
        return
    # bool is an int in Python; `"latency_ms": true` in JSON is a mistake, not 1 ms.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise FaultSpecError(f"{where} must be {kind}{' or null' if optional else ''}, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise FaultSpecError(f"{where} must be a finite number >= {minimum:g}, got {value!r}")


def _check_bool(where: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise FaultSpecError(f"{where} must be true or false, got {value!r}")


def _reject_unknown(where: str, data: Mapping[str, Any], known: set[str]) -> None:
    if not isinstance(data, Mapping):
        raise FaultSpecError(f"{where or 'fault spec'} must be an object, got {type(data).__name__}")
    unknown = sorted(set(data) - known)
    if unknown:
        raise FaultSpecError(f"unknown field(s) {', '.join(f'{where}{k}' for k in unknown)}; known: {', '.join(sorted(known))}")


@dataclass(frozen=True)
class StreamFaults:
    """What happens to one direction of an affected connection.

    - latency_ms, jitter_ms: each chunk is held latency +- uniform(jitter) ms (never below 0);
      chunks never overtake each other, so jitter cannot reorder the byte stream.
    - bandwidth_bytes_per_s: pace writes to this rate (None = unlimited).
    - blackhole: read and discard, forward nothing, keep the connection open. Sticky per
      connection: resuming after bytes were dropped would splice a stream with a hole in it.
    - reset: close both sides with a TCP RST (SO_LINGER 0) at the next chunk.
    - truncate_after_bytes: forward this many bytes of the connection's direction, counted from its
      start, then close both sides (FIN; RST when `reset` is also set).
    - slice_bytes, slice_delay_ms: split writes into pieces of at most slice_bytes, each written
      after a pause of slice_delay_ms (exercises a receiver's partial-read handling).
    """

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_bytes_per_s: float | None = None
    blackhole: bool = False
    reset: bool = False
    truncate_after_bytes: int | None = None
    slice_bytes: int | None = None
    slice_delay_ms: float = 0.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str = "") -> None:
        _check_number(f"{where}latency_ms", self.latency_ms)
        _check_number(f"{where}jitter_ms", self.jitter_ms)
        _check_number(f"{where}bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, minimum=1, optional=True)
        _check_bool(f"{where}blackhole", self.blackhole)
        _check_bool(f"{where}reset", self.reset)
        _check_number(f"{where}truncate_after_bytes", self.truncate_after_bytes, integer=True, optional=True)
        _check_number(f"{where}slice_bytes", self.slice_bytes, minimum=1, integer=True, optional=True)
        _check_number(f"{where}slice_delay_ms", self.slice_delay_ms)
        if self.slice_delay_ms and self.slice_bytes is None:
            raise FaultSpecError(f"{where}slice_delay_ms needs {where}slice_bytes")

    @property
    def active(self) -> bool:
        return self != NO_FAULTS

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> StreamFaults:
        _reject_unknown(where, data, {f.name for f in dataclasses.fields(cls)})
        # Built without __init__ so a bad value is reported with its JSON path ("upstream.").
        spec = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            object.__setattr__(spec, f.name, data.get(f.name, f.default))
        spec.validate(where)
        return spec

    def to_dict(self) -> dict[str, Any]:
        """Only the fields that differ from a clean link: {} means no fault."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}


NO_FAULTS = StreamFaults()


@dataclass(frozen=True)
class FaultSpec:
    """The proxy's whole fault state. `FaultSpec()` is a clean link.

    `probability` and `seed` pick which connections are affected (see the module docstring);
    `refuse` closes affected new connections at once with a RST, a partition at connection level.
    """

    upstream: StreamFaults = NO_FAULTS
    downstream: StreamFaults = NO_FAULTS
    probability: float = 1.0
    seed: int = 0
    refuse: bool = False

    def __post_init__(self) -> None:
        for name in DIRECTIONS:
            if not isinstance(getattr(self, name), StreamFaults):
                raise FaultSpecError(f"{name} must be StreamFaults, got {type(getattr(self, name)).__name__}")
        _check_number("probability", self.probability)
        if self.probability > 1:
            raise FaultSpecError(f"probability must be in [0, 1], got {self.probability!r}")
        _check_number("seed", self.seed, minimum=-(2**63), integer=True)
        _check_bool("refuse", self.refuse)

    @classmethod
    def both(cls, *, probability: float = 1.0, seed: int = 0, refuse: bool = False, **stream: Any) -> FaultSpec:
        """The same StreamFaults on both directions: `FaultSpec.both(latency_ms=50)`."""
        faults = StreamFaults(**stream)
        return cls(faults, faults, probability, seed, refuse)

    def stream(self, direction: Direction) -> StreamFaults:
        return self.upstream if direction == "upstream" else self.downstream

    @property
    def active(self) -> bool:
        return self.refuse or self.upstream.active or self.downstream.active

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FaultSpec:
        """JSON form: {"upstream": {...}, "downstream": {...}} or {"both": {...}}, plus
        "probability", "seed", "refuse". Unknown keys are errors, not silently ignored faults."""
        _reject_unknown("", data, {"upstream", "downstream", "both", "probability", "seed", "refuse"})
        if "both" in data and ("upstream" in data or "downstream" in data):
            raise FaultSpecError("give either 'both' or 'upstream'/'downstream', not both")
        streams = {d: StreamFaults.from_dict(data.get("both", data.get(d, {})), f"{'both' if 'both' in data else d}.") for d in DIRECTIONS}
        return cls(
            streams["upstream"],
            streams["downstream"],
            data.get("probability", 1.0),
            data.get("seed", 0),
            data.get("refuse", False),
        )

    def to_dict(self) -> dict[str, Any]:
        """Sparse, like StreamFaults.to_dict; a spec that injects nothing is {}, which is what
        `pdchaos heal`'s audit reads as "no faults left" (faults/undo.py)."""
        if not self.active:
            return {}
        out: dict[str, Any] = {d: self.stream(d).to_dict() for d in DIRECTIONS if self.stream(d).active}
        defaults = {"probability": 1.0, "seed": 0, "refuse": False}
        out.update({k: getattr(self, k) for k, v in defaults.items() if getattr(self, k) != v})
        return out


def as_spec(faults: FaultSpec | Mapping[str, Any] | None) -> FaultSpec:
    if faults is None:
        return FaultSpec()
    if isinstance(faults, FaultSpec):
        return faults
    return FaultSpec.from_dict(faults)


# ------------------------------------------------------------------------------------ stats ---


@dataclass
class ProxyStats:
    """What the proxy did. `affected` counts connections a fault actually touched."""

    accepted: int = 0
    active: int = 0
    affected: int = 0
    refused: int = 0
    connect_failures: int = 0
    bytes_up: int = 0  # forwarded client->server
    bytes_down: int = 0  # forwarded server->client
    discarded_bytes: int = 0
    blackholed: int = 0  # connections
    resets: int = 0
    truncations: int = 0
    delayed_chunks: int = 0
    throttled_bytes: int = 0
    sliced_chunks: int = 0

    @property
    def confirmed(self) -> bool:
        """Whether any fault touched traffic; False makes the fault window INCONCLUSIVE."""
        return self.affected > 0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "confirmed": self.confirmed}

    def since(self, before: ProxyStats) -> ProxyStats:
        """Counters accumulated after the snapshot `before` (`active` stays a current value)."""
        delta = {f.name: getattr(self, f.name) - getattr(before, f.name) for f in dataclasses.fields(self)}
        return ProxyStats(**{**delta, "active": self.active})


# ------------------------------------------------------------------------------ connections ---


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


def _close_writer(writer: asyncio.StreamWriter, how: Literal["graceful", "abort", "reset"]) -> None:
    if how == "reset":
        _set_rst_on_close(writer)
    if how == "graceful":
        writer.close()  # flushes what is buffered, then FIN
    else:
        writer.transport.abort()


class _Connection:
    def __init__(
        self,
        proxy: FaultProxy,
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
        tasks = [self.loop.create_task(stage(flow)) for flow in self.flows for stage in (self._read_stage, self._write_stage)]
        how: Literal["graceful", "abort", "reset"] = "abort"  # if cancelled by stop()
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            how = self._closing_mode([t.exception() for t in done if not t.cancelled()])
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for writer in self.writers:
                _close_writer(writer, how)

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
        delay_ms = faults.latency_ms + (self.rng.uniform(-faults.jitter_ms, faults.jitter_ms) if faults.jitter_ms else 0.0)
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


# ------------------------------------------------------------------------------------ proxy ---


class FaultProxy:
    """A TCP proxy from (listen_host, listen_port) to `upstream` that injects `FaultSpec` faults.

    It listens only where it is told (loopback by default). Use it from a running event loop;
    sync code uses `ProxyThread`.
    """

    def __init__(
        self,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        *,
        upstream: tuple[str, int],
        faults: FaultSpec | Mapping[str, Any] | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        host, port = upstream
        if not host or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"upstream must be (host, port) with a port in 1..65535, got {upstream!r}")
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.upstream = (host, port)
        self.connect_timeout_s = connect_timeout_s
        self.stats = ProxyStats()
        self._faults = FaultSpec()
        self._rng = random.Random(0)
        self._server: asyncio.AbstractServer | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._port: int | None = None
        self._stopping = False
        self.set_faults(faults)

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the proxy is not started")
        return self._port

    @property
    def address(self) -> tuple[str, int]:
        return self.listen_host, self.port

    @property
    def faults(self) -> FaultSpec:
        return self._faults

    def set_faults(self, faults: FaultSpec | Mapping[str, Any] | None) -> FaultSpec:
        """Replace the whole fault state; reseeds the per-connection draw. Returns the spec."""
        spec = as_spec(faults)
        self._faults = spec
        self._rng = random.Random(spec.seed)
        return spec

    def clear(self) -> None:
        self.set_faults(None)

    def snapshot(self) -> ProxyStats:
        return dataclasses.replace(self.stats)

    def reset_stats(self) -> None:
        self.stats = ProxyStats(active=self.stats.active)

    async def start(self) -> int:
        if self._server is not None:
            raise RuntimeError("the proxy is already started")
        self._server = await asyncio.start_server(self._on_accept, self.listen_host, self.listen_port)
        self._port = int(self._server.sockets[0].getsockname()[1])
        return self._port

    async def stop(self) -> None:
        """Close the listener and every open connection; safe to call twice."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        self._stopping = True
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        if server is not None:
            await server.wait_closed()
        self._stopping = False

    async def _on_accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        self.stats.accepted += 1
        roll, rng = self._rng.random(), random.Random(self._rng.getrandbits(64))
        try:
            await self._serve(roll, rng, reader, writer)
        except asyncio.CancelledError:
            # Python 3.11's stream server logs a cancelled handler as an error; a cancel from
            # stop() is the normal end of a connection, any other cancel is passed on.
            if not self._stopping:
                raise
        finally:
            self._handlers.discard(task)
            if not writer.is_closing():
                writer.transport.abort()

    async def _serve(self, roll: float, rng: random.Random, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        spec = self._faults
        if spec.refuse and roll < spec.probability:
            self.stats.refused += 1
            self.stats.affected += 1
            _close_writer(writer, "reset")  # RST, the nearest an accepted socket gets to ECONNREFUSED
            return
        try:
            server = await asyncio.wait_for(asyncio.open_connection(*self.upstream), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            self.stats.connect_failures += 1
            log.warning("fault proxy :%s cannot reach upstream %s:%s: %r", self._port, *self.upstream, exc)
            _close_writer(writer, "reset")
            return
        self.stats.active += 1
        try:
            await _Connection(self, roll, rng, (reader, writer), server).run()
        finally:
            self.stats.active -= 1


# ------------------------------------------------------------------------------ sync wrapper ---


class ProxyThread:
    """A FaultProxy on its own event loop in a daemon thread, driven from sync code."""

    def __init__(
        self,
        upstream: tuple[str, int],
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        *,
        faults: FaultSpec | Mapping[str, Any] | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.proxy = FaultProxy(listen_host, listen_port, upstream=upstream, faults=faults, connect_timeout_s=connect_timeout_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def address(self) -> tuple[str, int]:
        return self.proxy.address

    def start(self, timeout_s: float = 10.0) -> int:
        if self._loop is not None:
            raise RuntimeError("the proxy thread is already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"fault-proxy->{self.proxy.upstream[1]}", daemon=True)
        self._thread.start()
        try:
            return self._call(self.proxy.start(), timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the proxy (closing its connections) and its loop; safe to call twice."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            self._call(self.proxy.stop(), timeout_s)
        finally:
            self._loop = self._thread = None
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
            if not thread.is_alive():
                loop.close()

    def set_faults(self, faults: FaultSpec | Mapping[str, Any] | None) -> FaultSpec:
        return self._sync(lambda: self.proxy.set_faults(faults))

    def clear(self) -> None:
        self._sync(self.proxy.clear)

    def faults(self) -> FaultSpec:
        return self.proxy.faults

    def stats(self) -> ProxyStats:
        return self._sync(self.proxy.snapshot)

    def reset_stats(self) -> None:
        self._sync(self.proxy.reset_stats)

    def __enter__(self) -> ProxyThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("the proxy thread is not started")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _sync(self, fn: Any) -> Any:
        """Run `fn` on the proxy's loop, so live changes never race a connection mid-chunk."""

        async def call() -> Any:
            return fn()

        return self._call(call(), 10.0)


# --------------------------------------------------------------------------------------- CLI ---


def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m faults.proxy", description="TCP fault proxy with an HTTP control API")
    p.add_argument("--listen", type=parse_hostport, default=("127.0.0.1", 0), help="HOST:PORT to listen on (default 127.0.0.1:0)")
    p.add_argument("--upstream", type=parse_hostport, required=True, help="HOST:PORT to forward to")
    p.add_argument("--control", type=parse_hostport, help="HOST:PORT for the control API (GET/PUT /faults, GET /stats, POST /reset)")
    p.add_argument("--faults", type=json.loads, help="initial fault spec as JSON")
    return p


async def _serve_cli(args: argparse.Namespace) -> int:
    proxy = FaultProxy(*args.listen, upstream=args.upstream, faults=args.faults)
    await proxy.start()
    control = None
    if args.control:
        from faults.proxy_control import ControlServer  # aiohttp only where the API is wanted

        control = ControlServer(proxy, *args.control)
    try:
        control_port = await control.start() if control else None
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopping.set)
        ready = {
            "pid": os.getpid(),
            "listen": f"{proxy.listen_host}:{proxy.port}",
            "listen_port": proxy.port,
            "upstream": f"{proxy.upstream[0]}:{proxy.upstream[1]}",
            "control": f"{args.control[0]}:{control_port}" if control else None,
            "control_port": control_port,
        }
        print(json.dumps(ready), flush=True)
        await stopping.wait()
    finally:
        if control:
            await control.stop()
        await proxy.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        as_spec(args.faults)
    except FaultSpecError as exc:
        print(f"error: --faults: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(_serve_cli(args))


if __name__ == "__main__":
    # Run the imported module's main, not __main__'s copy: faults.proxy_control imports
    # faults.proxy, and two copies of FaultSpec would fail each other's isinstance checks.
    from faults.proxy import main as _main

    sys.exit(_main())
