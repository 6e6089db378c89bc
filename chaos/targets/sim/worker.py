"""One embedded-engine worker process: `python -m chaos.targets.sim.worker --disaggregation-mode prefill ...`.

Flags carry SGLang's names where SGLang has the setting, so launch commands read the same; the
few that only a simulated GPU needs (`--gpu-memory-gb`, speeds) are extra.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import signal
import sys
from collections.abc import Sequence

from aiohttp import web

from chaos.targets.sim.api import WorkerApi
from chaos.targets.sim.decode import DecodeEngine
from chaos.targets.sim.engine import Engine
from chaos.targets.sim.prefill import PrefillEngine
from chaos.targets.sim.settings import ROLES, TransferTimeouts, WorkerSettings
from chaos.targets.sim.timing import TimingLog

log = logging.getLogger("sglang.launch_server")

SHUTDOWN_GRACE_S = 2.0  # in-flight requests get this long on SIGTERM (aiohttp's default is 60 s)
ENGINES: dict[str, type[Engine]] = {"null": Engine, "prefill": PrefillEngine, "decode": DecodeEngine}


def build_parser() -> argparse.ArgumentParser:
    d = WorkerSettings()
    p = argparse.ArgumentParser(prog="python -m chaos.targets.sim.worker", description=__doc__)
    p.add_argument("--disaggregation-mode", choices=ROLES, default="null")
    p.add_argument("--host", default=d.host)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=d.bootstrap_port)
    p.add_argument("--transfer-port", type=int, default=d.transfer_port, help="decode: KV receive port (0: any free)")
    p.add_argument("--transfer-advertise", default=None, help="decode: HOST:PORT prefill must send KV to (a proxy)")
    p.add_argument("--model-path", default=d.model_path)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--gpu-memory-gb", type=float, default=d.gpu_memory_gb)
    p.add_argument("--mem-fraction-static", type=float, default=d.mem_fraction_static)
    p.add_argument("--weights-gb", type=float, default=d.weights_gb)
    p.add_argument("--kv-bytes-per-token", type=int, default=d.kv_bytes_per_token)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--context-length", type=int, default=d.context_length)
    p.add_argument("--max-running-requests", type=int, default=d.max_running_requests)
    p.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size)
    p.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s)
    p.add_argument("--decode-step-ms", type=float, default=d.decode_step_s * 1000)
    p.add_argument("--transfer-tokens-per-s", type=float, default=d.transfer_tokens_per_s)
    p.add_argument("--disaggregation-enable-kv-checksum", action="store_true")
    p.add_argument("--defect", action="append", default=[], metavar="NAME", help="turn on a defect switch (repeat)")
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--timing-log", default=None, metavar="PATH", help="append each request's receive and first-token times here"
    )
    return p


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    return WorkerSettings(
        role=args.disaggregation_mode,
        host=args.host,
        port=args.port,
        bootstrap_port=args.disaggregation_bootstrap_port,
        transfer_port=args.transfer_port,
        transfer_advertise=args.transfer_advertise,
        model_path=args.model_path,
        served_model_name=args.served_model_name,
        gpu_memory_gb=args.gpu_memory_gb,
        mem_fraction_static=args.mem_fraction_static,
        weights_gb=args.weights_gb,
        kv_bytes_per_token=args.kv_bytes_per_token,
        max_total_tokens=args.max_total_tokens,
        page_size=args.page_size,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_step_s=args.decode_step_ms / 1000.0,
        transfer_tokens_per_s=args.transfer_tokens_per_s,
        kv_checksum=args.disaggregation_enable_kv_checksum,
        defects=tuple(args.defect),
        timeouts=TransferTimeouts.from_env(),
        log_level=args.log_level,
        timing_log=args.timing_log,
    )


def command_for(s: WorkerSettings) -> list[str]:
    """The argv that starts a worker with these settings (timeouts travel as SGLang env vars)."""
    argv = [
        sys.executable,
        "-m",
        "chaos.targets.sim.worker",
        "--disaggregation-mode",
        s.role,
        "--host",
        s.host,
        "--port",
        str(s.port),
        "--disaggregation-bootstrap-port",
        str(s.bootstrap_port),
        "--transfer-port",
        str(s.transfer_port),
        "--model-path",
        s.model_path,
        "--gpu-memory-gb",
        str(s.gpu_memory_gb),
        "--mem-fraction-static",
        str(s.mem_fraction_static),
        "--weights-gb",
        str(s.weights_gb),
        "--kv-bytes-per-token",
        str(s.kv_bytes_per_token),
        "--page-size",
        str(s.page_size),
        "--context-length",
        str(s.context_length),
        "--max-running-requests",
        str(s.max_running_requests),
        "--chunked-prefill-size",
        str(s.chunked_prefill_size),
        "--prefill-tokens-per-s",
        str(s.prefill_tokens_per_s),
        "--decode-step-ms",
        str(s.decode_step_s * 1000),
        "--transfer-tokens-per-s",
        str(s.transfer_tokens_per_s),
        "--log-level",
        s.log_level,
    ]
    if s.served_model_name:
        argv += ["--served-model-name", s.served_model_name]
    if s.max_total_tokens is not None:
        argv += ["--max-total-tokens", str(s.max_total_tokens)]
    if s.transfer_advertise:
        argv += ["--transfer-advertise", s.transfer_advertise]
    if s.kv_checksum:
        argv.append("--disaggregation-enable-kv-checksum")
    if s.timing_log:
        argv += ["--timing-log", s.timing_log]
    for defect in s.defects:
        argv += ["--defect", defect]
    return argv


def env_for(timeouts: TransferTimeouts) -> dict[str, str]:
    return {
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(timeouts.bootstrap_timeout_s),
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(timeouts.waiting_timeout_s),
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(timeouts.heartbeat_interval_s),
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": str(timeouts.heartbeat_max_failure),
        "SGLANG_TEST_DISAGG_FAILURE_PROB": str(timeouts.failure_prob),
    }


def configure_logging(level: str) -> None:
    # SGLang's prefix: "[2026-08-16 10:00:00 TP0] message".
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="[%(asctime)s TP0] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        stream=sys.stdout,
    )
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    # The router probes every worker over gRPC (HTTP/2) before falling back to HTTP; aiohttp
    # would log each probe as a malformed request with a traceback.
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)


def log_startup(s: WorkerSettings) -> None:
    kv_gb = s.pool_tokens * s.kv_bytes_per_token / 1024**3
    # SGLang prints its ServerArgs dataclass repr; our readers (chaos/facts/log_facts.py) parse that form.
    args = {
        "model_path": s.model_path,
        "served_model_name": s.model_name,
        "host": s.host,
        "port": s.port,
        "mem_fraction_static": s.mem_fraction_static,
        "max_total_tokens": s.max_total_tokens,
        "context_length": s.context_length,
        "page_size": s.page_size,
        "tp_size": 1,
        "dp_size": 1,
        "disaggregation_mode": s.role,
        "disaggregation_bootstrap_port": s.bootstrap_port,
        "disaggregation_enable_kv_checksum": s.kv_checksum,
    }
    if s.defects:
        log.warning("DEFECTS ON: %s (this engine is broken on purpose)", ", ".join(s.defects))
    log.info("server_args=ServerArgs(%s)", ", ".join(f"{k}={v!r}" for k, v in args.items()))
    log.info(
        "KV Cache is allocated. dtype: torch.bfloat16, #tokens: %d, K size: %.2f GB, V size: %.2f GB",
        s.pool_tokens,
        kv_gb / 2,
        kv_gb / 2,
    )
    log.info("Memory pool end. avail mem=%.2f GB", s.available_gpu_mem_gb)
    log.info(
        "max_total_num_tokens=%d, chunked_prefill_size=%d, max_prefill_tokens=%d, max_running_requests=%d, context_len=%d, available_gpu_mem=%.2f GB",
        s.pool_tokens,
        s.chunked_prefill_size,
        s.chunked_prefill_size,
        s.max_running_requests,
        s.context_length,
        s.available_gpu_mem_gb,
    )


GC_GEN0_THRESHOLD = 20000  # allocations between young-generation collections (CPython's default: 700)


def tune_gc() -> None:
    """Collect cyclic garbage less often: every request allocates hundreds of short-lived objects
    (futures, tasks, frames, dicts) that reference counting frees anyway, and the collector's
    passes over them cost about 4% of a worker's CPU under load. The objects made at start-up
    (modules, the pool's arrays, the app) are frozen out of every later collection."""
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, 20, 20)


async def serve(settings: WorkerSettings) -> None:
    engine = ENGINES[settings.role](settings)
    runners: list[web.AppRunner] = []
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    log_startup(settings)
    await engine.start()
    if isinstance(engine, PrefillEngine):
        bootstrap = web.AppRunner(engine.bootstrap.app(), access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
        await bootstrap.setup()
        await web.TCPSite(bootstrap, settings.host, settings.bootstrap_port).start()
        runners.append(bootstrap)
    # handler_cancellation: a client that hangs up cancels its handler, which aborts the request.
    timing_log = TimingLog(settings.timing_log, settings.role) if settings.timing_log else None
    http = web.AppRunner(
        WorkerApi(engine, timing_log).app(),
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_GRACE_S,
    )
    await http.setup()
    await web.TCPSite(http, settings.host, settings.port).start()
    runners.append(http)
    tune_gc()
    log.info("The server is fired up and ready to roll!")

    await stop.wait()
    log.info("Shutting down")
    await engine.stop()
    for runner in reversed(runners):
        await runner.cleanup()
    if timing_log is not None:
        timing_log.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
