"""The scheduler core of one embedded-engine worker.

`Engine` is a whole non-disaggregated server (SGLang's `disaggregation_mode: null`): admission
checks, a prefill queue whose forward pass writes KV into the paged pool (through the prefix
cache), and a decode loop that reads the pages each request attends. `PrefillEngine` and
`DecodeEngine` (in `prefill.py` and `decode.py`) reuse these pieces and add the KV handoff.

Everything runs on one asyncio loop, so the engine's state needs no locks; time passes only in
the `asyncio.sleep` calls that stand for GPU work (prefill speed, decode step time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeVar

import numpy as np

from chaos.targets.sim import model
from chaos.targets.sim.kvpool import KVPool
from chaos.targets.sim.metrics import Metrics
from chaos.targets.sim.prefix_cache import PrefixCache, chain_keys
from chaos.targets.sim.protocol import BadRequest, Finish, GenerateInput, abort, kv_transfer_error
from chaos.targets.sim.settings import WorkerSettings
from chaos.targets.sim.tokenizer import EOS_ID, token_text

log = logging.getLogger("sglang.scheduler")
T = TypeVar("T")

DECODE_LOG_INTERVAL = 40  # SGLang's --decode-log-interval


class Phase(str, Enum):
    QUEUED = "queued"
    BOOTSTRAP = "bootstrap"  # prefill: waiting for decode's destination pages
    PREALLOC = "prealloc"  # decode: waiting for pool pages
    PREFILL = "prefill"
    TRANSFER = "transfer"  # prefill: writing KV into decode's pool
    WAITING_KV = "waiting_kv"  # decode: pages published, KV not arrived yet
    DECODE = "decode"
    DONE = "done"


@dataclass(eq=False)
class Req:
    """One request inside the engine."""

    rid: str
    inp: GenerateInput
    created: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.QUEUED
    pages: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    extra_tokens: int = 0  # pages reserved past the prompt, to decode in place
    promised_pages: int = 0  # decode: pages its output may still take (admission counted them)
    kv_computed: bool = False  # prompt KV in `pages` is this request's own
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: Finish | None = None
    mode: model.Mode = model.Mode.GENERATE
    abort_reason: Finish | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)  # set once, by finish()
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    # Wake-ups of `Engine.until_aborted` calls in progress, rung by `Engine.request_abort`.
    abort_watchers: list[asyncio.Future[None]] = field(default_factory=list)
    prefilled: asyncio.Future[int] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    # (page table, its slots): see Engine._slot_table. Keyed by the list's identity, because the
    # engine replaces `pages` (never mutates it) whenever a request's pages change.
    slot_table: tuple[list[int], np.ndarray] | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.inp.input_ids)

    @property
    def room(self) -> int | None:
        return self.inp.bootstrap_room

    def meta_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish.to_json() if self.finish else None,
            "prompt_tokens": self.prompt_len,
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
        }
        if self.finished_at is not None:
            info["e2e_latency"] = self.finished_at - self.created
        return info


class Engine:
    """A whole server on one pool: prefill and decode in the same process."""

    role = "null"

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.defects = settings.defect_set
        self.pool = KVPool(settings.num_pages, settings.page_size)
        self.cache = PrefixCache(self.pool, keep_evicted_keys="prefix_cache_keeps_evicted_pages" in self.defects)
        self.metrics = Metrics()
        self.reqs: dict[str, Req] = {}
        self.prefill_queue: list[Req] = []
        self.running: list[Req] = []
        self.forward_batch: list[Req] = []  # in the forward pass now: out of the queue, not yet handed off
        self._wake_prefill = asyncio.Event()
        self._wake_decode = asyncio.Event()
        self._memory_freed = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()
        self.started_at = time.time()
        self.ready = False
        self._decode_steps = 0
        self._last_gen_throughput = 0.0

    # ---------------------------------------------------------------- lifecycle of the server --

    async def start(self) -> None:
        self._spawn(self._forward_loop(), critical=True)
        self._spawn(self._decode_loop(), critical=True)
        self.ready = True

    async def stop(self) -> None:
        self.ready = False
        for task in list(self._tasks):
            task.cancel()

    def _spawn(self, coro: Any, critical: bool = False) -> asyncio.Task[Any]:
        """Run `coro` in the background; a critical loop that dies makes `/health` fail."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._task_done(t, critical))
        return task

    def _task_done(self, task: asyncio.Task[Any], critical: bool) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        log.error("Engine task failed", exc_info=task.exception())
        if critical:
            self.ready = False

    # -------------------------------------------------------------------------- admission ----

    def validate(self, inp: GenerateInput) -> None:
        """SGLang's tokenizer-manager check: context length, with and without max_new_tokens."""
        n, ctx = len(inp.input_ids), self.settings.context_length
        if n == 0:
            raise BadRequest("The input is empty; provide at least one token.")
        if n >= ctx:
            raise BadRequest(f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens).")
        if n + inp.max_new_tokens > ctx:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {n + inp.max_new_tokens} tokens: {n} tokens from the input "
                f"messages and {inp.max_new_tokens} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )

    def scheduler_rejection(self, req: Req) -> Finish | None:
        """SGLang's scheduler check (`validate_input_length`): depends on the pool size."""
        limit = self.settings.max_req_input_len
        if req.prompt_len >= limit:
            message = (
                f"Input length ({req.prompt_len} tokens) exceeds the maximum allowed length ({limit} tokens). "
                "Use a shorter input or enable --allow-auto-truncate."
            )
            log.warning("%s self.rid=%s", message, req.rid)
            return abort(message, status_code=400, err_type="BadRequestError")
        return None

    def submit(self, inp: GenerateInput) -> Req:
        """Admit a request (or raise BadRequest) and start its lifecycle."""
        self.validate(inp)
        rid = inp.rid or uuid.uuid4().hex
        if rid in self.reqs:
            raise BadRequest(f"Duplicate request id {rid}")
        req = Req(rid=rid, inp=inp)
        self.reqs[rid] = req
        self.metrics.inc("num_requests_total")
        self.metrics.inc("prompt_tokens_total", req.prompt_len)
        rejection = self.scheduler_rejection(req)
        if rejection is not None and not self.admit_rejected(req):
            self.finish(req, rejection)
            self.on_rejected(req, rejection)
        else:
            self._spawn(self._run_guarded(req))
        return req

    def admit_rejected(self, req: Req) -> bool:
        """Whether a request the scheduler check rejected goes on anyway (only a defect says yes)."""
        return False

    def on_rejected(self, req: Req, rejection: Finish) -> None:
        """The scheduler check rejected `req` (prefill tells its decode peer)."""

    async def _run_guarded(self, req: Req) -> None:
        try:
            await self.run(req)
        except asyncio.CancelledError:
            if req.finish is None:
                self.finish(req, abort("Server is shutting down", status_code=503))
            raise
        except Exception as exc:  # an engine bug must end the request, not hang it
            log.exception("Request %s failed inside the engine", req.rid)
            if req.finish is None:
                self.finish(req, abort(f"Internal error: {exc!r}", status_code=500))

    async def run(self, req: Req) -> None:
        """The non-disaggregated lifecycle: prefill locally, then decode over the same pages."""
        first = await self.prefill(req, extra_tokens=req.inp.max_new_tokens)
        if first is not None:
            self.start_decoding(req, first)

    def fail_handoff(self, req: Req, stage: str, reason: str) -> None:
        """End a request whose KV handoff failed, as SGLang logs and answers it (500)."""
        message = kv_transfer_error(req.room or 0, reason)
        log.error(
            "%s %s failed for request rank=0 req.rid=%s req.bootstrap_room=%s with exception %s",
            self.role.capitalize(),
            stage,
            req.rid,
            req.room,
            message,
        )
        bootstrap = stage in ("bootstrap", "handshake")  # prefill's and decode's names for it
        failed = "num_bootstrap_failed_reqs_total" if bootstrap else "num_transfer_failed_reqs_total"
        self.metrics.inc(failed)
        self.finish(req, abort(message, status_code=500))

    def injected_failure(self) -> bool:
        """SGLANG_TEST_DISAGG_FAILURE_PROB: report a poll as failed, without telling the peer."""
        probability = self.settings.timeouts.failure_prob
        return probability > 0 and random.random() < probability

    # ------------------------------------------------------------------------------ abort ----

    def request_abort(self, req: Req, reason: Finish) -> None:
        if req.finish is None and req.abort_reason is None:
            req.abort_reason = reason
            req.aborted.set()
            for watcher in req.abort_watchers:
                if not watcher.done():
                    watcher.set_result(None)
            self._wake_prefill.set()

    def abort_matching(self, rid_prefix: str, abort_all: bool = False) -> int:
        """`/abort_request`: SGLang matches rids by prefix."""
        matched = [r for r in self.reqs.values() if abort_all or r.rid.startswith(rid_prefix)]
        for req in matched:
            log.info("Aborted by AbortReq. rid=%s", req.rid)
            self.request_abort(req, abort("Aborted by AbortReq."))
        return len(matched)

    async def until_aborted(self, req: Req, future: asyncio.Future[T], timeout: float | None = None) -> T | None:
        """Await `future`, but give up when the request is aborted (returns None) or on timeout.

        `future` is never cancelled here (it may be shared, as with `asyncio.shield`). If it is
        done when we wake, its outcome wins over an abort. One wake-up future and callbacks
        instead of `asyncio.wait` over two tasks: this runs a few times for every request.
        """
        if not future.done() and not req.aborted.is_set():
            loop = asyncio.get_running_loop()
            wake: asyncio.Future[None] = loop.create_future()

            def ring(_: object = None) -> None:
                if not wake.done():
                    wake.set_result(None)

            future.add_done_callback(ring)
            req.abort_watchers.append(wake)
            timer = loop.call_later(timeout, ring) if timeout is not None else None
            try:
                await wake
            finally:
                future.remove_done_callback(ring)
                req.abort_watchers.remove(wake)
                if timer is not None:
                    timer.cancel()
        if future.done():
            return future.result()
        if req.aborted.is_set():
            return None
        raise asyncio.TimeoutError

    # ---------------------------------------------------------------------------- prefill ----

    async def prefill(self, req: Req, extra_tokens: int) -> int | None:
        """Queue the prompt for a forward pass; the first token, or None if it was aborted."""
        req.phase = Phase.PREFILL
        req.extra_tokens = extra_tokens
        self.prefill_queue.append(req)
        self._wake_prefill.set()
        first = await self.until_aborted(req, req.prefilled)
        if first is None:
            if req in self.prefill_queue:
                self.prefill_queue.remove(req)
            self.finish(req, req.abort_reason or abort("Aborted"))
        return first

    def cache_salt(self, req: Req) -> bytes:
        """What besides the tokens decides whether cached KV may be reused: the adapter (it
        changes the KV) and the tenant's salt (isolation). Two defects each drop one."""
        adapter = "" if "cache_key_ignores_adapter" in self.defects else (req.inp.lora_path or "")
        tenant = "" if "prefix_cache_shared_across_tenants" in self.defects else (req.inp.cache_salt or "")
        return f"{adapter}\x00{tenant}".encode()

    def _reserve(self, req: Req) -> bool:
        """Pages for the prompt (+ room to decode in place): prefix-cache hits first."""
        n = req.prompt_len
        keys = chain_keys(req.inp.input_ids[: n - 1], self.pool.page_size, self.cache_salt(req))
        cached = self.cache.match(keys)
        needed = self.pool.pages_for(n + req.extra_tokens) - len(cached)
        if not self.cache.can_alloc(needed):
            self.pool.release(cached)
            return False
        req.pages = cached + self.cache.alloc(needed)
        req.cached_tokens = len(cached) * self.pool.page_size
        return True

    async def _forward_loop(self) -> None:
        while True:
            if not self.prefill_queue:
                self._wake_prefill.clear()
                await self._wake_prefill.wait()
            batch: list[Req] = []
            new_tokens = 0
            for req in list(self.prefill_queue):
                if req.abort_reason is not None:
                    continue  # its lifecycle removes it
                if batch and new_tokens + req.prompt_len > self.settings.chunked_prefill_size:
                    break
                if not self._reserve(req):
                    break  # FIFO: wait for memory rather than let later requests overtake
                self.prefill_queue.remove(req)
                batch.append(req)
                new_tokens += req.prompt_len - req.cached_tokens
            if not batch:
                self._memory_freed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._memory_freed.wait(), timeout=0.05)
                continue
            self._log_prefill_batch(batch, new_tokens)
            self.forward_batch = batch
            await asyncio.sleep(new_tokens / self.settings.prefill_tokens_per_s)
            self.forward_batch = []
            for req in batch:
                try:
                    first = self._compute_prompt(req)
                except Exception as exc:  # one request's failure must not stop the loop
                    log.exception("Prefill of %s failed", req.rid)
                    if not req.prefilled.done():
                        req.prefilled.set_exception(exc)
                    continue
                if not req.prefilled.done():
                    req.prefilled.set_result(first)

    def _compute_prompt(self, req: Req) -> int:
        """Write the uncached part of the prompt's KV, then predict the first token."""
        n, start = req.prompt_len, req.cached_tokens
        slots = self.pool.slots(req.pages, n)
        previous = int(self.pool.ctx[slots[start - 1]]) if start else model.adapter_seed(req.inp.lora_path)
        self.pool.write(slots[start:], model.kv_for(req.inp.input_ids[start:], start, previous))
        req.kv_computed = True
        attended = self.pool.read(slots)
        req.mode = model.choose_mode(attended)
        return model.next_token(attended, n, 0, req.mode, req.inp.sampling)

    def _log_prefill_batch(self, batch: list[Req], new_tokens: int) -> None:
        log.info(
            "Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d, %s",
            len(batch),
            new_tokens,
            sum(r.cached_tokens for r in batch),
            self.token_usage(),
            len(self.running),
            len(self.prefill_queue),
            self._pd_batch_fields(),
        )

    def _pd_batch_fields(self) -> str:
        return "#bootstrap-req: 0, #inflight-req: 0, #optimistic-req: 0"

    # ----------------------------------------------------------------------------- decode ----

    def start_decoding(self, req: Req, first_token: int) -> None:
        req.phase = Phase.DECODE
        req.first_token_at = time.monotonic()
        self.metrics.observe("time_to_first_token_seconds", req.first_token_at - req.created)
        if self._append_token(req, first_token):
            self.running.append(req)
            self._wake_decode.set()

    def _append_token(self, req: Req, token: int) -> bool:
        """Add one generated token; finish the request when it should stop. True if it goes on."""
        if req.abort_reason is not None:
            self.finish(req, req.abort_reason)
            return False
        if token == EOS_ID and not req.inp.sampling.ignore_eos:
            self.finish(req, Finish(type="stop", matched=EOS_ID))
            return False
        if req.inp.max_new_tokens == 0:
            self.finish(req, Finish(type="length", length=0))
            return False
        req.output_ids.append(token)
        # The same as detokenizing all of output_ids (a token's text never depends on its
        # neighbours), without redoing the whole output on every step.
        req.text += token_text(token)
        self.metrics.inc("generation_tokens_total")
        for stop in req.inp.stop:
            cut = req.text.find(stop)
            if cut >= 0:
                req.text = req.text[:cut]
                self.finish(req, Finish(type="stop", matched=stop))
                return False
        if len(req.output_ids) >= req.inp.max_new_tokens:
            self.finish(req, Finish(type="length", length=len(req.output_ids)))
            return False
        req.changed.set()
        return True

    async def _decode_loop(self) -> None:
        while True:
            if not self.running:
                self._wake_decode.clear()
                await self._wake_decode.wait()
            started = time.monotonic()
            for req in list(self.running):  # finish() takes a request out of `running`
                if req.finish is None:
                    self._append_token(req, self._decode_one(req))
            await asyncio.sleep(self.settings.decode_step_s)
            self._decode_steps += 1
            elapsed = time.monotonic() - started
            if elapsed > 0:
                self._last_gen_throughput = len(self.running) / elapsed
            if self._decode_steps % DECODE_LOG_INTERVAL == 0 and self.running:
                self._log_decode_batch()

    def _decode_one(self, req: Req) -> int:
        """Write the last token's KV, attend every slot of the sequence, predict the next."""
        prompt_len = req.prompt_len
        pos = prompt_len + len(req.output_ids) - 1
        if pos >= len(req.pages) * self.pool.page_size:
            self.grow(req)
        slots = self._slot_table(req, pos + 1)
        pool = self.pool
        previous = int(pool.ctx[slots[pos - 1]])
        token = req.output_ids[-1]
        pool.write_one(int(slots[pos]), token, pos, model.context_hash(previous, token, pos))
        return model.next_token(pool.read(slots), prompt_len, len(req.output_ids), req.mode, req.inp.sampling)

    def grow(self, req: Req) -> None:
        """Give `req` one more page to decode into. A whole server reserved its output with its
        prompt (`extra_tokens`), so needing one here is a bug; decode takes them as it goes."""
        raise RuntimeError(f"request {req.rid} decodes past the pages reserved for it")

    def _slot_table(self, req: Req, num_tokens: int) -> np.ndarray:
        """`pool.slots(req.pages, num_tokens)`, from a table of all the request's slots made once
        per page table rather than on every decode step."""
        table = req.slot_table
        if table is None or table[0] is not req.pages:
            table = (req.pages, self.pool.slots(req.pages, len(req.pages) * self.pool.page_size))
            req.slot_table = table
        if num_tokens > len(table[1]):
            return self.pool.slots(req.pages, num_tokens)  # raises, as it always did
        return table[1][:num_tokens]

    def _log_decode_batch(self) -> None:
        log.info(
            "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, %sgen throughput (token/s): %.2f, #queue-req: %d",
            len(self.running),
            self.used_tokens(),
            self.token_usage(),
            self._decode_batch_pd_fields(),
            self._last_gen_throughput,
            len(self.prefill_queue),
        )

    def _decode_batch_pd_fields(self) -> str:
        return ""

    # ------------------------------------------------------------------------------ finish ----

    def finish(self, req: Req, reason: Finish) -> None:
        if req.finish is not None:
            return
        req.finish = reason
        req.phase = Phase.DONE
        req.finished_at = time.monotonic()
        if reason.type == "abort":
            self.metrics.inc("num_aborted_requests_total")
        self.metrics.observe("e2e_request_latency_seconds", req.finished_at - req.created)
        self.release(req)
        self.reqs.pop(req.rid, None)
        if req in self.running:
            self.running.remove(req)
        if not req.prefilled.done():
            req.prefilled.cancel()
        req.changed.set()
        req.ended.set()

    def release(self, req: Req) -> None:
        """Give the request's pages back; full prompt pages it computed stay in the prefix cache."""
        if not req.pages:
            return
        if req.kv_computed:
            keys = chain_keys(req.inp.input_ids, self.pool.page_size, self.cache_salt(req))
            self.cache.insert(keys, req.pages[: len(keys)])
        self.pool.release(req.pages)
        req.pages = []
        self._memory_freed.set()

    # ---------------------------------------------------------------------------- queries ----

    def used_tokens(self) -> int:
        return (self.pool.used_pages - self.cache.evictable_pages) * self.pool.page_size

    def token_usage(self) -> float:
        return self.used_tokens() / self.pool.capacity_tokens

    def flush_cache(self) -> bool:
        if self.reqs:
            return False
        self.cache.flush()
        self._memory_freed.set()
        return True

    def queue_counts(self) -> dict[str, int]:
        return {
            "prefill_bootstrap_queue_reqs": 0,
            "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": 0,
            "decode_retracted_queue_reqs": 0,
        }

    def count_phase(self, phase: Phase) -> int:
        return sum(1 for r in self.reqs.values() if r.phase is phase)

    def quarantined_tokens(self) -> int:
        """Pages held back because a KV write may still land there (decode only)."""
        return 0

    def kv_transfer_stats(self) -> tuple[float, float]:
        """(speed GB/s, latency ms) of recent transfers."""
        return 0.0, 0.0

    def num_waiting(self) -> int:
        return len(self.prefill_queue)

    def num_running(self) -> int:
        """Requests being computed: the decode batch and the prompts in the forward pass, so that
        /v1/loads never shows a request holding pages in no count at all."""
        return len(self.running) + len(self.forward_batch)
