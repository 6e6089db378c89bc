"""Detection matrix: which shipped campaign catches each engine defect, how often, and how fast.

For every defect of the embedded engine it runs that defect's campaign (`campaigns/defects/`)
over several seeds, and every campaign used on the clean engine over the same seeds; then it
writes `docs/detection-matrix.md`:

- per defect: the campaign, the oracle(s) that caught it (and how often each did), the detection
  rate over seeds, the median time from load start to the first detection, and the oracles that
  failed besides the intended ones;
- per campaign on the clean engine: the verdicts over seeds and the false positives (runs where
  any oracle FAILed), which must be zero;
- one line per run, with its run directory, so every figure can be checked in its report.

A run counts as a detection when `pdchaos run` ends FAIL and at least one of the defect's intended
oracles is among the failing ones (the rule of tests/test_defects.py). Time to first detection
is read from the journal: over the failing findings of the intended oracles, the earliest
`t_send` of the finding's request (`finding.request_id` looked up in the journal), minus the
meta `load_started_at`. A finding with no request (a page leak seen after the drain, the pool
preflight) counts from the after-drain `/v1/loads` snapshot when there is one, else from the
oracle's verdict event; a page leak seen at an idle moment mid-load counts from that snapshot
(`evidence.t_snapshot`). A time below zero is a detection before the load started: the baseline's
tenant probe. Oracles list only the first findings of each rule (their listing caps), in journal
order, so the earliest listed finding is not always the earliest in the run.

Every finished run also leaves a record: its summary as JSON (a few kB) under `--records`
(default `benchmarks/results/detection-matrix/`, kept in the repository), with the commit and a
digest of the sources that decide the outcome (embedded engine, faults, oracles, load, defect
campaigns).
Records outlive the run directories (a fresh machine has none), so a matrix too long for one
sitting accumulates: `--from-records` summarises them, and the matrix reuses a record of the
current sources instead of running again. Records of other sources are summarised only with
`--any-source` (the doc then lists every digest).

Each run is one `pdchaos run CAMPAIGN --out DIR --quiet --seed N [--defect NAME]` at a time,
about a minute each on 2 cores (10 defects + 4 clean campaigns: about 15 minutes per seed).
Runs already complete in `--out-dir` are reused, so an interrupted matrix resumes where it
stopped. `--from-runs DIR` runs nothing: it summarises every run directory found under DIR,
whatever its layout, from the journals alone (campaign, defects and seed come from the
journal's meta).

    .venv/bin/python benchmarks/detection_matrix.py --seeds 3                     # ~45 minutes
    .venv/bin/python benchmarks/detection_matrix.py --seeds 2 --defects metadata_slot_collision,pages_leak_on_abort
    .venv/bin/python benchmarks/detection_matrix.py --from-runs runs/detection-matrix-20261202T1300Z
    .venv/bin/python benchmarks/detection_matrix.py --from-records benchmarks/results/detection-matrix
    .venv/bin/python benchmarks/detection_matrix.py --self-test                   # synthetic journals, no runs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import yaml

from chaos.journal import JOURNAL_FILENAME, Journal, JournalError
from chaos.targets.sim.defects import DEFECTS

CAMPAIGNS = REPO / "campaigns" / "defects"
DEFAULT_DOC = REPO / "docs" / "detection-matrix.md"
DEFAULT_RECORDS = HERE / "results" / "detection-matrix"
# What decides a run's outcome: a record counts for the current sources only when these match.
SOURCE_GLOBS = ("chaos/**/*.py", "faults/**/*.py", "loadprofiles/**/*.py", "campaigns/defects/*.yaml")
# The other engines' targets: a matrix run launches the embedded engine only (their specs just
# parse their own `target:` sections), so a fix there does not make the records stale.
SOURCE_EXCLUDED = ("chaos/targets/sglang/", "chaos/targets/vllm/")
RUN_TIMEOUT_S = 900

# defect -> (campaign in campaigns/defects/, oracles of which at least one must FAIL): the
# defect registry says both, as tests/test_defects.py reads them too.
EXPECTED: dict[str, tuple[str, frozenset[str]]] = {d.name: (d.campaign, frozenset(d.caught_by)) for d in DEFECTS.values()}
CLEAN = "(clean)"


# ----------------------------------------------------------------------- reading one run ----

@dataclass
class OracleOutcome:
    name: str
    verdict: str
    failing_findings: int
    first_s: float | None = None  # earliest failing finding, seconds after load start
    first_end_s: float | None = None  # the same finding's reply end (request findings only)
    basis: str | None = None  # request | idle snapshot | drain snapshot | verdict


@dataclass
class RunSummary:
    path: str
    campaign: str  # the file stem in campaigns/defects/ when known, else the campaign's name
    defects: list[str]
    seed: int | None
    verdict: str | None  # PASS / FAIL / INCONCLUSIVE; None: the run never reached its verdict
    exit_code: int | None
    load_started_at: float | None
    oracles: dict[str, OracleOutcome] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    wall_s: float | None = None  # from the sidecar this script writes when it ran the run
    commit: str | None = None  # records only: where the run was made
    source_digest: str | None = None

    @property
    def key(self) -> str:
        return "+".join(sorted(self.defects)) if self.defects else CLEAN

    @property
    def failing(self) -> list[str]:
        return sorted(n for n, o in self.oracles.items() if o.verdict == "FAIL")

    def expected_oracles(self) -> frozenset[str] | None:
        if len(self.defects) == 1 and self.defects[0] in EXPECTED:
            return EXPECTED[self.defects[0]][1]
        return None

    def detected(self) -> bool:
        """FAIL through an intended oracle (any oracle when the defect is not in the map)."""
        if self.verdict != "FAIL":
            return False
        expected = self.expected_oracles()
        return bool(set(self.failing) & expected) if expected is not None else bool(self.failing)

    def catching(self) -> list[str]:
        expected = self.expected_oracles()
        return [n for n in self.failing if expected is None or n in expected]

    def first_detection(self) -> OracleOutcome | None:
        timed = [self.oracles[n] for n in self.catching() if self.oracles[n].first_s is not None]
        return min(timed, key=lambda o: o.first_s) if timed else None  # type: ignore[arg-type,return-value]


def campaign_stems() -> dict[str, str]:
    """Campaign name (inside the YAML) -> file stem, for the shipped defect campaigns."""
    stems = {}
    for path in sorted(CAMPAIGNS.glob("*.yaml")):
        try:
            name = (yaml.safe_load(path.read_text()) or {}).get("name")
        except yaml.YAMLError:
            continue
        if isinstance(name, str):
            stems[name] = path.stem
    return stems


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def summarize_run(run_dir: Path, stems: dict[str, str] | None = None) -> RunSummary:
    """Everything the matrix needs from one run directory, read from its journal only."""
    stems = campaign_stems() if stems is None else stems
    with Journal.open(run_dir, readonly=True) as journal:
        meta = journal.all_meta()
        campaign = meta.get("campaign") if isinstance(meta.get("campaign"), dict) else {}
        name = str(campaign.get("name", "?"))
        sim = ((campaign.get("target") or {}).get("sim") or {}) if isinstance(campaign.get("target"), dict) else {}
        defects = [str(d) for d in sim.get("defects") or []]
        seed = meta.get("seed", campaign.get("seed"))
        run = RunSummary(path=str(run_dir), campaign=stems.get(name, name), defects=defects,
                         seed=int(seed) if isinstance(seed, int) else None, verdict=None, exit_code=None,
                         load_started_at=_number(meta.get("load_started_at")))
        for event in journal.iter_events(kind="verdict", name="run"):
            run.verdict, run.exit_code = event.data.get("verdict"), event.data.get("exit_code")
        if run.verdict is None:
            run.problems.append("no run verdict in the journal (crashed or still running)")
        if run.load_started_at is None:
            run.problems.append("no load_started_at in the meta: times are not known")
        drained = [e.t for e in journal.iter_events(kind="probe", name="loads") if e.data.get("phase") == "after_drain"]
        drain_t = min(drained) if drained else None
        latest: dict[str, tuple[float, dict[str, Any]]] = {}
        for event in journal.iter_events(kind="verdict", name="oracle"):
            latest[str(event.data.get("name"))] = (event.t, dict(event.data))  # a re-evaluation replaces it
        for oracle, (verdict_t, data) in latest.items():
            failing = [f for f in data.get("findings") or [] if f.get("verdict") == "FAIL"]
            outcome = OracleOutcome(oracle, str(data.get("verdict")), len(failing))
            if failing and run.load_started_at is not None:
                candidates: list[tuple[float, float | None, str]] = []
                for finding in failing:
                    request_id = finding.get("request_id")
                    record = journal.get_request(request_id) if isinstance(request_id, str) else None
                    seen_at = _number((finding.get("evidence") or {}).get("t_snapshot"))
                    if record is not None and record.t_send is not None:
                        candidates.append((record.t_send, record.t_end, "request"))
                    elif seen_at is not None:
                        candidates.append((seen_at, None, "idle snapshot"))
                    elif drain_t is not None and oracle == "liveness":
                        candidates.append((drain_t, None, "drain snapshot"))
                    else:
                        candidates.append((verdict_t, None, "verdict"))
                t, t_end, basis = min(candidates, key=lambda c: c[0])
                outcome.first_s = t - run.load_started_at
                outcome.first_end_s = None if t_end is None else t_end - run.load_started_at
                outcome.basis = basis
            run.oracles[oracle] = outcome
    sidecar = run_dir.with_name(run_dir.name + ".result.json")
    if sidecar.is_file():
        try:
            run.wall_s = _number(json.loads(sidecar.read_text()).get("wall_s"))
        except (ValueError, AttributeError):
            pass
    return run


def find_runs(roots: Iterable[Path]) -> list[Path]:
    found: set[Path] = set()
    for root in roots:
        if (root / JOURNAL_FILENAME).is_file():
            found.add(root)
        found.update(p.parent for p in root.rglob(JOURNAL_FILENAME))
    return sorted(found)


def source_digest() -> str:
    """sha256 over the files that decide a run's outcome (SOURCE_GLOBS), 16 hex digits."""
    digest = hashlib.sha256()
    paths = {p for pattern in SOURCE_GLOBS for p in REPO.glob(pattern)}
    for path in sorted(p for p in paths if not str(p.relative_to(REPO)).startswith(SOURCE_EXCLUDED)):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def current_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def record_path(records: Path, key: str, campaign: str, seed: int | None) -> Path:
    return records / ("clean" if key == CLEAN else key) / f"{campaign}-seed-{seed}.json"


