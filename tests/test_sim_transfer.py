"""The KV transfer channel: prefill writes KV straight into decode's pool over TCP (like RDMA)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest

from chaos.targets.sim.kvpool import KVPool, KVSlots
from chaos.targets.sim.model import kv_for
from chaos.targets.sim.transfer import (
    HEADER,
    MAGIC,
    Destination,
    Done,
    Kind,
    KVReceiver,
    KVSender,
    SendState,
    TransferFailed,
    kv_checksum,
)

PAGE = 4
FAST = 1e12  # tokens per second: no simulated wire delay
WAIT_S = 5.0


class RecordingSink:
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_done(self, room: int, done: Done) -> None:
        self.events.append(("done", room, done))

    def on_aborted(self, room: int, reason: str = "") -> None:
        self.events.append(("aborted", room))

    def on_stream_closed(self, room: int, terminated: bool) -> None:
        self.events.append(("closed", room, terminated))

    def closed(self, room: int) -> list[bool]:
        return [e[2] for e in self.events if e[0] == "closed" and e[1] == room]


async def _until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def _run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 20))


def _source(num_tokens: int, text_base: int = 100) -> tuple[KVPool, list[int], np.ndarray]:
    pool = KVPool(16, PAGE)
    pool.alloc(3)  # so source pages are not the same numbers as destination pages
    pages = pool.alloc(pool.pages_for(num_tokens))
    slots = pool.slots(pages, num_tokens)
    pool.write(slots, kv_for(list(range(text_base, text_base + num_tokens)), 0, 0))
    return pool, pages, slots


async def _receiver(pool: KVPool) -> tuple[KVReceiver, RecordingSink, int]:
    sink = RecordingSink()
    receiver = KVReceiver(pool, sink)
    port = await receiver.start("127.0.0.1", 0)
    assert port > 0
    return receiver, sink, port


def _assert_kv_equal(a: KVSlots, b: KVSlots) -> None:
    assert a.tokens.tolist() == b.tokens.tolist()
    assert a.positions.tolist() == b.positions.tolist()
    assert a.ctx.tolist() == b.ctx.tolist()


# ---------------------------------------------------------------------------- success ----


def test_send_writes_exact_kv_into_destination_slots_and_done_is_acknowledged() -> None:
    async def main() -> None:
        n = 10
        src_pool, _, src_slots = _source(n)
        dst_pool = KVPool(16, PAGE)
        dst_pages = dst_pool.alloc(dst_pool.pages_for(n))
        dst_slots = dst_pool.slots(dst_pages, n)
        before = dst_pool.read(np.arange(dst_pool.capacity_tokens))
        receiver, sink, port = await _receiver(dst_pool)
        checksum = kv_checksum(src_pool.read(src_slots))
        sender = KVSender(room=4642423220847530966)
        ok = await sender.send(
            Destination("127.0.0.1", port, dst_pages),
            src_pool,
            src_slots,
            dst_slots,
            Done(first_token=777, num_tokens=n, checksum=checksum),
            chunk_tokens=3,
            tokens_per_s=FAST,
            should_stop=lambda: False,
        )
        assert ok is True
        assert sender.state is SendState.FINISHED and sender.finished.is_set()
        assert not sender.may_still_write
        _assert_kv_equal(dst_pool.read(dst_slots), src_pool.read(src_slots))
        # Nothing outside the destination slots changed.
        after = dst_pool.read(np.arange(dst_pool.capacity_tokens))
        outside = np.setdiff1d(np.arange(dst_pool.capacity_tokens), dst_slots)
        assert after.tokens[outside].tolist() == before.tokens[outside].tolist()
        assert after.ctx[outside].tolist() == before.ctx[outside].tolist()
        assert kv_checksum(dst_pool.read(dst_slots)) == checksum
        # on_done before the ACK, so it is recorded by the time send() returns.
        assert sink.events[0] == ("done", 4642423220847530966, Done(777, n, checksum))
        await _until(lambda: sink.closed(4642423220847530966) != [])
        assert sink.closed(4642423220847530966) == [True]
        assert [e[0] for e in sink.events] == ["done", "closed"]
        # 4 WRITE frames (3+3+3+1 slots, 32 bytes a slot + 4) + DONE.
        done_len = len(json.dumps(dataclasses.asdict(Done(777, n, checksum))))
        expected = 4 * HEADER.size + 4 * 4 + 32 * n + HEADER.size + done_len
        await _until(lambda: receiver.open_connections == 0)
        assert receiver.bytes_received == expected
        await receiver.stop()

    _run(main)


def test_done_carries_cached_tokens() -> None:
    async def main() -> None:
        src_pool, _, src_slots = _source(4)
        dst_pool = KVPool(4, PAGE)
        receiver, sink, port = await _receiver(dst_pool)
        ok = await KVSender(room=2).send(
            Destination("127.0.0.1", port, [1]),
            src_pool,
            src_slots,
            dst_pool.slots([1], 4),
            Done(first_token=9, num_tokens=4, checksum=123, cached_tokens=16),
            chunk_tokens=4,
            tokens_per_s=FAST,
            should_stop=lambda: False,
        )
        assert ok
        assert sink.events[0] == ("done", 2, Done(9, 4, 123, 16))
        await receiver.stop()

    _run(main)


def test_done_without_checksum() -> None:
    async def main() -> None:
        src_pool, _, src_slots = _source(5)
        dst_pool = KVPool(8, PAGE)
        dst_pages = [6, 2]
        receiver, sink, port = await _receiver(dst_pool)
        ok = await KVSender(room=1).send(
            Destination("127.0.0.1", port, dst_pages),
            src_pool,
            src_slots,
            dst_pool.slots(dst_pages, 5),
            Done(first_token=5, num_tokens=5, checksum=None),
            chunk_tokens=100,
            tokens_per_s=FAST,
            should_stop=lambda: False,
        )
        assert ok
        assert sink.events[0] == ("done", 1, Done(5, 5, None))
        assert dst_pool.tokens[24:28].tolist() == [100, 101, 102, 103]
        assert dst_pool.tokens[8] == 104
        await receiver.stop()

    _run(main)


# ------------------------------------------------------------------------------ abort ----


def test_should_stop_after_first_chunk_sends_aborted() -> None:
    async def main() -> None:
        n = 12
        src_pool, _, src_slots = _source(n)
        dst_pool = KVPool(16, PAGE)
        dst_pages = dst_pool.alloc(3)
        dst_slots = dst_pool.slots(dst_pages, n)
        receiver, sink, port = await _receiver(dst_pool)
        calls = 0

        def should_stop() -> bool:
            nonlocal calls
            calls += 1
            return calls > 1

        sender = KVSender(room=42)
        ok = await sender.send(
            Destination("127.0.0.1", port, dst_pages),
            src_pool,
            src_slots,
            dst_slots,
            Done(first_token=1, num_tokens=n, checksum=None),
            chunk_tokens=4,
            tokens_per_s=FAST,
            should_stop=should_stop,
        )
        assert ok is False
        assert calls == 2
        assert sender.state is SendState.FINISHED
        assert sink.events[0] == ("aborted", 42)
        assert not any(e[0] == "done" for e in sink.events)
        await _until(lambda: sink.closed(42) != [])
        assert sink.closed(42) == [True]  # ABORTED is a terminal frame
        # The first chunk landed; the rest of the destination is untouched.
        assert dst_pool.tokens[dst_slots[:4]].tolist() == [100, 101, 102, 103]
        assert dst_pool.tokens[dst_slots[4:]].tolist() == [0] * 8
        assert dst_pool.positions[dst_slots[4:]].tolist() == [-1] * 8
        await receiver.stop()

    _run(main)


def test_should_stop_before_any_chunk_writes_nothing() -> None:
    async def main() -> None:
        src_pool, _, src_slots = _source(4)
        dst_pool = KVPool(4, PAGE)
        receiver, sink, port = await _receiver(dst_pool)
        ok = await KVSender(room=7).send(
            Destination("127.0.0.1", port, [0]),
            src_pool,
            src_slots,
            dst_pool.slots([0], 4),
            Done(0, 4, None),
            chunk_tokens=4,
            tokens_per_s=FAST,
            should_stop=lambda: True,
        )
        assert ok is False
        assert sink.events[0] == ("aborted", 7)
        assert dst_pool.tokens.tolist() == [0] * 16
        await receiver.stop()

    _run(main)


# ----------------------------------------------------------------- no ownership check ----


def test_receiver_writes_into_slots_owned_by_nobody() -> None:
    """Intended: the receiver is an RDMA target. It never asks who owns the slots it writes.

    Decode's own bookkeeping (quarantine until the stream ends) is what keeps a late write from
    landing in a page that has been handed to another request; the channel does not.
    """

    async def main() -> None:
        src_pool, _, src_slots = _source(8)
        dst_pool = KVPool(8, PAGE)
        assert dst_pool.free_pages == 8  # nothing allocated: every page is free
        dst_slots = dst_pool.slots([5, 3], 8)
        receiver, _sink, port = await _receiver(dst_pool)
        ok = await KVSender(room=3).send(
            Destination("127.0.0.1", port, [5, 3]),
            src_pool,
            src_slots,
            dst_slots,
            Done(0, 8, None),
            chunk_tokens=8,
            tokens_per_s=FAST,
            should_stop=lambda: False,
        )
        assert ok
        _assert_kv_equal(dst_pool.read(dst_slots), src_pool.read(src_slots))
        assert dst_pool.free_pages == 8  # writes do not allocate
        await receiver.stop()

    _run(main)


def test_source_is_read_at_send_time_not_snapshotted() -> None:
    """Like an RDMA read of registered memory: a source page overwritten mid-send ships the new KV."""

    async def main() -> None:
        n = 8
        src_pool, _, src_slots = _source(n)
        dst_pool = KVPool(8, PAGE)
        dst_slots = dst_pool.slots([0, 1], n)
        receiver, _sink, port = await _receiver(dst_pool)
        calls = 0

        def should_stop() -> bool:
            nonlocal calls
            calls += 1
            if calls == 2:  # after the first chunk went out, someone reuses the second page
                src_pool.write(src_slots[4:], kv_for([9, 9, 9, 9], 0, 0))
            return False

        ok = await KVSender(room=8).send(
            Destination("127.0.0.1", port, [0, 1]),
            src_pool,
            src_slots,
            dst_slots,
            Done(0, n, None),
            chunk_tokens=4,
            tokens_per_s=FAST,
            should_stop=should_stop,
        )
        assert ok
        assert dst_pool.tokens[dst_slots].tolist() == [100, 101, 102, 103, 9, 9, 9, 9]
        await receiver.stop()

    _run(main)


# --------------------------------------------------------------------- bad connections ----


def _write_frame(room: int, slots: list[int], tokens: list[int]) -> bytes:
    count = len(slots)
    payload = (
        struct.pack("!I", count)
        + np.asarray(slots, dtype="<i8").tobytes()
        + np.asarray(tokens, dtype="<i8").tobytes()
        + np.arange(count, dtype="<i8").tobytes()
        + np.arange(count, dtype="<u8").tobytes()
    )
    return HEADER.pack(MAGIC, Kind.WRITE, room, len(payload)) + payload


async def _raw_connection(port: int, data: bytes) -> bytes:
    """Send raw bytes; return whatever comes back before the receiver closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        got = await asyncio.wait_for(reader.read(), WAIT_S)  # EOF: the receiver hung up
    finally:
        writer.close()
    return got


