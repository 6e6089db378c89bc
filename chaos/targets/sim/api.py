"""SGLang's worker HTTP API over an embedded-engine `Engine` (shapes: SGLang's `http_server.py`)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from chaos import __version__
from chaos.targets.sim.engine import Engine, Req
from chaos.targets.sim.metrics import render
from chaos.targets.sim.protocol import (
    Api,
    BadRequest,
    GenerateInput,
    abort,
    decode_json_body,
    generate_error_body,
    openai_error_body,
    parse_generate,
    parse_openai,
    server_error_body,
)
from chaos.targets.sim.timing import RequestTiming, TimingLog

log = logging.getLogger("sglang.http_server")

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's sampling default
OPENAI_DEFAULT_MAX_TOKENS = 16
MAX_BODY_BYTES = 64 * 1024 * 1024
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class WorkerApi:
    def __init__(self, engine: Engine, timing_log: TimingLog | None = None) -> None:
        self.engine = engine
        self.created = int(time.time())
        self.timing_log = timing_log  # opt-in: see timing.py

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._errors])
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_post("/v1/chat/completions", self.chat)
        r.add_post("/v1/completions", self.completions)
        r.add_get("/v1/models", self.models)
        for path in ("/health", "/health_generate"):
            r.add_get(path, self.health)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/v1/loads", self.loads)
        r.add_get("/metrics", self.metrics)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("GET", "/flush_cache", self.flush_cache)
        r.add_route("POST", "/flush_cache", self.flush_cache)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status == 413:
                return web.json_response(
                    generate_error_body(f"Request body is larger than {MAX_BODY_BYTES} bytes"), status=413
                )
            raise
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # keep serving: one bad request must not take the worker down
            log.exception("[http_server] Error: %r", exc)
            return web.json_response(server_error_body(f"Internal server error: {exc!r}", 500), status=500)

    # ------------------------------------------------------------------------ generation ----

    async def _submit(self, request: web.Request, api: Api) -> GenerateInput:
        body = decode_json_body(await request.read())
        if api == "generate":
            return parse_generate(body, DEFAULT_MAX_NEW_TOKENS)
        return parse_openai(api, body, OPENAI_DEFAULT_MAX_TOKENS)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "generate")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completions")

    async def _serve(self, request: web.Request, api: Api) -> web.StreamResponse:
        timings = self.timing_log
        timing = timings.start(request.headers.get("X-Request-ID")) if timings is not None else None
        error_body = generate_error_body if api == "generate" else (lambda m: openai_error_body(m, 400))
        try:
            inp = await self._submit(request, api)
            req = self.engine.submit(inp)
        except BadRequest as exc:
            log.info("[http_server] Error: %s", exc)
            return web.json_response(error_body(str(exc)), status=400)
        status: int | None = None
        try:
            if inp.stream:
                streamed = await self._stream(request, req, timing)
                status = streamed.status
                return streamed
            await self._until_finished(req)
            response = self._final(req)
            status = response.status
            if timing is not None:
                # Send it here rather than after returning (the same bytes: aiohttp finishes a
                # prepared response as it is), so the log says when it left.
                await response.prepare(request)
                await response.write_eof()
                if status == 200 and req.output_ids:
                    timing.first_token_sent()
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            if req.finish is None:
                log.info("Request is disconnected from the client side (type 1). Abort request rid=%s", req.rid)
                self.engine.request_abort(req, abort("Request is disconnected from the client side"))
            raise
        finally:
            if timings is not None and timing is not None:
                timings.write(
                    timing, rid=req.rid, api=api, stream=inp.stream, status=status, output_tokens=len(req.output_ids)
                )

    async def _until_finished(self, req: Req) -> None:
        # One wake-up at the end, not one per generated token as `changed` would give.
        await req.ended.wait()

    def _final(self, req: Req) -> web.Response:
        finish = req.finish
        assert finish is not None
        if finish.type == "abort" and finish.status_code is not None:
            status = finish.status_code
            if req.inp.api == "generate":
                body = (
                    generate_error_body(finish.message) if status == 400 else server_error_body(finish.message, status)
                )
            else:
                body = openai_error_body(finish.message, status)
            return web.json_response(body, status=status)
        return web.json_response(self._body(req))

    def _body(self, req: Req) -> dict[str, Any]:
        if req.inp.api == "generate":
            return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": req.meta_info()}
        finish = req.finish.type if req.finish else None
        common = {
            "id": req.rid,
            "created": int(time.time()),
            "model": self.engine.settings.model_name,
            "usage": self._usage(req),
        }
        if req.inp.api == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": req.text}, "finish_reason": finish}
            return {"object": "chat.completion", "choices": [choice], **common}
        return {
            "object": "text_completion",
            "choices": [{"index": 0, "text": req.text, "finish_reason": finish}],
            **common,
        }

    def _usage(self, req: Req) -> dict[str, Any]:
        completion = len(req.output_ids)
        return {
            "prompt_tokens": req.prompt_len,
            "completion_tokens": completion,
            "total_tokens": req.prompt_len + completion,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
        }

    async def _stream(self, request: web.Request, req: Req, timing: RequestTiming | None = None) -> web.StreamResponse:
        """SSE; `/generate` chunks carry cumulative text (SGLang's default), OpenAI ones deltas."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        sent_chars = 0
        sent_tokens = 0
        if req.inp.api == "chat":
            await response.write(_sse(self._chunk(req, {"role": "assistant", "content": ""}, None)))
        while True:
            req.changed.clear()
            finished = req.finish is not None
            if req.inp.api == "generate":
                if len(req.output_ids) > sent_tokens or finished:
                    sent_tokens = len(req.output_ids)
                    await response.write(
                        _sse({"text": req.text, "output_ids": list(req.output_ids), "meta_info": req.meta_info()})
                    )
                    if timing is not None and sent_tokens:
                        timing.first_token_sent()
            else:
                delta = req.text[sent_chars:]
                sent_chars = len(req.text)
                if finished and req.finish and req.finish.type == "abort" and req.finish.status_code is not None:
                    err = openai_error_body(req.finish.message, req.finish.status_code)
                    await response.write(
                        _sse({"error": {"message": err["message"], "type": err["type"], "code": err["code"]}})
                    )
                elif delta or finished:
                    reason = req.finish.type if finished and req.finish else None
                    content = {"content": delta} if req.inp.api == "chat" else delta
                    await response.write(_sse(self._chunk(req, content, reason)))
                    if timing is not None and delta:
                        timing.first_token_sent()
                if finished and req.inp.include_usage:
                    await response.write(
                        _sse({**self._chunk(req, None, None), "choices": [], "usage": self._usage(req)})
                    )
            if finished:
                break
            await req.changed.wait()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _chunk(self, req: Req, content: Any, finish_reason: str | None) -> dict[str, Any]:
        base = {"id": req.rid, "created": int(time.time()), "model": self.engine.settings.model_name}
        if req.inp.api == "chat":
            choice = {"index": 0, "delta": content or {}, "finish_reason": finish_reason}
            return {**base, "object": "chat.completion.chunk", "choices": [choice]}
        return {
            **base,
            "object": "text_completion",
            "choices": [{"index": 0, "text": content or "", "finish_reason": finish_reason}],
        }

    # ------------------------------------------------------------------------ introspection ----

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.ready else 503)

    async def models(self, _: web.Request) -> web.Response:
        s = self.engine.settings
        card = {
            "id": s.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "sglang",
            "root": s.model_path,
            "max_model_len": s.context_length,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def model_info(self, _: web.Request) -> web.Response:
        s = self.engine.settings
        return web.json_response(
            {
                "model_path": s.model_path,
                "tokenizer_path": s.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "pdchaos-toy",
                "architectures": ["PdchaosToyForCausalLM"],
            }
        )

    async def server_info(self, _: web.Request) -> web.Response:
        s, e = self.engine.settings, self.engine
        info = {
            "model_path": s.model_path,
            "served_model_name": s.model_name,
            "host": s.host,
            "port": s.port,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "disaggregation_mode": s.role,
            "disaggregation_bootstrap_port": s.bootstrap_port,
            "disaggregation_transfer_backend": "pdchaos-tcp",
            "disaggregation_enable_kv_checksum": s.kv_checksum,
            "mem_fraction_static": s.mem_fraction_static,
            "max_total_tokens": s.max_total_tokens,
            "context_length": s.context_length,
            "page_size": s.page_size,
            "max_running_requests": s.max_running_requests,
            "chunked_prefill_size": s.chunked_prefill_size,
            "status": "ready" if e.ready else "starting",
            "max_total_num_tokens": s.pool_tokens,
            "max_req_input_len": s.max_req_input_len,
            "startup_time": e.started_at,
            "internal_states": [
                {
                    "last_gen_throughput": e._last_gen_throughput,
                    "memory_usage": {
                        "kvcache": round(s.kv_memory_gb, 3),
                        "weight": s.weights_gb,
                        "token_capacity": s.pool_tokens,
                    },
                    "effective_max_running_requests_per_dp": s.max_running_requests,
                }
            ],
            "version": f"pdchaos-sim {__version__}",
            "kv_events": None,
            "pdchaos_sim": s.to_json(),
        }
        return web.json_response(info)

    def _loads(self) -> dict[str, Any]:
        e, s = self.engine, self.engine.settings
        speed, latency = e.kv_transfer_stats()
        return {
            "num_running_reqs": e.num_running(),
            "num_waiting_reqs": e.num_waiting(),
            "num_used_tokens": e.used_tokens(),
            "num_total_tokens": s.pool_tokens,
            "max_total_num_tokens": s.pool_tokens,
            "token_usage": round(e.token_usage(), 4),
            "disaggregation": {**e.queue_counts(), "kv_transfer_speed_gb_s": speed, "kv_transfer_latency_ms": latency},
            "quarantined_tokens": e.quarantined_tokens(),
        }

    async def loads(self, _: web.Request) -> web.Response:
        return web.json_response(self._loads())

    async def metrics(self, _: web.Request) -> web.Response:
        e, s = self.engine, self.engine.settings
        loads = self._loads()
        labels = {
            "model_name": s.model_name,
            "engine_type": "unified" if s.role == "null" else s.role,
            "tp_rank": "0",
            "pp_rank": "0",
        }
        gauges: dict[str, float] = {
            "max_total_num_tokens": s.pool_tokens,
            "context_len": s.context_length,
            "page_size": s.page_size,
            "num_pages": s.num_pages,
            "kv_cache_memory_usage_gb": max(0.0, s.kv_memory_gb),
            "weight_memory_usage_gb": s.weights_gb,
            "num_running_reqs": loads["num_running_reqs"],
            "num_queue_reqs": loads["num_waiting_reqs"],
            "num_used_tokens": loads["num_used_tokens"],
            "token_usage": loads["token_usage"],
            "kv_used_tokens": e.pool.used_pages * s.page_size,
            "kv_available_tokens": e.pool.free_pages * s.page_size,
            "kv_evictable_tokens": e.cache.evictable_pages * s.page_size,
            "gen_throughput": e._last_gen_throughput,
            "cache_hit_rate": e.cache.hits_tokens / e.cache.lookups_tokens if e.cache.lookups_tokens else 0.0,
            "num_retracted_reqs": 0,
            "num_prefill_bootstrap_queue_reqs": loads["disaggregation"]["prefill_bootstrap_queue_reqs"],
            "num_prefill_inflight_queue_reqs": loads["disaggregation"]["prefill_inflight_queue_reqs"],
            "num_decode_prealloc_queue_reqs": loads["disaggregation"]["decode_prealloc_queue_reqs"],
            "num_decode_transfer_queue_reqs": loads["disaggregation"]["decode_transfer_queue_reqs"],
            "kv_transfer_speed_gb_s": loads["disaggregation"]["kv_transfer_speed_gb_s"],
            "kv_transfer_latency_ms": loads["disaggregation"]["kv_transfer_latency_ms"],
        }
        for name in ("num_bootstrap_failed_reqs_total", "num_transfer_failed_reqs_total", "num_aborted_requests_total"):
            e.metrics.counters.setdefault(name, 0.0)
        return web.Response(text=render(labels, gauges, e.metrics), content_type="text/plain", charset="utf-8")

    # ----------------------------------------------------------------------------- control ----

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = decode_json_body(await request.read())
        except BadRequest as exc:
            return web.json_response(generate_error_body(str(exc)), status=400)
        rid = body.get("rid") or ""
        if not isinstance(rid, str):
            return web.json_response(generate_error_body("Field 'rid' must be a string"), status=400)
        self.engine.abort_matching(rid, abort_all=bool(body.get("abort_all", False)))
        return web.Response(status=200)

    async def flush_cache(self, _: web.Request) -> web.Response:
        if self.engine.flush_cache():
            return web.Response(
                text="Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n"
            )
        return web.Response(status=400, text="Cache not flushed: requests are running or waiting.\n")
