"""`pdchaos smoke`: a short load with canary and reference checks on the embedded engine."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from chaos.smoke import run_smoke


def register(commands: Any) -> None:
    smoke = commands.add_parser("smoke", help="short canary load against the embedded engine; prints a JSON result")
    smoke.add_argument("--probes", type=int, default=48, help="distinct probe prompts (each carries its own markers)")
    smoke.add_argument("--rounds", type=int, default=4, help="times each probe is replayed under load")
    smoke.add_argument("--concurrency", type=int, default=32)
    smoke.add_argument("--out", type=Path, default=None, help="run directory (default: runs/smoke-TIME)")
    smoke.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    out = args.out or Path("runs") / time.strftime("smoke-%Y%m%d-%H%M%S")
    print(f"embedded PD engine + sglang-router; logs in {out / 'logs'}", flush=True)
    result = run_smoke(out, probes=args.probes, rounds=args.rounds, concurrency=args.concurrency)
    for finding in result.findings[:20]:
        print(finding)
    print(result.to_json())
    return 0 if result.passed else 1
