"""``pdchaos canary``: over-length prompts must be rejected with a 4xx and leak nothing.

Sends victim traffic carrying unique markers, then over-length probes (just over the KV pool, just
over the context length, inside SGLang's band ``[max_req_input_len, context_length)``, or the sizes
``--max-tokens-probe`` gives) on every route, streaming and not, and checks that every probe was
rejected with a 4xx and that no reply carries another request's marker. The logic lives in
`chaos.canary`; this module turns arguments into a `CanaryConfig` and prints.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence

from chaos import transport
from chaos.canary.render import format_report
from chaos.canary.run import CanaryConfig, run_canary
from chaos.canary.target import DEFAULT_TIMEOUT_S
from chaos.cli.access import add_access_arguments, configure_from_args
from chaos.cli.command import Subcommands, call_handler
from chaos.errors import UsageError
from chaos.exit_codes import ExitCode

_URL = re.compile(r"https?://[^/\s:]+(:\d{1,5})?(/\S*)?")


def register(commands: Subcommands) -> None:
    """Add the ``canary`` subcommand; its ``handler`` returns the exit code."""
    parser = commands.add_parser(
        "canary",
        help="send over-length canary prompts: each must get a 4xx and leak no other request's data",
        description=(
            "Send victim requests that carry unique markers, then over-length probes at several "
            "sizes (just over the KV pool, just over the context length, inside the band where "
            "only SGLang's scheduler rejects) on /v1/chat/completions, /v1/completions and, on "
            "SGLang targets, /generate, each streaming and not. Every probe must be rejected with "
            "a 4xx, and no reply may carry another request's marker. Works against any "
            "OpenAI-compatible endpoint (router, SGLang worker, vLLM)."
        ),
        epilog=(
            "A streamed probe answered 200 counts as rejected only when no content was streamed "
            "and the stream carries an error stating a 4xx (SGLang aborts in-stream). "
            f"Exit codes: {ExitCode.PASS} pass, {ExitCode.FAIL} fail (a probe not rejected with a 4xx, or a leaked "
            f"marker), {ExitCode.USAGE} usage error (bad or unreachable --url, nothing to size the probes by), "
            f"{ExitCode.INCONCLUSIVE} inconclusive (a probe undershot or got 401/403/404/405/408/429, victims failed)."
        ),
    )
    parser.add_argument(
        "--url",
        required=True,
        metavar="BASE",
        help="the target's base URL, e.g. http://127.0.0.1:30000 (router or worker; a trailing /v1 is dropped)",
    )
    parser.add_argument("--model", default=None, help="model name to send (default: the first model /v1/models lists)")
    parser.add_argument(
        "--max-tokens-probe",
        type=int,
        default=None,
        metavar="N",
        help=(
            "probe N+1 and 2N tokens as well; required when the target reports neither a "
            "context length nor a KV pool size (N: the length it must reject, e.g. its context)"
        ),
    )
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"per-request HTTP timeout (default {DEFAULT_TIMEOUT_S:g})",
    )
    add_access_arguments(parser)
    parser.set_defaults(handler=run_canary_command)


def config_from_args(args: argparse.Namespace) -> CanaryConfig:
    url = (args.url or "").strip()
    if not _URL.fullmatch(url):
        raise UsageError(
            f"--url {args.url!r}: not an http(s) URL. Give the target's base URL, e.g. --url http://127.0.0.1:30000."
        )
    if args.timeout is None or not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout}: must be a positive number of seconds.")
    if args.max_tokens_probe is not None and args.max_tokens_probe < 2:
        raise UsageError(f"--max-tokens-probe {args.max_tokens_probe}: must be at least 2 tokens.")
    url = url.rstrip("/")
    if url.endswith("/v1"):  # an OpenAI client's base URL; the routes carry /v1 themselves
        url = url[: -len("/v1")]
    return CanaryConfig(
        url=url,
        model=args.model or None,
        max_tokens_probe=args.max_tokens_probe,
        timeout_s=args.timeout,
    )


def run_canary_command(args: argparse.Namespace) -> int:
    """Handler: 0 pass, 1 fail, 3 inconclusive (usage errors raise `UsageError`)."""
    config = config_from_args(args)
    configure_from_args(args)
    transport.check_access(config.url)
    report = run_canary(config)
    if args.json:
        sys.stdout.write(report.to_json() + "\n")
    else:
        sys.stdout.write(format_report(report))
    sys.stdout.flush()
    return report.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    """``pdchaos canary`` alone, for a script that runs only this command (``main(["--url", URL])``).

    Its parser holds only this command, so this module needs nothing from the package that
    assembles every command.
    """
    parser = argparse.ArgumentParser(prog="pdchaos")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = list(sys.argv[1:] if argv is None else argv)
    return call_handler(parser.parse_args(args if args[:1] == ["canary"] else ["canary", *args]))