def write_record(records: Path, run: RunSummary) -> Path:
    path = record_path(records, run.key, run.campaign, run.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(run)
    data["path"] = _relative(run.path)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def read_record(path: Path) -> RunSummary:
    data = json.loads(path.read_text())
    oracles = {name: OracleOutcome(**o) for name, o in (data.pop("oracles", None) or {}).items()}
    return RunSummary(**data, oracles=oracles)


def read_records(roots: Iterable[Path]) -> list[tuple[Path, RunSummary]]:
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.json")):
            try:
                found.append((path, read_record(path)))
            except (ValueError, TypeError, OSError) as exc:  # keep the rest
                print(f"[matrix] {path}: not a run record ({type(exc).__name__}: {exc}); left out", file=sys.stderr)
    return found


# ------------------------------------------------------------------------------ the matrix ----

def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _secs(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f} s"


def aggregate(runs: list[RunSummary]) -> dict[str, Any]:
    defects: dict[str, Any] = {}
    clean: dict[str, Any] = {}
    for key in sorted({r.key for r in runs if r.key != CLEAN}):
        mine = [r for r in runs if r.key == key]
        hits = [r for r in mine if r.detected()]
        firsts = [f for r in hits if (f := r.first_detection()) is not None]
        caught_by = Counter(n for r in hits for n in r.catching())
        expected = mine[0].expected_oracles()
        others = Counter(n for r in mine for n in r.failing if expected is not None and n not in expected)
        defects[key] = {
            "campaigns": sorted({r.campaign for r in mine}),
            "intended": sorted(expected) if expected is not None else None,
            "runs": len(mine), "detected": len(hits),
            "verdicts": dict(Counter(str(r.verdict) for r in mine)),
            "caught_by": dict(caught_by), "other_failing": dict(others),
            "median_first_s": _median([f.first_s for f in firsts if f.first_s is not None]),
            "first_s": [round(f.first_s, 2) for f in firsts if f.first_s is not None],
            "bases": dict(Counter(f.basis for f in firsts)),
            "seeds": sorted(r.seed for r in mine if r.seed is not None),
        }
    for campaign in sorted({r.campaign for r in runs if r.key == CLEAN}):
        mine = [r for r in runs if r.key == CLEAN and r.campaign == campaign]
        fp = [r for r in mine if r.failing]
        clean[campaign] = {
            "runs": len(mine), "verdicts": dict(Counter(str(r.verdict) for r in mine)),
            "false_positives": len(fp), "failing_oracles": dict(Counter(n for r in fp for n in r.failing)),
            "inconclusive": len([r for r in mine if r.verdict == "INCONCLUSIVE"]),
            "seeds": sorted(r.seed for r in mine if r.seed is not None),
        }
    return {"defects": defects, "clean": clean}


def _counts(counter: dict[str, int], of: int | None = None) -> str:
    if not counter:
        return "–"
    return ", ".join(f"{k} {v}" + (f"/{of}" if of else "") for k, v in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])))


