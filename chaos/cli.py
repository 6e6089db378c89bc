"""The `pdchaos` command line.

Each command lives in its own module and exposes `register(subparsers)`, which adds its parser and
sets `handler` to a function taking the parsed namespace and returning the exit code. This module
only assembles them, so a new command never touches another command's code.

Exit codes follow README.md: 0 PASS/ok, 1 FAIL, 2 usage or configuration error, 3 INCONCLUSIVE.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from chaos import __version__
from chaos.errors import TargetError, UsageError

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    from chaos import cli_canary, cli_heal, cli_load, cli_plan, cli_preflight, cli_report, cli_run, cli_sim

    parser = argparse.ArgumentParser(
        prog="pdchaos",
        description="Fault-injection qualification for prefill/decode disaggregated LLM serving.",
    )
    parser.add_argument("--version", action="version", version=f"pdchaos {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    for module in (cli_run, cli_plan, cli_report, cli_sim, cli_load, cli_preflight, cli_canary, cli_heal):
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except UsageError as exc:
        print(f"pdchaos: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except TargetError as exc:  # the target could not be started or reached: a setup problem
        print(f"pdchaos: target error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `pdchaos ... | head`: the reader left, nothing is wrong
        return 0


if __name__ == "__main__":
    sys.exit(main())
