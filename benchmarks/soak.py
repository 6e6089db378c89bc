"""Soak: does the suite itself hold up over an hour of load? Memory, file descriptors, journal lag.

Runs `pdchaos run campaigns/soak.yaml` (steady canary load on the embedded engine, a fault window
every six minutes) and, every `--interval` seconds, samples from /proc:

- the resident memory of each part of the run, by process: the driver (`pdchaos run`), the Ray
  load actors (`ray::…` workers), the Locust processes, Ray's own daemons, and the engine stack
  (prefill, decode, router, fault proxies; the target's, reported but not judged);
- the driver's open file descriptors and threads;
- the journal's lag: Locust's records on disk (`load/actor-*/records.jsonl`, one line each) minus
  the load requests in `journal.sqlite` (read-only; WAL lets it read while the run writes).

Then it checks what a soak must show (exit 1 when one fails, with the reason):

- flat memory: for the driver, the load actors and Locust, the median of the last quarter of the
  load is within `--max-growth` (10 %) of the median of its second quarter (the first is warm-up);
- no descriptor leak: the driver's descriptors in the last quarter exceed the second quarter's
  most by at most `--fd-slack`;
- the journal keeps up: its lag in the last quarter is no larger than in the second quarter plus
  one flush's worth, and at the end every record Locust wrote is in the journal;
- nothing is left: every process the run started (engine, Ray, Locust) has exited 30 s after it;
- the run's own verdict is PASS (the clean engine).

    .venv/bin/python benchmarks/soak.py                                  # the hour
    .venv/bin/python benchmarks/soak.py --duration 90s --interval 2      # CI's short version

The record (every sample, the summary, the machine's load average) goes to `--json` (default
`benchmarks/results/soak/soak-<duration>.json`); docs/performance.md quotes the hour's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml

from chaos.journal import EventKind, Journal, JournalError

ROOT = Path(__file__).resolve().parent.parent
SOAK_CAMPAIGN = ROOT / "campaigns" / "soak.yaml"
RESULTS = ROOT / "benchmarks" / "results" / "soak"
JUDGED = ("driver", "load_actors", "locust")  # the suite's own processes; the engine is the target's
GROUPS = (*JUDGED, "ray", "engine")
WINDOW_TAIL_S = 30.0  # a window must end this long before the load does to stay in a shortened soak


@dataclass
class Sample:
    t: float  # seconds since the driver started
    rss_mb: dict[str, float]
    processes: dict[str, int]
    driver_fds: int
    driver_threads: int
    locust_records: int
    journaled: int

    @property
    def lag(self) -> int:
        return self.locust_records - self.journaled


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class SoakResult:
    campaign: str
    duration_s: float
    interval_s: float
    windows: list[str]
    exit_code: int | None = None
    verdict: str | None = None
    load_started_at_s: float | None = None  # since the driver started
    load_ended_at_s: float | None = None
    locust_requests: int | None = None
    journaled_requests: int | None = None
    left_behind: list[str] = field(default_factory=list)  # processes of the run alive after it ended
    checks: list[Check] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    loadavg: list[list[float]] = field(default_factory=list)  # at the start and at the end

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)


# ------------------------------------------------------------------------------- the campaign ----


def parse_duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    text = text.strip()
    if text[-1:] in units:
        return float(text[:-1]) * units[text[-1]]
    return float(text)


def shortened(campaign: dict[str, Any], duration_s: float) -> tuple[dict[str, Any], list[str]]:
    """The campaign with `duration_s` of load and only the windows that end `WINDOW_TAIL_S` before it."""
    spec = copy.deepcopy(campaign)
    spec["load"]["duration"] = f"{duration_s:g}s"
    kept = [
        w
        for w in spec["faults"]["windows"]
        if parse_duration(str(w["at"])) + parse_duration(str(w["duration"])) + WINDOW_TAIL_S <= duration_s
    ]
    spec["faults"]["windows"] = kept
    return spec, [f"{w['fault']}@{w['at']}" for w in kept]


# --------------------------------------------------------------------------------- sampling ----


def group_of(proc: psutil.Process, driver_pid: int) -> str:
    if proc.pid == driver_pid:
        return "driver"
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "engine"
    if cmd.startswith("ray::"):
        return "load_actors"  # a Ray worker process: the load actors (and the idle workers Ray keeps)
    if "-m locust" in cmd:
        return "locust"
    if any(name in cmd for name in ("gcs_server", "raylet", "/ray/", "ray/_private", "ray.util")):
        return "ray"
    return "engine"


class LineCounter:
    """Counts the lines appended to a set of files, reading each byte once."""

    def __init__(self) -> None:
        self.offsets: dict[Path, int] = {}
        self.lines = 0

    def update(self, paths: list[Path]) -> int:
        for path in paths:
            offset = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            self.offsets[path] = offset + len(chunk)
            self.lines += chunk.count(b"\n")
        return self.lines


def journaled_load_requests(run_dir: Path) -> int:
    """The load's requests in the journal now (Locust's, not the probes': `Journal.count_requests`
    counts both), read beside the writer; -1 while the file is being created."""
    path = run_dir / "journal.sqlite"
    if not path.exists():
        return 0
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
        try:
            return int(db.execute("SELECT count(*) FROM requests WHERE actor LIKE 'actor%'").fetchone()[0])
        finally:
            db.close()
    except sqlite3.Error:
        return -1  # not readable this instant (the schema is being created): skipped by the checks


def sample(
    driver: psutil.Process, run_dir: Path, counter: LineCounter, t0: float, seen: dict[int, psutil.Process]
) -> Sample:
    """One reading; every process of the run goes into `seen`, to be found gone at the end."""
    rss = dict.fromkeys(GROUPS, 0.0)
    count = dict.fromkeys(GROUPS, 0)
    for proc in [driver, *driver.children(recursive=True)]:
        seen.setdefault(proc.pid, proc)
        try:
            mb = proc.memory_info().rss / 1e6
        except psutil.Error:
            continue
        group = group_of(proc, driver.pid)
        rss[group] += mb
        count[group] += 1
    try:
        fds, threads = driver.num_fds(), driver.num_threads()
    except psutil.Error:
        fds, threads = -1, -1
    records = counter.update(sorted((run_dir / "load").glob("actor-*/records.jsonl")))
    return Sample(
        round(time.monotonic() - t0, 2),
        {g: round(v, 1) for g, v in rss.items()},
        count,
        fds,
        threads,
        records,
        journaled_load_requests(run_dir),
    )


def read_load_phase(run_dir: Path, driver_started: float, result: SoakResult) -> None:
    """From the journal once the run is over: when the load started and ended (seconds since the
    driver started), and Locust's own request count against the journal's (the `load:end` event)."""
    try:
        with Journal.open(run_dir, readonly=True) as journal:
            started = journal.get_meta("load_started_at")
            end = next(journal.iter_events(kind=EventKind.PHASE, name="load:end"), None)
    except (FileNotFoundError, JournalError):
        return
    if started is not None:
        result.load_started_at_s = float(started) - driver_started
    if end is not None:
        result.load_ended_at_s = end.t - driver_started
        result.locust_requests, result.journaled_requests = end.data.get("locust_requests"), end.data.get("journaled")


# ----------------------------------------------------------------------------------- checks ----

LEFT_BEHIND_WAIT_S = 30.0  # Ray's workers and daemons take a few seconds to go after the driver
FLUSH_WORTH = 256  # records: chaos.journal's flush_every, what one commit may still hold back


def quarters(result: SoakResult) -> tuple[list[Sample], list[Sample]]:
    """The samples of the load's second quarter and of its last."""
    start, end = result.load_started_at_s, result.load_ended_at_s
    if start is None or end is None or end <= start:
        return [], []
    span = end - start
    second = [s for s in result.samples if start + span / 4 <= s.t < start + span / 2]
    last = [s for s in result.samples if start + 3 * span / 4 <= s.t <= end]
    return second, last


