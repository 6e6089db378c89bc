"""`pdchaos load`: load alone, journaled (`--target sim` starts the embedded engine)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from chaos import transport
from chaos.cli.access import add_access_arguments, configure_from_args
from chaos.cli.command import Subcommands
from chaos.durations import parse_duration
from chaos.errors import UsageError
from chaos.exit_codes import ExitCode
from chaos.journal import Journal
from chaos.load import LoadPlan, run_load, summary, terminal_progress, write_summary
from chaos.loadstats import compute
from chaos.markers import new_run_prefix
from chaos.targets.discovery import discover_facts
from loadprofiles.profiles import PROFILES


def register(commands: Subcommands) -> None:
    p = commands.add_parser("load", help="drive journaled canary load at a target (no faults)")
    p.add_argument("--target", required=True, help="a router/server URL, or 'sim' for the embedded engine")
    p.add_argument("--profile", default="canary-chat", help=f"one of: {', '.join(PROFILES)}")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--duration", default="30s", help="e.g. 60s, 2m")
    p.add_argument("--actors", type=int, default=1, help="load actors (each runs one Locust process)")
    p.add_argument("--shape", default="steady", choices=("steady", "ramp", "spike", "stages", "soak"))
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--worker", action="append", default=[], help="a worker URL that takes /abort_request (repeat)")
    p.add_argument("--ray-address", default=None, help="join this Ray cluster instead of starting one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="run directory (default: runs/load-TIME)")
    add_access_arguments(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.profile not in PROFILES:
        raise UsageError(f"--profile: unknown profile {args.profile!r}; choose one of {', '.join(PROFILES)}")
    if args.users < 1 or args.actors < 1:
        raise UsageError("--users and --actors must be at least 1")
    duration = parse_duration(args.duration, "--duration")
    out: Path = args.out or Path("runs") / time.strftime("load-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    stack = None
    try:
        if args.target == "sim":
            from chaos.targets.sim.stack import SimStack, SimStackConfig

            stack = SimStack(SimStackConfig(), out)
            endpoints = stack.up()
            target_url, abort_urls = endpoints.router_url, tuple(w.url for w in endpoints.workers)
        else:
            if not args.target.startswith(("http://", "https://")):
                raise UsageError(f"--target: {args.target!r} is neither 'sim' nor an http(s) URL")
            target_url, abort_urls = args.target.rstrip("/"), tuple(args.worker)
            configure_from_args(args)
            for url in (target_url, *abort_urls):
                transport.check_access(url)
        facts = discover_facts(target_url, abort_urls)
        plan = LoadPlan(
            target_url=target_url,
            facts=facts,
            profile=PROFILES[args.profile],
            run_prefix=new_run_prefix(),
            users=args.users,
            duration_s=duration,
            actors=args.actors,
            shape=args.shape,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
        with Journal.create(out) as journal:
            journal.set_meta(
                "load_plan",
                {
                    "target": target_url,
                    "profile": args.profile,
                    "users": args.users,
                    "duration_s": duration,
                    "actors": args.actors,
                    "shape": args.shape,
                    "run_prefix": plan.run_prefix,
                    "seed": args.seed,
                },
            )
            print(
                f"load: {args.users} users ({args.profile}) for {duration:.0f}s at {target_url}; journal in {out}",
                file=sys.stderr,
                flush=True,
            )
            outcome = run_load(plan, out, journal, ray_address=args.ray_address, progress=terminal_progress(duration))
            if sys.stdout.isatty():
                print()
            result = summary(compute(journal.iter_requests()), outcome)
        write_summary(out, result)
        print(json.dumps(result), flush=True)
        return ExitCode.INTERRUPTED if outcome.interrupted else ExitCode.PASS
    finally:
        if stack is not None:
            stack.down()
