"""Traffic faults: faults made by sending requests, not by breaking a process or a link.

- client_abort: requests aborted at a chosen phase (queued, prefill, transfer, decode), by
  `/abort_request` with the request's `rid` on every worker, or by the client disconnecting. The
  abort time comes from latencies measured at inject: the TTFT of a small and of a same-size
  prompt, and the prefill workers' KV transfer latency (`/v1/loads`); `decode` waits for the first
  streamed token.
- over_length_burst: prompts just over each limit the workers report (the KV pool, the context,
  and the band [max_req_input_len, context) only SGLang's scheduler check rejects), sized with
  the target's own token counts, sent at once.
- cache_flush: `POST /flush_cache` to the workers every interval during the window.

Every generation request a fault sends is a `RequestRecord` in the journal (when there is one),
with canary markers of the run (`MarkerCodec`) at its head and tail, so the oracles see it as a
possible leak source and victim: user_kind "fault_abort" (the aborted requests), "over_length"
(the over-length prompts, judged by the status oracle) or "fault_calibration" (the short requests
that measure latency or token counts first). Marker indices come from the fault's own params
(`index_base`; 0 picks a range from the window id above the load's indices), the run prefix from
`run_prefix` or the journal's meta "run_prefix".

Nothing here outlives the window: there is nothing to undo, so the undo plans are empty.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import secrets
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from chaos.errors import UsageError
from chaos.http_status import NOT_ABOUT_THE_PROMPT_4XX
from chaos.journal import EventKind, JournalEvent, Outcome, RequestRecord
from chaos.oracles.liveness import loads_ranks
from chaos.oracles.canary import (
    MAX_REQUEST_INDEX,
    MarkerCodec,
    new_run_prefix,
    validate_run_prefix,
)
from faults.base import Confirmation, Fault, FaultContext, FaultParams
from faults.links import FaultNotAvailable
from chaos.targets.dialect import dialect_of
from faults.signals import LogCursor
from faults.undo import UndoAction

FAULT_INDEX_BASE = 1_000_000_000  # far above the load's indices (it counts up from 10 000)
INDEX_SPAN = 100_000  # indices one window may use
INDEX_SLOTS = (MAX_REQUEST_INDEX - FAULT_INDEX_BASE) // INDEX_SPAN
FILLER = " the"  # one token per repetition in common tokenizers and in the embedded engine's
FIXED_TOKENS_ESTIMATE = 24  # markers and instructions around the filler, before measuring
CALIBRATION_K = (8, 72)
REQUEST_TIMEOUT_S = 60.0
CONTROL_TIMEOUT_S = 5.0
MAX_TEXT_KEEP = 16384

KIND_ABORT = "fault_abort"
KIND_OVER_LENGTH = "over_length"
KIND_CALIBRATION = "fault_calibration"
PHASE = "fault"


# ----------------------------------------------------------------------- shared machinery ----


def _check_run_prefix(where: str, run_prefix: str) -> None:
    if run_prefix:
        try:
            validate_run_prefix(run_prefix)
        except ValueError as exc:
            raise UsageError(f"{where}.run_prefix: {exc}") from None


def _check_index_base(where: str, index_base: int) -> None:
    if index_base and not 0 < index_base <= MAX_REQUEST_INDEX - INDEX_SPAN:
        raise UsageError(f"{where}.index_base: {index_base} must be 0 (automatic) or in 1..{MAX_REQUEST_INDEX - INDEX_SPAN}")


def window_index_base(window_id: str) -> int:
    """An index range of its own for a window: "w3" -> the third slot above FAULT_INDEX_BASE."""
    digits = re.search(r"(\d+)$", window_id)
    slot = int(digits.group(1)) if digits else zlib.crc32(window_id.encode())
    return FAULT_INDEX_BASE + (slot % INDEX_SLOTS) * INDEX_SPAN


class TrafficSource:
    """Whatever sends canary-marked requests for a window: a run prefix, marker indices, rids,
    the request shape the target speaks, and the journal. Traffic faults and provocations share it."""

    name: str

    def _setup(self, ctx: FaultContext, run_prefix: str = "", index_base: int = 0, offset: int = 0) -> None:
        prefix = run_prefix
        if not prefix and ctx.journal is not None:
            stored = ctx.journal.get_meta("run_prefix")
            prefix = stored if isinstance(stored, str) else ""
        self.codec = MarkerCodec(prefix or new_run_prefix())
        base = (index_base or window_index_base(ctx.window_id or self.name)) + offset
        self._indices: Iterator[int] = iter(range(base, base + INDEX_SPAN - offset))
        self._window = ctx.window_id or "adhoc"
        # The request shape the target's engine speaks (SGLang /generate unless its dialect says otherwise).
        self._api = dialect_of(ctx.target).request_api

    def next_index(self) -> int:
        return next(self._indices)

    def rid(self, index: int) -> str:
        """Unique and fixed width, so `/abort_request`'s prefix match hits this request only."""
        return f"{self.codec.run_prefix}-{PHASE}-{self._window}-{index:010d}-{secrets.token_hex(3)}"

    def prompt(self, index: int, repetitions: int, instruction: str) -> tuple[str, list[str]]:
        head, tail = self.codec.marker(index, 0), self.codec.marker(index, 1)
        return f"{head} {instruction}\n" + FILLER * max(1, repetitions) + f"\n{tail} Repeat every code word you saw.", [head, tail]

    def exchange(self, index: int, prompt: tuple[str, list[str]], user_kind: str, max_tokens: int,
                 stream: bool) -> Exchange:
        text, markers = prompt
        return Exchange(rid=self.rid(index), index=index, prompt=text, markers=markers, user_kind=user_kind,
                        actor=f"fault/{self._window}/{self.name}", max_tokens=max_tokens, stream=stream,
                        api=self._api, endpoint="/v1/completions" if self._api == "openai" else "/generate")

    async def measure_sizer(self, client: httpx.AsyncClient, url: str, instruction: str,
                            exchanges: list[Exchange]) -> Sizer:
        """Prompt tokens per filler repetition, from two short requests the target counts."""
        k0, k1 = CALIBRATION_K
        counts = []
        for k in (k0, k1):
            index = self.next_index()
            ex = self.exchange(index, self.prompt(index, k, instruction), KIND_CALIBRATION, 1, stream=False)
            exchanges.append(ex)
            await send(client, url, ex)
            counts.append(ex.prompt_tokens if ex.status == 200 else None)
        if counts[0] is None or counts[1] is None or counts[1] <= counts[0]:
            return Sizer(float(FIXED_TOKENS_ESTIMATE), 1.0, exact=False)
        slope = (counts[1] - counts[0]) / (k1 - k0)
        return Sizer(counts[0] - slope * k0, slope, exact=True)

    def journal(self, ctx: FaultContext, exchanges: list[Exchange]) -> None:
        if ctx.journal is not None and exchanges:
            ctx.journal.append_requests(e.record() for e in exchanges)
            ctx.journal.flush()