def test_garbage_after_a_write_drops_the_connection_and_reports_an_unterminated_stream() -> None:
    async def main() -> None:
        dst_pool = KVPool(8, PAGE)
        receiver, sink, port = await _receiver(dst_pool)
        garbage = HEADER.pack(b"JUNK", Kind.DONE, 99, 0)
        got = await _raw_connection(port, _write_frame(99, [0, 1], [55, 56]) + garbage)
        assert got == b""  # no ACK: dropped
        await _until(lambda: sink.closed(99) != [])
        assert sink.events == [("closed", 99, False)]
        assert dst_pool.tokens[:2].tolist() == [55, 56]  # the good frame before it was applied

        # The receiver keeps serving: a following good connection works.
        src_pool, _, src_slots = _source(4)
        ok = await KVSender(room=100).send(
            Destination("127.0.0.1", port, [2]),
            src_pool,
            src_slots,
            dst_pool.slots([2], 4),
            Done(0, 4, None),
            chunk_tokens=4,
            tokens_per_s=FAST,
            should_stop=lambda: False,
        )
        assert ok
        assert dst_pool.tokens[8:12].tolist() == [100, 101, 102, 103]
        await _until(lambda: sink.closed(100) != [])
        assert sink.closed(100) == [True]
        await _until(lambda: receiver.open_connections == 0)
        await receiver.stop()

    _run(main)


