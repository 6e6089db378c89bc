"""A gateway-like OpenAI-compatible server (no /generate, /server_info or worker endpoints) for
the credential and attach tests: it demands
`Authorization: Bearer <key>` (401 without it, 403 with another) and echoes every request header
into its replies, as a careless gateway or debug endpoint would, so a leak of the key into any
artifact shows up. HTTP, or HTTPS with a certificate from a test CA (trustme).

Words are tokens; the context is CONTEXT words and a longer prompt gets a 400 that says so.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from typing import Any

from aiohttp import web

from tests.aiohttp_thread import ThreadedServer

CONTEXT = 2048


class AuthEchoServer:
    def __init__(
        self,
        key: str | None,
        *,
        tls: ssl.SSLContext | None = None,
        token_delay_s: float = 0.0,
        streams: bool = True,
    ) -> None:
        self.key = key  # None: a server without credentials
        self.tls = tls
        self.token_delay_s = token_delay_s  # between streamed tokens, so a client can abort mid-stream
        self.streams = streams  # False: `stream` is ignored and every reply comes whole, in one body
        self.unauthorized = 0  # requests refused for their credentials
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 1024 * 1024)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self.server = ThreadedServer(app, tls=tls)
        host = "localhost" if tls else "127.0.0.1"  # the test CA's certificate names localhost
        self.url = f"{'https' if tls else 'http'}://{host}:{self.server.port}"

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization")
        if self.key is not None and given != f"Bearer {self.key}":
            self.unauthorized += 1
            status = 401 if given is None else 403
            # echoes what it was given, as many gateways do in their error bodies
            return web.json_response({"error": {"message": f"bad credentials: {given}", "code": status}}, status=status)
        response: web.StreamResponse = await handler(request)
        return response

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "echo-model", "object": "model", "max_model_len": CONTEXT}]}
        )

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        words = len(str(prompt).split())
        if words + int(body.get("max_tokens") or 16) > CONTEXT:
            return web.json_response(
                {
                    "object": "error",
                    "message": f"This model's maximum context length is {CONTEXT} tokens. "
                    f"However, you requested {words} tokens in the messages.",
                    "code": 400,
                },
                status=400,
            )
        echo = "; ".join(f"{k}={v}" for k, v in request.headers.items())
        budget = max(1, int(body.get("max_tokens") or 2))
        # repeats the prompt's markers, then the headers, then one word per token up to max_tokens
        pieces = ([f"{prompt} ", f"(headers: {echo})"] + [" ok"] * budget)[:budget]
        usage = {"prompt_tokens": words, "completion_tokens": len(pieces), "total_tokens": words + len(pieces)}
        if not body.get("stream") or not self.streams:
            text = "".join(pieces)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                if chat
                else {"index": 0, "text": text, "finish_reason": "stop"}
            )
            return web.json_response({"id": "x", "object": "completion", "choices": [choice], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            delta = {"delta": {"content": piece}} if chat else {"text": piece}
            choice = {"index": 0, **delta, "finish_reason": None}
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        done = {"index": 0, "finish_reason": "stop", **({"delta": {}} if chat else {"text": ""})}
        await response.write(f"data: {json.dumps({'choices': [done], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def __enter__(self) -> AuthEchoServer:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__(*exc)