def markdown(runs: list[RunSummary], matrix: dict[str, Any], *, command: str, sources: list[str]) -> str:
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 0
    seeds = sorted({r.seed for r in runs if r.seed is not None})
    lines = [
        "# Detection matrix",
        "",
        "Which shipped campaign catches each defect of the embedded engine, through which oracle, how often",
        "over seeds and how soon after the load starts; and what the same campaigns say about the clean engine.",
        "Written by `benchmarks/detection_matrix.py` (see `benchmarks/README.md`); do not edit by hand.",
        "",
        f"- generated {now} by `{command}`",
        f"- summarised on: {cpus} usable CPUs, Linux {platform.release()}, Python {platform.python_version()}",
        f"- runs: {len(runs)} from {', '.join(f'`{s}`' for s in sources)}; seeds {', '.join(map(str, seeds)) or '–'}",
        f"- sources: {_provenance(runs)}",
        "- detected: the run ended FAIL and one of the defect's intended oracles failed (tests/test_defects.py's rule)",
        "- first detection: the earliest failing finding of the catching oracle(s): its request's send time minus",
        "  the load start (a page leak: the idle snapshot that showed it, mid-load or after the drain; no request:",
        "  the verdict). Negative: before the",
        "  load, in the baseline. Oracles list only their first findings per rule, so this is the earliest listed one.",
        "",
        "## Defects",
        "",
        "| defect | campaign | intended oracles | caught by (runs) | detection rate | median first detection | each run (s) | also failed |",
        "|---|---|---|---|---:|---:|---|---|",
    ]
    for key, d in matrix["defects"].items():
        rate = f"{d['detected']}/{d['runs']}" + (f" ({100 * d['detected'] / d['runs']:.0f}%)" if d["runs"] else "")
        lines.append(
            f"| `{key}` | {', '.join(d['campaigns'])} | {', '.join(d['intended']) if d['intended'] else 'any'} | "
            f"{_counts(d['caught_by'])} | {rate} | {_secs(d['median_first_s'])} | "
            f"{', '.join(f'{x:g}' for x in d['first_s']) or '–'} | {_counts(d['other_failing'])} |"
        )
    lines += ["", "## Clean engine (false positives must be zero)", "",
              "| campaign | runs | verdicts | false positives | failing oracles |", "|---|---:|---|---:|---|"]
    for campaign, c in matrix["clean"].items():
        fp = f"**{c['false_positives']}**" if c["false_positives"] else "0"
        lines.append(f"| {campaign} | {c['runs']} | {_counts(c['verdicts'])} | {fp} | {_counts(c['failing_oracles'])} |")
    if not matrix["clean"]:
        lines.append("| (no clean runs) | 0 | – | – | – |")
    total_fp = sum(c["false_positives"] for c in matrix["clean"].values())
    lines += ["", f"False positives on the clean engine: **{total_fp}**"
              + (" (must be zero: see the runs below)." if total_fp else ".")]
    lines += ["", "## Runs", "",
              "| defect | campaign | seed | verdict | failing oracles | first detection (basis) | run time | run directory |",
              "|---|---|---:|---|---|---|---:|---|"]
    for r in sorted(runs, key=lambda r: (r.key == CLEAN, r.key, r.campaign, r.seed if r.seed is not None else -1)):
        first = r.first_detection() if r.key != CLEAN else None
        shown = f"{first.first_s:.1f} s ({first.basis}, {first.name})" if first and first.first_s is not None else "–"
        problems = f" ⚠ {'; '.join(r.problems)}" if r.problems else ""
        lines.append(f"| {r.key} | {r.campaign} | {r.seed if r.seed is not None else '?'} | {r.verdict or '–'}{problems} | "
                     f"{', '.join(r.failing) or '–'} | {shown} | {_secs(r.wall_s)} | `{_relative(r.path)}` |")
    return "\n".join(lines) + "\n"


