"""The TCP fault proxy: pass-through, each fault, live changes, stats, stop, and the standalone CLI.

Loopback only. Timing asserts are lower bounds (a fault must cost at least what it promises);
the few upper bounds are far from the injected delay (a clean ping vs a 200 ms fault).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from aiohttp import web

from chaos.targets.sim.kvpool import KVPool
from chaos.targets.sim.model import kv_for
from chaos.targets.sim.transfer import Destination, Done, KVReceiver, KVSender, TransferFailed
from faults.proxy.control import ControlClient
from faults.proxy.spec import FaultSpec, FaultSpecError, StreamFaults
from faults.proxy.stats import ProxyStats
from faults.proxy.tcp import FaultProxy
from faults.proxy.thread import ProxyThread
from tests.aiohttp_thread import ThreadedServer

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 5.0


# ------------------------------------------------------------------------------- upstreams ---


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except ConnectionResetError:
            pass  # the reset faults reset this side too


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture(scope="module")
def echo_port() -> Iterator[int]:
    server = _EchoServer(("127.0.0.1", 0), _Echo)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


BIG = random.Random(7).randbytes(256 * 1024)


@pytest.fixture(scope="module")
def http_port() -> Iterator[int]:
    async def big(_: web.Request) -> web.Response:
        return web.Response(body=BIG)

    async def echo(request: web.Request) -> web.Response:
        return web.Response(body=await request.read())

    app = web.Application()
    app.add_routes([web.get("/big", big), web.post("/echo", echo)])
    with ThreadedServer(app, access_log=None) as server:
        yield server.port


@pytest.fixture()
def proxy(echo_port: int) -> Iterator[ProxyThread]:
    with ProxyThread(("127.0.0.1", echo_port)) as p:
        yield p


# --------------------------------------------------------------------------------- helpers ---


def connect(port: int, timeout_s: float = WAIT_S) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout_s)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            break
        buf += data
    return bytes(buf)


def recv_until_eof(sock: socket.socket) -> bytes:
    buf = bytearray()
    while data := sock.recv(65536):
        buf += data
    return bytes(buf)


def exchange(sock: socket.socket, payload: bytes) -> bytes:
    """Send from a thread while reading here, so neither side's buffers can deadlock us."""
    sender = threading.Thread(target=sock.sendall, args=(payload,))
    sender.start()
    try:
        return recv_exactly(sock, len(payload))
    finally:
        sender.join(WAIT_S)


def ping(sock: socket.socket) -> float:
    start = time.monotonic()
    sock.sendall(b"p")
    assert sock.recv(1) == b"p"
    return time.monotonic() - start


def wait_for(probe: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not probe():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def run_async(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 15))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ------------------------------------------------------------------------------ fault spec ---


def test_spec_validation_names_the_field() -> None:
    with pytest.raises(FaultSpecError, match="latency_ms"):
        StreamFaults(latency_ms=-1)
    with pytest.raises(FaultSpecError, match="probability"):
        FaultSpec(probability=1.5)
    with pytest.raises(FaultSpecError, match="slice_delay_ms needs"):
        StreamFaults(slice_delay_ms=5)
    with pytest.raises(FaultSpecError, match=r"upstream.truncate_after_bytes"):
        FaultSpec.from_dict({"upstream": {"truncate_after_bytes": 1.5}})
    with pytest.raises(FaultSpecError, match=r"downstream.blackhole"):
        FaultSpec.from_dict({"downstream": {"blackhole": 1}})
    with pytest.raises(FaultSpecError, match=r"both.latency_ms"):
        FaultSpec.from_dict({"both": {"latency_ms": True}})
    with pytest.raises(FaultSpecError, match=r"unknown field.*upstream.latency"):
        FaultSpec.from_dict({"upstream": {"latency": 5}})
    with pytest.raises(FaultSpecError, match=r"unknown field.*toxicity"):
        FaultSpec.from_dict({"toxicity": 0.5})
    with pytest.raises(FaultSpecError, match="either 'both'"):
        FaultSpec.from_dict({"both": {}, "upstream": {}})
    spec = FaultSpec.from_dict(
        {"both": {"latency_ms": 5, "bandwidth_bytes_per_s": 1000}, "probability": 0.25, "seed": 3}
    )
    assert spec.upstream == spec.downstream == StreamFaults(latency_ms=5, bandwidth_bytes_per_s=1000)
    assert FaultSpec.from_dict(spec.to_dict()) == spec
    assert spec == FaultSpec.both(latency_ms=5, bandwidth_bytes_per_s=1000, probability=0.25, seed=3)
    assert spec.active and not FaultSpec().active and FaultSpec(refuse=True).active
    # Sparse JSON: {} is a clean link (heal's audit relies on it), defaults are left out.
    assert FaultSpec().to_dict() == {} == FaultSpec(probability=0.5, seed=9).to_dict()
    assert FaultSpec(downstream=StreamFaults(reset=True), seed=9).to_dict() == {
        "downstream": {"reset": True},
        "seed": 9,
    }
    assert FaultSpec.from_dict({}) == FaultSpec()


