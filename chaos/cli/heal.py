"""`pdchaos heal RUN_DIR` and `pdchaos faults list`."""

from __future__ import annotations

import argparse
from pathlib import Path

from chaos.cli.command import Subcommands
from chaos.exit_codes import ExitCode
from chaos.heal import heal_run
from faults.registry import FAULTS, describe


def register(commands: Subcommands) -> None:
    heal = commands.add_parser("heal", help="undo any fault an interrupted run left behind and stop its processes")
    heal.add_argument("run_dir", type=Path)
    heal.set_defaults(handler=run_heal)
    faults = commands.add_parser("faults", help="the fault library")
    sub = faults.add_subparsers(dest="faults_command", metavar="SUBCOMMAND")
    sub.required = True
    listing = sub.add_parser("list", help="every fault, its parameters and the targets it supports")
    listing.set_defaults(handler=run_list)


def run_heal(args: argparse.Namespace) -> int:
    report = heal_run(args.run_dir)
    for line in report.done or ["nothing to heal"]:
        print(line)
    for line in report.left:
        print(f"LEFT: {line}")
    return ExitCode.PASS if report.clean else ExitCode.FAIL


def run_list(_: argparse.Namespace) -> int:
    for cls in FAULTS.values():
        print("\n".join(describe(cls)))
    return ExitCode.PASS