def _provenance(runs: list[RunSummary]) -> str:
    """Which source digests (and commits) the runs were made from."""
    by_digest: dict[str | None, set[str]] = {}
    for run in runs:
        by_digest.setdefault(run.source_digest, set()).update([run.commit] if run.commit else [])
    return "; ".join(f"digest {d or 'not recorded'}" + (f" (commits {', '.join(sorted(c))})" if c else "")
                     for d, c in sorted(by_digest.items(), key=lambda kv: str(kv[0])))


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return path


# ---------------------------------------------------------------------------- running runs ----

@dataclass(frozen=True)
class Planned:
    key: str  # defect name or "clean-<campaign>"
    campaign: str
    defect: str | None
    seed: int

    def run_dir(self, out: Path) -> Path:
        return out / self.key / f"seed-{self.seed}"


def plan(defects: list[str], seeds: list[int], clean: bool, clean_campaigns: list[str] | None) -> list[Planned]:
    runs = []
    campaigns = clean_campaigns if clean_campaigns is not None else sorted({EXPECTED[d][0] for d in defects})
    for seed in seeds:  # seed-major: a partial matrix still covers every defect
        for defect in defects:
            runs.append(Planned(defect, EXPECTED[defect][0], defect, seed))
        if clean:
            for campaign in campaigns:
                runs.append(Planned(f"clean-{campaign}", campaign, None, seed))
    return runs


