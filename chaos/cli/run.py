"""`pdchaos run CAMPAIGN` and `pdchaos schema`."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from chaos.campaign import Campaign, json_schema
from chaos.campaign_validation import load_campaign, parse_campaign
from chaos.cli.access import access_overrides, add_access_arguments
from chaos.cli.command import Subcommands
from chaos.errors import UsageError
from chaos.exit_codes import ExitCode


def register(commands: Subcommands) -> None:
    run = commands.add_parser(
        "run",
        help=(
            f"qualify a deployment with a campaign; exit {ExitCode.PASS} PASS, {ExitCode.FAIL} FAIL, "
            f"{ExitCode.USAGE} usage, {ExitCode.INCONCLUSIVE} INCONCLUSIVE"
        ),
    )
    run.add_argument("campaign", type=Path, help="campaign YAML (see campaigns/ and `pdchaos schema`)")
    run.add_argument("--out", type=Path, default=None, help="run directory (default: runs/<campaign>-<time>)")
    run.add_argument("--seed", type=int, default=None, help="override the campaign's seed")
    run.add_argument(
        "--ray-address",
        default=None,
        help=(
            "join this Ray cluster: prefill and decode start on the nodes offering the pdchaos_prefill and "
            "pdchaos_decode resources, load actors on pdchaos_load nodes (docs/real-sglang.md)"
        ),
    )
    run.add_argument(
        "--defect",
        action="append",
        default=None,
        metavar="NAME",
        help="embedded engine only: turn on this defect (repeat; replaces the campaign's list)",
    )
    run.add_argument("--quiet", action="store_true", help="no progress lines")
    run.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (verdict, exit_code, run_dir, reasons, report) and nothing else on stdout",
    )
    run.add_argument(
        "--explore",
        type=int,
        default=None,
        metavar="N",
        help=(
            "run N seeded random schedules drawn from the campaign's fault windows, stop at the first FAIL and "
            f"shrink it to a minimal OUT/reproduce.yaml (exit {ExitCode.FAIL} when one failed, {ExitCode.INCONCLUSIVE} "
            f"when none failed but one was inconclusive, {ExitCode.PASS} when all passed)"
        ),
    )
    add_access_arguments(run)
    run.set_defaults(handler=run_campaign)
    schema = commands.add_parser("schema", help="print the campaign JSON Schema")
    schema.set_defaults(handler=print_schema)


def run_campaign(args: argparse.Namespace) -> int:
    campaign = load_campaign(args.campaign)
    overrides: dict[str, Any] = campaign.model_dump(mode="json")
    if args.seed is not None:
        overrides["seed"] = args.seed
    if args.defect is not None:
        if campaign.target.kind != "sim":
            raise UsageError(
                f"--defect: {args.campaign} targets {campaign.target.kind}; defects are switches of the "
                "embedded engine (target.kind: sim)"
            )
        overrides["target"]["sim"]["defects"] = list(args.defect)
    overrides["target"].update(access_overrides(args))
    campaign = parse_campaign(overrides, str(args.campaign))
    out = args.out or Path("runs") / f"{campaign.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    from chaos.runner import Runner  # with Ray and the load machinery: only once a run starts, so --help stays quick

    if args.explore is not None:
        return _explore(campaign, args, out)
    outcome = Runner(campaign, out, ray_address=args.ray_address, progress=not (args.quiet or args.json)).run()
    if args.json:
        print(
            json.dumps(
                {
                    "verdict": outcome.verdict.value,
                    "exit_code": outcome.exit_code,
                    "run_dir": str(out),
                    "reasons": outcome.reasons,
                    "report": str(out / "report.html"),
                }
            ),
            flush=True,
        )
        return outcome.exit_code
    print(f"verdict: {outcome.verdict.value} (exit {outcome.exit_code})")
    for reason in outcome.reasons[:15]:
        print(f"  - {reason}")
    print(f"report: {out / 'report.html'}")
    return outcome.exit_code


def print_schema(_: argparse.Namespace) -> int:
    print(json.dumps(json_schema(), indent=2))
    return ExitCode.PASS


def _explore(campaign: Campaign, args: argparse.Namespace, out: Path) -> int:
    from chaos.explore import explore
    from chaos.runner import Runner

    if args.explore < 1:
        raise UsageError(f"--explore {args.explore}: give the number of schedules to try (at least 1)")
    say = (lambda _: None) if args.quiet or args.json else (lambda text: print(f"[explore] {text}", flush=True))
    verdict, reproduce = explore(
        campaign,
        args.explore,
        out,
        lambda c, d: Runner(c, d, ray_address=args.ray_address, progress=False).run().verdict,
        say,
    )
    if args.json:
        print(
            json.dumps(
                {
                    "verdict": verdict.value,
                    "exit_code": verdict.exit_code,
                    "run_dir": str(out),
                    "reproduce": None if reproduce is None else str(reproduce),
                    "attempts": str(out / "explore.json"),
                }
            ),
            flush=True,
        )
        return verdict.exit_code
    print(f"verdict: {verdict.value} (exit {verdict.exit_code})")
    if reproduce is not None:
        print(f"reproduce: {reproduce}")
    print(f"attempts: {out / 'explore.json'}")
    return verdict.exit_code
