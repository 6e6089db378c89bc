"""`pdchaos report RUN_DIR` and `pdchaos compare BASE_RUN CANDIDATE_RUN`.

`report` re-renders a run's reports from its journal (a crashed or still-running run too). It
exits 0 once the files are written, 1 when a renderer failed; with `--exit-code` it exits with
the run's own verdict code instead (0 PASS, 1 FAIL, 3 INCONCLUSIVE), for CI jobs that only have
the run dir.

`compare` exits 1 when the candidate regressed, 3 when it cannot be shown not to have (see
reports/compare.py for the rules), 0 otherwise. A missing journal is a usage error (2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from chaos.cli.command import Subcommands
from chaos.errors import UsageError
from chaos.exit_codes import ExitCode
from reports.formats import FILENAMES

# The renderers (and numpy) are imported by the handlers, so building the parser stays cheap.


def register(commands: Subcommands) -> None:
    report = commands.add_parser(
        "report", help="render a run's reports (HTML, JUnit, JSON, Markdown, reproduce.yaml) from its journal"
    )
    report.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    report.add_argument(
        "--format",
        dest="formats",
        action="append",
        choices=sorted(FILENAMES),
        metavar="FORMAT",
        help=f"render only this format (repeatable; {', '.join(FILENAMES)}); default: the campaign's report.formats",
    )
    report.add_argument("--out", type=Path, default=None, help="write the files here instead of RUN_DIR")
    report.add_argument("--exit-code", action="store_true", help="exit with the run's verdict code instead of 0")
    report.add_argument(
        "--json", action="store_true", help="print one JSON object (verdict, exit_code, reasons, files)"
    )
    report.set_defaults(handler=run_report)

    compare = commands.add_parser("compare", help="engine-upgrade regression: compare a candidate run with a base run")
    compare.add_argument("base", type=Path, metavar="BASE_RUN")
    compare.add_argument("candidate", type=Path, metavar="CANDIDATE_RUN")
    compare.add_argument(
        "--out", type=Path, default=None, help="where compare.html/.md/.json go (default: CANDIDATE_RUN)"
    )
    compare.add_argument(
        "--json", action="store_true", help="print one JSON object (outcome, exit_code, regressions, unproven, files)"
    )
    compare.add_argument(
        "--max-latency-ratio",
        type=float,
        default=None,
        help="TTFT p50/p99 or ITL p99 under faults growing by this factor is a regression (default 2; 0: off)",
    )
    compare.set_defaults(handler=run_compare)


def _journal_or_usage(run_dir: Path) -> None:
    if not (run_dir / "journal.sqlite").is_file() and not (run_dir.is_file() and run_dir.name.endswith(".sqlite")):
        raise UsageError(f"{run_dir}: no journal.sqlite here; pass a pdchaos run directory")


def run_report(args: argparse.Namespace) -> int:
    from reports.render import RenderError, render_all

    _journal_or_usage(args.run_dir)
    try:
        rendered = render_all(args.run_dir, args.formats, out_dir=args.out)
    except RenderError as exc:
        print(f"pdchaos: error: {exc}", file=sys.stderr)
        return ExitCode.FAIL
    report = rendered.report
    if args.json:
        print(
            json.dumps(
                {
                    "verdict": report.verdict_label,
                    "exit_code": report.exit_code,
                    "campaign": report.campaign_name,
                    "seed": report.seed,
                    "reasons": list(report.reasons),
                    "files": {name: str(path) for name, path in rendered.paths.items()},
                }
            )
        )
        return report.exit_code if args.exit_code else ExitCode.PASS
    print(f"{report.verdict_label} (exit code {report.exit_code}): {report.campaign_name}, seed {report.seed}")
    for reason in report.reasons[:5]:
        print(f"  {reason}")
    for path in rendered.paths.values():
        print(f"wrote {path}")
    return report.exit_code if args.exit_code else ExitCode.PASS


def run_compare(args: argparse.Namespace) -> int:
    from reports.compare import DEFAULT_MAX_LATENCY_RATIO, compare_runs
    from reports.compare_render import write_comparison
    from reports.model import load_run

    ratio = DEFAULT_MAX_LATENCY_RATIO if args.max_latency_ratio is None else args.max_latency_ratio
    if ratio < 0:
        raise UsageError("--max-latency-ratio must be 0 (off) or positive")
    for run_dir in (args.base, args.candidate):
        _journal_or_usage(run_dir)
    comparison = compare_runs(load_run(args.base), load_run(args.candidate), ratio)
    paths = write_comparison(comparison, args.out or args.candidate)
    if args.json:
        print(
            json.dumps(
                {
                    "outcome": comparison.outcome,
                    "exit_code": comparison.exit_code,
                    "base": str(args.base),
                    "candidate": str(args.candidate),
                    "regressions": list(comparison.regressions),
                    "unproven": list(comparison.unproven),
                    "files": {name: str(path) for name, path in paths.items()},
                }
            )
        )
        return comparison.exit_code
    print(f"{comparison.outcome} (exit code {comparison.exit_code}): {args.candidate} vs {args.base}")
    for line in comparison.regressions or comparison.unproven:
        print(f"  {line}")
    for path in paths.values():
        print(f"wrote {path}")
    return comparison.exit_code