# ------------------------------------------------------------------------------ pass-through ---


def test_passthrough_is_byte_exact_and_unconfirmed(proxy: ProxyThread) -> None:
    payload = random.Random(1).randbytes(1024 * 1024)
    with connect(proxy.port) as sock:
        assert exchange(sock, payload) == payload
    wait_for(lambda: proxy.stats().active == 0, "the connection to close")
    stats = proxy.stats()
    assert (stats.accepted, stats.bytes_up, stats.bytes_down) == (1, len(payload), len(payload))
    assert stats.affected == 0 and not stats.confirmed  # no fault, nothing to confirm


def test_http_link_passthrough_then_downstream_reset(http_port: int) -> None:
    with (
        ProxyThread(("127.0.0.1", http_port)) as p,
        httpx.Client(base_url=f"http://127.0.0.1:{p.port}", timeout=WAIT_S) as client,
    ):
        assert client.get("/big").content == BIG
        assert client.post("/echo", content=b"x" * 5000).content == b"x" * 5000
        p.set_faults(FaultSpec(downstream=StreamFaults(reset=True)))
        with pytest.raises(httpx.TransportError):
            client.get("/big")
        stats = p.stats()
        assert stats.resets >= 1 and stats.confirmed


# ------------------------------------------------------------------------------------ faults ---


def test_latency_is_a_lower_bound_and_jitter_keeps_order(proxy: ProxyThread) -> None:
    proxy.set_faults(FaultSpec(upstream=StreamFaults(latency_ms=150), downstream=StreamFaults(jitter_ms=40), seed=5))
    with connect(proxy.port) as sock:
        assert ping(sock) >= 0.15
        parts = [bytes([i]) * 100 for i in range(40)]
        for part in parts:  # separate chunks, each with its own jitter draw
            sock.sendall(part)
            time.sleep(0.002)
        assert recv_exactly(sock, 4000) == b"".join(parts)
    stats = proxy.stats()
    assert stats.delayed_chunks >= 2 and stats.affected == 1


def test_bandwidth_limit_is_a_lower_bound(proxy: ProxyThread) -> None:
    rate = 1024 * 1024
    proxy.set_faults(FaultSpec(downstream=StreamFaults(bandwidth_bytes_per_s=rate)))
    payload = random.Random(2).randbytes(256 * 1024)
    with connect(proxy.port) as sock:
        start = time.monotonic()
        assert exchange(sock, payload) == payload
        assert time.monotonic() - start >= len(payload) / rate
    assert proxy.stats().throttled_bytes == len(payload)


def test_slicing_splits_and_delays(proxy: ProxyThread) -> None:
    proxy.set_faults(FaultSpec(downstream=StreamFaults(slice_bytes=100, slice_delay_ms=5)))
    payload = random.Random(3).randbytes(2000)
    with connect(proxy.port) as sock:
        start = time.monotonic()
        assert exchange(sock, payload) == payload
        assert time.monotonic() - start >= 20 * 0.005  # 20 pieces, each after a pause
    assert proxy.stats().sliced_chunks >= 1


def test_blackhole_holds_the_connection_open_and_forwards_nothing(proxy: ProxyThread) -> None:
    proxy.set_faults(FaultSpec(upstream=StreamFaults(blackhole=True)))
    with connect(proxy.port, timeout_s=0.3) as sock:
        sock.sendall(b"a" * 1000)
        with pytest.raises(socket.timeout):
            sock.recv(1)
        sock.sendall(b"b" * 1000)  # still open: no reset, no EOF
        wait_for(lambda: proxy.stats().discarded_bytes == 2000, "2000 discarded bytes")
        stats = proxy.stats()
        assert (stats.active, stats.blackholed, stats.bytes_up, stats.bytes_down) == (1, 1, 0, 0)
        proxy.clear()
        # Sticky: this stream already has a hole; a new connection is clean.
        sock.sendall(b"c")
        with pytest.raises(socket.timeout):
            sock.recv(1)
        with connect(proxy.port) as fresh:
            assert ping(fresh) < 1.0


