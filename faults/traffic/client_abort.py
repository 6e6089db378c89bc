"""client_abort: requests aborted at a chosen phase (queued, prefill, transfer, decode), by
`/abort_request` with the request's `rid` on every worker, or by the client disconnecting.

The abort time comes from latencies measured at inject: the TTFT of a small and of a same-size
prompt, and the prefill workers' KV transfer latency (`/v1/loads`); `decode` waits for the first
streamed token. Confirmed when an aborted request ended as an abort (or a disconnect) and the
workers' abort counters (or, where an engine counts none, its log lines) rose.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import httpx

from chaos import transport
from chaos.errors import UsageError
from chaos.facts.endpoints import loads_ranks
from faults.base import Confirmation, FaultContext, FaultNotAvailable, FaultParams
from faults.signals import LogCursor
from faults.traffic.exchange import KIND_ABORT, KIND_CALIBRATION, Exchange, send
from faults.traffic.source import (
    CONTROL_TIMEOUT_S,
    FIXED_TOKENS_ESTIMATE,
    REQUEST_TIMEOUT_S,
    TrafficFault,
    check_index_base,
    check_run_prefix,
    fault_client,
)


def aborted_total(ctx: FaultContext) -> float:
    dialect = ctx.target.dialect
    return sum(dialect.aborted(w.url) or 0.0 for w in ctx.target.endpoints.workers)


def _abort_log_cursors(ctx: FaultContext) -> dict[str, LogCursor]:
    """Where each worker's log ends now, for an engine that logs aborts instead of counting them."""
    if ctx.target.dialect.aborted_log is None:
        return {}
    return {w.role: LogCursor.at_end(ctx.target.logs(w.role)) for w in ctx.target.endpoints.workers}


def _abort_log_lines(ctx: FaultContext) -> int:
    pattern = ctx.target.dialect.aborted_log
    cursors: dict[str, LogCursor] = ctx.baseline.get("abort_logs", {})
    return sum(cursor.count(ctx.target.logs(role), pattern) for role, cursor in cursors.items()) if pattern else 0


@dataclass(frozen=True)
class ClientAbortParams(FaultParams):
    phase: Literal["queued", "prefill", "transfer", "decode"] = "decode"
    method: Literal["abort_request", "disconnect"] = "abort_request"
    count: int = 3  # aborted requests, one after another (each timed on its own)
    prompt_tokens: int = 2000
    max_new_tokens: int = 64
    run_prefix: str = ""  # "" = the journal's run prefix, else a fresh one
    index_base: int = 0  # marker indices from here; 0 = a range of the window's own

    def validate(self, where: str) -> None:
        if not 1 <= self.count <= 1000:
            raise UsageError(f"{where}.count: {self.count} must be in 1..1000")
        if self.prompt_tokens < 32:
            raise UsageError(f"{where}.prompt_tokens: {self.prompt_tokens} must be at least 32")
        if self.max_new_tokens < 2:
            raise UsageError(
                f"{where}.max_new_tokens: {self.max_new_tokens} must be at least 2 (decode must have a token to abort after)"
            )
        check_run_prefix(where, self.run_prefix)
        check_index_base(where, self.index_base)


@dataclass
class AbortPlan:
    """When to abort, from latencies measured at inject (seconds after the send)."""

    ttft_small: float
    ttft_full: float
    transfer_s: float
    transfer_measured: bool

    def delay(self, phase: str) -> float | None:
        """None for decode (abort after the first streamed token)."""
        overhead = max(self.ttft_small, 0.001)
        work = max(self.ttft_full - self.ttft_small, 0.001)
        transfer = min(self.transfer_s, 0.9 * work) if self.transfer_measured else 0.25 * work
        prefill = work - transfer
        return {
            "queued": 0.5 * overhead,
            "prefill": overhead + 0.5 * prefill,
            "transfer": overhead + prefill + 0.5 * transfer,
            "decode": None,
        }[phase]

    def describe(self) -> str:
        source = "prefill /v1/loads" if self.transfer_measured else "estimated as a quarter of the work"
        return (
            f"TTFT small {1000 * self.ttft_small:.0f} ms, same-size {1000 * self.ttft_full:.0f} ms, "
            f"transfer {1000 * self.transfer_s:.0f} ms ({source})"
        )


