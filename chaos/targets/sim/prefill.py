"""The prefill worker: compute the prompt's KV, then write it into decode's pool.

SGLang's prefill lifecycle (`srt/disaggregation/prefill.py`): open a sender for the request's bootstrap
room, wait (bootstrap timeout) until decode says which pages to fill, run the forward pass, send
the KV chunk by chunk and finish with the first token. On success the response's finish reason is
`length 0`; the client sees decode's answer, the router only checks this one's status.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from chaos.targets.sim.bootstrap import BootstrapServer
from chaos.targets.sim.engine import Engine, Phase, Req
from chaos.targets.sim.protocol import Finish, abort
from chaos.targets.sim.transfer import Done, TransferFailed, kv_checksum, send_rejection

log = logging.getLogger("sglang.disaggregation.prefill")


class PrefillEngine(Engine):
    role = "prefill"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.bootstrap = BootstrapServer()
        self._transfer_seconds = 0.0
        self._transfer_bytes = 0
        self._transfer_count = 0

    def admit_rejected(self, req: Req) -> bool:
        """Defect "rejected_prefill_handoff" (SGLang #30233): the rejected prompt is swapped for
        the one-token stub [0], which still bootstraps, sends one token of KV and succeeds."""
        if "rejected_prefill_handoff" not in self.defects:
            return False
        req.inp = dataclasses.replace(req.inp, input_ids=[0], max_new_tokens=1)
        return True

    def on_rejected(self, req: Req, rejection: Finish) -> None:
        """Decode admitted what we rejected (asymmetric pools): tell it, so it answers our 400
        instead of waiting out its timeout with the pages held and then answering 500."""
        if req.room is None:
            return
        message = str(rejection.message or "rejected by prefill")
        early = self.bootstrap.reject(req.room, message)
        if early is not None:
            self._spawn(send_rejection(early, req.room, message))

    async def run(self, req: Req) -> None:
        if req.room is None:
            log.error("Invalid request: Disaggregated request received without bootstrap room id")
            self.finish(req, abort("Disaggregated request received without bootstrap room id", status_code=400))
            return
        try:
            room = self.bootstrap.open_room(req.room)
        except ValueError as exc:
            self.finish(req, abort(str(exc), status_code=400))
            return
        try:
            await self._handoff(req, room.sender, room.destination)
        finally:
            self.bootstrap.close_room(req.room)

    async def _handoff(self, req: Req, sender, destination) -> None:  # type: ignore[no-untyped-def]
        timeouts = self.settings.timeouts
        req.phase = Phase.BOOTSTRAP
        try:
            dest = await self.until_aborted(req, destination, timeout=timeouts.bootstrap_timeout_s)
        except asyncio.TimeoutError:
            log.warning(
                "Some requests timed out when bootstrapping, which means prefill instances fail to receive the KV indices from the decode instance of this request."
            )
            self.fail_handoff(
                req,
                "bootstrap",
                f"Request {req.room} timed out after {timeouts.bootstrap_timeout_s:.1f}s in KVPoll.Bootstrapping",
            )
            return
        if dest is None or sender.abort_requested:
            self.finish(req, req.abort_reason or abort("Aborted by the decode side"))
            return
        if self.injected_failure():
            self.fail_handoff(req, "bootstrap", "Failed due to an injected failure (SGLANG_TEST_DISAGG_FAILURE_PROB)")
            return

        first = await self.prefill(req, extra_tokens=0)
        if first is None:
            return
        req.phase = Phase.TRANSFER
        n = req.prompt_len
        src_slots = self.pool.slots(req.pages, n)
        dst_slots = self.pool.slots(dest.pages, n)
        checksum = kv_checksum(self.pool.read(src_slots)) if self.settings.kv_checksum else None
        started = time.monotonic()
        try:
            completed = await sender.send(
                dest,
                self.pool,
                src_slots,
                dst_slots,
                Done(first_token=first, num_tokens=n, checksum=checksum, cached_tokens=req.cached_tokens),
                chunk_tokens=self.settings.transfer_chunk_pages * self.pool.page_size,
                tokens_per_s=self.settings.transfer_tokens_per_s,
                should_stop=lambda: req.abort_reason is not None or sender.abort_requested,
                fence_done="commit_before_kv_lands" not in self.defects,
                drop_last_chunk="partial_transfer_reported_complete" in self.defects,
            )
        except TransferFailed as exc:
            log.error("Failed to send kv chunk of %s to %s:%s (%s)", req.room, dest.host, dest.port, exc)
            self.fail_handoff(req, "transfer", f"Failed to send kv chunk of {req.room} to {dest.host}:{dest.port}")
            return
        self._transfer_seconds += time.monotonic() - started
        self._transfer_bytes += n * self.settings.kv_bytes_per_token
        self._transfer_count += 1
        if not completed:
            self.finish(req, req.abort_reason or abort("Aborted by the decode side"))
            return
        if self.injected_failure():
            self.fail_handoff(req, "transfer", "Failed due to an injected failure (SGLANG_TEST_DISAGG_FAILURE_PROB)")
            return
        req.output_ids.append(first)
        # SGLang forces FINISH_LENGTH(0) on a successful transfer unless the request was aborted.
        self.finish(req, Finish(type="length", length=0))

    def _pd_batch_fields(self) -> str:
        return (
            f"#bootstrap-req: {self.count_phase(Phase.BOOTSTRAP)}, "
            f"#inflight-req: {self.count_phase(Phase.TRANSFER)}, #optimistic-req: 0"
        )

    def queue_counts(self) -> dict[str, int]:
        counts = super().queue_counts()
        counts["prefill_bootstrap_queue_reqs"] = self.count_phase(Phase.BOOTSTRAP)
        counts["prefill_inflight_queue_reqs"] = self.count_phase(Phase.TRANSFER)
        return counts

    def kv_transfer_stats(self) -> tuple[float, float]:
        if not self._transfer_count or self._transfer_seconds <= 0:
            return 0.0, 0.0
        return (
            self._transfer_bytes / self._transfer_seconds / 1e9,
            1000.0 * self._transfer_seconds / self._transfer_count,
        )