def test_reset_gives_connection_reset_to_the_client(proxy: ProxyThread) -> None:
    proxy.set_faults(FaultSpec(upstream=StreamFaults(reset=True)))
    with connect(proxy.port) as sock:
        sock.sendall(b"hello")
        with pytest.raises(ConnectionResetError):
            sock.recv(10)
    stats = proxy.stats()
    assert (stats.resets, stats.bytes_up, stats.affected) == (1, 0, 1)


def test_truncate_delivers_exactly_n_bytes_then_eof(proxy: ProxyThread) -> None:
    proxy.set_faults(FaultSpec(downstream=StreamFaults(truncate_after_bytes=1000)))
    payload = random.Random(4).randbytes(5000)
    with connect(proxy.port) as sock:
        sock.sendall(payload)
        assert recv_until_eof(sock) == payload[:1000]
    wait_for(lambda: proxy.stats().active == 0, "the connection to close")
    stats = proxy.stats()
    assert (stats.truncations, stats.resets, stats.bytes_down) == (1, 0, 1000)


def test_truncate_with_reset_ends_in_rst(proxy: ProxyThread) -> None:
    proxy.set_faults(FaultSpec(downstream=StreamFaults(truncate_after_bytes=10, reset=True)))
    with connect(proxy.port) as sock:
        sock.sendall(b"z" * 100)
        time.sleep(0.2)  # let the RST arrive before reading
        with pytest.raises(ConnectionResetError):
            recv_until_eof(sock)
    stats = proxy.stats()
    assert (stats.truncations, stats.resets) == (1, 1)


def _refusal_pattern(proxy: ProxyThread, n: int) -> list[bool]:
    pattern = []
    for _ in range(n):
        try:  # the RST of a refusal can beat connect() itself
            with connect(proxy.port, timeout_s=2.0) as sock:
                sock.sendall(b"x")
                refused = sock.recv(1) != b"x"
        except (ConnectionResetError, BrokenPipeError):
            refused = True
        pattern.append(refused)
    return pattern


def test_probability_affects_a_seeded_subset(proxy: ProxyThread) -> None:
    spec = FaultSpec(refuse=True, probability=0.5, seed=1234)
    proxy.set_faults(spec)
    first = _refusal_pattern(proxy, 16)
    assert 0 < sum(first) < 16
    stats = proxy.stats()
    assert stats.refused == stats.affected == sum(first)
    proxy.set_faults(spec)  # reseeds: the k-th connection after set_faults draws the same
    assert _refusal_pattern(proxy, 16) == first
    # The same draws pick which connections a stream fault touches.
    proxy.set_faults(FaultSpec(upstream=StreamFaults(reset=True), probability=0.5, seed=1234))
    before = proxy.stats()
    assert _refusal_pattern(proxy, 16) == first
    assert proxy.stats().since(before).resets == sum(first)
    proxy.set_faults(FaultSpec(refuse=True, probability=0.0))
    assert _refusal_pattern(proxy, 4) == [False] * 4


def test_faults_change_live_on_an_open_connection(proxy: ProxyThread) -> None:
    with connect(proxy.port) as sock:
        assert ping(sock) < 0.2
        before = proxy.stats()
        proxy.set_faults(FaultSpec(upstream=StreamFaults(latency_ms=300)))
        assert ping(sock) >= 0.3
        proxy.clear()
        assert ping(sock) < 0.2
        delta = proxy.stats().since(before)
    assert delta.delayed_chunks == 1 and delta.affected == 1 and delta.confirmed


# ------------------------------------------------------------------------- lifecycle (async) ---


async def _echo_handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.close()


def test_stop_closes_open_connections_and_leaks_no_task() -> None:
    async def main() -> None:
        baseline = asyncio.all_tasks()
        upstream = await asyncio.start_server(_echo_handler, "127.0.0.1", 0)
        proxy = FaultProxy(upstream=("127.0.0.1", upstream.sockets[0].getsockname()[1]))
        port = await proxy.start()
        assert proxy.address == ("127.0.0.1", port)
        clients = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        for reader, writer in clients:
            writer.write(b"hi")
            assert await reader.readexactly(2) == b"hi"
        assert proxy.stats.active == 3
        await proxy.stop()
        for reader, writer in clients:
            with contextlib.suppress(ConnectionResetError):
                assert await asyncio.wait_for(reader.read(10), 2) == b""
            writer.close()
        assert proxy.stats.active == 0
        await proxy.stop()  # idempotent
        with pytest.raises(ConnectionRefusedError):
            await asyncio.open_connection("127.0.0.1", port)
        upstream.close()
        await upstream.wait_closed()
        await asyncio.sleep(0.05)
        assert not [t for t in asyncio.all_tasks() - baseline if not t.done()]

    run_async(main)


