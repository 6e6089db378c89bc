"""Reports at scale: `pdchaos report` on journals of growing size, side by side in one run.

A 10-minute run at 1,000 requests/s journals 600,000 requests. This writes synthetic run journals
with the same tables a real run writes (requests with canary markers and per-token times, fault
windows, probe snapshots, oracle results and a verdict: `tests/run_fixtures.write_large_run`), at
each size asked for, then times `pdchaos report RUN_DIR` on each as a child process and reads the
child's peak resident memory. It prints a table and writes JSON (`--json`): per size the journal's
bytes, the report's wall time and peak memory, the size of every file it wrote, and the cost per
request relative to the smallest size (1.0 when the report scales linearly).

    .venv/bin/python benchmarks/report_scale.py                      # 50,000 and 1,000,000 requests
    .venv/bin/python benchmarks/report_scale.py --sizes 20000 --json /tmp/scale.json

The journals go under `--work` (default: a temporary directory, removed afterwards); a 1M-request
journal is about 1.5 GB. Writing it takes longer than reporting on it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests/run_fixtures.py: the realistic journal writer the report tests use

from tests.run_fixtures import write_large_run  # noqa: E402

DEFAULT_SIZES = (50_000, 1_000_000)
REPORT_FILES = ("report.html", "report.json", "junit.xml", "summary.md", "reproduce.yaml")
# `pdchaos report` in a child that prints its own peak resident memory (kB) last, on stderr. VmHWM,
# not getrusage: Linux carries a process's ru_maxrss across exec, so a child forked from this
# process (which just wrote a big journal) would report this process's peak.
CHILD = (
    "import re, sys\nfrom chaos.cli import main\ncode = main(sys.argv[1:])\n"
    "status = open('/proc/self/status').read()\n"
    "print(re.search(r'VmHWM:\\s+(\\d+)', status).group(1), file=sys.stderr)\nsys.exit(code)"
)


def measure(size: int, work: Path) -> dict[str, Any]:
    run_dir = work / f"run-{size}"
    started = time.perf_counter()
    write_large_run(run_dir, requests=size)
    written_s = time.perf_counter() - started
    journal_bytes = sum(p.stat().st_size for p in run_dir.glob("journal.sqlite*"))
    out = work / f"report-{size}"
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", CHILD, "report", str(run_dir), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    wall_s = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"pdchaos report failed on {size} requests:\n{result.stdout}\n{result.stderr}")
    return {
        "requests": size,
        "journal_bytes": journal_bytes,
        "journal_write_s": round(written_s, 2),
        "report_wall_s": round(wall_s, 2),
        "report_peak_rss_mb": round(int(result.stderr.strip().splitlines()[-1]) / 1024, 1),
        "files_bytes": {name: (out / name).stat().st_size for name in REPORT_FILES if (out / name).exists()},
        "verdict_line": next((line for line in result.stdout.splitlines() if "(exit code" in line), ""),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        default=",".join(str(s) for s in DEFAULT_SIZES),
        help="journal sizes in requests, comma-separated (default %(default)s)",
    )
    parser.add_argument("--work", type=Path, help="where the journals go (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes.split(","))
    with tempfile.TemporaryDirectory(prefix="pdchaos-report-scale-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rows = [measure(size, work) for size in sizes]
    base = rows[0]
    for row in rows:
        row["per_request_vs_smallest"] = round(
            (row["report_wall_s"] / row["requests"]) / (base["report_wall_s"] / base["requests"]), 2
        )
    print("| requests | journal | report wall | peak memory | report.html | per request vs smallest |")
    print("|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        html = row["files_bytes"].get("report.html", 0)
        print(
            f"| {row['requests']:,} | {row['journal_bytes'] / 2**20:,.0f} MiB | {row['report_wall_s']:.1f} s | "
            f"{row['report_peak_rss_mb']} MiB | {html / 2**10:,.0f} KiB | {row['per_request_vs_smallest']}x |"
        )
    summary = {
        "rows": rows,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.platform(),
        "loadavg_end": os.getloadavg()[0],
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
