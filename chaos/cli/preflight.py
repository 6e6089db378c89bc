"""``pdchaos preflight``: is every node's KV pool at least its context length?

Reads node logs (``--log``) and/or live workers (``--url``), prints one row per node with its pool,
context length, ratio and OK / FAIL / UNKNOWN, and exits 0 only when every node is OK. The rules
live in `chaos.preflight`; this module only turns arguments into `PreflightInputs` and prints.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from chaos import transport
from chaos.cli.access import add_access_arguments, configure_from_args
from chaos.cli.command import Subcommands
from chaos.errors import UsageError
from chaos.exit_codes import ExitCode
from chaos.preflight import DEFAULT_TIMEOUT_S, PreflightInputs, format_report, run_preflight

_NAME = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]*)=(.+)")


def register(commands: Subcommands) -> None:
    """Add the ``preflight`` subcommand; its ``handler`` returns the exit code."""
    parser = commands.add_parser(
        "preflight",
        help="check every node's KV pool against its context length",
        description=(
            "Compare each prefill/decode node's KV pool (max_total_num_tokens) with its context "
            "length. A pool smaller than the context length is the configuration behind the KV "
            "leak incident. Exit 0 only when every node is OK; UNKNOWN is not OK."
        ),
        epilog=(
            "A node may be named: --log prefill-0=/var/log/prefill.log, "
            f"--url decode-0=http://10.0.0.2:30000. Exit codes: {ExitCode.PASS} all OK, {ExitCode.FAIL} any FAIL or "
            f"UNKNOWN, {ExitCode.USAGE} usage error."
        ),
    )
    parser.add_argument(
        "--log",
        dest="logs",
        metavar="FILE",
        nargs="+",
        action="extend",
        default=[],
        help="a node's SGLang log (one file per node; several ranks and restarts are fine; .gz ok)",
    )
    parser.add_argument(
        "--url",
        dest="urls",
        metavar="URL",
        nargs="+",
        action="extend",
        default=[],
        help="a live worker's base URL; reads /server_info, /v1/models and /metrics",
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"per-request HTTP timeout for --url (default {DEFAULT_TIMEOUT_S:g})",
    )
    add_access_arguments(parser)
    parser.set_defaults(handler=run_preflight_command)


def _split_name(arg: str) -> tuple[str | None, str]:
    match = _NAME.fullmatch(arg)
    if match is None:
        return None, arg
    return match.group(1), match.group(2)


def _log_input(arg: str) -> tuple[str, Path]:
    name, value = (None, arg) if Path(arg).exists() else _split_name(arg)
    path = Path(value)
    if not path.exists():
        raise UsageError(
            f"--log {arg}: no such file. Pass the path of a node's SGLang log (the file its "
            f"stdout/stderr went to), optionally as NAME=PATH."
        )
    if not path.is_file():
        raise UsageError(f"--log {arg}: not a regular file. Pass a log file, not a directory.")
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise UsageError(f"--log {arg}: cannot be read ({exc.strerror}). Check its permissions.") from None
    return name or value, path


def _url_input(arg: str) -> tuple[str, str]:
    name, value = _split_name(arg)
    if not re.match(r"https?://[^/\s]+", value):
        raise UsageError(
            f"--url {arg}: not an http(s) URL. Give a worker's base URL, e.g. "
            f"--url http://127.0.0.1:30000 (optionally as NAME=URL)."
        )
    return name or value, value.rstrip("/")


def resolve_inputs(args: argparse.Namespace) -> PreflightInputs:
    """Turn the parsed arguments into `PreflightInputs`.

    Seam for the campaign form: a future ``--campaign FILE`` resolves the campaign's target into
    the same `PreflightInputs` (its workers' URLs and captured log paths) and adds them here.
    """
    inputs = PreflightInputs(
        logs=[_log_input(arg) for arg in args.logs],
        urls=[_url_input(arg) for arg in args.urls],
    )
    if inputs.empty:
        raise UsageError(
            "nothing to check: give at least one --log FILE (a node's SGLang log) or --url URL "
            "(a live worker, e.g. --url http://127.0.0.1:30000)."
        )
    return inputs


def run_preflight_command(args: argparse.Namespace) -> int:
    """Handler: 0 when every node is OK, 1 when any is FAIL or UNKNOWN (usage errors raise)."""
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g}: must be a positive number of seconds.")
    inputs = resolve_inputs(args)
    configure_from_args(args)
    for _, url in inputs.urls:
        transport.check_access(url)
    report = run_preflight(inputs, timeout=args.timeout)
    if args.json:
        sys.stdout.write(report.to_json() + "\n")
    else:
        sys.stdout.write(format_report(report))
    return report.exit_code