def judge(result: SoakResult, max_growth: float, fd_slack: int) -> list[Check]:
    checks = [
        Check("verdict", result.verdict == "PASS", f"the run's verdict: {result.verdict} (exit {result.exit_code})")
    ]
    second, last = quarters(result)
    if len(second) < 2 or len(last) < 2:
        checks.append(
            Check(
                "samples",
                False,
                f"{len(second)} and {len(last)} samples in the second and last quarters: too few to judge (a shorter --interval)",
            )
        )
        return checks
    for group in JUDGED:
        before = statistics.median(s.rss_mb[group] for s in second)
        after = statistics.median(s.rss_mb[group] for s in last)
        if before <= 0:
            checks.append(Check(f"memory:{group}", False, f"no {group} process seen in the second quarter"))
            continue
        growth = after / before - 1
        checks.append(
            Check(
                f"memory:{group}",
                growth <= max_growth,
                f"{before:.0f} MB -> {after:.0f} MB (median of the second quarter -> of the last): {growth:+.1%}, at most {max_growth:+.0%}",
            )
        )
    fds_before = max(s.driver_fds for s in second)
    fds_after = max(s.driver_fds for s in last)
    checks.append(
        Check(
            "driver_fds",
            fds_after <= fds_before + fd_slack,
            f"most open descriptors {fds_before} -> {fds_after} (slack {fd_slack})",
        )
    )
    lag_before = max(s.lag for s in second if s.journaled >= 0)
    lag_after = max(s.lag for s in last if s.journaled >= 0)
    checks.append(
        Check(
            "journal_lag",
            lag_after <= lag_before + FLUSH_WORTH,
            f"most records not yet journaled {lag_before} -> {lag_after} (one flush: {FLUSH_WORTH})",
        )
    )
    checks.append(
        Check(
            "nothing_left",
            not result.left_behind,
            "every process the run started exited"
            if not result.left_behind
            else f"alive {LEFT_BEHIND_WAIT_S:g} s after the run: {'; '.join(result.left_behind)}",
        )
    )
    complete = result.locust_requests is not None and result.locust_requests == result.journaled_requests
    checks.append(
        Check(
            "journal_complete",
            complete,
            f"Locust counted {result.locust_requests}, the journal holds {result.journaled_requests}",
        )
    )
    return checks


