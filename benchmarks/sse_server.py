"""A trivial LLM-shaped HTTP server: just enough of /generate and the OpenAI routes, streaming or not.

For load-generator benchmarks (`benchmarks/locust_users.py`): the replies must be cheap to
make, so the client is what gets measured. One aiohttp process. Each request body is parsed as
JSON; the reply's text is the first `--echo-chars` characters of the prompt (a canary prompt
starts with its head marker, so the marker comes back, as with a model asked to repeat) cut into
`--chunks` pieces, with finish reason `length` and the usage fields our users read.

- `POST /generate`: SGLang's `{"text", "meta_info"}`; streamed, cumulative text per `data:`
  line, then `data: [DONE]`.
- `POST /v1/completions`, `POST /v1/chat/completions`: OpenAI `choices` (deltas when streamed),
  a usage chunk when `stream_options.include_usage`, then `data: [DONE]`.
- `GET /health`: 200.

    .venv/bin/python benchmarks/sse_server.py --port 31500
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from typing import Any

from aiohttp import web

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def _prompt_of(body: dict[str, Any]) -> str:
    text = body.get("text")
    if isinstance(text, str):
        return text
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    messages = body.get("messages")
    if isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        return str(messages[-1].get("content", ""))
    return ""


def _pieces(text: str, chunks: int) -> list[str]:
    size = max(1, -(-len(text) // chunks))
    return [text[i : i + size] for i in range(0, len(text), size)] or [" "]


def _data(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def build_app(echo_chars: int, chunks: int) -> web.Application:
    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = _prompt_of(body)
        pieces = _pieces(prompt[:echo_chars], chunks)
        usage = {"prompt_tokens": len(prompt) // 4, "completion_tokens": len(pieces), "cached_tokens": 0}
        if not body.get("stream"):
            meta = {"finish_reason": {"type": "length", "length": len(pieces)}, **usage}
            return web.json_response({"text": "".join(pieces), "meta_info": meta})
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        text = ""
        for n, piece in enumerate(pieces):
            text += piece
            last = n == len(pieces) - 1
            meta = {
                "finish_reason": {"type": "length", "length": len(pieces)} if last else None,
                **usage,
                "completion_tokens": n + 1,
            }
            await response.write(_data({"text": text, "meta_info": meta}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def openai(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        prompt = _prompt_of(body)
        pieces = _pieces(prompt[:echo_chars], chunks)
        usage = {
            "prompt_tokens": len(prompt) // 4,
            "completion_tokens": len(pieces),
            "total_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        kind = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            text = "".join(pieces)
            choice = {
                "index": 0,
                "finish_reason": "length",
                **({"message": {"role": "assistant", "content": text}} if chat else {"text": text}),
            }
            return web.json_response(
                {"id": "x", "object": kind, "model": body.get("model"), "choices": [choice], "usage": usage}
            )
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        for n, piece in enumerate(pieces):
            last = n == len(pieces) - 1
            choice = {
                "index": 0,
                "finish_reason": "length" if last else None,
                **({"delta": {"content": piece}} if chat else {"text": piece}),
            }
            await response.write(_data({"id": "x", "object": kind + ".chunk", "choices": [choice]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(_data({"id": "x", "object": kind + ".chunk", "choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/generate", generate)
    app.router.add_post("/v1/completions", openai)
    app.router.add_post("/v1/chat/completions", openai)
    app.router.add_get("/health", health)
    return app


async def serve(host: str, port: int, echo_chars: int, chunks: int) -> None:
    runner = web.AppRunner(build_app(echo_chars, chunks), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=1024).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"sse_server listening on http://{host}:{port}", flush=True)
    await stop.wait()
    await runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--echo-chars", type=int, default=160, help="reply with this much of the prompt")
    p.add_argument("--chunks", type=int, default=8, help="streamed pieces per reply")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(serve(args.host, args.port, args.echo_chars, args.chunks))


if __name__ == "__main__":
    main()