def _complete(run_dir: Path) -> bool:
    if not (run_dir / JOURNAL_FILENAME).is_file():
        return False
    try:
        with Journal.open(run_dir, readonly=True) as journal:
            return any(True for _ in journal.iter_events(kind="verdict", name="run"))
    except (sqlite3.Error, JournalError, OSError):
        return False


def execute(item: Planned, out: Path, timeout_s: float) -> int | None:
    """One `pdchaos run`; its output goes next to the run directory, with a small sidecar."""
    run_dir = item.run_dir(out)
    if _complete(run_dir):
        print(f"[matrix] {item.key} seed {item.seed}: already complete, reused", flush=True)
        return None
    if run_dir.exists():  # an interrupted run: keep it for the record, start afresh
        stale = run_dir.with_name(f"{run_dir.name}.incomplete-{int(time.time())}")
        run_dir.rename(stale)
        print(f"[matrix] {item.key} seed {item.seed}: incomplete run moved to {stale}", flush=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "chaos.cli", "run", str(CAMPAIGNS / f"{item.campaign}.yaml"), "--out", str(run_dir),
            "--quiet", "--seed", str(item.seed)]
    if item.defect:
        argv += ["--defect", item.defect]
    env = dict(os.environ)
    for key, value in (("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"), ("RAY_AUTH_MODE", "disabled"),
                       ("HF_ENDPOINT", "http://127.0.0.1:9")):
        env.setdefault(key, value)  # as the Makefile sets them
    print(f"[matrix] {item.key} seed {item.seed}: {' '.join(argv[2:])}", flush=True)
    started = time.monotonic()
    log = run_dir.with_name(run_dir.name + ".log")
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)  # the runner heals and reports on SIGINT
            try:
                rc = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
        except KeyboardInterrupt:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=120)
            raise
    wall = time.monotonic() - started
    run_dir.with_name(run_dir.name + ".result.json").write_text(json.dumps(
        {"argv": argv[1:], "rc": rc, "wall_s": round(wall, 1), "log": log.name}))
    meaning = {0: "PASS", 1: "FAIL", 3: "INCONCLUSIVE"}.get(rc, f"error, see {log}")
    print(f"[matrix] {item.key} seed {item.seed}: exit {rc} ({meaning}) in {wall:.0f} s", flush=True)
    return rc