def test_garbage_first_frame_drops_the_connection_without_any_room() -> None:
    """A bad magic before any valid frame names no room, so there is no stream to close."""

    async def main() -> None:
        dst_pool = KVPool(4, PAGE)
        receiver, sink, port = await _receiver(dst_pool)
        got = await _raw_connection(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert got == b""
        await _until(lambda: receiver.open_connections == 0)
        assert sink.events == []
        assert dst_pool.tokens.tolist() == [0] * 16
        await receiver.stop()

    _run(main)


ROOM_5_UNTERMINATED = [("closed", 5, False)]


@pytest.mark.parametrize(
    ("frame", "expected_events"),
    [
        pytest.param(_write_frame(5, [0, 16], [1, 2]), ROOM_5_UNTERMINATED, id="write-outside-pool"),
        pytest.param(_write_frame(5, [-1], [1]), ROOM_5_UNTERMINATED, id="write-negative-slot"),
        pytest.param(HEADER.pack(MAGIC, Kind.WRITE, 5, 7) + b"\x00" * 7, ROOM_5_UNTERMINATED, id="write-short-payload"),
        pytest.param(HEADER.pack(MAGIC, Kind.ACK, 5, 0), ROOM_5_UNTERMINATED, id="ack-from-sender"),
        pytest.param(HEADER.pack(MAGIC, Kind.DONE, 5, 3) + b"{x}", ROOM_5_UNTERMINATED, id="done-bad-json"),
        # Rejected while reading the header: the frame names no room the receiver accepted.
        pytest.param(HEADER.pack(MAGIC, 9, 5, 0), [], id="unknown-kind"),
        pytest.param(HEADER.pack(MAGIC, Kind.WRITE, 5, 2**31), [], id="payload-over-limit"),
    ],
)
def test_protocol_violations_drop_the_connection(frame: bytes, expected_events: list[tuple[Any, ...]]) -> None:
    async def main() -> None:
        dst_pool = KVPool(4, PAGE)
        receiver, sink, port = await _receiver(dst_pool)
        got = await _raw_connection(port, frame)
        assert got == b""  # no ACK, connection closed
        await _until(lambda: receiver.open_connections == 0)
        assert sink.events == expected_events
        assert dst_pool.tokens.tolist() == [0] * 16  # nothing written
        await receiver.stop()

    _run(main)


# A DONE that does not parse must count as an unterminated stream, so a waiting decode fails fast.
@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"{}", id="missing-fields"),
        pytest.param(b'{"first_token": 1}', id="missing-num-tokens"),
        pytest.param(b"[1]", id="not-an-object"),
        pytest.param(b'{"first_token": null, "num_tokens": 4}', id="null-field"),
    ],
)
def test_malformed_done_reports_an_unterminated_stream(payload: bytes) -> None:
    """A DONE that cannot be parsed is a protocol violation: no on_done, stream NOT terminated.

    Decode only fails a waiting room fast on `on_stream_closed(terminated=False)`; a stream that
    ends "terminated" without on_done/on_aborted leaves it waiting for the full waiting timeout.
    The receiver must also handle it itself (its warning), not leave an unhandled exception.
    """

    async def main() -> None:
        loop = asyncio.get_running_loop()
        unhandled: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, context: unhandled.append(context))
        dst_pool = KVPool(4, PAGE)
        receiver, sink, port = await _receiver(dst_pool)
        got = await _raw_connection(port, HEADER.pack(MAGIC, Kind.DONE, 5, len(payload)) + payload)
        assert got == b""
        await _until(lambda: receiver.open_connections == 0)
        await asyncio.sleep(0.05)
        assert sink.events == [("closed", 5, False)]
        assert unhandled == []
        await receiver.stop()

    _run(main)