# ------------------------------------------------------------------------------------- main ----


def run(campaign_path: Path, duration_s: float | None, interval_s: float, out: Path) -> SoakResult:
    spec = yaml.safe_load(campaign_path.read_text())
    windows = [f"{w['fault']}@{w['at']}" for w in spec["faults"]["windows"]]
    if duration_s is not None:
        spec, windows = shortened(spec, duration_s)
    out.mkdir(parents=True, exist_ok=True)
    campaign = out / "campaign.yaml"
    campaign.write_text(yaml.safe_dump(spec, sort_keys=False))
    run_dir = out / "run"
    result = SoakResult(
        str(campaign_path.relative_to(ROOT)), parse_duration(str(spec["load"]["duration"])), interval_s, windows
    )
    result.loadavg.append(list(os.getloadavg()))
    started = time.time()
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos.cli", "run", str(campaign), "--out", str(run_dir), "--quiet", "--json"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )

    def forward(signum: int, _: object) -> None:  # the driver heals and reports on SIGINT
        proc.send_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, forward), signal.signal(signal.SIGTERM, forward)
    try:
        driver = psutil.Process(proc.pid)
        counter = LineCounter()
        seen: dict[int, psutil.Process] = {}
        while proc.poll() is None:
            try:
                result.samples.append(sample(driver, run_dir, counter, t0, seen))
            except psutil.NoSuchProcess:
                break
            deadline = time.monotonic() + interval_s
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(min(0.2, interval_s))
        stdout, _ = proc.communicate()
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
    result.exit_code = proc.returncode
    result.left_behind = left_behind(seen.values())
    try:
        result.verdict = json.loads(stdout)["verdict"]
    except (ValueError, KeyError, TypeError):
        result.verdict = None
    read_load_phase(run_dir, started, result)
    result.loadavg.append(list(os.getloadavg()))
    return result


def still_running(processes: Iterable[psutil.Process]) -> list[str]:
    """`pid command` of each of `processes` that still runs: a zombie has exited, and a pid reused
    since names another process (psutil compares start times)."""
    running = []
    for proc in processes:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                running.append(f"{proc.pid} {' '.join(proc.cmdline())[:100]}")
        except psutil.Error:
            continue
    return running


def left_behind(processes: Iterable[psutil.Process], wait_s: float = LEFT_BEHIND_WAIT_S) -> list[str]:
    """The processes still running `wait_s` after the driver exited."""
    deadline = time.monotonic() + wait_s
    while (found := still_running(processes)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return found


def render(result: SoakResult) -> str:
    lines = [
        f"soak: {result.campaign}, {result.duration_s:g} s of load, windows {', '.join(result.windows) or 'none'}",
        f"  verdict {result.verdict}, {len(result.samples)} samples every {result.interval_s:g} s, load average {result.loadavg}",
    ]
    for check in result.checks:
        lines.append(f"  {'ok  ' if check.ok else 'FAIL'} {check.name}: {check.detail}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--campaign", type=Path, default=SOAK_CAMPAIGN)
    parser.add_argument("--duration", help="shorten the load (e.g. 90s, 10m); windows that no longer fit are dropped")
    parser.add_argument("--interval", type=float, default=15.0, help="seconds between samples (default 15)")
    parser.add_argument(
        "--max-growth", type=float, default=0.10, help="most memory growth, last quarter over second (0.10)"
    )
    parser.add_argument(
        "--fd-slack", type=int, default=10, help="most extra descriptors the driver may hold at the end (10)"
    )
    parser.add_argument("--out", type=Path, help="where the run goes (default runs/soak-<time>)")
    parser.add_argument("--json", type=Path, help="the record (default benchmarks/results/soak/soak-<duration>.json)")
    args = parser.parse_args(argv)
    duration_s = parse_duration(args.duration) if args.duration else None
    out = args.out or ROOT / "runs" / time.strftime("soak-%Y%m%dT%H%MZ", time.gmtime())
    result = run(args.campaign.resolve(), duration_s, args.interval, out)
    result.checks = judge(result, args.max_growth, args.fd_slack)
    record = args.json or RESULTS / f"soak-{result.duration_s:g}s.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    where = out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out
    record.write_text(json.dumps({**asdict(result), "ok": result.ok, "run_dir": str(where)}, indent=1) + "\n")
    print(render(result))
    print(f"  record: {record}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
