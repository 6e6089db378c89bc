"""The most trivial SGLang-shaped worker: a fixed answer at once, no model, no KV transfer.

One process per role (`--disaggregation-mode prefill|decode|null`). It answers the calls
`sglang-router` makes at startup and on its health checks (`/health`, `/server_info` with the
fields the router reads: `tp_size`, `dp_size`, `model_path`, `served_model_name`,
`disaggregation_mode`; `/model_info`; `/v1/models`) and `POST /generate` with a precomputed
`{"text", "output_ids", "meta_info"}` body (finish reason `length`). The request body is read
but not parsed. `benchmarks/router_throughput.py` puts two of these behind the router to
measure the router's own cost; see `benchmarks/README.md`.

    python benchmarks/stub_worker.py --disaggregation-mode decode --port 31002
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

OUTPUT_TEXT = " a b c d e f g h"
OUTPUT_IDS = [1, 2, 3, 4, 5, 6, 7, 8]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/stub_worker.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--disaggregation-mode", choices=("prefill", "decode", "null"), default="null")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--model-path", default="pdchaos/stub")
    return p


def make_app(args: argparse.Namespace) -> web.Application:
    role = args.disaggregation_mode
    # Prefill's body is ignored by the router apart from its status; SGLang's prefill says length 0.
    n = 0 if role == "prefill" else len(OUTPUT_IDS)
    generate_body = json.dumps(
        {
            "text": OUTPUT_TEXT if n else "",
            "output_ids": OUTPUT_IDS[:n] if n else [OUTPUT_IDS[0]],
            "meta_info": {
                "id": "stub",
                "finish_reason": {"type": "length", "length": n},
                "prompt_tokens": 16,
                "completion_tokens": n,
                "cached_tokens": 0,
                "weight_version": "default",
            },
        }
    ).encode()
    server_info = {
        "model_path": args.model_path,
        "served_model_name": args.model_path,
        "tp_size": 1,
        "dp_size": 1,
        "pp_size": 1,
        "disaggregation_mode": role,
        "disaggregation_bootstrap_port": args.disaggregation_bootstrap_port,
        "status": "ready",
        "version": "pdchaos-stub",
    }
    model_info = {"model_path": args.model_path, "tokenizer_path": args.model_path, "is_generation": True}
    models = {
        "object": "list",
        "data": [{"id": args.model_path, "object": "model", "owned_by": "sglang", "root": args.model_path}],
    }

    async def generate(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=generate_body, content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    def fixed(payload: dict[str, Any]) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(_: web.Request) -> web.Response:
            return web.json_response(payload)

        return handler

    app = web.Application()
    app.router.add_post("/generate", generate)
    for path in ("/health", "/health_generate"):
        app.router.add_get(path, health)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, fixed(server_info))
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, fixed(model_info))
    app.router.add_get("/v1/models", fixed(models))
    return app


async def serve(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner = web.AppRunner(make_app(args), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    print(f"stub {args.disaggregation_mode} worker ready on {args.host}:{args.port}", flush=True)
    await stop.wait()
    await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
    # The router first probes each worker over gRPC (HTTP/2); aiohttp would log every probe
    # as a malformed request with a traceback.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