def test_sender_fails_when_the_connection_drops_before_ack() -> None:
    async def main() -> None:
        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(HEADER.size)
            writer.close()

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        src_pool, _, src_slots = _source(4)
        sender = KVSender(room=11)
        with pytest.raises(TransferFailed):
            await sender.send(
                Destination("127.0.0.1", port, [0]),
                src_pool,
                src_slots,
                np.arange(4),
                Done(0, 4, None),
                chunk_tokens=4,
                tokens_per_s=FAST,
                should_stop=lambda: False,
            )
        assert sender.state is SendState.FINISHED  # it did connect: writes may have landed
        server.close()

    _run(main)


def test_connect_to_closed_port_raises_transfer_failed_never_connected() -> None:
    async def main() -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        # Nothing listens on `port` now.
        src_pool, _, src_slots = _source(4)
        sender = KVSender(room=12)
        assert sender.state is SendState.IDLE
        with pytest.raises(TransferFailed, match=f"127.0.0.1:{port}"):
            await sender.send(
                Destination("127.0.0.1", port, [0]),
                src_pool,
                src_slots,
                np.arange(4),
                Done(0, 4, None),
                chunk_tokens=4,
                tokens_per_s=FAST,
                should_stop=lambda: False,
            )
        assert sender.state is SendState.NEVER_CONNECTED
        assert sender.finished.is_set()
        assert not sender.may_still_write

    _run(main)