@dataclass(frozen=True)
class Sizer:
    """Prompt length as a function of filler repetitions: `fixed + slope * repetitions` tokens."""

    fixed: float
    slope: float
    exact: bool  # measured on the target (else estimated: one token per repetition)

    def repetitions(self, tokens: int) -> int:
        return max(1, math.ceil((tokens - self.fixed) / self.slope))


class TrafficFault(TrafficSource, Fault):
    """A fault that sends requests: a run prefix, marker indices, rids, and the journal."""

    targets = frozenset({"sim", "sglang", "attach", "vllm"})  # traffic only: any SGLang- or OpenAI-shaped URL

    def undo_plan(self, ctx: FaultContext) -> list[UndoAction]:
        return []  # requests end by themselves; nothing is left to undo

    def _setup(self, ctx: FaultContext, run_prefix: str = "", index_base: int = 0, offset: int = 0) -> None:
        super()._setup(ctx, run_prefix or getattr(self.params, "run_prefix", "") or "",
                       index_base or getattr(self.params, "index_base", 0) or 0, offset)


@dataclass
class Exchange:
    """One `/generate` request a fault sent, as the client saw it."""

    rid: str
    index: int
    prompt: str
    markers: list[str]
    user_kind: str
    actor: str
    max_tokens: int
    stream: bool
    api: str = "sglang"  # "sglang": /generate; "openai": /v1/completions (vLLM)
    endpoint: str = "/generate"
    t_send: float | None = None
    t_first_byte: float | None = None
    t_end: float | None = None
    token_times: list[float] = field(default_factory=list)
    status: int | None = None
    finish: dict[str, Any] | None = None
    done: bool = False  # a stream's [DONE] arrived
    text: str = ""
    tokens: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    body_bytes: int = 0
    error_message: str | None = None  # an error object in the body or the stream
    transport: tuple[str, str] | None = None
    client_closed: str | None = None  # we closed the connection on purpose, at this phase
    abort_sent_at: float | None = None
    notes: list[str] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)

    def body(self) -> dict[str, Any]:
        if self.api == "openai":
            body: dict[str, Any] = {"prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                                    "stream": self.stream, "ignore_eos": True}
            if self.stream:
                body["stream_options"] = {"include_usage": True}
            return body
        return {"text": self.prompt, "rid": self.rid, "stream": self.stream,
                "sampling_params": {"max_new_tokens": self.max_tokens, "temperature": 0}}

    @property
    def ttft(self) -> float | None:
        if self.t_send is None or not self.token_times:
            return None
        return self.token_times[0] - self.t_send

    @property
    def finish_type(self) -> str | None:
        return str(self.finish.get("type")) if isinstance(self.finish, dict) else None

    def apply(self, obj: Any, now: float) -> bool:
        """Take one /generate object (a body or an SSE payload); True when a new token arrived."""
        if not isinstance(obj, dict):
            self.anomalies.append("not_an_object")
            return False
        if "error" in obj:
            error = obj["error"]
            self.error_message = str(error.get("message", error) if isinstance(error, dict) else error)[:500]
            return False
        if obj.get("object") == "error":
            self.error_message = str(obj.get("message", ""))[:500]
            return False
        if self.api == "openai":
            return self._apply_openai(obj, now)
        if isinstance(obj.get("text"), str):
            self.text = obj["text"]
        meta = obj.get("meta_info") if isinstance(obj.get("meta_info"), dict) else {}
        for name in ("prompt_tokens", "completion_tokens", "cached_tokens"):
            if isinstance(meta.get(name), int):
                setattr(self, name, meta[name])
        if isinstance(meta.get("finish_reason"), dict):
            self.finish = meta["finish_reason"]
        ids = obj.get("output_ids")
        count = len(ids) if isinstance(ids, list) else (self.completion_tokens or 0)
        if count > self.tokens:
            self.tokens = count
            self.token_times.append(now)
            return True
        return False

    def _apply_openai(self, obj: dict[str, Any], now: float) -> bool:
        """A /v1/completions body or stream chunk: text (a delta when streamed), finish, usage."""
        usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
        for name in ("prompt_tokens", "completion_tokens"):
            if isinstance(usage.get(name), int):
                setattr(self, name, usage[name])
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.cached_tokens = details["cached_tokens"]
        choices = obj.get("choices") if isinstance(obj.get("choices"), list) else []
        choice = choices[0] if choices and isinstance(choices[0], dict) else {}
        if isinstance(choice.get("finish_reason"), str):
            self.finish = {"type": choice["finish_reason"]}
        text = choice.get("text")
        if not isinstance(text, str):
            return False
        if not self.stream:
            self.text = text
            count = self.completion_tokens or 0
        else:
            # vLLM streams one chunk per generated token; its text is "" while the detokenizer
            # holds back an incomplete UTF-8 sequence, and the token still counts.
            self.text += text
            count = self.tokens + 1
        if count > self.tokens:
            self.tokens = count
            self.token_times.append(now)
            return True
        return False

    def ended_normally(self) -> bool:
        return self.status == 200 and self.finish_type not in (None, "abort") and self.client_closed is None

    def judge(self) -> tuple[Outcome, str | None, str | None]:
        """(outcome, error_class, detail) with the rules of loadprofiles/recorder.py."""
        asked = self.abort_sent_at is not None
        if self.status is None:
            if self.client_closed:
                return Outcome.INFO, "disconnect", f"client closed {self.client_closed}, before the first byte"
            if self.transport:
                kind, detail = self.transport
                return (Outcome.FAIL if kind == "connect_error" else Outcome.INFO), kind, detail
            return Outcome.INFO, "client_error", "no response"
        if not 200 <= self.status < 300:
            detail = f"HTTP {self.status}" + (f": {self.error_message}" if self.error_message else "")
            if asked and self.status >= 500:
                return Outcome.INFO, "abort", f"after /abort_request: {detail}"
            if 400 <= self.status < 500 or self.status in (500, 501, 503, 505):
                return Outcome.FAIL, f"http_{self.status}", detail
            return Outcome.INFO, f"http_{self.status}", detail
        if self.finish_type == "abort":
            message = str(self.finish.get("message", "")) if self.finish else ""
            code = self.finish.get("status_code") if self.finish else None
            outcome = Outcome.INFO if asked or code is None else Outcome.FAIL
            return outcome, "abort", f"finish abort (status {code}): {message}".strip()
        if self.client_closed:
            return Outcome.INFO, "disconnect", f"client closed {self.client_closed}"
        if self.finish_type is not None:
            return Outcome.OK, None, None
        if self.error_message:
            return Outcome.INFO, "stream_error", self.error_message
        if self.transport:
            return Outcome.INFO, *self.transport
        return Outcome.INFO, "truncated_stream" if self.stream else "malformed_body", "no finish reason"

    def record(self) -> RequestRecord:
        outcome, error_class, detail = self.judge()
        details = [d for d in (detail, *self.notes) if d]
        return RequestRecord(
            id=self.rid, request_index=self.index, phase=PHASE, user_kind=self.user_kind, actor=self.actor,
            endpoint=self.endpoint, stream=self.stream, markers=list(self.markers),
            prompt=self.prompt if len(self.prompt) <= MAX_TEXT_KEEP else "", prompt_chars=len(self.prompt),
            max_tokens=self.max_tokens, t_send=self.t_send, t_first_byte=self.t_first_byte,
            t_first_token=self.token_times[0] if self.token_times else None, t_end=self.t_end,
            token_times=list(self.token_times), status=self.status, finish_reason=self.finish_type,
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens, response_text=self.text, body_bytes=self.body_bytes,
            outcome=outcome, error_class=error_class, error_detail=" | ".join(details)[:2000] if details else None,
            anomaly="; ".join(self.anomalies)[:4000] if self.anomalies else None,
        )


async def send(client: httpx.AsyncClient, url: str, ex: Exchange, first_token: asyncio.Event | None = None) -> Exchange:
    """Send `ex` and read the reply; a cancel (our disconnect) closes the connection."""
    ex.t_send = time.time()
    try:
        async with client.stream("POST", url + ex.endpoint, json=ex.body()) as response:
            ex.t_first_byte = time.time()
            ex.status = response.status_code
            if ex.stream and response.status_code == 200:
                async for line in response.aiter_lines():
                    ex.body_bytes += len(line) + 1
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        ex.done = True
                        break
                    try:
                        obj = json.loads(payload)
                    except ValueError:
                        ex.anomalies.append("malformed_sse")
                        continue
                    if ex.apply(obj, time.time()) and first_token is not None:
                        first_token.set()
            else:
                raw = await response.aread()
                ex.body_bytes = len(raw)
                try:
                    ex.apply(json.loads(raw), time.time())
                except ValueError:
                    ex.error_message = raw[:300].decode(errors="replace")
    except httpx.ConnectError as exc:
        ex.transport = ("connect_error", f"{type(exc).__name__}: {exc}")
    except httpx.TimeoutException as exc:
        ex.transport = ("timeout", f"{type(exc).__name__}: {exc}")
    except httpx.HTTPError as exc:
        ex.transport = ("disconnect", f"{type(exc).__name__}: {exc}")
    finally:
        ex.t_end = time.time()
    return ex


def aborted_total(ctx: FaultContext) -> float:
    dialect = dialect_of(ctx.target)
    return sum(dialect.aborted(w.url) or 0.0 for w in ctx.target.endpoints.workers)


def _abort_log_cursors(ctx: FaultContext) -> dict[str, LogCursor]:
    """Where each worker's log ends now, for an engine that logs aborts instead of counting them."""
    if dialect_of(ctx.target).aborted_log is None:
        return {}
    return {w.role: LogCursor.at_end(ctx.target.logs(w.role)) for w in ctx.target.endpoints.workers}


def _abort_log_lines(ctx: FaultContext) -> int:
    pattern = dialect_of(ctx.target).aborted_log
    cursors: dict[str, LogCursor] = ctx.baseline.get("abort_logs", {})
    return sum(cursor.count(ctx.target.logs(role), pattern) for role, cursor in cursors.items()) if pattern else 0


def _client() -> httpx.AsyncClient:
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    return httpx.AsyncClient(timeout=timeout, trust_env=False, limits=httpx.Limits(max_connections=64))


# ---------------------------------------------------------------------------- client_abort ----


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
            raise UsageError(f"{where}.max_new_tokens: {self.max_new_tokens} must be at least 2 (decode must have a token to abort after)")
        _check_run_prefix(where, self.run_prefix)
        _check_index_base(where, self.index_base)


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
        return (f"TTFT small {1000 * self.ttft_small:.0f} ms, same-size {1000 * self.ttft_full:.0f} ms, "
                f"transfer {1000 * self.transfer_s:.0f} ms ({source})")


def transfer_latency_s(ctx: FaultContext) -> float | None:
    """The prefill workers' KV transfer latency (`/v1/loads`), None when none is reported."""
    values = []
    for worker in ctx.target.endpoints.of("prefill"):
        try:
            loads = httpx.get(f"{worker.url}/v1/loads", timeout=CONTROL_TIMEOUT_S, trust_env=False).json()
        except (httpx.HTTPError, ValueError):
            continue
        for rank in loads_ranks(loads):
            disagg = rank.get("disaggregation")
            value = disagg.get("kv_transfer_latency_ms") if isinstance(disagg, Mapping) else None
            if isinstance(value, (int, float)) and value > 0:
                values.append(float(value) / 1000)
    return max(values) if values else None


class ClientAbort(TrafficFault):
    name = "client_abort"
    summary = "abort requests at a phase (queued, prefill, transfer, decode) by /abort_request on every worker or by disconnect"
    Params = ClientAbortParams

    @property
    def p(self) -> ClientAbortParams:
        return self.params  # type: ignore[return-value]

    def _context_length(self, ctx: FaultContext) -> int | None:
        dialect = dialect_of(ctx.target)
        lengths = [n for w in ctx.target.endpoints.workers if (n := dialect.limits(w.url).context_length) is not None]
        return min(lengths) if lengths else None

    def inject(self, ctx: FaultContext) -> None:
        p = self.p
        self._setup(ctx)
        context = self._context_length(ctx)
        if context is not None and p.prompt_tokens + p.max_new_tokens >= context:
            raise UsageError(f"client_abort: prompt_tokens + max_new_tokens ({p.prompt_tokens + p.max_new_tokens}) "
                             f"must stay under the target's context length {context}")
        if p.method == "abort_request" and dialect_of(ctx.target).abort_path is None:
            raise FaultNotAvailable(f"client_abort: {dialect_of(ctx.target).name} has no abort-by-id endpoint; "
                                    "use method: disconnect")
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
        async with _client() as client:
            plan = await self._measure(client, url, ctx, exchanges)
            ctx.baseline["plan"] = plan
            for _ in range(p.count):
                index = self.next_index()
                prompt = self.prompt(index, p.prompt_tokens - FIXED_TOKENS_ESTIMATE, "Please remember these notes.")
                ex = self.exchange(index, prompt, KIND_ABORT, p.max_new_tokens, stream=True)
                exchanges.append(ex)
                await self._abort_one(client, url, ctx, ex, plan.delay(p.phase))

    async def _measure(self, client: httpx.AsyncClient, url: str, ctx: FaultContext, exchanges: list[Exchange]) -> AbortPlan:
        """TTFT of a small and of a same-size prompt (streamed), and the transfer latency."""
        ttfts = []
        for tokens in (8, self.p.prompt_tokens - FIXED_TOKENS_ESTIMATE):
            index = self.next_index()
            ex = self.exchange(index, self.prompt(index, tokens, "Please remember these notes."), KIND_CALIBRATION, 2, stream=True)
            exchanges.append(ex)
            await send(client, url, ex)
            if ex.ttft is None:
                why = ex.error_message or (ex.transport[1] if ex.transport else f"HTTP {ex.status}")
                raise RuntimeError(f"client_abort: the latency measurement got no token ({why})")
            ttfts.append(ex.ttft)
        transfer = transfer_latency_s(ctx)
        return AbortPlan(ttfts[0], ttfts[1], transfer or 0.0, transfer is not None)

    async def _abort_one(self, client: httpx.AsyncClient, url: str, ctx: FaultContext, ex: Exchange, delay: float | None) -> None:
        first = asyncio.Event()
        task = asyncio.create_task(send(client, url, ex, first))
        if delay is None:
            waiter = asyncio.create_task(first.wait())
            await asyncio.wait({task, waiter}, timeout=REQUEST_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
        else:
            await asyncio.wait({task}, timeout=delay)
        if task.done():
            ex.notes.append(f"finished before the {self.p.phase} abort")
            return
        at = ex.t_send or time.time()
        ex.notes.append(f"{self.p.method} at {1000 * (time.time() - at):.0f} ms ({self.p.phase})")
        if self.p.method == "disconnect":
            ex.client_closed = self.p.phase
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return
        ex.abort_sent_at = time.time()
        path = dialect_of(ctx.target).abort_path
        answers = await asyncio.gather(*(
            client.post(f"{w.url}{path}", json={"rid": ex.rid}, timeout=CONTROL_TIMEOUT_S)
            for w in ctx.target.endpoints.workers
        ), return_exceptions=True)
        ex.notes.append("abort_request answers: " + ", ".join(
            str(a.status_code) if isinstance(a, httpx.Response) else type(a).__name__ for a in answers))
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
        counters = "/".join(dialect_of(ctx.target).aborted_metrics)
        moved = f"workers' {counters} +{max(counted, 0):.0f}" + (f", abort log lines +{logged}" if ctx.baseline.get("abort_logs") else "")
        plan: AbortPlan | None = ctx.baseline.get("plan")
        delay = plan.delay(self.p.phase) if plan else None
        when = "after the first streamed token" if delay is None else f"at {1000 * delay:.0f} ms"
        outcomes = Counter(self._describe(e) for e in exchanges)
        evidence = (f"{self.p.method} {when} ({self.p.phase}; {plan.describe() if plan else 'no plan'}): "
                    f"{len(ended)}/{len(exchanges)} ended as {'a disconnect' if self.p.method == 'disconnect' else 'an abort'} "
                    f"({', '.join(f'{k} x{v}' for k, v in sorted(outcomes.items()))}); "
                    f"{moved}")
        return Confirmation(bool(ended) and rose > 0, evidence)

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


# ----------------------------------------------------------------------- over_length_burst ----


@dataclass(frozen=True)
class OverLengthParams(FaultParams):
    count: int = 1  # prompts per threshold
    stream: bool = False
    run_prefix: str = ""
    index_base: int = 0

    def validate(self, where: str) -> None:
        if not 1 <= self.count <= 100:
            raise UsageError(f"{where}.count: {self.count} must be in 1..100")
        _check_run_prefix(where, self.run_prefix)
        _check_index_base(where, self.index_base)


@dataclass(frozen=True)
class Threshold:
    """One limit a prompt is sent just over."""

    name: str  # pool, context, band
    tokens: int  # a prompt of at least this many tokens is over the limit
    target: int  # the prompt length aimed at
    upper: int | None = None  # band: stay below this (the context)
    context: int | None = None

    @property
    def label(self) -> str:
        if self.upper is not None:
            return f"band [{self.tokens},{self.upper})"
        return f"{self.name} {self.tokens}"

    def max_new_tokens(self) -> int:
        """Room under the context, so the tokenizer's `input + max_new_tokens > context` check
        does not reject the prompt before the check under test."""
        if self.context is not None and self.target < self.context:
            return max(1, min(8, self.context - self.target))
        return 8


_TOKENS_IN_MESSAGE = re.compile(r"[Ii]nput(?: length)? \((\d+) tokens\)|(\d+) tokens from the input")


def tokens_in_message(message: str) -> int | None:
    """The prompt length an SGLang rejection message states, if it states one."""
    match = _TOKENS_IN_MESSAGE.search(message)
    return int(match.group(1) or match.group(2)) if match else None


def plan_thresholds(limits: list[tuple[int | None, int | None, int | None]]) -> list[Threshold]:
    """Just over every limit any worker reports (asymmetric pools give one size per worker)."""
    contexts = [c for _, c, _ in limits if c is not None]
    smallest_context = min(contexts) if contexts else None
    found: dict[int, Threshold] = {}
    for pool, context, max_input in limits:
        if pool is not None:
            found.setdefault(pool + 1, Threshold("pool", pool, pool + 1, context=smallest_context))
        if context is not None:
            found.setdefault(context + 1, Threshold("context", context, context + 1, context=context))
        if context is not None and max_input is not None and max_input < context:
            middle = max_input + (context - max_input) // 2
            found.setdefault(middle, Threshold("band", max_input, middle, upper=context, context=context))
    return sorted(found.values(), key=lambda t: t.target)


def undershot(thresholds: list[Threshold], counted: int) -> bool:
    """A prompt the target counted at `counted` tokens is under every limit. Over the deployment's
    smallest limit is over-length whichever limit it was aimed at: a prompt aimed past decode's
    limit that lands past only prefill's must still be rejected."""
    return counted < min(t.tokens for t in thresholds)


class OverLengthBurst(TrafficFault):
    name = "over_length_burst"
    summary = "prompts just over each limit the workers report (pool, context, the [max_req_input_len, context) band), at once"
    Params = OverLengthParams

    INSTRUCTION = "This is an over-length canary."

    @property
    def p(self) -> OverLengthParams:
        return self.params  # type: ignore[return-value]

    def inject(self, ctx: FaultContext) -> None:
        self._setup(ctx)
        workers = ctx.target.endpoints.workers
        urls = [w.url for w in workers] or [ctx.target.endpoints.router_url]
        dialect = dialect_of(ctx.target)
        thresholds = plan_thresholds([dialect.limits(u).as_tuple() for u in urls])
        if not thresholds:
            raise FaultNotAvailable("the target reports no pool size or context length (/server_info, /v1/models)")
        ctx.baseline["thresholds"] = thresholds
        self._probe_thresholds: dict[str, Threshold] = {}
        self._notes: list[str] = []
        exchanges: list[Exchange] = []
        try:
            asyncio.run(self._run(ctx, thresholds, exchanges))
        finally:
            self.journal(ctx, exchanges)
        ctx.baseline["probes"] = [e for e in exchanges if e.user_kind == KIND_OVER_LENGTH]

    async def _tokens(self, client: httpx.AsyncClient, url: str, index: int, reps: int, exchanges: list[Exchange]) -> int | None:
        ex = self.exchange(index, self.prompt(index, reps, self.INSTRUCTION), KIND_CALIBRATION, 1, stream=False)
        exchanges.append(ex)
        await send(client, url, ex)
        return ex.prompt_tokens if ex.status == 200 else None

    async def _run(self, ctx: FaultContext, thresholds: list[Threshold], exchanges: list[Exchange]) -> None:
        url = ctx.target.endpoints.router_url
        notes: list[str] = self._notes
        async with _client() as client:
            sizer = await self.measure_sizer(client, url, self.INSTRUCTION, exchanges)
            k0 = CALIBRATION_K[0]
            planned: list[tuple[Threshold, int, int, bool]] = []  # threshold, index, repetitions, exact
            for threshold in thresholds:
                for _ in range(self.p.count):
                    index = self.next_index()
                    # This index's own count: its marker's tokens shift the fixed part by a few.
                    base = await self._tokens(client, url, index, k0, exchanges) if sizer.exact else None
                    if base is not None:
                        own = Sizer(base - sizer.slope * k0, sizer.slope, exact=True)
                        planned.append((threshold, index, own.repetitions(threshold.target), True))
                    elif threshold.upper is not None:
                        notes.append(f"{threshold.label}: skipped, the target reports no token counts to aim into the band")
                    else:  # at least one token per repetition: aim a little over
                        planned.append((threshold, index, threshold.target + 32, False))
            probes: list[tuple[Threshold, Exchange]] = []
            for threshold, index, reps, exact in planned:
                ex = self.exchange(index, self.prompt(index, reps, self.INSTRUCTION), KIND_OVER_LENGTH,
                                   threshold.max_new_tokens(), stream=self.p.stream)
                ex.notes.append(f"{threshold.label}, aimed at {threshold.target} tokens" + ("" if exact else " (estimated)"))
                probes.append((threshold, ex))
                self._probe_thresholds[ex.rid] = threshold
                exchanges.append(ex)
            await asyncio.gather(*(send(client, url, ex) for _, ex in probes))
            for _, ex in probes:
                if ex.status == 200 and ex.prompt_tokens is not None and undershot(thresholds, ex.prompt_tokens):
                    ex.anomalies.append("over_length_missed")  # we undershot: not an over-length prompt

    def confirm(self, ctx: FaultContext) -> Confirmation:
        probes: list[Exchange] = ctx.baseline.get("probes", [])
        if not probes:
            notes = "; ".join(getattr(self, "_notes", [])) or "none planned"
            return Confirmation(False, f"no over-length prompt was sent ({notes})")
        # Answered by the server's admission: a 404 or 401 never reached it (chaos/http_status.py).
        answered = [e for e in probes if e.status is not None
                    and e.status not in NOT_ABOUT_THE_PROMPT_4XX]
        parts = []
        for ex in probes:
            threshold = getattr(self, "_probe_thresholds", {}).get(ex.rid)
            label = threshold.label if threshold else "?"
            counted = ex.prompt_tokens if ex.prompt_tokens is not None else tokens_in_message(ex.error_message or "")
            got = f"{counted} tokens" if counted is not None else "tokens not reported"
            status = str(ex.status) if ex.status is not None else (ex.transport[0] if ex.transport else "no answer")
            parts.append(f"{label}: {status} ({got})")
        notes = getattr(self, "_notes", [])
        evidence = (f"{len(probes)} over-length prompt(s) sent, {len(answered)} answered by the server's "
                    "admission: " + "; ".join(parts + notes))
        return Confirmation(len(answered) == len(probes), evidence)


# ------------------------------------------------------------------------------ cache_flush ----


@dataclass(frozen=True)
class CacheFlushParams(FaultParams):
    interval_s: float = 1.0
    role: Literal["both", "prefill", "decode"] = "both"

    def validate(self, where: str) -> None:
        if not 0.05 <= self.interval_s <= 3600:
            raise UsageError(f"{where}.interval_s: {self.interval_s} must be in 0.05..3600 seconds")


class CacheFlush(Fault):
    """POST /flush_cache to the workers every interval_s while the window lasts.

    SGLang answers 400 while requests are running or waiting, so under constant load no flush
    may take effect: then the window is unconfirmed, with the counts of 200 and 400 answers."""

    name = "cache_flush"
    summary = "POST /flush_cache to the workers every interval during the window (400 while requests run)"
    Params = CacheFlushParams
    targets = frozenset({"sim", "sglang", "attach"})

    @property
    def p(self) -> CacheFlushParams:
        return self.params  # type: ignore[return-value]

    def undo_plan(self, ctx: FaultContext) -> list[UndoAction]:
        return []  # a flushed cache refills by itself

    def _urls(self, ctx: FaultContext) -> list[str]:
        roles = ("prefill", "decode") if self.p.role == "both" else (self.p.role,)
        return [w.url for w in ctx.target.endpoints.workers if w.role in roles]

    def inject(self, ctx: FaultContext) -> None:
        urls = self._urls(ctx)
        if not urls:
            raise FaultNotAvailable(f"the target lists no {self.p.role} worker to flush")
        self._answers: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._flush_all(urls)  # the first round now, so even a short window flushes once
        self._thread = threading.Thread(target=self._loop, args=(urls,), name=f"cache-flush-{ctx.window_id}", daemon=True)
        self._thread.start()

    def _flush_all(self, urls: list[str]) -> None:
        for url in urls:
            try:
                answer = str(httpx.post(f"{url}/flush_cache", timeout=CONTROL_TIMEOUT_S, trust_env=False).status_code)
            except httpx.HTTPError as exc:
                answer = type(exc).__name__
            with self._lock:
                self._answers[answer] += 1

    def _loop(self, urls: list[str]) -> None:
        while not self._stop.wait(self.p.interval_s):
            self._flush_all(urls)

    def _counts(self) -> Counter[str]:
        with self._lock:
            return Counter(getattr(self, "_answers", Counter()))

    def confirm(self, ctx: FaultContext) -> Confirmation:
        answers = self._counts()
        summary = ", ".join(f"{k} x{v}" for k, v in sorted(answers.items())) or "none sent"
        if answers.get("200"):
            return Confirmation(True, f"/flush_cache answers: {summary}")
        why = " (SGLang refuses to flush while requests run or wait: under constant load no flush takes effect)" \
            if answers.get("400") else ""
        return Confirmation(False, f"no flush answered 200: {summary}{why}")

    def heal(self, ctx: FaultContext, plan: list[UndoAction]) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self._thread.join(CONTROL_TIMEOUT_S * 2 + self.p.interval_s)
            if ctx.journal is not None:
                ctx.journal.append_event(JournalEvent(EventKind.NOTE, self.name, {
                    "window": ctx.window_id, "flush_answers": dict(self._counts())}))
        super().heal(ctx, plan)

    def audit(self, ctx: FaultContext, plan: list[UndoAction]) -> list[str]:
        thread = getattr(self, "_thread", None)
        return [f"the {self.name} thread is still running"] if thread is not None and thread.is_alive() else []