def test_upstream_connect_failure_closes_the_client() -> None:
    async def main() -> None:
        proxy = FaultProxy(upstream=("127.0.0.1", free_port()))
        port = await proxy.start()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(reader.read(10), 2) == b""
        writer.close()
        assert (proxy.stats.connect_failures, proxy.stats.active) == (1, 0)
        await proxy.stop()

    run_async(main)


def test_listens_only_where_told(echo_port: int) -> None:
    # Another loopback address than the default: the socket itself must be bound there, and the
    # same port on 127.0.0.1 must refuse, or the proxy would answer on every interface.
    with ProxyThread(("127.0.0.1", echo_port), listen_host="127.0.0.2") as p:
        assert p.address == ("127.0.0.2", p.port)
        with socket.create_connection(("127.0.0.2", p.port), timeout=2) as conn:
            assert conn.getpeername() == ("127.0.0.2", p.port)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", p.port), timeout=2).close()
    with pytest.raises(ValueError, match="upstream"):
        FaultProxy(upstream=("127.0.0.1", 0))


# ------------------------------------------------------------------------ KV transfer channel ---


class _Sink:
    def __init__(self) -> None:
        self.closed: list[tuple[int, bool]] = []

    def on_done(self, room: int, done: Done) -> None:
        pass

    def on_aborted(self, room: int, reason: str = "") -> None:
        pass

    def on_stream_closed(self, room: int, terminated: bool) -> None:
        self.closed.append((room, terminated))


def test_kv_transfer_through_the_proxy_and_truncated() -> None:
    async def send(port: int, room: int) -> bool:
        src = KVPool(16, 4)
        pages = src.alloc(3)
        slots = src.slots(pages, 10)
        src.write(slots, kv_for(list(range(100, 110)), 0, 0))
        return await KVSender(room).send(
            Destination("127.0.0.1", port, pages),
            src,
            slots,
            np.asarray(slots),
            Done(1, 10, None),
            chunk_tokens=3,
            tokens_per_s=1e12,
            should_stop=lambda: False,
        )

    async def main() -> None:
        sink = _Sink()
        receiver = KVReceiver(KVPool(16, 4), sink)
        proxy = FaultProxy(upstream=("127.0.0.1", await receiver.start("127.0.0.1", 0)))
        port = await proxy.start()
        assert await send(port, room=1) is True
        # Past the first WRITE frame (117 bytes), so decode has registered the room.
        proxy.set_faults(FaultSpec(upstream=StreamFaults(truncate_after_bytes=150)))
        with pytest.raises(TransferFailed):
            await send(port, room=2)
        for _ in range(200):
            if (2, False) in sink.closed:
                break
            await asyncio.sleep(0.01)
        assert sink.closed == [(1, True), (2, False)]  # decode saw a stream that never finished
        assert proxy.stats.truncations == 1
        await proxy.stop()
        await receiver.stop()

    run_async(main)


# -------------------------------------------------------------------------------------- CLI ---


def test_standalone_process_with_control_api(echo_port: int) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "faults.proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            f"127.0.0.1:{echo_port}",
            "--control",
            "127.0.0.1:0",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["pid"] == proc.pid and ready["listen"] == f"127.0.0.1:{ready['listen_port']}"
        assert ready["upstream"] == f"127.0.0.1:{echo_port}"
        with ControlClient(f"http://{ready['control']}") as control, connect(ready["listen_port"]) as sock:
            assert ping(sock) < 1.0
            assert control.faults() == FaultSpec()
            spec = control.set_faults({"upstream": {"latency_ms": 150}})
            assert spec.upstream.latency_ms == 150
            assert ping(sock) >= 0.15
            with pytest.raises(FaultSpecError, match="latency_ms"):
                control.set_faults({"upstream": {"latency_ms": -5}})
            assert control.faults() == spec  # a rejected PUT changes nothing
            stats = control.stats()
            assert isinstance(stats, ProxyStats) and stats.delayed_chunks == 1 and stats.confirmed
            control.reset()
            assert httpx.get(f"http://{ready['control']}/faults", trust_env=False).json() == {}
            control.set_faults({"downstream": {"jitter_ms": 5}})
            assert httpx.put(f"http://{ready['control']}/faults", json={}, trust_env=False).json() == {}  # heal's clear
            assert control.stats().delayed_chunks == 1  # reset removes faults, keeps the evidence
            control.reset_stats()
            assert control.stats().accepted == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout:
            proc.stdout.close()
        if proc.stderr:
            proc.stderr.close()


def test_cli_rejects_a_bad_fault_spec() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "faults.proxy", "--upstream", "127.0.0.1:9", "--faults", '{"refuse": "yes"}'],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "refuse" in result.stderr
