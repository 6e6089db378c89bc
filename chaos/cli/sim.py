"""`pdchaos sim`: run the embedded PD engine (prefill + decode + real sglang-router)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from chaos.cli.command import Subcommands
from chaos.errors import UsageError
from chaos.exit_codes import ExitCode
from chaos.targets.sglang.router import RouterOptions
from chaos.targets.sim.defects import DEFECTS
from chaos.targets.sim.settings import TransferTimeouts, WorkerSettings
from chaos.targets.sim.stack import SimStack, SimStackConfig
from chaos.targets.state import state_path, stop_from_state

DEFAULT_STATE_DIR = Path(".pdchaos/sim")


def register(commands: Subcommands) -> None:
    sim = commands.add_parser("sim", help="run the embedded PD engine behind the real sglang-router")
    sim_commands = sim.add_subparsers(dest="sim_command", metavar="SUBCOMMAND")
    sim_commands.required = True

    up = sim_commands.add_parser("up", help="start the stack and print its URLs; Ctrl-C stops it")
    up.add_argument("--dir", type=Path, default=DEFAULT_STATE_DIR, help="where logs and the state file go")
    up.add_argument("--detach", action="store_true", help="leave the stack running in the background")
    up.add_argument("--page-size", type=int, default=WorkerSettings.page_size)
    up.add_argument("--context-length", type=int, default=WorkerSettings.context_length)
    up.add_argument("--mem-fraction-static", type=float, default=WorkerSettings.mem_fraction_static)
    up.add_argument("--max-total-tokens", type=int, default=None)
    up.add_argument("--prefill-mem-fraction-static", type=float, default=None, help="prefill only (asymmetric pools)")
    up.add_argument("--decode-mem-fraction-static", type=float, default=None, help="decode only (asymmetric pools)")
    up.add_argument("--prefill-tokens-per-s", type=float, default=WorkerSettings.prefill_tokens_per_s)
    up.add_argument("--decode-step-ms", type=float, default=WorkerSettings.decode_step_s * 1000)
    up.add_argument("--kv-checksum", action="store_true", help="like --disaggregation-enable-kv-checksum")
    up.add_argument(
        "--waiting-timeout",
        type=float,
        default=TransferTimeouts.waiting_timeout_s,
        help="SGLANG_DISAGGREGATION_WAITING_TIMEOUT",
    )
    up.add_argument(
        "--bootstrap-timeout",
        type=float,
        default=TransferTimeouts.bootstrap_timeout_s,
        help="SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
    )
    up.add_argument("--router-retries", action="store_true", help="keep the router's retries (they hide faults)")
    up.add_argument(
        "--defect",
        action="append",
        default=[],
        metavar="NAME",
        help="turn on a defect switch (repeat; see `pdchaos sim defects`)",
    )
    up.add_argument("--json", action="store_true", help="print the endpoints as one JSON line")
    up.set_defaults(handler=run_up)

    defects = sim_commands.add_parser("defects", help="list the defect switches (each reproduces a real KV bug)")
    defects.set_defaults(handler=run_defects)

    down = sim_commands.add_parser("down", help="stop a stack started with --detach")
    down.add_argument("--dir", type=Path, default=DEFAULT_STATE_DIR)
    down.set_defaults(handler=run_down)


def config_from_args(args: argparse.Namespace) -> SimStackConfig:
    try:
        worker = WorkerSettings(
            page_size=args.page_size,
            context_length=args.context_length,
            mem_fraction_static=args.mem_fraction_static,
            max_total_tokens=args.max_total_tokens,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            decode_step_s=args.decode_step_ms / 1000.0,
            kv_checksum=args.kv_checksum,
            defects=tuple(args.defect),
            timeouts=replace(
                TransferTimeouts(), waiting_timeout_s=args.waiting_timeout, bootstrap_timeout_s=args.bootstrap_timeout
            ),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    prefill = {"mem_fraction_static": args.prefill_mem_fraction_static} if args.prefill_mem_fraction_static else {}
    decode = {"mem_fraction_static": args.decode_mem_fraction_static} if args.decode_mem_fraction_static else {}
    return SimStackConfig(
        worker=worker,
        prefill_overrides=prefill,
        decode_overrides=decode,
        router=RouterOptions(retries=args.router_retries, circuit_breaker=args.router_retries),
    )


def run_up(args: argparse.Namespace) -> int:
    if state_path(args.dir).exists():
        raise UsageError(f"a stack already runs from {args.dir}; stop it with `pdchaos sim down --dir {args.dir}`")
    config = config_from_args(args)
    stack = SimStack(config, args.dir)
    started = time.monotonic()
    endpoints = stack.up()
    if args.json:
        print(
            json.dumps(
                {
                    "router": endpoints.router_url,
                    "prefill": endpoints.prefill_urls[0],
                    "decode": endpoints.decode_urls[0],
                    "bootstrap_port": endpoints.workers[0].bootstrap_port,
                    "router_metrics": endpoints.router_metrics_url,
                    "logs": str(stack.log_dir),
                }
            ),
            flush=True,
        )
    else:
        print(f"embedded PD engine ready in {time.monotonic() - started:.1f}s", flush=True)
        print(f"  router   {endpoints.router_url}")
        print(f"  prefill  {endpoints.prefill_urls[0]}  (bootstrap port {endpoints.workers[0].bootstrap_port})")
        print(f"  decode   {endpoints.decode_urls[0]}")
        print(f"  metrics  {endpoints.router_metrics_url}")
        print(f"  logs     {stack.log_dir}")
    if args.detach:
        print(f"running in the background; stop it with: pdchaos sim down --dir {args.dir}", flush=True)
        return ExitCode.PASS
    print("Ctrl-C stops it.", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while all(p.alive() for p in stack.procs.values()):
            time.sleep(0.5)
        dead = [name for name, p in stack.procs.items() if not p.alive()]
        print(f"stopping: {', '.join(dead)} exited; see {stack.log_dir}", file=sys.stderr)
        return ExitCode.FAIL
    except KeyboardInterrupt:
        return ExitCode.PASS
    finally:
        stack.down()


def run_defects(_: argparse.Namespace) -> int:
    for d in DEFECTS.values():
        print(f"{d.name}  [{d.bug_class}]  {d.summary}")
        print(f"    mechanism: {d.mechanism}")
        print(f"    real bugs: {d.references}")
        campaign = f"campaigns/defects/{d.campaign}.yaml"
        print(f"    trigger:   {d.trigger}; campaign: {campaign}, caught by: {', '.join(d.caught_by)}")
    return ExitCode.PASS


def run_down(args: argparse.Namespace) -> int:
    if not state_path(args.dir).exists():
        print(f"no stack recorded in {args.dir}; nothing to stop")
        return ExitCode.PASS
    for line in stop_from_state(args.dir):
        print(line)
    return ExitCode.PASS