def transfer_latency_s(ctx: FaultContext) -> float | None:
    """The prefill workers' KV transfer latency (`/v1/loads`), None when none is reported."""
    values = []
    for worker in ctx.target.endpoints.of("prefill"):
        try:
            loads = transport.get(f"{worker.url}/v1/loads", timeout=CONTROL_TIMEOUT_S, trust_env=False).json()
        except (httpx.HTTPError, ValueError):
            continue
        for rank in loads_ranks(loads):
            disagg = rank.get("disaggregation")
            value = disagg.get("kv_transfer_latency_ms") if isinstance(disagg, Mapping) else None
            if isinstance(value, (int, float)) and value > 0:
                values.append(float(value) / 1000)
    return max(values) if values else None


class ClientAbort(TrafficFault):
    name = "client_abort"  # type: ignore[misc]  # see TrafficSource.name
    summary = "abort requests at a phase (queued, prefill, transfer, decode) by /abort_request on every worker or by disconnect"
    Params = ClientAbortParams

    @property
    def p(self) -> ClientAbortParams:
        return self.params  # type: ignore[return-value]

    def _context_length(self, ctx: FaultContext) -> int | None:
        dialect = ctx.target.dialect
        lengths = [n for w in ctx.target.endpoints.workers if (n := dialect.limits(w.url).context_length) is not None]
        return min(lengths) if lengths else None

    def inject(self, ctx: FaultContext) -> None:
        p = self.p
        self._setup(ctx)
        context = self._context_length(ctx)
        if context is not None and p.prompt_tokens + p.max_new_tokens >= context:
            raise UsageError(
                f"client_abort: prompt_tokens + max_new_tokens ({p.prompt_tokens + p.max_new_tokens}) "
                f"must stay under the target's context length {context}"
            )
        if p.method == "abort_request" and ctx.target.dialect.abort_path is None:
            raise FaultNotAvailable(
                f"client_abort: {ctx.target.dialect.name} has no abort-by-id endpoint; use method: disconnect"
            )
        ctx.baseline["aborted_before"] = aborted_total(ctx)
        ctx.baseline["abort_logs"] = _abort_log_cursors(ctx)
        exchanges: list[Exchange] = []
        try:
            asyncio.run(self._run(ctx, exchanges))
        finally:
            self.journal(ctx, exchanges)
        ctx.baseline["exchanges"] = [e for e in exchanges if e.user_kind == KIND_ABORT]

    async def _run(self, ctx: FaultContext, exchanges: list[Exchange]) -> None:
        p = self.p
        url = ctx.target.endpoints.router_url
        async with fault_client() as client:
            plan = await self._measure(client, url, ctx, exchanges)
            ctx.baseline["plan"] = plan
            for _ in range(p.count):
                index = self.next_index()
                prompt = self.prompt(index, p.prompt_tokens - FIXED_TOKENS_ESTIMATE, "Please remember these notes.")
                ex = self.exchange(index, prompt, KIND_ABORT, p.max_new_tokens, stream=True)
                exchanges.append(ex)
                await self._abort_one(client, url, ctx, ex, plan.delay(p.phase))

    async def _measure(
        self, client: httpx.AsyncClient, url: str, ctx: FaultContext, exchanges: list[Exchange]
    ) -> AbortPlan:
        """TTFT of a small and of a same-size prompt (streamed), and the transfer latency."""
        ttfts = []
        for tokens in (8, self.p.prompt_tokens - FIXED_TOKENS_ESTIMATE):
            index = self.next_index()
            ex = self.exchange(
                index, self.prompt(index, tokens, "Please remember these notes."), KIND_CALIBRATION, 2, stream=True
            )
            exchanges.append(ex)
            await send(client, url, ex)
            if ex.ttft is None:
                why = ex.error_message or (ex.transport[1] if ex.transport else f"HTTP {ex.status}")
                raise RuntimeError(f"client_abort: the latency measurement got no token ({why})")
            ttfts.append(ex.ttft)
        transfer = transfer_latency_s(ctx)
        return AbortPlan(ttfts[0], ttfts[1], transfer or 0.0, transfer is not None)

    async def _abort_one(
        self, client: httpx.AsyncClient, url: str, ctx: FaultContext, ex: Exchange, delay: float | None
    ) -> None:
        first = asyncio.Event()
        task = asyncio.create_task(send(client, url, ex, first))
        if delay is None:
            waiter = asyncio.create_task(first.wait())
            await asyncio.wait({task, waiter}, timeout=REQUEST_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        else:
            await asyncio.wait({task}, timeout=delay)
        if task.done():
            ex.details.append(f"finished before the {self.p.phase} abort")
            return
        at = ex.t_send or time.time()
        ex.details.append(f"{self.p.method} at {1000 * (time.time() - at):.0f} ms ({self.p.phase})")
        if self.p.method == "disconnect":
            ex.client_closed = self.p.phase
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return
        ex.abort_sent_at = time.time()
        path = ctx.target.dialect.abort_path
        answers = await asyncio.gather(
            *(
                client.post(f"{w.url}{path}", json={"rid": ex.rid}, timeout=CONTROL_TIMEOUT_S)
                for w in ctx.target.endpoints.workers
            ),
            return_exceptions=True,
        )
        ex.details.append(
            "abort_request answers: "
            + ", ".join(str(a.status_code) if isinstance(a, httpx.Response) else type(a).__name__ for a in answers)
        )
        done, _ = await asyncio.wait({task}, timeout=REQUEST_TIMEOUT_S)
        if not done:
            ex.client_closed = "timeout after abort_request"
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def confirm(self, ctx: FaultContext) -> Confirmation:
        exchanges: list[Exchange] = ctx.baseline.get("exchanges", [])
        if not exchanges:
            return Confirmation(False, "no request was sent")
        ended = [e for e in exchanges if self._ended_as_abort(e)]
        counted = aborted_total(ctx) - ctx.baseline.get("aborted_before", 0.0)
        logged = _abort_log_lines(ctx)
        rose = counted + logged
        counters = "/".join(ctx.target.dialect.aborted_metrics)
        moved = f"workers' {counters} +{max(counted, 0):.0f}" + (
            f", abort log lines +{logged}" if ctx.baseline.get("abort_logs") else ""
        )
        if not self._server_counts_aborts(ctx):
            # Nothing on the server side to read (a plain OpenAI server, or no worker URLs given):
            # the client's own ending is all the evidence there is, and it is said so.
            moved = "the target states no abort count (no worker metrics or log): confirmed by the client's ending"
            rose = 1 if ended else 0
        plan: AbortPlan | None = ctx.baseline.get("plan")
        delay = plan.delay(self.p.phase) if plan else None
        when = "after the first streamed token" if delay is None else f"at {1000 * delay:.0f} ms"
        outcomes = Counter(self._describe(e) for e in exchanges)
        evidence = (
            f"{self.p.method} {when} ({self.p.phase}; {plan.describe() if plan else 'no plan'}): "
            f"{len(ended)}/{len(exchanges)} ended as {'a disconnect' if self.p.method == 'disconnect' else 'an abort'} "
            f"({', '.join(f'{k} x{v}' for k, v in sorted(outcomes.items()))}); "
            f"{moved}"
        )
        return Confirmation(bool(ended) and rose > 0, evidence)

    @staticmethod
    def _server_counts_aborts(ctx: FaultContext) -> bool:
        dialect = ctx.target.dialect
        return bool(ctx.target.endpoints.workers) and bool(dialect.aborted_metrics or dialect.aborted_log)

    def _ended_as_abort(self, ex: Exchange) -> bool:
        if self.p.method == "disconnect":
            return ex.client_closed == self.p.phase and not ex.ended_normally()
        if ex.abort_sent_at is None:
            return False
        if ex.finish_type == "abort":
            return True
        return not ex.ended_normally() and (ex.status is None or ex.status >= 400 or not ex.done)

    @staticmethod
    def _describe(ex: Exchange) -> str:
        if ex.client_closed:
            return f"closed ({ex.client_closed})"
        if ex.status is None:
            return "no answer"
        return f"{ex.status} {ex.finish_type or 'no finish'}"