def test_sender_with_room_outside_u64_fails_as_transfer_failed() -> None:
    """A room the frame header cannot carry (negative, or >= 2**64) must fail as TransferFailed.

    Today `HEADER.pack` raises `struct.error`, which `send` does not catch: prefill's handoff only
    handles TransferFailed, so the request dies with a 500 "Internal error", and decode never sees
    a frame for that room (no stream to close), so it waits out the full waiting timeout.
    """

    async def main() -> None:
        dst_pool = KVPool(4, PAGE)
        receiver, _sink, port = await _receiver(dst_pool)
        src_pool, _, src_slots = _source(4)
        for room in (-1, 2**64):
            with pytest.raises(TransferFailed):
                await KVSender(room=room).send(
                    Destination("127.0.0.1", port, [0]),
                    src_pool,
                    src_slots,
                    np.arange(4),
                    Done(0, 4, None),
                    chunk_tokens=4,
                    tokens_per_s=FAST,
                    should_stop=lambda: False,
                )
        await receiver.stop()

    _run(main)


# --------------------------------------------------------------------------- checksum ----


def test_kv_checksum_detects_one_changed_token_and_ctx() -> None:
    kv = kv_for(list(range(100, 164)), 0, 0)
    base = kv_checksum(kv)
    assert base == kv_checksum(kv_for(list(range(100, 164)), 0, 0))
    for index in (0, 31, 63):
        tokens = kv.tokens.copy()
        tokens[index] += 1
        assert kv_checksum(KVSlots(tokens, kv.positions, kv.ctx)) != base, index
        ctx = kv.ctx.copy()
        ctx[index] ^= np.uint64(1 << 40)
        assert kv_checksum(KVSlots(kv.tokens, kv.positions, ctx)) != base, index
    # Swapping two tokens (same multiset) is also caught: adler-32 weighs position.
    swapped = kv.tokens.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert kv_checksum(KVSlots(swapped, kv.positions, kv.ctx)) != base