# ------------------------------------------------------------------------------- self-test ----

def _synthetic_run(run_dir: Path, *, name: str, defects: list[str], seed: int, verdict: str,
                   oracles: dict[str, list[dict[str, Any]]], requests: dict[str, float], start: float,
                   drain_at: float | None = None) -> None:
    """A journal shaped like a finished `pdchaos run` (only what the matrix reads)."""
    from chaos.journal import JournalEvent, RequestRecord

    with Journal.create(run_dir) as journal:
        journal.set_meta("campaign", {"name": name, "seed": seed, "target": {"kind": "sim", "sim": {"defects": defects}}})
        journal.set_meta("seed", seed)
        journal.set_meta("load_started_at", start)
        for n, (request_id, t_send) in enumerate(requests.items()):
            journal.append_request(RequestRecord(id=request_id, request_index=10_000 + n, t_send=t_send, t_end=t_send + 0.5))
        if drain_at is not None:
            journal.append_event(JournalEvent("probe", "loads", {"role": "prefill", "phase": "after_drain", "data": {}},
                                              t=drain_at))
        for oracle, findings in oracles.items():
            result = {"name": oracle, "verdict": "FAIL" if findings else "PASS", "checked": 10,
                      "findings": [{"oracle": oracle, "verdict": "FAIL", "summary": "x", "request_id": None, **f}
                                   for f in findings], "notes": []}
            journal.append_event(JournalEvent("verdict", "oracle", result, t=start + 100))
        journal.append_event(JournalEvent("verdict", "run", {"verdict": verdict, "exit_code": {"PASS": 0, "FAIL": 1}.get(verdict, 3)},
                                          t=start + 101))


def self_test() -> int:
    """Synthetic runs through --from-runs: leaks, page leaks (after the drain, mid-load), clean runs."""
    with tempfile.TemporaryDirectory(prefix="detection-matrix-") as tmp:
        root = Path(tmp)
        t0 = 1_800_000_000.0
        _synthetic_run(root / "a" / "seed-1", name="defects-handoff", defects=["metadata_slot_collision"], seed=1,
                       verdict="FAIL", start=t0, requests={"r1": t0 + 9.0, "r2": t0 + 4.0, "r3": t0 + 2.0},
                       oracles={"canary": [{"request_id": "r1"}, {"request_id": "r2"}], "reference": [],
                                "status": [{"request_id": "r3"}]})
        _synthetic_run(root / "a" / "seed-2", name="defects-handoff", defects=["metadata_slot_collision"], seed=2,
                       verdict="FAIL", start=t0, requests={"r1": t0 + 6.0},
                       oracles={"canary": [], "reference": [{"request_id": "r1"}]})
        _synthetic_run(root / "b" / "x", name="defects-aborts", defects=["pages_leak_on_abort"], seed=1,
                       verdict="FAIL", start=t0, requests={}, drain_at=t0 + 45.0,
                       oracles={"liveness": [{"evidence": {"role": "prefill"}}], "canary": []})
        _synthetic_run(root / "b" / "y", name="defects-aborts", defects=["pages_leak_on_abort"], seed=2,
                       verdict="FAIL", start=t0, requests={}, drain_at=t0 + 45.0,
                       oracles={"liveness": [{"evidence": {"role": "decode", "t_snapshot": t0 + 12.5}}]})
        _synthetic_run(root / "c", name="defects-handoff", defects=[], seed=1, verdict="PASS", start=t0,
                       requests={}, oracles={"canary": [], "reference": []})
        _synthetic_run(root / "d", name="defects-cache", defects=[], seed=1, verdict="FAIL", start=t0,
                       requests={"q": t0 + 1.0}, oracles={"reference": [{"request_id": "q"}]})
        runs = [summarize_run(p) for p in find_runs([root])]
        matrix = aggregate(runs)
        d = matrix["defects"]
        checks = {
            "six runs found": len(runs) == 6,
            "leak: 2/2 detected": d["metadata_slot_collision"]["detected"] == 2,
            "leak: earliest intended finding (4 s, not status's 2 s)": d["metadata_slot_collision"]["first_s"] == [4.0, 6.0],
            "leak: median 5 s": d["metadata_slot_collision"]["median_first_s"] == 5.0,
            "leak: caught by canary 1, reference 1": d["metadata_slot_collision"]["caught_by"] == {"canary": 1, "reference": 1},
            "leak: status counted as also failed": d["metadata_slot_collision"]["other_failing"] == {"status": 1},
            "campaign stem from the YAML name": d["metadata_slot_collision"]["campaigns"] == ["handoff"],
            "page leak: timed at the drain snapshot, or at the idle snapshot mid-load":
                sorted(d["pages_leak_on_abort"]["first_s"]) == [12.5, 45.0]
                and d["pages_leak_on_abort"]["bases"] == {"drain snapshot": 1, "idle snapshot": 1},
            "clean handoff: no false positive": matrix["clean"]["handoff"]["false_positives"] == 0,
            "clean cache: one false positive": matrix["clean"]["cache"]["false_positives"] == 1,
        }
        text = markdown(runs, matrix, command="self-test", sources=[tmp])
        checks["doc flags the false positive"] = "False positives on the clean engine: **1**" in text
        for run in runs:
            run.commit, run.source_digest = "abc123", "d1"
            write_record(root / "records", run)
        recorded = [run for _, run in read_records([root / "records"])]
        checks["records: one per run, and the same matrix read back"] = (
            len(recorded) == len(runs) and aggregate(recorded) == matrix)
        checks["records: the doc names their sources"] = "digest d1 (commits abc123)" in markdown(
            recorded, matrix, command="self-test", sources=[tmp])
        for what, ok in checks.items():
            print(f"{'ok  ' if ok else 'FAIL'} {what}")
        if not all(checks.values()):
            print(text)
            return 1
    print("self-test passed")
    return 0


