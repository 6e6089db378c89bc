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

Here is `FaultProxy`, the listener; its parts are `spec.py` (the faults), `connection.py` (one
relayed connection) and `stats.py` (what the faults did).

Three ways to run it: `FaultProxy` inside a running loop, `ProxyThread` (thread.py) from sync
code, and `python -m faults.proxy` as its own process (faults/proxy/__main__.py; so `pdchaos heal`
can kill a leftover by PID).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import Mapping
from typing import Any

from faults.proxy.connection import Connection, close_writer
from faults.proxy.spec import FaultSpec, as_spec
from faults.proxy.stats import ProxyStats

log = logging.getLogger("pdchaos.faults.proxy")


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

    async def _serve(
        self, roll: float, rng: random.Random, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        spec = self._faults
        if spec.refuse and roll < spec.probability:
            self.stats.refused += 1
            self.stats.affected += 1
            close_writer(writer, "reset")  # RST, the nearest an accepted socket gets to ECONNREFUSED
            return
        try:
            server = await asyncio.wait_for(asyncio.open_connection(*self.upstream), self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            self.stats.connect_failures += 1
            log.warning("fault proxy :%s cannot reach upstream %s:%s: %r", self._port, *self.upstream, exc)
            close_writer(writer, "reset")
            return
        self.stats.active += 1
        try:
            await Connection(self, roll, rng, (reader, writer), server).run()
        finally:
            self.stats.active -= 1
