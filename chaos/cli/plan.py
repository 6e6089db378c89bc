"""`pdchaos plan CAMPAIGN`: print every process a campaign's target would start; start nothing."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from chaos.campaign_validation import load_campaign
from chaos.cli.command import Subcommands
from chaos.errors import UsageError
from chaos.exit_codes import ExitCode
from chaos.targets.factory import build_stack
from chaos.targets.nodes import role_resource


def register(commands: Subcommands) -> None:
    plan = commands.add_parser("plan", help="print the exact commands and environment a campaign's target would run")
    plan.add_argument("campaign", type=Path)
    plan.add_argument(
        "--out", type=Path, default=None, help="the run directory the logs would go to (default: a placeholder)"
    )
    plan.add_argument(
        "--ray-address",
        default=None,
        help="show the placement a run with this Ray address would use (nothing is contacted)",
    )
    plan.add_argument("--json", action="store_true", help="one JSON object per process instead of text")
    plan.set_defaults(handler=print_plan)


def _placement(role: str, ray_address: str | None) -> str:
    if ray_address is None:
        return "this machine"
    if role == "router":
        return f"the Ray node offering {role_resource(role)}, else the driver's node"
    return f"the Ray node offering {role_resource(role)}"


def print_plan(args: argparse.Namespace) -> int:
    campaign = load_campaign(args.campaign)
    if campaign.target.kind == "attach":
        raise UsageError(
            f"{args.campaign}: target.kind is attach: pdchaos launches nothing for it "
            f"(it reaches {campaign.target.url})"
        )
    run_dir = args.out or Path(tempfile.gettempdir()) / f"pdchaos-plan-{campaign.name}"
    commands = build_stack(campaign, run_dir).plan()  # ports are picked here, on this machine
    if args.json:
        for c in commands:
            print(
                json.dumps(
                    {
                        "name": c.name,
                        "role": c.role,
                        "placement": _placement(c.role, args.ray_address),
                        "argv": c.argv,
                        "env": c.env,
                        "log": str(c.log_path),
                        "ready_url": c.ready_url,
                    }
                )
            )
        return ExitCode.PASS
    print(f"# campaign {campaign.name}: target {campaign.target.kind}, {len(commands)} process(es), in this order.")
    print("# Nothing was started. Each runs in its own session (setsid); ports were free when this was printed.")
    for c in commands:
        print(f"\n## {c.name} ({_placement(c.role, args.ray_address)})")
        if c.ready_url:
            print(f"# ready when {c.ready_url} answers 200")
        print(f"# log: {c.log_path}")
        print(c.shell())
    return ExitCode.PASS
