"""Purpose-built servers that really misbehave, and a client that journals what they answer.

`ToyServer` is a tiny SGLang-shaped worker (`/generate`, streaming or not, `/abort_request`,
`/v1/loads`, `/metrics`) over a toy greedy model, with real timing (prefill cost per uncached
token, a decode step per token), a prefix cache, a page pool and SGLang-format log lines. Each
`Defects` switch turns on one real mechanism (bug classes K1–K9, docs/architecture.md); with every
switch off it keeps every contract the oracles check. `drive` sends `Shot`s over real HTTP (httpx)
and writes one `RequestRecord` per request into a real `Journal`, as the load driver does.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
from aiohttp import web

from chaos.journal import EventKind, Journal, JournalEvent, Outcome, RequestRecord
from tests.aiohttp_thread import ThreadedServer

VOCAB = (
    "amber",
    "birch",
    "cobalt",
    "delta",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kelp",
    "lumen",
    "maple",
    "nectar",
    "onyx",
    "pebble",
    "quartz",
    "raven",
    "sable",
    "tundra",
)


@dataclass(frozen=True)
class Defects:
    """One switch per mechanism; all off is a correct server."""

    # K3 (SGLang #30233): an over-length prompt is not rejected; a 1-token stub is "prefilled" (so it
    # answers as fast as a 1-token prompt) and decode runs over pages it never received, which
    # still hold the previous request's output.
    accept_over_length: bool = False
    # K1/K4-like: decode steps go through one scratch buffer shared by every request; each step
    # writes its token, yields, and reads the slot back, so a concurrent request's token comes out.
    shared_scratch: bool = False
    # With `shared_scratch`: check the slot's owner on read and log SGLang's
    # "Context corruption detected" line when it is another request's (log only, keep going).
    detect_corruption: bool = False
    # K7 (SGLang #25972, vLLM #43370): cached_tokens taken from the decode side's page-rounded
    # preallocation, not the prefix-cache hit: it exceeds prompt_tokens on a repeated prompt.
    cached_over_prompt: bool = False
    # K7: prompt_tokens counted from a counter shared by in-flight requests.
    prompt_tokens_drift: bool = False
    # K7 / #33507: an aborted request answers 200 finish `length` with the tokens it had so far.
    abort_as_length: bool = False
    # K8 (vLLM #46283): an aborted request never returns its pages and stays counted in the transfer queue.
    leak_on_abort: bool = False
    # K8 / #31800: a prompt containing this word waits for a transfer that never completes.
    hang_word: str | None = None


@dataclass
class ToyConfig:
    context_length: int = 1024  # tokens (whitespace words)
    page_size: int = 16
    pool_tokens: int = 65536
    prefill_base_s: float = 0.002
    prefill_s_per_token: float = 0.0002
    decode_step_s: float = 0.002
    scratch_slots: int = 1  # one slot: any request decoding at the same time clobbers it


@dataclass
class _Req:
    rid: str
    room: int
    words: list[str]
    max_tokens: int
    pages: int = 0
    aborted: asyncio.Event = field(default_factory=asyncio.Event)


def _now_header() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S")


class ToyServer:
    """The aiohttp app and its state; `serve` runs it on a loopback port in a thread."""

    def __init__(self, defects: Defects | None = None, config: ToyConfig | None = None) -> None:
        self.defects = defects or Defects()
        self.config = config or ToyConfig()
        self.cache: list[tuple[str, ...]] = []  # prompts seen (a prefix cache of whole prompts)
        self.running: dict[str, _Req] = {}
        self.used_pages = 0
        self.leaked_queue = 0
        self.scratch: list[tuple[int, str]] = [(0, VOCAB[0])] * self.config.scratch_slots
        self.last_output: list[str] = [VOCAB[1]] * 4  # what the "stale pages" hold
        self.counters = {"num_requests_total": 0, "num_aborted_requests_total": 0, "num_transfer_failed_reqs_total": 0}
        self.log_lines: list[str] = []
        self.stopping: asyncio.Event | None = None
        self.url = ""

    # ------------------------------------------------------------------------------ logging ----

    def log(self, message: str) -> None:
        self.log_lines.append(f"[{_now_header()} TP0] {message}")

    @property
    def log_text(self) -> str:
        return "\n".join(self.log_lines) + "\n"

    # -------------------------------------------------------------------------------- model ----

    def _token(self, words: Sequence[str], step: int) -> str:
        seed = zlib.crc32(" ".join(words).encode())
        return VOCAB[(seed + step * 7 + zlib.crc32(words[step % len(words)].encode())) % len(VOCAB)]

    def _cached(self, words: tuple[str, ...]) -> int:
        best = 0
        for seen in self.cache:
            n = 0
            for a, b in zip(seen, words, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        page = self.config.page_size
        return min(best // page * page, max(0, len(words) - 1))

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.config.page_size)

    # -------------------------------------------------------------------------------- HTTP ----

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/abort_request", self.abort_request)
        app.router.add_get("/v1/loads", self.loads)
        app.router.add_get("/metrics", self.metrics)
        return app

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await request.json()
        rid = str(body.get("rid", ""))
        for req in list(self.running.values()):
            if req.rid.startswith(rid):
                self.log(f"Abort request rid={req.rid}")
                req.aborted.set()
        return web.Response(status=200)

    async def loads(self, _: web.Request) -> web.Response:
        page = self.config.page_size
        return web.json_response(
            {
                "num_running_reqs": len(self.running),
                "num_waiting_reqs": 0,
                "num_used_tokens": self.used_pages * page,
                "num_total_tokens": self.config.pool_tokens,
                "max_total_num_tokens": self.config.pool_tokens,
                "token_usage": round(self.used_pages * page / self.config.pool_tokens, 4),
                "disaggregation": {
                    "decode_prealloc_queue_reqs": 0,
                    "decode_transfer_queue_reqs": self.leaked_queue,
                    "kv_transfer_speed_gb_s": 0.0,
                    "kv_transfer_latency_ms": 0.0,
                },
            }
        )

    async def metrics(self, _: web.Request) -> web.Response:
        labels = 'model_name="toy",engine_type="decode",tp_rank="0",pp_rank="0"'
        lines = [f"sglang:{name}{{{labels}}} {value}" for name, value in self.counters.items()]
        return web.Response(text="\n".join(lines) + "\n")

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        words = tuple(str(body.get("text", "")).split())
        params = body.get("sampling_params") or {}
        max_tokens = int(params.get("max_new_tokens", 16))
        rid = str(body.get("rid") or uuid.uuid4().hex)
        n = len(words)
        self.counters["num_requests_total"] += 1
        over_length = n >= self.config.context_length
        if over_length and not self.defects.accept_over_length:
            message = f"The input ({n} tokens) is longer than the model's context length ({self.config.context_length} tokens)."
            self.log(f"[http_server] Error: {message}")
            return web.json_response({"error": {"message": message}}, status=400)
        if not words:
            return web.json_response({"error": {"message": "empty prompt"}}, status=400)
        req = _Req(rid=rid, room=zlib.crc32(rid.encode()), words=list(words), max_tokens=max_tokens)
        self.running[rid] = req
        req.pages = self._pages(n + max_tokens)
        self.used_pages += req.pages
        leaked = False
        try:
            cached = 0 if over_length else self._cached(words)
            reported_prompt = n + (len(self.running) - 1 if self.defects.prompt_tokens_drift else 0)
            reported_cached = cached
            if self.defects.cached_over_prompt and cached:
                reported_cached = req.pages * self.config.page_size - max_tokens  # page-rounded prealloc
            if self.defects.hang_word and self.defects.hang_word in words:
                self.log(f"Decode transfer waiting for bootstrap_room={req.room} rid={rid}")
                assert self.stopping is not None
                await self.stopping.wait()
                return web.json_response({"error": {"message": "server stopping"}}, status=503)
            uncached = 1 if over_length else n - cached  # the stub prefill of the incident
            await asyncio.sleep(self.config.prefill_base_s + self.config.prefill_s_per_token * uncached)
            self.cache.append(words)
            stream = bool(body.get("stream"))
            response: web.StreamResponse | None = None
            if stream:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
            output: list[str] = []
            finish: dict[str, Any] = {"type": "length", "length": max_tokens}
            for step in range(max_tokens):
                if req.aborted.is_set():
                    self.counters["num_aborted_requests_total"] += 1
                    if self.defects.abort_as_length:
                        finish = {"type": "length", "length": len(output)}
                    else:
                        finish = {"type": "abort", "message": "Aborted"}
                    leaked = self.defects.leak_on_abort
                    break
                output.append(await self._step(req, step, over_length))
                if response is not None:
                    await response.write(self._sse(output, reported_prompt, reported_cached, None))
            self.last_output = output or self.last_output
            meta = self._meta(output, reported_prompt, reported_cached, finish)
            if response is not None:
                await response.write(f"data: {json.dumps({'text': ' '.join(output), 'meta_info': meta})}\n\n".encode())
                await response.write(b"data: [DONE]\n\n")
                await response.write_eof()
                return response
            return web.json_response(
                {"text": " ".join(output), "output_ids": list(range(len(output))), "meta_info": meta}
            )
        finally:
            self.running.pop(rid, None)
            if leaked:
                self.leaked_queue += 1
            else:
                self.used_pages -= req.pages

    async def _step(self, req: _Req, step: int, over_length: bool) -> str:
        if over_length:  # decoding over pages that were never written: the last request's content
            await asyncio.sleep(self.config.decode_step_s)
            return self.last_output[step % len(self.last_output)]
        token = self._token(req.words, step)
        if not self.defects.shared_scratch:
            await asyncio.sleep(self.config.decode_step_s)
            return token
        slot = step % len(self.scratch)
        self.scratch[slot] = (req.room, token)
        await asyncio.sleep(self.config.decode_step_s)
        owner, read = self.scratch[slot]
        if owner != req.room and self.defects.detect_corruption:
            self.log(
                f"Context corruption detected: Request rid={req.rid} (bootstrap_room={req.room}) received metadata "
                f"from bootstrap_room={owner}. This indicates a metadata buffer index collision."
            )
        return read

    def _meta(self, output: list[str], prompt: int, cached: int, finish: dict[str, Any] | None) -> dict[str, Any]:
        return {
            "finish_reason": finish,
            "prompt_tokens": prompt,
            "completion_tokens": len(output),
            "cached_tokens": cached,
        }

    def _sse(self, output: list[str], prompt: int, cached: int, finish: dict[str, Any] | None) -> bytes:
        payload = {"text": " ".join(output), "meta_info": self._meta(output, prompt, cached, finish)}
        return f"data: {json.dumps(payload)}\n\n".encode()


@contextmanager
def serve(defects: Defects | None = None, config: ToyConfig | None = None) -> Iterator[ToyServer]:
    """Run a `ToyServer` on 127.0.0.1 (a free port) in a background thread."""
    server = ToyServer(defects, config)
    server.stopping = asyncio.Event()
    with ThreadedServer(server.app(), shutdown_timeout=1.0) as running:
        server.url = running.url
        try:
            yield server
        finally:  # on the server's loop, before the runner's cleanup: held requests answer 503
            running.loop.call_soon_threadsafe(server.stopping.set)


# ------------------------------------------------------------------------------------ client ----


@dataclass
class Shot:
    """One request to send: what the load driver would send, and how it is labelled."""

    index: int
    text: str
    max_tokens: int = 16
    user_kind: str = "canary_chat"
    phase: str = "load"
    stream: bool = False
    abort_after_s: float | None = None  # POST /abort_request with the rid after this long
    rid: str = ""

    def __post_init__(self) -> None:
        if not self.rid:
            self.rid = f"{self.phase}-{self.index}-{uuid.uuid4().hex[:8]}"


async def _send(
    client: httpx.AsyncClient, base_url: str, shot: Shot, timeout_s: float, abort_urls: Sequence[str]
) -> RequestRecord:
    body = {
        "text": shot.text,
        "rid": shot.rid,
        "stream": shot.stream,
        "sampling_params": {"max_new_tokens": shot.max_tokens, "temperature": 0},
    }
    record = RequestRecord(
        id=shot.rid,
        request_index=shot.index,
        phase=shot.phase,
        user_kind=shot.user_kind,
        actor="oracle-test",
        endpoint="/generate",
        stream=shot.stream,
        prompt=shot.text,
        max_tokens=shot.max_tokens,
    )
    aborter: asyncio.Task[None] | None = None
    if shot.abort_after_s is not None:

        async def abort_later() -> None:
            await asyncio.sleep(shot.abort_after_s or 0.0)
            for url in abort_urls or (base_url,):
                await client.post(f"{url}/abort_request", json={"rid": shot.rid})

        aborter = asyncio.create_task(abort_later())

    async def exchange() -> dict[str, Any]:
        async with client.stream("POST", f"{base_url}/generate", json=body) as response:
            record.status = response.status_code
            record.t_first_byte = time.time()
            if shot.stream and response.status_code == 200:
                return await _read_stream(response, record)
            return _read_body(await response.aread(), record)

    record.t_send = time.time()
    try:
        meta = await asyncio.wait_for(exchange(), timeout_s)
        record.t_end = time.time()
        _judge(record, meta)
    except asyncio.TimeoutError:
        record.t_end = time.time()
        record.outcome, record.error_class = Outcome.INFO, "timeout"
        record.error_detail = f"no answer within {timeout_s} s"
    except httpx.HTTPError as exc:
        record.t_end = time.time()
        record.outcome, record.error_class, record.error_detail = Outcome.INFO, "disconnect", repr(exc)
    finally:
        if aborter is not None:
            aborter.cancel()
    return record


async def _read_stream(response: httpx.Response, record: RequestRecord) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        now = time.time()
        if record.t_first_token is None and chunk.get("text"):
            record.t_first_token = now
        record.token_times.append(now)
        record.response_text = chunk.get("text", record.response_text)
        meta = chunk.get("meta_info") or meta
    return meta


def _read_body(raw: bytes, record: RequestRecord) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError:
        record.error_detail = raw[:300].decode(errors="replace")
        return {}
    if record.status != 200:
        record.error_detail = json.dumps(body)[:300]
        return {}
    record.response_text = body.get("text", "")
    return body.get("meta_info") or {}


def _judge(record: RequestRecord, meta: dict[str, Any]) -> None:
    finish = meta.get("finish_reason")
    record.finish_reason = finish.get("type") if isinstance(finish, dict) else finish
    record.prompt_tokens = meta.get("prompt_tokens")
    record.completion_tokens = meta.get("completion_tokens")
    record.cached_tokens = meta.get("cached_tokens")
    status = record.status or 0
    if status != 200:
        failed = 400 <= status < 500 or status in (500, 501, 503, 505)
        record.outcome, record.error_class = (Outcome.FAIL if failed else Outcome.INFO), f"http_{status}"
    elif record.finish_reason == "abort":
        record.outcome, record.error_class = Outcome.INFO, "abort"
    else:
        record.outcome = Outcome.OK


async def _drive(
    base_url: str, shots: Sequence[Shot], concurrent: bool, timeout_s: float, abort_urls: Sequence[str]
) -> list[RequestRecord]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s + 5)) as client:
        if concurrent:
            return list(await asyncio.gather(*(_send(client, base_url, s, timeout_s, abort_urls) for s in shots)))
        return [await _send(client, base_url, s, timeout_s, abort_urls) for s in shots]


def drive(
    journal: Journal,
    base_url: str,
    shots: Sequence[Shot],
    *,
    concurrent: bool = False,
    timeout_s: float = 30.0,
    abort_urls: Sequence[str] = (),
) -> list[RequestRecord]:
    """Send the shots (one at a time, or all at once) and journal one record per request."""
    records = asyncio.run(_drive(base_url, shots, concurrent, timeout_s, abort_urls))
    journal.append_requests(records)
    journal.flush()
    return records


def snapshot_loads(journal: Journal, role: str, phase: str, url: str) -> dict[str, Any]:
    """Journal `/v1/loads` of a worker as the runner does (`probe/loads`)."""
    data = httpx.get(f"{url}/v1/loads", timeout=10).json()
    journal.append_event(
        JournalEvent(kind=EventKind.PROBE, name="loads", data={"role": role, "phase": phase, "data": data})
    )
    return data


def snapshot_metrics(journal: Journal, role: str, phase: str, url: str) -> str:
    """Journal `/metrics` of a worker as the runner does (`probe/metrics`)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    journal.append_event(
        JournalEvent(kind=EventKind.PROBE, name="metrics", data={"role": role, "phase": phase, "text": text})
    )
    return text


def fault_event(journal: Journal, name: str, window: str, step: str, t: float | None = None, **data: Any) -> None:
    """Journal one step of a fault window (`fault/<name>`), as the fault runner does."""
    event = JournalEvent(
        kind=EventKind.FAULT,
        name=name,
        data={"window": window, "step": step, **data},
        t=time.time() if t is None else t,
    )
    journal.append_event(event)
