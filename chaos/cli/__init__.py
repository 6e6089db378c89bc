"""The `pdchaos` command line (`python -m chaos.cli` runs it too).

Each command lives in its own module, whose `register(commands)` adds its parser and handler
(`chaos.cli.command`). This module only assembles them, so a new command never touches another
command's code. Exit codes are `chaos.exit_codes.ExitCode`, listed at the end of `pdchaos --help`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from chaos import __version__
from chaos.cli import canary, heal, load, plan, preflight, report, run, sim
from chaos.cli.command import call_handler
from chaos.exit_codes import table as exit_code_table

# The order of `pdchaos --help`.
COMMANDS = (run, plan, report, sim, load, preflight, canary, heal)


class _TableEpilogFormatter(argparse.HelpFormatter):
    """Wraps one-paragraph text as argparse does; keeps text of several lines (a table) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" not in text:
            return super()._fill_text(text, width, indent)
        return "\n".join(indent + line for line in text.splitlines())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdchaos",
        description="Fault-injection qualification for prefill/decode disaggregated LLM serving.",
        epilog=f"exit codes (what each command counts as wrong: docs/ci.md):\n{exit_code_table()}",
        formatter_class=_TableEpilogFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pdchaos {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    for module in COMMANDS:
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return call_handler(build_parser().parse_args(argv))
