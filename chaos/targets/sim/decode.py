"""The decode worker: preallocate pages, let prefill fill them, then decode over them.

SGLang's decode lifecycle (`srt/disaggregation/decode.py`): preallocate pages for the prompt,
publish them to prefill's bootstrap server keyed by the room, wait for the KV (waiting timeout,
heartbeat), check the handoff and commit, then decode. Admission counts the pages the output will
need (SGLang reserves room for decode tokens), but, as in SGLang, the output takes them one at a
time as it crosses each page boundary, from the top of the free list: a page freed a moment ago
goes to a request that is already decoding, not only to the next one admitted.

The one rule that keeps tenants apart: **pages whose KV write may still be in flight are never
reused.** On abort, timeout or a lost prefill, the request's pages go into quarantine (SGLang's
deferred release) until the transfer stream for that room has ended or prefill confirms it never
started one. Only then do they return to the free list.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import cast

from chaos.targets.sim import model
from chaos.targets.sim.aio import within
from chaos.targets.sim.bootstrap import BootstrapClient
from chaos.targets.sim.engine import Engine, Phase, Req
from chaos.targets.sim.protocol import Finish, abort
from chaos.targets.sim.transfer import Destination, Done, KVReceiver, kv_checksum

log = logging.getLogger("sglang.disaggregation.decode")

NOTIFY_RETRY_S = 1.0
METADATA_SLOTS = 2  # defect "metadata_slot_collision": completions are matched by room % this


@dataclass
class Quarantined:
    room: int
    pages: list[int]
    prefill_addr: str
    since: float
    notified: bool = False  # prefill confirmed it stopped; now we wait for the stream to end


@dataclass
class TransferOutcome:
    done: Done | None = None
    failure: str | None = None
    stream_closed: bool = False  # no write for this room can arrive any more
    rejection: str | None = None  # prefill rejected the request before writing anything


class DecodeEngine(Engine):
    role = "decode"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.receiver = KVReceiver(self.pool, self)
        self.client = BootstrapClient()
        self.transfer_host = self.settings.host
        self.transfer_port = 0
        self.waiting: dict[int, tuple[Req, asyncio.Future[TransferOutcome]]] = {}
        self.quarantine: dict[int, Quarantined] = {}
        self.prealloc_queue: list[Req] = []
        self.promised_pages = 0  # admitted outputs' pages not taken yet: admission keeps them free
        self._heartbeat_failures: dict[str, int] = {}
        self._slot_owner: dict[int, int] = {}  # metadata slot -> room that registered it last

    async def start(self) -> None:
        self.transfer_port = await self.receiver.start(self.settings.host, self.settings.transfer_port)
        if self.settings.transfer_advertise:
            host, _, port = self.settings.transfer_advertise.rpartition(":")
            self.transfer_host, self.transfer_port = host, int(port)
        await super().start()
        self._spawn(self._heartbeat_loop(), critical=True)
        self._spawn(self._quarantine_loop(), critical=True)

    async def stop(self) -> None:
        await self.receiver.stop()
        await self.client.close()
        await super().stop()

    # ------------------------------------------------------------------------- lifecycle ----

    def prefill_addr(self, req: Req) -> str:
        """The bootstrap server to talk to: the router's fields, else our own default port."""
        return f"{req.inp.bootstrap_host or '127.0.0.1'}:{req.inp.bootstrap_port or self.settings.bootstrap_port}"

    async def run(self, req: Req) -> None:
        if req.room is None:
            log.error("Invalid request: Disaggregated request received without bootstrap room id")
            self.finish(req, abort("Disaggregated request received without bootstrap room id", status_code=400))
            return
        capacity = self.pool.capacity_tokens
        if req.prompt_len + req.inp.max_new_tokens > capacity:
            message = f"Request {req.rid} exceeds the maximum number of tokens: {req.prompt_len + req.inp.max_new_tokens} > {capacity}"
            log.warning(message)
            self.finish(req, abort(message, status_code=400, err_type="BadRequestError"))
            return
        if req.room in self.waiting or req.room in self.quarantine:
            self.finish(req, abort(f"bootstrap_room {req.room} is already in use", status_code=400))
            return
        if not await self._preallocate(req):
            return
        done = await self._receive(req, self.prefill_addr(req))
        if done is not None:
            self._commit(req, done)

    async def _preallocate(self, req: Req) -> bool:
        """Wait (FIFO, no timeout, as in SGLang) until the pool has pages for prompt + output
        besides those promised to outputs already admitted; take the prompt's, promise the rest."""
        req.phase = Phase.PREALLOC
        needed = self.pool.pages_for(req.prompt_len + req.inp.max_new_tokens)
        self.prealloc_queue.append(req)
        try:
            while not (self.prealloc_queue[0] is req and self.pool.free_pages - self.promised_pages >= needed):
                if req.abort_reason is not None:
                    self.finish(req, abort("Abort in waiting queue"))
                    return False
                self._memory_freed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._memory_freed.wait(), timeout=0.05)
        finally:
            self.prealloc_queue.remove(req)
        req.pages = self.pool.alloc(self.pool.pages_for(req.prompt_len))
        req.promised_pages = needed - len(req.pages)
        self.promised_pages += req.promised_pages
        return True

    def grow(self, req: Req) -> None:
        """The next page of `req`'s output, from the pages admission promised it."""
        if req.promised_pages <= 0:
            raise RuntimeError(f"request {req.rid} decodes past the pages it was admitted with")
        req.pages = req.pages + self.pool.alloc(1)  # a new list: the slot table is keyed by its identity
        req.promised_pages -= 1
        self.promised_pages -= 1

    async def _receive(self, req: Req, addr: str) -> Done | None:
        """Publish the pages to prefill and wait for the KV. None when the request ended here."""
        room = req.room
        assert room is not None
        prompt_pages = req.pages[: self.pool.pages_for(req.prompt_len)]
        outcome: asyncio.Future[TransferOutcome] = asyncio.get_running_loop().create_future()
        self.waiting[room] = (req, outcome)
        self._slot_owner[room % METADATA_SLOTS] = room
        req.phase = Phase.WAITING_KV
        # The waiting timer starts here, not after prefill acknowledged the pages: SGLang's send is
        # fire-and-forget, so a prefill that stops answering times its rooms out all the same.
        waiting_timeout = self.settings.timeouts.waiting_timeout_s
        deadline = asyncio.get_running_loop().time() + waiting_timeout
        try:
            try:
                rejection = await within(
                    self.client.send_destination(
                        addr, room, req.rid, Destination(self.transfer_host, self.transfer_port, prompt_pages)
                    ),
                    timeout=waiting_timeout,
                )
            except ConnectionError as exc:
                self.fail_handoff(req, "handshake", str(exc))
                return None
            except asyncio.TimeoutError:
                self._waiting_timed_out(req, waiting_timeout)
                return None
            if rejection is not None:
                self._rejected_by_prefill(req, rejection)
                return None
            if self.injected_failure():
                self.fail_handoff(
                    req, "transfer", "Failed due to an injected failure (SGLANG_TEST_DISAGG_FAILURE_PROB)"
                )
                return None
            try:
                left = max(0.0, deadline - asyncio.get_running_loop().time())
                result = await self.until_aborted(req, outcome, timeout=left)
            except asyncio.TimeoutError:
                self._waiting_timed_out(req, waiting_timeout)
                return None
            if result is None:
                if "abort_reported_as_length" in self.defects:  # SGLang #33507
                    self.finish(req, Finish(type="length", length=0))
                else:
                    self.finish(req, req.abort_reason or abort("Aborted"))
                return None
            if result.rejection is not None:
                self._rejected_by_prefill(req, result.rejection)
                return None
            if result.failure is not None:
                if result.stream_closed:
                    self.pool.release(req.pages)  # the stream is over: nothing can land any more
                    req.pages = []
                self.fail_handoff(req, "transfer", result.failure)
                return None
            assert result.done is not None
            return result.done
        finally:
            self.waiting.pop(room, None)

    def _rejected_by_prefill(self, req: Req, message: str) -> None:
        """Prefill rejected the request before any write: no KV can land, so the pages go back
        at once, and the client gets prefill's 400."""
        self.pool.release(req.pages)
        req.pages = []
        self.finish(req, abort(message, status_code=400, err_type="BadRequestError"))

    def _waiting_timed_out(self, req: Req, waiting_timeout: float) -> None:
        log.warning(
            "Some requests fail to receive KV Cache transfer done signal after bootstrapping. These requests will be marked as failed."
        )
        self.fail_handoff(
            req, "transfer", f"Request {req.room} timed out after {waiting_timeout:.1f}s in KVPoll.WaitingForInput"
        )

    def _commit(self, req: Req, done: Done) -> None:
        """Check the handoff before decoding over it: full coverage, then the checksum."""
        # SGLang before #38704 had no such check; two defects model engines without it.
        unchecked = "rejected_prefill_handoff" in self.defects or "metadata_slot_collision" in self.defects
        if done.num_tokens != req.prompt_len and not unchecked:
            self.fail_handoff(
                req, "transfer", f"KV transfer incomplete: received {done.num_tokens} of {req.prompt_len} tokens"
            )
            return
        slots = self.pool.slots(req.pages, req.prompt_len)
        if done.checksum is not None and self.settings.kv_checksum:
            landed = kv_checksum(self.pool.read(slots))
            if landed != done.checksum:
                log.error(
                    "KV checksum mismatch for bootstrap_room=%s: sent %s, landed %s", req.room, done.checksum, landed
                )
                self.fail_handoff(req, "transfer", f"KV checksum mismatch (sent {done.checksum}, landed {landed})")
                return
        req.kv_computed = True
        req.cached_tokens = done.cached_tokens
        req.mode = model.choose_mode(self.pool.read(slots))
        self.start_decoding(req, done.first_token)

    # ---------------------------------------------------------- transfer stream callbacks ----

    def on_done(self, room: int, done: Done) -> None:
        if "metadata_slot_collision" in self.defects:  # SGLang #22716: no identity check on the slot
            room = self._slot_owner.get(room % METADATA_SLOTS, room)
        if room in self.waiting:
            _, outcome = self.waiting[room]
            if not outcome.done():
                outcome.set_result(TransferOutcome(done=done))
        else:
            self._release_quarantined(room, "transfer finished")

    def on_aborted(self, room: int, reason: str = "") -> None:
        if room in self.waiting:
            _, outcome = self.waiting[room]
            if not outcome.done():
                outcome.set_result(
                    TransferOutcome(rejection=reason, stream_closed=True)
                    if reason
                    else TransferOutcome(
                        failure="Failed to get kvcache from prefill instance, it might be dead", stream_closed=True
                    )
                )
        else:
            self._release_quarantined(room, "transfer aborted by prefill")

    def on_stream_closed(self, room: int, terminated: bool) -> None:
        if room in self.waiting and not terminated:
            _, outcome = self.waiting[room]
            if not outcome.done():
                outcome.set_result(
                    TransferOutcome(
                        failure="Failed to get kvcache from prefill instance, it might be dead", stream_closed=True
                    )
                )
        elif room not in self.waiting:
            self._release_quarantined(room, "transfer stream closed")

    # ------------------------------------------------------------------------ quarantine ----

    def release(self, req: Req) -> None:
        """Committed pages go back at once; uncommitted ones wait until no write can land. Pages
        promised to the output and never taken are free already: only the promise ends."""
        self.promised_pages -= req.promised_pages
        req.promised_pages = 0
        uncommitted = req.pages and not req.kv_computed and req.room is not None and req.phase is not Phase.PREALLOC
        if uncommitted and "pages_leak_on_abort" in self.defects:
            req.pages = []  # nobody will ever give them back
            return
        if uncommitted and "free_before_transfer_done" not in self.defects:
            room = cast(int, req.room)  # not None: `uncommitted` requires a room
            self.quarantine[room] = Quarantined(room, req.pages, self.prefill_addr(req), time.monotonic())
            req.pages = []
            return
        self.pool.release(req.pages)
        req.pages = []
        self._memory_freed.set()

    def _release_quarantined(self, room: int, why: str) -> None:
        held = self.quarantine.pop(room, None)
        if held is not None:
            log.info("Deferred release of %d pages for bootstrap_room=%d: %s", len(held.pages), room, why)
            self.pool.release(held.pages)
            self._memory_freed.set()

    async def _quarantine_loop(self) -> None:
        """Ask prefill about each quarantined room until it says no write can come."""
        while True:
            await asyncio.sleep(NOTIFY_RETRY_S / 4)
            for held in list(self.quarantine.values()):
                if held.notified or held.room not in self.quarantine:
                    continue
                state = await self.client.notify_abort(held.prefill_addr, held.room)
                if state in ("never_started", "unknown"):
                    self._release_quarantined(held.room, f"prefill reports {state}")
                elif state is not None:
                    held.notified = True  # the receiver releases when the stream ends

    async def _heartbeat_loop(self) -> None:
        """Poll each prefill we wait on; after enough misses fail its rooms (SGLang's heartbeat)."""
        timeouts = self.settings.timeouts
        while True:
            await asyncio.sleep(timeouts.heartbeat_interval_s)
            addrs = {self.prefill_addr(req) for req, _ in self.waiting.values()}
            for addr in addrs:
                if await self.client.healthy(addr, timeout_s=min(2.0, timeouts.heartbeat_interval_s)):
                    self._heartbeat_failures.pop(addr, None)
                    continue
                misses = self._heartbeat_failures.get(addr, 0) + 1
                self._heartbeat_failures[addr] = misses
                log.info("Attempting to reconnect to %s...", addr)
                if misses >= timeouts.heartbeat_max_failure:
                    self._heartbeat_failures.pop(addr, None)
                    self._fail_rooms_of(addr)

    def _fail_rooms_of(self, addr: str) -> None:
        affected = [(req, outcome) for req, outcome in self.waiting.values() if self.prefill_addr(req) == addr]
        log.error(
            "Lost connection with prefill instance (bootstrap_addr: %s), %d requests affected", addr, len(affected)
        )
        for _, outcome in affected:
            if not outcome.done():
                outcome.set_result(
                    TransferOutcome(failure=f"Lost connection with prefill instance (bootstrap_addr: {addr})")
                )

    # --------------------------------------------------------------------------- queries ----

    def _decode_batch_pd_fields(self) -> str:
        total = self.pool.capacity_tokens
        prealloc_tokens = sum(len(r.pages) for r, _ in self.waiting.values()) * self.pool.page_size
        return (
            f"pre-allocated usage: {prealloc_tokens / total:.2f}, #prealloc-req: {len(self.prealloc_queue)}, "
            f"#transfer-req: {len(self.waiting)}, #retracted-req: 0, "
        )

    def queue_counts(self) -> dict[str, int]:
        counts = super().queue_counts()
        counts["decode_prealloc_queue_reqs"] = len(self.prealloc_queue)
        counts["decode_transfer_queue_reqs"] = len(self.waiting)
        return counts

    def quarantined_tokens(self) -> int:
        return sum(len(q.pages) for q in self.quarantine.values()) * self.pool.page_size

    def num_waiting(self) -> int:
        return len(self.prealloc_queue)