# ------------------------------------------------------------------------------------ main ----

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3, help="seeds per defect and per clean campaign (default 3)")
    p.add_argument("--first-seed", type=int, default=1, help="seeds are FIRST .. FIRST+SEEDS-1 (default 1)")
    p.add_argument("--defects", default=",".join(EXPECTED), help="comma-separated; default every defect")
    p.add_argument("--no-clean", action="store_true", help="skip the clean-engine runs")
    p.add_argument("--clean-campaigns", default=None,
                   help="campaigns (stems in campaigns/defects/) to run clean; default those of the chosen defects")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="where the runs go (default runs/detection-matrix-<time>); complete runs in it are reused")
    p.add_argument("--doc", type=Path, default=DEFAULT_DOC, help="the Markdown to write (default docs/detection-matrix.md)")
    p.add_argument("--json", type=Path, default=None, help="also write the summary as JSON")
    p.add_argument("--from-runs", type=Path, action="append", default=None, metavar="DIR",
                   help="run nothing: summarise every run directory under DIR (repeatable)")
    p.add_argument("--records", type=Path, default=DEFAULT_RECORDS,
                   help="where each finished run's summary is recorded, and reused from (default %(default)s)")
    p.add_argument("--no-records", dest="records", action="store_const", const=None, help="record nothing, reuse nothing")
    p.add_argument("--from-records", type=Path, action="append", default=None, metavar="DIR",
                   help="run nothing: summarise the run records under DIR (repeatable)")
    p.add_argument("--any-source", action="store_true",
                   help="with --from-records: also records made from other sources than these")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S, help="seconds per run before it is interrupted")
    p.add_argument("--dry-run", action="store_true", help="print the runs it would make and stop")
    p.add_argument("--self-test", action="store_true", help="check the summary on synthetic journals; runs nothing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.self_test:
        return self_test()
    command = "benchmarks/detection_matrix.py " + " ".join(sys.argv[1:] if argv is None else argv)
    digest = source_digest()
    stems = campaign_stems()
    runs: list[RunSummary] = []
    if args.from_records:
        sources = [str(p) for p in args.from_records]
        found = read_records(args.from_records)
        others = [path for path, run in found if run.source_digest != digest]
        if others and not args.any_source:
            print(f"[matrix] {len(others)} record(s) of other sources left out (--any-source keeps them)", file=sys.stderr)
        runs = [run for _, run in found if args.any_source or run.source_digest == digest]
    elif args.from_runs:
        sources = [str(p) for p in args.from_runs]
        runs = summarize_dirs(find_runs(args.from_runs), stems)
    else:
        defects = [d.strip() for d in args.defects.split(",") if d.strip()]
        unknown = [d for d in defects if d not in EXPECTED]
        if unknown:
            print(f"unknown defect(s) {', '.join(unknown)}; known: {', '.join(EXPECTED)}", file=sys.stderr)
            return 2
        clean_campaigns = [c.strip() for c in args.clean_campaigns.split(",")] if args.clean_campaigns else None
        for campaign in clean_campaigns or []:
            if not (CAMPAIGNS / f"{campaign}.yaml").is_file():
                print(f"--clean-campaigns: no campaigns/defects/{campaign}.yaml", file=sys.stderr)
                return 2
        seeds = list(range(args.first_seed, args.first_seed + args.seeds))
        out = args.out_dir or REPO / "runs" / f"detection-matrix-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%MZ')}"
        planned = plan(defects, seeds, not args.no_clean, clean_campaigns)
        print(f"[matrix] {len(planned)} runs into {out} (about a minute each); sources {digest}", flush=True)
        if args.dry_run:
            for item in planned:
                print(f"  {item.key} seed {item.seed}: campaigns/defects/{item.campaign}.yaml -> {item.run_dir(out)}")
            return 0
        out.mkdir(parents=True, exist_ok=True)
        commit = current_commit()
        sources = [str(out)] + ([str(args.records)] if args.records else [])
        try:
            for item in planned:
                run = matrix_run(item, out, args, stems, digest, commit)
                if run is not None:
                    runs.append(run)
        except KeyboardInterrupt:
            print("[matrix] interrupted: summarising the runs made so far", flush=True)
    if not runs:
        print("no runs found (no journal.sqlite under the run directories, no records)", file=sys.stderr)
        return 1
    matrix = aggregate(runs)
    text = markdown(runs, matrix, command=command, sources=[_relative(s) for s in sources])
    args.doc.parent.mkdir(parents=True, exist_ok=True)
    args.doc.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"matrix": matrix, "runs": [asdict(r) for r in runs]}, indent=2))
    print(text)
    print(f"[matrix] wrote {args.doc}", flush=True)
    false_positives = sum(c["false_positives"] for c in matrix["clean"].values())
    missed = sum(d["runs"] - d["detected"] for d in matrix["defects"].values())
    return 1 if false_positives or missed else 0


def summarize_dirs(run_dirs: list[Path], stems: dict[str, str]) -> list[RunSummary]:
    runs = []
    for run_dir in run_dirs:
        try:
            runs.append(summarize_run(run_dir, stems))
        except (sqlite3.Error, JournalError, OSError, ValueError, TypeError) as exc:  # keep the rest
            print(f"[matrix] {run_dir}: cannot read the journal ({type(exc).__name__}: {exc}); left out", file=sys.stderr)
    return runs


def matrix_run(item: Planned, out: Path, args: argparse.Namespace, stems: dict[str, str], digest: str,
               commit: str | None) -> RunSummary | None:
    """One planned run: its record when one of these sources exists, else the run (made or reused)
    summarised and recorded."""
    if args.records:
        existing = record_path(args.records, item.defect or CLEAN, item.campaign, item.seed)
        if existing.is_file():
            try:
                recorded = read_record(existing)
            except (ValueError, TypeError, OSError):
                recorded = None
            if recorded is not None and recorded.source_digest == digest:
                print(f"[matrix] {item.key} seed {item.seed}: recorded for these sources, reused ({_relative(str(existing))})", flush=True)
                return recorded
    execute(item, out, args.timeout)
    run_dir = item.run_dir(out)
    if not (run_dir / JOURNAL_FILENAME).is_file():
        return None
    [run] = summarize_dirs([run_dir], stems) or [None]
    if run is None:
        return None
    run.commit, run.source_digest = commit, digest
    if args.records and run.verdict is not None:
        write_record(args.records, run)
    return run


if __name__ == "__main__":
    sys.exit(main())
