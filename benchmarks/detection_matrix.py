"""Detection matrix: which campaign catches each engine defect, how often, and how fast.

It measures **columns of campaigns** (`--campaigns default,twin,defects`, all three by default):

- `default`: `campaigns/default.yaml`, the campaign `make run` runs, against every defect of the
  embedded engine and against the clean engine;
- `twin`: `benchmarks/campaigns/sglang-launch-sim.yaml`, the fault windows of
  `campaigns/sglang-launch.yaml` in the same order, scaled to two and a half minutes of load on
  the embedded engine;
- `defects`: each defect's own campaign in `campaigns/defects/`, which the defect registry names.

Each defect runs in every chosen column over `--seeds` seeds; the clean engine runs `default` and
`twin` over `--clean-seeds` seeds (default 20 for `default`, 3 for `twin`) and each per-defect
campaign over `--clean-seeds` seeds (default 3). Then it writes `docs/detection-matrix.md`: one table
per column with, per defect, the detection rate, the median time from the start of the provoking
window to the first detection (and from the load start), the oracles that caught it; the
clean-engine verdicts and false positives of the column's campaigns; the machine's load during
the runs, the command and the source digest.

A run counts as a detection when `pdchaos run` ends FAIL and at least one of the defect's intended
oracles is among the failing ones (the rule of tests/test_defects.py). Time to first detection
is read from the journal: over the failing findings of the intended oracles, the earliest
`t_send` of the finding's request (`finding.request_id` looked up in the journal), minus the
meta `load_started_at`. A finding with no request (a page leak seen after the drain, the pool
preflight) counts from the after-drain `/v1/loads` snapshot when there is one, else from the
oracle's verdict event; a page leak seen at an idle moment mid-load counts from that snapshot,
a wedged target from the progress watchdog's snapshot (`evidence.t_snapshot`). A time below
zero is a detection before the load started: the baseline's tenant probe. Oracles list only the first findings of each rule (their listing caps), in journal
order, so the earliest listed finding is not always the earliest in the run.
The provoking window of a detection is the fault window most recently started at or before it:
of the windows in journal order, the last whose start (its first journaled event, the undo plan,
which precedes its provocation's sizing requests and the inject) is at or before the detection
time. A detection before every window (the baseline, ordinary traffic) has none.

Every finished run leaves a record: its summary as JSON (a few kB) under `--records` (default
`benchmarks/results/detection-matrix/`, kept in the repository), keyed by (campaign, defect or
clean, seed), with the commit, the machine's load average at the run's start and end, and the
digest of the sources that decide the outcome of the campaigns it runs (`chaos/` but for the
SGLang and vLLM targets, `faults/`, `loadprofiles/`, `campaigns/default.yaml`,
`campaigns/defects/`, `benchmarks/campaigns/`; `--digest` prints it). The digest is taken before
and after each run: a run during which the sources changed is not recorded. A record of the
current sources is reused instead of running again, so a matrix too long for one sitting
accumulates across machines. **A record of other sources is never reused and never summarised
into the matrix**: the doc is made from the records of the current digest only. `--any-source`
(every digest) and `--records-digest D` (the records of digest D) are diagnostics: the doc they
write is headed as not being of the current sources.

Each run is one `pdchaos run CAMPAIGN --out DIR --quiet --seed N [--defect NAME]` at a time (2
cores): about a minute for a per-defect campaign, about 4 minutes for `default` and `twin`.
`--stop-at-detection` interrupts a defect's run (SIGINT, as Ctrl-C) once one of its intended
oracles already FAILs on its journal (benchmarks/detection_watch.py); the doc counts those runs.
Runs already complete in `--out-dir` are reused when their sidecar names the current digest, so an
interrupted matrix resumes where it stopped. `--from-runs DIR` runs nothing: it summarises every
run directory found under DIR, whatever its layout, from the journals alone (campaign, defects and
seed come from the journal's meta; the digest from the sidecar this script wrote beside it, so
runs made by hand count only with `--any-source`).

    .venv/bin/python benchmarks/detection_matrix.py --seeds 3                      # every column
    .venv/bin/python benchmarks/detection_matrix.py --campaigns defects --seeds 2 --defects metadata_slot_collision
    .venv/bin/python benchmarks/detection_matrix.py --dry-run                      # the runs it would make
    .venv/bin/python benchmarks/detection_matrix.py --from-records benchmarks/results/detection-matrix
    .venv/bin/python benchmarks/detection_matrix.py --from-runs runs/detection-matrix-20261203T1300Z
    .venv/bin/python benchmarks/detection_matrix.py --digest                       # the current sources' digest
    .venv/bin/python benchmarks/detection_matrix.py --self-test                    # synthetic journals, no runs
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import hashlib
import itertools
import json
import os
import platform
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import yaml
from detection_watch import stop_past_time, wait_until_caught

from chaos.journal import JOURNAL_FILENAME, Journal, JournalError
from chaos.targets.sim.defects import DEFECTS

CAMPAIGNS = REPO / "campaigns" / "defects"  # the `defects` column: one campaign per defect
DEFAULT_CAMPAIGN = REPO / "campaigns" / "default.yaml"  # the `default` column: what `make run` runs
TWIN_CAMPAIGN = HERE / "campaigns" / "sglang-launch-sim.yaml"  # the `twin` column
COLUMNS = ("default", "twin", "defects")
COLUMN_TITLES = {
    "default": "campaigns/default.yaml, the campaign `make run` runs",
    "twin": "benchmarks/campaigns/sglang-launch-sim.yaml, the windows of campaigns/sglang-launch.yaml on the embedded engine",
    "defects": "each defect's own campaign in campaigns/defects/",
}
CLEAN_SEEDS = {"default": 20, "twin": 3, "defects": 3}  # clean-engine seeds per column unless --clean-seeds
DEFAULT_DOC = REPO / "docs" / "detection-matrix.md"
DEFAULT_RECORDS = HERE / "results" / "detection-matrix"
# What decides the outcome of the campaigns the matrix runs: a record counts for the current
# sources only when the digest over these matches. Every file under the trees (not only *.py:
# data a module reads decides too), and the campaigns themselves.
SOURCE_TREES = ("chaos", "faults", "loadprofiles")
SOURCE_FILES = ("campaigns/default.yaml", "campaigns/defects/*.yaml", "benchmarks/campaigns/*.yaml")
# The other engines' targets: a matrix run launches the embedded engine only (their specs just
# parse their own `target:` sections), so a fix there does not make the records stale; except
# the files the embedded engine's own modules import from them (SIM_TREE: its stack starts the
# real sglang-router with chaos/targets/sglang/router.py's flags), which are covered.
SOURCE_EXCLUDED = ("chaos/targets/sglang/", "chaos/targets/vllm/")
SIM_TREE = "chaos/targets/sim"
RUN_TIMEOUT_S = 900
DIGEST_LINE = re.compile(r"^- source digest: `([0-9a-f]+)`")

# defect -> (campaign in campaigns/defects/, oracles of which at least one must FAIL): the
# defect registry says both, as tests/test_defects.py reads them too.
EXPECTED: dict[str, tuple[str, frozenset[str]]] = {
    d.name: (d.campaign, frozenset(d.caught_by)) for d in DEFECTS.values()
}
CLEAN = "(clean)"


# ----------------------------------------------------------------------- the campaigns ----


@dataclass(frozen=True)
class CampaignFile:
    stem: str  # how records and the doc name it: the file stem
    column: str  # default, twin or defects
    path: Path


def campaign_files() -> dict[str, CampaignFile]:
    """Campaign name (inside the YAML) -> the campaign file, for every column's campaigns."""
    files = [(DEFAULT_CAMPAIGN, "default"), (TWIN_CAMPAIGN, "twin")] + [
        (p, "defects") for p in sorted(CAMPAIGNS.glob("*.yaml"))
    ]
    found = {}
    for path, column in files:
        try:
            name = (yaml.safe_load(path.read_text()) or {}).get("name")
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(name, str):
            found[name] = CampaignFile(path.stem, column, path)
    return found


def campaign_stems() -> dict[str, str]:
    """Campaign name (inside the YAML) -> file stem."""
    return {name: f.stem for name, f in campaign_files().items()}


@functools.cache
def _columns_by_stem() -> dict[str, str]:
    return {f.stem: f.column for f in campaign_files().values()}


def column_of(campaign: str) -> str:
    """The column of a campaign stem; a campaign of none of them is a column of its own."""
    return _columns_by_stem().get(campaign, campaign)


def column_order(columns: Iterable[str]) -> list[str]:
    return sorted(set(columns), key=lambda c: (COLUMNS.index(c) if c in COLUMNS else len(COLUMNS), c))


# ----------------------------------------------------------------------- reading one run ----


@dataclass
class OracleOutcome:
    name: str
    verdict: str
    failing_findings: int
    first_s: float | None = None  # earliest failing finding, seconds after load start
    first_end_s: float | None = None  # the same finding's reply end (request findings only)
    basis: str | None = None  # request | idle snapshot | watchdog | drain snapshot | verdict
    window: str | None = None  # the provoking window (fault#wN): the last started at or before first_s
    window_s: float | None = None  # first_s minus that window's start


@dataclass
class RunSummary:
    path: str
    campaign: str  # the campaign's file stem when known, else the campaign's name
    defects: list[str]
    seed: int | None
    verdict: str | None  # PASS / FAIL / INCONCLUSIVE; None: the run never reached its verdict
    exit_code: int | None
    load_started_at: float | None
    oracles: dict[str, OracleOutcome] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    wall_s: float | None = None  # from the sidecar this script writes when it ran the run
    commit: str | None = None
    source_digest: str | None = None
    # fault windows in journal order: label, start_s (first event), inject_s, end_s (heal), after load
    # start; None: not recorded (a record older than window timing)
    windows: list[dict[str, Any]] | None = None
    loadavg_start: list[float] | None = None  # os.getloadavg() right before the run (sidecar)
    loadavg_end: list[float] | None = None  # and right after it
    cpus: int | None = None  # usable CPUs of the machine that ran it
    stopped_at_detection: bool = False  # interrupted once an intended oracle FAILed (--stop-at-detection)

    @property
    def key(self) -> str:
        return "+".join(sorted(self.defects)) if self.defects else CLEAN

    @property
    def column(self) -> str:
        return column_of(self.campaign)

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

    @property
    def ended_before_load(self) -> bool:
        """Caught before its load started (stopped in its baseline): no window, no time from either."""
        return self.load_started_at is None and self.verdict == "FAIL"

    def detection_window(self) -> str | None:
        """Where the detection fell (its provoking window, or why there is none); None: not detected,
        or not timed. A run that ended in its baseline caught its defect before every window."""
        first = self.first_detection()
        if first is not None:
            return self.window_of(first)
        return "(before every window)" if self.ended_before_load and self.detected() else None

    def window_of(self, first: OracleOutcome) -> str:
        """The provoking window of a detection, or why there is none."""
        if first.window:
            return first.window
        if self.windows is None:
            return "(windows not recorded)"
        # A run stopped at detection before its first window journaled none, yet its campaign has some.
        return "(before every window)" if self.windows or self.stopped_at_detection else "(no fault window in the run)"


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _loadavg(value: Any) -> list[float] | None:
    if isinstance(value, list) and value and all(_number(v) is not None for v in value):
        return [float(v) for v in value]
    return None


def provoking_window(windows: Sequence[dict[str, Any]], t: float | None) -> dict[str, Any] | None:
    """Of the windows in journal order, the last whose start is at or before `t` (seconds after
    the load start): the window whose provocation or fault was active at or before it."""
    if t is None:
        return None
    started = [w for w in windows if w.get("start_s") is not None and w["start_s"] <= t]
    return started[-1] if started else None


def read_windows(journal: Journal, load_started_at: float) -> list[dict[str, Any]]:
    """The run's fault windows in journal order, timed from the load start."""
    windows: dict[str, dict[str, Any]] = {}
    for event in journal.iter_events(kind="fault"):
        wid = str(event.data.get("window", event.name))
        window = windows.setdefault(
            wid,
            {
                "label": f"{event.name}#{wid}",
                "start_s": round(event.t - load_started_at, 3),
                "inject_s": None,
                "end_s": None,
            },
        )
        step = event.data.get("step")
        if step == "inject" and window["inject_s"] is None:
            window["inject_s"] = round(event.t - load_started_at, 3)
        elif step == "heal":
            window["end_s"] = round(event.t - load_started_at, 3)
    return list(windows.values())


def summarize_run(run_dir: Path, stems: dict[str, str] | None = None) -> RunSummary:
    """Everything the matrix needs from one run directory, read from its journal (and the sidecar
    this script writes beside a run it made)."""
    stems = campaign_stems() if stems is None else stems
    with Journal.open(run_dir, readonly=True) as journal:
        meta = journal.all_meta()
        meta_campaign = meta.get("campaign")
        campaign: dict[str, Any] = meta_campaign if isinstance(meta_campaign, dict) else {}
        name = str(campaign.get("name", "?"))
        sim = ((campaign.get("target") or {}).get("sim") or {}) if isinstance(campaign.get("target"), dict) else {}
        defects = [str(d) for d in sim.get("defects") or []]
        seed = meta.get("seed", campaign.get("seed"))
        run = RunSummary(
            path=str(run_dir),
            campaign=stems.get(name, name),
            defects=defects,
            seed=int(seed) if isinstance(seed, int) else None,
            verdict=None,
            exit_code=None,
            load_started_at=_number(meta.get("load_started_at")),
        )
        for event in journal.iter_events(kind="verdict", name="run"):
            run.verdict, run.exit_code = event.data.get("verdict"), event.data.get("exit_code")
        if run.verdict is None:
            run.problems.append("no run verdict in the journal (crashed or still running)")
        if run.load_started_at is not None:
            run.windows = read_windows(journal, run.load_started_at)
        elif not run.ended_before_load:
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
                    evidence = finding.get("evidence") or {}
                    seen_at = _number(evidence.get("t_snapshot"))
                    if record is not None and record.t_send is not None:
                        candidates.append((record.t_send, record.t_end, "request"))
                    elif seen_at is not None:
                        candidates.append((seen_at, None, "watchdog" if "quiet_s" in evidence else "idle snapshot"))
                    elif drain_t is not None and oracle == "liveness":
                        candidates.append((drain_t, None, "drain snapshot"))
                    else:
                        candidates.append((verdict_t, None, "verdict"))
                t, t_end, basis = min(candidates, key=lambda c: c[0])
                outcome.first_s = round(t - run.load_started_at, 3)
                outcome.first_end_s = None if t_end is None else round(t_end - run.load_started_at, 3)
                outcome.basis = basis
                window = provoking_window(run.windows or [], outcome.first_s)
                if window is not None:
                    outcome.window, outcome.window_s = window["label"], round(outcome.first_s - window["start_s"], 3)
            run.oracles[oracle] = outcome
    sidecar = run_dir.with_name(run_dir.name + ".result.json")
    if sidecar.is_file():
        try:
            side = json.loads(sidecar.read_text())
            run.wall_s = _number(side.get("wall_s"))
            run.loadavg_start, run.loadavg_end = _loadavg(side.get("loadavg_start")), _loadavg(side.get("loadavg_end"))
            run.cpus = side.get("cpus") if isinstance(side.get("cpus"), int) else None
            run.stopped_at_detection = side.get("stopped_at_detection") is True
            digest = side.get("source_digest")
            if isinstance(digest, str) and digest and digest == side.get("source_digest_after", digest):
                run.source_digest, run.commit = digest, side.get("commit")
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


def _imported_files(path: Path) -> set[Path]:
    """The repository's .py files `path` imports (anywhere in it, lazy imports too), with the
    packages' __init__.py that importing them runs."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
    found: set[Path] = set()
    for name in names:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            module = REPO / Path(*parts[:depth])
            found.update(c for c in (module / "__init__.py", module.with_suffix(".py")) if c.is_file())
    return found


def sim_imports_from_excluded() -> set[Path]:
    """The files of SOURCE_EXCLUDED that the embedded engine's modules import, directly or through
    each other: they decide the matrix's runs as much as the engine does."""
    pending = [p for p in (REPO / SIM_TREE).rglob("*.py")]
    seen: set[Path] = set(pending)
    kept: set[Path] = set()
    while pending:
        for imported in _imported_files(pending.pop()):
            if imported in seen:
                continue
            seen.add(imported)
            if imported.relative_to(REPO).as_posix().startswith(SOURCE_EXCLUDED):
                kept.add(imported)
                pending.append(imported)
    return kept


def source_files() -> list[Path]:
    """The files the digest covers (SOURCE_TREES, SOURCE_FILES; not SOURCE_EXCLUDED but for what
    the embedded engine imports from it), sorted."""
    paths = {p for tree in SOURCE_TREES for p in (REPO / tree).rglob("*")}
    paths |= {p for pattern in SOURCE_FILES for p in REPO.glob(pattern)}
    imported = sim_imports_from_excluded()
    keep = []
    for path in paths:
        rel = path.relative_to(REPO).as_posix()
        if (
            not path.is_file()
            or (rel.startswith(SOURCE_EXCLUDED) and path not in imported)
            or "__pycache__" in path.parts
            or path.suffix == ".pyc"
        ):
            continue
        keep.append(path)
    return sorted(keep, key=lambda p: p.relative_to(REPO).as_posix())


def source_digest() -> str:
    """sha256 over the files that decide the outcome of the matrix's campaigns, 16 hex digits."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def current_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def record_path(records: Path, key: str, campaign: str, seed: int | None) -> Path:
    """A record is keyed by (campaign, defect or clean, seed); campaign stems are unique across columns."""
    return records / ("clean" if key == CLEAN else key) / f"{campaign}-seed-{seed}.json"


def _record_name(run: RunSummary) -> str:
    """Where the run's committed record is (its run directory was on the machine that ran it)."""
    return _relative(str(record_path(DEFAULT_RECORDS, run.key, run.campaign, run.seed)))


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


def select(
    runs: Iterable[RunSummary], digest: str, *, any_source: bool = False, records_digest: str | None = None
) -> tuple[list[RunSummary], list[RunSummary]]:
    """(kept, left out): the runs of the current sources; with `records_digest`, those of that
    digest instead; with `any_source`, all. A run of unknown sources is of no digest."""
    kept: list[RunSummary] = []
    left: list[RunSummary] = []
    for run in runs:
        wanted = any_source or run.source_digest == (records_digest or digest)
        (kept if wanted else left).append(run)
    return kept, left


# ------------------------------------------------------------------------------ the matrix ----


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _secs(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f} s"


def _column_defects(runs: list[RunSummary]) -> dict[str, Any]:
    defects: dict[str, Any] = {}
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
            "runs": len(mine),
            "detected": len(hits),
            "verdicts": dict(Counter(str(r.verdict) for r in mine)),
            "caught_by": dict(caught_by),
            "other_failing": dict(others),
            "median_window_s": _median([f.window_s for f in firsts if f.window_s is not None]),
            "median_first_s": _median([f.first_s for f in firsts if f.first_s is not None]),
            "window_s": [round(f.window_s, 2) for f in firsts if f.window_s is not None],
            "first_s": [round(f.first_s, 2) for f in firsts if f.first_s is not None],
            "windows": dict(Counter(w for r in hits if (w := r.detection_window()) is not None)),
            "bases": dict(Counter(f.basis for f in firsts)),
            "seeds": sorted(r.seed for r in mine if r.seed is not None),
        }
    return defects


def _column_clean(runs: list[RunSummary]) -> dict[str, Any]:
    clean: dict[str, Any] = {}
    for campaign in sorted({r.campaign for r in runs if r.key == CLEAN}):
        mine = [r for r in runs if r.key == CLEAN and r.campaign == campaign]
        fp = [r for r in mine if r.failing]
        clean[campaign] = {
            "runs": len(mine),
            "verdicts": dict(Counter(str(r.verdict) for r in mine)),
            "false_positives": len(fp),
            "failing_oracles": dict(Counter(n for r in fp for n in r.failing)),
            "inconclusive": len([r for r in mine if r.verdict == "INCONCLUSIVE"]),
            "seeds": sorted(r.seed for r in mine if r.seed is not None),
        }
    return clean


def machine_load(runs: list[RunSummary]) -> dict[str, Any]:
    """The 1-minute load average at the start and end of each run: median and max."""
    readings = [v[0] for r in runs for v in (r.loadavg_start, r.loadavg_end) if v]
    return {
        "readings": len(readings),
        "median": _median(readings),
        "max": max(readings) if readings else None,
        "runs_without": len([r for r in runs if not (r.loadavg_start or r.loadavg_end)]),
        "cpus": sorted({r.cpus for r in runs if r.cpus is not None}),
    }


def aggregate(runs: list[RunSummary]) -> dict[str, Any]:
    columns = {}
    for column in column_order(r.column for r in runs):
        mine = [r for r in runs if r.column == column]
        columns[column] = {"defects": _column_defects(mine), "clean": _column_clean(mine)}
    return {"columns": columns, "load": machine_load(runs)}


def _counts(counter: dict[str, int], of: int | None = None) -> str:
    if not counter:
        return "–"
    return ", ".join(
        f"{k} {v}" + (f"/{of}" if of else "") for k, v in sorted(counter.items(), key=lambda kv: (-kv[1], kv[0]))
    )


def _rate(d: dict[str, Any]) -> str:
    return f"{d['detected']}/{d['runs']}" + (f" ({100 * d['detected'] / d['runs']:.0f}%)" if d["runs"] else "")


def _digests(runs: list[RunSummary]) -> list[str | None]:
    return sorted({r.source_digest for r in runs}, key=str)


def markdown(
    runs: list[RunSummary], matrix: dict[str, Any], *, command: str, sources: list[str], digest: str | None = None
) -> str:
    """The document. `digest`: the current sources' digest; runs of any other (or of several)
    make the document a diagnostic, and its head says so."""
    digest = source_digest() if digest is None else digest
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 0
    seeds = sorted({r.seed for r in runs if r.seed is not None})
    digests = _digests(runs)
    lines = ["# Detection matrix", ""]
    if digests != [digest]:
        shown = ", ".join(f"`{d}`" if d else "not recorded" for d in digests)
        kind = "mixed" if len(digests) > 1 else "other" if digests[0] else "unknown"
        lines += [
            f"> **Not the matrix: a diagnostic of {kind} sources.** These runs are of "
            f"source digest(s) {shown}; the current sources are `{digest}`. Records of other sources",
            "> prove nothing about these sources: re-run `benchmarks/detection_matrix.py` (see benchmarks/README.md).",
            "",
        ]
    lines += [
        "Which defects of the embedded engine each column of campaigns catches, through which oracle, how often over",
        "seeds and how soon after the provoking fault window starts; and what the same campaigns say about the clean",
        "engine. Written by `benchmarks/detection_matrix.py` (see `benchmarks/README.md`); do not edit by hand.",
        "",
        f"- generated {now} by `{command}`",
        (
            f"- source digest: `{digests[0]}`"
            if len(digests) == 1 and digests[0]
            else "- source digest: not recorded"
            if len(digests) == 1
            else f"- source digest: mixed ({', '.join(str(d) if d else 'not recorded' for d in digests)})"
        )
        + (" (the current sources)" if digests == [digest] else f" (the current sources are `{digest}`)"),
        f"- commits: {_provenance(runs)}",
        f"- runs: {len(runs)} from {', '.join(f'`{s}`' for s in sources)}; seeds {_ranges(seeds)}",
        f"- machine load during the runs: {_load_line(matrix['load'])}",
        f"- summarised on: {cpus} usable CPUs, Linux {platform.release()}, Python {platform.python_version()}",
        "- columns: " + "; ".join(f"`{c}` = {COLUMN_TITLES.get(c, f'campaign {c}')}" for c in matrix["columns"]),
        "- detected: the run ended FAIL and one of the defect's intended oracles failed (tests/test_defects.py's rule)",
        "- first detection: the earliest failing finding of the catching oracle(s): its request's send time (a page",
        "  leak: the idle snapshot that showed it, mid-load or after the drain; a wedged target: the progress watchdog's",
        "  snapshot; no request: the verdict). Oracles list only their first findings per rule, so this is the earliest",
        "  listed one.",
        "- from window start: first detection minus the start of its provoking window, the last fault window (in",
        "  journal order) started at or before it; a window starts at its first journaled event (its undo plan, before",
        "  its provocation and inject). From load start: first detection minus the load start (negative: in the baseline).",
    ]
    stopped = [r for r in runs if r.stopped_at_detection]
    if stopped:
        lines += [
            f"- stopped at detection: {len(stopped)} of {len([r for r in runs if r.key != CLEAN])} defect runs "
            "(`--stop-at-detection`): interrupted with SIGINT",
            "  once an intended oracle already FAILed on the journal, on a FAIL that stays a FAIL as the journal grows",
            "  (the tenant test and the timing fit judge whole samples: they count from the baseline's end on). Up to",
            "  the interrupt each is the campaign's run, so whether and when it caught its defect is what the whole run",
            '  shows; its failing oracles are those that failed by then, and its run time (marked "stopped") is not a',
            "  whole campaign's. A run stopped in its baseline has no load start: its detection counts, before every",
            "  window, with no time for the medians.",
        ]
    columns = matrix["columns"]
    keys = sorted({k for c in columns.values() for k in c["defects"]})
    if keys and len(columns) > 1:
        lines += [
            "",
            "## At a glance: detected (median from window start)",
            "",
            "| defect | " + " | ".join(columns) + " |",
            "|---|" + "---:|" * len(columns),
        ]
        for key in keys:
            cells = []
            for c in columns.values():
                d = c["defects"].get(key)
                cells.append("not run" if d is None else f"{d['detected']}/{d['runs']} ({_secs(d['median_window_s'])})")
            lines.append(f"| `{key}` | " + " | ".join(cells) + " |")
    total_fp = 0
    for column, c in columns.items():
        lines += ["", f"## `{column}`: {COLUMN_TITLES.get(column, f'campaign {column}')}", ""]
        if c["defects"]:
            lines += [
                "| defect | campaign | intended oracles | detected | median from window start | median from load start | "
                "provoking window (runs) | caught by (runs) | each run from window start (s) | also failed |",
                "|---|---|---|---:|---:|---:|---|---|---|---|",
            ]
            for key, d in c["defects"].items():
                lines.append(
                    f"| `{key}` | {', '.join(d['campaigns'])} | {', '.join(d['intended']) if d['intended'] else 'any'} | "
                    f"{_rate(d)} | {_secs(d['median_window_s'])} | {_secs(d['median_first_s'])} | {_counts(d['windows'])} | "
                    f"{_counts(d['caught_by'])} | {', '.join(f'{x:g}' for x in d['window_s']) or '–'} | {_counts(d['other_failing'])} |"
                )
        else:
            lines.append("No defect runs in this column.")
        lines += [
            "",
            "Clean engine (false positives must be zero):",
            "",
            "| campaign | runs | seeds | verdicts | false positives | failing oracles |",
            "|---|---:|---|---|---:|---|",
        ]
        for campaign, k in c["clean"].items():
            fp = f"**{k['false_positives']}**" if k["false_positives"] else "0"
            lines.append(
                f"| {campaign} | {k['runs']} | {_ranges(k['seeds'])} | {_counts(k['verdicts'])} | {fp} | "
                f"{_counts(k['failing_oracles'])} |"
            )
        if not c["clean"]:
            lines.append("| (no clean runs) | 0 | – | – | – | – |")
        total_fp += sum(k["false_positives"] for k in c["clean"].values())
    lines += [
        "",
        f"False positives on the clean engine: **{total_fp}**"
        + (" (must be zero: see the runs below)." if total_fp else "."),
    ]
    lines += [
        "",
        "## Runs",
        "",
        "| column | defect | campaign | seed | verdict | failing oracles | first detection from load start (basis, oracle) | "
        "provoking window (from its start) | load 1 min (start → end) | run time | record |",
        "|---|---|---|---:|---|---|---|---|---|---:|---|",
    ]
    order = {c: n for n, c in enumerate(columns)}
    for r in sorted(
        runs,
        key=lambda r: (
            order.get(r.column, 99),
            r.key == CLEAN,
            r.key,
            r.campaign,
            r.seed if r.seed is not None else -1,
        ),
    ):
        first = r.first_detection() if r.key != CLEAN else None
        shown = f"{first.first_s:.1f} s ({first.basis}, {first.name})" if first and first.first_s is not None else "–"
        window = (
            f"{first.window} ({_secs(first.window_s)})"
            if first and first.window
            else r.window_of(first)
            if first and first.first_s is not None
            else "–"
        )
        if r.key != CLEAN and first is None and (placed := r.detection_window()) is not None:
            shown, window = "before the load (no load start)", placed
        load = f"{r.loadavg_start[0]:.2f} → {r.loadavg_end[0]:.2f}" if r.loadavg_start and r.loadavg_end else "–"
        problems = f" ⚠ {'; '.join(r.problems)}" if r.problems else ""
        lines.append(
            f"| {r.column} | {r.key} | {r.campaign} | {r.seed if r.seed is not None else '?'} | {r.verdict or '–'}{problems} | "
            f"{', '.join(r.failing) or '–'} | {shown} | {window} | {load} | {_secs(r.wall_s)}"
            f"{' (stopped)' if r.stopped_at_detection else ''} | `{_record_name(r)}` |"
        )
    return "\n".join(lines) + "\n"


def _ranges(seeds: Sequence[int]) -> str:
    """1, 2, 3, 5 -> "1–3, 5"."""
    if not seeds:
        return "–"
    parts, start, prev = [], seeds[0], seeds[0]
    for s in list(seeds[1:]) + [None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        parts.append(str(start) if start == prev else f"{start}–{prev}")
        if s is not None:
            start = prev = s
    return ", ".join(parts)


def _load_line(load: dict[str, Any]) -> str:
    if not load["readings"]:
        return "not recorded"
    cpus = ", ".join(map(str, load["cpus"])) or "?"
    missing = f"; {load['runs_without']} run(s) without readings" if load["runs_without"] else ""
    return (
        f"1-minute load average at each run's start and end: median {load['median']:.2f}, max {load['max']:.2f} "
        f"({load['readings']} readings, on {cpus} usable CPUs{missing})"
    )


def _provenance(runs: list[RunSummary]) -> str:
    """Which source digests (and commits) the runs were made from."""
    by_digest: dict[str | None, set[str]] = {}
    for run in runs:
        by_digest.setdefault(run.source_digest, set()).update([run.commit] if run.commit else [])
    return "; ".join(
        f"digest {d or 'not recorded'}" + (f" (commits {', '.join(sorted(c))})" if c else "")
        for d, c in sorted(by_digest.items(), key=lambda kv: str(kv[0]))
    )


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return path


# ---------------------------------------------------------------------------- running runs ----


@dataclass(frozen=True)
class Planned:
    column: str
    key: str  # defect name or "clean-<campaign>"
    campaign: str  # the campaign's file stem
    path: Path  # the campaign file
    defect: str | None
    seed: int

    def run_dir(self, out: Path) -> Path:
        return out / self.column / self.key / f"seed-{self.seed}"


def column_campaigns(
    column: str, defects: list[str], clean_campaigns: list[str] | None
) -> tuple[dict[str, Path], list[str]]:
    """(defect -> campaign file, the campaign stems run clean) of one column."""
    if column == "default":
        return {d: DEFAULT_CAMPAIGN for d in defects}, [DEFAULT_CAMPAIGN.stem]
    if column == "twin":
        return {d: TWIN_CAMPAIGN for d in defects}, [TWIN_CAMPAIGN.stem]
    mine = {d: CAMPAIGNS / f"{EXPECTED[d][0]}.yaml" for d in defects}
    return mine, clean_campaigns if clean_campaigns is not None else sorted({p.stem for p in mine.values()})


def plan(
    defects: list[str],
    seeds: list[int],
    clean_seeds: dict[str, list[int]],
    columns: Sequence[str] = ("defects",),
    clean_campaigns: list[str] | None = None,
) -> list[Planned]:
    """Seed-major (a partial matrix still covers every defect and column), one column after the
    other within a seed; the clean runs of a seed beside its defect runs, the extra clean seeds of
    a column (default: 20 for `default`) after the last defect seed."""
    runs = []
    per_column = {c: column_campaigns(c, defects, clean_campaigns) for c in columns}
    for n in range(max([len(seeds)] + [len(v) for v in clean_seeds.values()])):
        for column in columns:
            by_defect, clean = per_column[column]
            if n < len(seeds):
                for defect in defects:
                    path = by_defect[defect]
                    runs.append(Planned(column, defect, path.stem, path, defect, seeds[n]))
            if n < len(clean_seeds.get(column, [])):
                for campaign in clean:
                    path = (
                        DEFAULT_CAMPAIGN
                        if column == "default"
                        else TWIN_CAMPAIGN
                        if column == "twin"
                        else CAMPAIGNS / f"{campaign}.yaml"
                    )
                    runs.append(Planned(column, f"clean-{campaign}", campaign, path, None, clean_seeds[column][n]))
    return runs


def _sidecar(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads(run_dir.with_name(run_dir.name + ".result.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _complete(run_dir: Path) -> bool:
    if not (run_dir / JOURNAL_FILENAME).is_file():
        return False
    try:
        with Journal.open(run_dir, readonly=True) as journal:
            return any(True for _ in journal.iter_events(kind="verdict", name="run"))
    except (sqlite3.Error, JournalError, OSError):
        return False


# The `pdchaos run` children in flight: each runs in its own session (a Ctrl-C at the terminal
# does not reach it), so an interrupt of the matrix passes SIGINT on to every one, and each heals
# and reports before it exits.
_IN_FLIGHT: set[subprocess.Popen[bytes]] = set()
_IN_FLIGHT_LOCK = threading.Lock()
INTERRUPTED = threading.Event()  # set: what ends now was cut short, and is not recorded


def interrupt_in_flight(wait_s: float = 120.0) -> None:
    INTERRUPTED.set()
    with _IN_FLIGHT_LOCK:
        procs = list(_IN_FLIGHT)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
    for proc in procs:
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def execute(
    item: Planned,
    out: Path,
    timeout_s: float,
    digest: str | None = None,
    commit: str | None = None,
    stop_at_detection: bool = False,
) -> int | None:
    """One `pdchaos run`; its output goes next to the run directory, with a small sidecar that
    carries the exit code, the wall time, the machine's load and the sources' digest before and
    after the run. `stop_at_detection`: a defect's run is interrupted once one of the defect's
    intended oracles already FAILs on its journal (benchmarks/detection_watch.py), and the
    sidecar says so."""
    digest = source_digest() if digest is None else digest
    run_dir = item.run_dir(out)
    if _complete(run_dir) and _sidecar(run_dir).get("source_digest") == digest == _sidecar(run_dir).get(
        "source_digest_after"
    ):
        print(f"[matrix] {item.key} seed {item.seed} ({item.column}): already complete, reused", flush=True)
        return None
    if run_dir.exists():  # an interrupted run, or one of other sources: keep it for the record, start afresh
        stale = run_dir.with_name(
            f"{run_dir.name}.{'other-sources' if _complete(run_dir) else 'incomplete'}-{int(time.time())}"
        )
        run_dir.rename(stale)
        print(f"[matrix] {item.key} seed {item.seed}: earlier run moved to {stale}", flush=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable,
        "-m",
        "chaos.cli",
        "run",
        str(item.path),
        "--out",
        str(run_dir),
        "--quiet",
        "--seed",
        str(item.seed),
    ]
    if item.defect:
        argv += ["--defect", item.defect]
    env = dict(os.environ)
    for key, value in (
        ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0"),
        ("RAY_AUTH_MODE", "disabled"),
        ("HF_ENDPOINT", "http://127.0.0.1:9"),
    ):
        env.setdefault(key, value)  # as the Makefile sets them
    print(f"[matrix] {item.key} seed {item.seed} ({item.column}): {' '.join(argv[2:])}", flush=True)
    loadavg_start = [round(x, 2) for x in os.getloadavg()]
    started = time.monotonic()
    log = run_dir.with_name(run_dir.name + ".log")
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        with _IN_FLIGHT_LOCK:
            _IN_FLIGHT.add(proc)
        interrupted: list[bool] = []  # set by the watcher's interrupt: kept if the run then times out

        def interrupt() -> None:
            interrupted.append(True)
            proc.send_signal(signal.SIGINT)  # the driver alone, as its Ctrl-C handler sees it

        try:
            if stop_at_detection and item.defect in EXPECTED:
                wait_until_caught(proc, run_dir, EXPECTED[item.defect][1], timeout_s, interrupt)
                rc = proc.returncode
            else:
                rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = stop_past_time(proc, functools.partial(os.killpg, proc.pid))  # the whole group
        finally:
            with _IN_FLIGHT_LOCK:
                _IN_FLIGHT.discard(proc)
    wall = time.monotonic() - started
    loadavg_end = [round(x, 2) for x in os.getloadavg()]
    after = source_digest()
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 0
    run_dir.with_name(run_dir.name + ".result.json").write_text(
        json.dumps(
            {
                "argv": argv[1:],
                "rc": rc,
                "wall_s": round(wall, 1),
                "log": log.name,
                "loadavg_start": loadavg_start,
                "loadavg_end": loadavg_end,
                "cpus": cpus,
                "source_digest": digest,
                "source_digest_after": after,
                "commit": commit,
                "stopped_at_detection": bool(interrupted),
            }
        )
    )
    meaning = {0: "PASS", 1: "FAIL", 3: "INCONCLUSIVE"}.get(rc, f"error, see {log}")
    if interrupted:
        meaning += ", stopped at detection"
    print(
        f"[matrix] {item.key} seed {item.seed} ({item.column}): exit {rc} ({meaning}) in {wall:.0f} s, "
        f"load {loadavg_start[0]:.2f} -> {loadavg_end[0]:.2f}",
        flush=True,
    )
    if after != digest:
        print(
            f"[matrix] the sources changed during this run ({digest} -> {after}): it is not recorded",
            file=sys.stderr,
            flush=True,
        )
    return rc


# ------------------------------------------------------------------------------- self-test ----


def _synthetic_run(
    run_dir: Path,
    *,
    name: str,
    defects: list[str],
    seed: int,
    verdict: str,
    oracles: dict[str, list[dict[str, Any]]],
    requests: dict[str, float],
    start: float | None,
    drain_at: float | None = None,
    windows: Sequence[tuple[str, float, float, float]] = (),
    sidecar: dict[str, Any] | None = None,
) -> None:
    """A journal shaped like a finished `pdchaos run` (only what the matrix reads). `windows`:
    (fault, plan t, inject t, heal t), journaled in that order. `start` None: a run judged before
    its load started (stopped in its baseline)."""
    from chaos.journal import JournalEvent, RequestRecord

    with Journal.create(run_dir) as journal:
        journal.set_meta(
            "campaign", {"name": name, "seed": seed, "target": {"kind": "sim", "sim": {"defects": defects}}}
        )
        journal.set_meta("seed", seed)
        if start is not None:
            journal.set_meta("load_started_at", start)
        else:
            start = max(requests.values(), default=0.0)
        for n, (fault, planned, injected, healed) in enumerate(windows):
            wid = f"w{n + 1}"
            for step, t in (
                ("plan", planned),
                ("inject", injected),
                ("confirm", injected + 0.5),
                ("heal", healed),
                ("audit", healed + 0.1),
            ):
                journal.append_event(JournalEvent("fault", fault, {"window": wid, "step": step}, t=t))
        for n, (request_id, t_send) in enumerate(requests.items()):
            journal.append_request(
                RequestRecord(id=request_id, request_index=10_000 + n, t_send=t_send, t_end=t_send + 0.5)
            )
        if drain_at is not None:
            journal.append_event(
                JournalEvent("probe", "loads", {"role": "prefill", "phase": "after_drain", "data": {}}, t=drain_at)
            )
        for oracle, findings in oracles.items():
            result = {
                "name": oracle,
                "verdict": "FAIL" if findings else "PASS",
                "checked": 10,
                "findings": [
                    {"oracle": oracle, "verdict": "FAIL", "summary": "x", "request_id": None, **f} for f in findings
                ],
                "notes": [],
            }
            journal.append_event(JournalEvent("verdict", "oracle", result, t=start + 100))
        journal.append_event(
            JournalEvent(
                "verdict",
                "run",
                {"verdict": verdict, "exit_code": {"PASS": 0, "FAIL": 1}.get(verdict, 3)},
                t=start + 101,
            )
        )
    if sidecar is not None:
        run_dir.with_name(run_dir.name + ".result.json").write_text(json.dumps(sidecar))


def self_test() -> int:
    """Synthetic runs through --from-runs: three columns, leaks timed from their provoking window,
    page leaks (after the drain, mid-load), clean runs, the machine's load, stale records."""
    files = campaign_files()
    names = {f.column if f.column != "defects" else f.stem: name for name, f in files.items()}
    with tempfile.TemporaryDirectory(prefix="detection-matrix-") as tmp:
        root = Path(tmp)
        t0 = 1_800_000_000.0
        handoff_windows = [("kv_transfer", t0 + 1.0, t0 + 1.2, t0 + 3.0), ("router_link", t0 + 5.0, t0 + 5.5, t0 + 7.0)]
        side = {
            "wall_s": 40.0,
            "loadavg_start": [1.0, 1.0, 1.0],
            "loadavg_end": [3.0, 2.0, 1.0],
            "cpus": 2,
            "source_digest": "d2",
            "source_digest_after": "d2",
            "commit": "abc123",
        }
        # the `defects` column (campaigns/defects/)
        _synthetic_run(
            root / "a" / "seed-1",
            name=names["handoff"],
            defects=["metadata_slot_collision"],
            seed=1,
            verdict="FAIL",
            start=t0,
            requests={"r1": t0 + 9.0, "r2": t0 + 4.0, "r3": t0 + 2.0},
            oracles={
                "canary": [{"request_id": "r1"}, {"request_id": "r2"}],
                "reference": [],
                "status": [{"request_id": "r3"}],
            },
            windows=handoff_windows,
            sidecar=side,
        )
        _synthetic_run(
            root / "a" / "seed-2",
            name=names["handoff"],
            defects=["metadata_slot_collision"],
            seed=2,
            verdict="FAIL",
            start=t0,
            requests={"r1": t0 + 6.0},
            oracles={"canary": [], "reference": [{"request_id": "r1"}]},
            windows=handoff_windows,
            sidecar={
                **side,
                "loadavg_start": [9.0, 1.0, 1.0],
                "loadavg_end": [5.0, 1.0, 1.0],
                "stopped_at_detection": True,
            },
        )
        _synthetic_run(
            root / "b" / "x",
            name=names["aborts"],
            defects=["pages_leak_on_abort"],
            seed=1,
            verdict="FAIL",
            start=t0,
            requests={},
            drain_at=t0 + 45.0,
            oracles={"liveness": [{"evidence": {"role": "prefill"}}], "canary": []},
        )
        _synthetic_run(
            root / "b" / "y",
            name=names["aborts"],
            defects=["pages_leak_on_abort"],
            seed=2,
            verdict="FAIL",
            start=t0,
            requests={},
            drain_at=t0 + 45.0,
            oracles={"liveness": [{"evidence": {"role": "decode", "t_snapshot": t0 + 12.5}}]},
        )
        _synthetic_run(
            root / "c",
            name=names["handoff"],
            defects=[],
            seed=1,
            verdict="PASS",
            start=t0,
            requests={},
            oracles={"canary": [], "reference": []},
        )
        _synthetic_run(
            root / "d",
            name=names["cache"],
            defects=[],
            seed=1,
            verdict="FAIL",
            start=t0,
            requests={"q": t0 + 1.0},
            oracles={"reference": [{"request_id": "q"}]},
        )
        # the `default` column: two windows started before the finding; the last one provoked it
        default_windows = [
            ("kv_transfer", t0 + 2.0, t0 + 2.4, t0 + 7.0),
            ("client_abort", t0 + 14.0, t0 + 14.5, t0 + 18.0),
            ("transfer_stall", t0 + 38.0, t0 + 38.2, t0 + 42.0),
        ]
        _synthetic_run(
            root / "e" / "1",
            name=names["default"],
            defects=["free_before_transfer_done"],
            seed=1,
            verdict="FAIL",
            start=t0,
            requests={"u": t0 + 15.5, "v": t0 + 40.0},
            oracles={"reference": [{"request_id": "v"}], "canary": [{"request_id": "u"}]},
            windows=default_windows,
        )
        _synthetic_run(
            root / "e" / "2",
            name=names["default"],
            defects=["free_before_transfer_done"],
            seed=2,
            verdict="FAIL",
            start=t0,
            requests={"u": t0 + 14.0},
            oracles={"canary": [{"request_id": "u"}]},
            windows=default_windows,
        )
        _synthetic_run(
            root / "e" / "3",
            name=names["default"],
            defects=["rejected_prefill_handoff"],
            seed=1,
            verdict="FAIL",
            start=t0,
            requests={"b": t0 - 3.0},
            oracles={"status": [{"request_id": "b"}]},
            windows=default_windows,
        )
        _synthetic_run(
            root / "e" / "clean",
            name=names["default"],
            defects=[],
            seed=1,
            verdict="FAIL",
            start=t0,
            requests={"w": t0 + 20.0},
            oracles={"liveness": [{"request_id": "w"}]},
            windows=default_windows,
        )
        # the `twin` column: a defect it misses, a clean run INCONCLUSIVE (no false positive)
        _synthetic_run(
            root / "f" / "1",
            name=names["twin"],
            defects=["pages_leak_on_abort"],
            seed=1,
            verdict="PASS",
            start=t0,
            requests={},
            oracles={"liveness": []},
            windows=default_windows,
        )
        _synthetic_run(
            root / "f" / "clean",
            name=names["twin"],
            defects=[],
            seed=1,
            verdict="INCONCLUSIVE",
            start=t0,
            requests={},
            oracles={"canary": []},
            windows=default_windows,
        )
        # a run during which the sources changed: of no digest
        _synthetic_run(
            root / "g",
            name=names["handoff"],
            defects=[],
            seed=2,
            verdict="PASS",
            start=t0,
            requests={},
            oracles={"canary": []},
            sidecar={**side, "source_digest_after": "d3"},
        )
        runs = [summarize_run(p) for p in find_runs([root])]
        matrix = aggregate(runs)
        cols = matrix["columns"]
        d, dd = cols["defects"]["defects"], cols["default"]["defects"]
        checks = {
            "thirteen runs found": len(runs) == 13,
            "three columns, in order": list(cols) == ["default", "twin", "defects"],
            "leak: 2/2 detected": d["metadata_slot_collision"]["detected"] == 2,
            "leak: earliest intended finding (4 s, not status's 2 s)": d["metadata_slot_collision"]["first_s"]
            == [4.0, 6.0],
            "leak: median 5 s from load start": d["metadata_slot_collision"]["median_first_s"] == 5.0,
            "leak: from the start (first event) of the window started last before it: 3 s and 1 s": d[
                "metadata_slot_collision"
            ]["window_s"]
            == [3.0, 1.0]
            and d["metadata_slot_collision"]["median_window_s"] == 2.0,
            "leak: provoking windows named": d["metadata_slot_collision"]["windows"]
            == {"kv_transfer#w1": 1, "router_link#w2": 1},
            "leak: caught by canary 1, reference 1": d["metadata_slot_collision"]["caught_by"]
            == {"canary": 1, "reference": 1},
            "leak: status counted as also failed": d["metadata_slot_collision"]["other_failing"] == {"status": 1},
            "campaign stem from the YAML name": d["metadata_slot_collision"]["campaigns"] == ["handoff"],
            "page leak: timed at the drain snapshot, or at the idle snapshot mid-load": sorted(
                d["pages_leak_on_abort"]["first_s"]
            )
            == [12.5, 45.0]
            and d["pages_leak_on_abort"]["bases"] == {"drain snapshot": 1, "idle snapshot": 1},
            "page leak: no window in its journal, no window time": d["pages_leak_on_abort"]["window_s"] == []
            and d["pages_leak_on_abort"]["windows"] == {"(no fault window in the run)": 2},
            "default: the last window started before the finding (client_abort, not kv_transfer)": dd[
                "free_before_transfer_done"
            ]["windows"]
            == {"client_abort#w2": 2},
            "default: 1.5 s and 0 s from the window's start (a finding at the start counts), 15.5 and 14 from the load's": dd[
                "free_before_transfer_done"
            ]["window_s"]
            == [1.5, 0.0]
            and dd["free_before_transfer_done"]["first_s"] == [15.5, 14.0],
            "default: a detection in the baseline has no provoking window": dd["rejected_prefill_handoff"]["windows"]
            == {"(before every window)": 1}
            and dd["rejected_prefill_handoff"]["median_window_s"] is None
            and dd["rejected_prefill_handoff"]["median_first_s"] == -3.0,
            "default: every window of the run, from its first event": [
                [w["start_s"] for w in r.windows or []] for r in runs if r.path.endswith("e/1")
            ]
            == [[2.0, 14.0, 38.0]],
            "default: the clean run's FAIL is a false positive of its column": cols["default"]["clean"]["default"][
                "false_positives"
            ]
            == 1,
            "twin: a miss is 0/1": cols["twin"]["defects"]["pages_leak_on_abort"]["detected"] == 0,
            "twin: INCONCLUSIVE is no false positive": cols["twin"]["clean"]["sglang-launch-sim"]["false_positives"]
            == 0,
            "clean handoff: no false positive": cols["defects"]["clean"]["handoff"]["false_positives"] == 0,
            "clean cache: one false positive": cols["defects"]["clean"]["cache"]["false_positives"] == 1,
            "load: median and max of the 1-minute readings at start and end": matrix["load"]["median"] == 3.0
            and matrix["load"]["max"] == 9.0
            and matrix["load"]["readings"] == 6,
            "sidecar: digest and commit of an unchanged run": runs[0].source_digest == "d2"
            and runs[0].commit == "abc123",
            "sidecar: the one run stopped at detection": [r.path for r in runs if r.stopped_at_detection]
            == [str(root / "a" / "seed-2")],
            "sidecar: a run during which the sources changed has no digest": [
                r.source_digest for r in runs if r.path.endswith("/g")
            ]
            == [None],
        }
        text = markdown(runs, matrix, command="self-test", sources=[tmp], digest="d2")
        checks["doc: one table per column"] = all(f"## `{c}`: " in text for c in COLUMNS) and "## At a glance" in text
        checks["doc: flags the false positives"] = "False positives on the clean engine: **2**" in text
        checks["doc: mixed sources are headed as a diagnostic"] = (
            "**Not the matrix: a diagnostic of mixed sources.**" in text and "- source digest: mixed" in text
        )
        checks["doc: the runs stopped at detection, counted and marked"] = (
            "- stopped at detection: 1 of " in text and text.count("(stopped) |") == 1
        )
        _synthetic_run(
            root / "baseline-stop" / "seed-1",
            name=names["default"],
            defects=["cache_key_ignores_adapter"],
            seed=1,
            verdict="FAIL",
            start=None,
            requests={"r1": t0 - 20.0},
            oracles={"reference": [{"request_id": "r1"}]},
            sidecar={**side, "stopped_at_detection": True},
        )
        stopped_early = summarize_run(root / "baseline-stop" / "seed-1")
        early = _column_defects([stopped_early])["cache_key_ignores_adapter"]
        checks["a run stopped in its baseline: detected before every window, untimed, no problem"] = (
            stopped_early.ended_before_load
            and not stopped_early.problems
            and early["detected"] == 1
            and early["windows"] == {"(before every window)": 1}
            and early["median_first_s"] is None
            and "before the load (no load start)"
            in markdown([stopped_early], aggregate([stopped_early]), command="t", sources=[], digest="d2")
        )
        checks["doc: the load line"] = (
            "median 3.00, max 9.00 (6 readings, on 2 usable CPUs; 10 run(s) without readings)" in text
        )
        for run in runs:
            run.commit, run.source_digest = "abc123", "d1"
            write_record(root / "records", run)
        recorded = [run for _, run in read_records([root / "records"])]
        checks["records: one per (campaign, defect or clean, seed), and the same matrix read back"] = (
            len(recorded) == len(runs) and aggregate(recorded) == matrix
        )
        old_record = json.loads(record_path(root / "records", "metadata_slot_collision", "handoff", 1).read_text())
        old_record.pop("windows")
        for outcome in old_record["oracles"].values():
            outcome.pop("window"), outcome.pop("window_s")
        older = RunSummary(
            **{**old_record, "oracles": {n: OracleOutcome(**o) for n, o in old_record["oracles"].items()}}
        )
        checks["records: one made before window timing says its windows are not recorded"] = _column_defects([older])[
            "metadata_slot_collision"
        ]["windows"] == {"(windows not recorded)": 1}
        kept, left = select(recorded, "d2")
        checks["records: stale ones are never selected"] = not kept and len(left) == len(recorded)
        checks["records: --records-digest and --any-source select them"] = (
            len(select(recorded, "d2", records_digest="d1")[0])
            == len(recorded)
            == len(select(recorded, "d2", any_source=True)[0])
        )
        stale = markdown(recorded, matrix, command="self-test", sources=[tmp], digest="d2")
        checks["records: a doc of stale records says so, and names its digest"] = (
            "**Not the matrix: a diagnostic of other sources.**" in stale
            and [m.group(1) for line in stale.splitlines() if (m := DIGEST_LINE.match(line))] == ["d1"]
            and "digest d1 (commits abc123)" in stale
        )
        current = markdown(recorded, matrix, command="self-test", sources=[tmp], digest="d1")
        checks["records: a doc of the current sources has no banner"] = (
            "Not the matrix" not in current and "- source digest: `d1` (the current sources)" in current
        )
        planned = plan(
            ["metadata_slot_collision", "pages_leak_on_abort"],
            [1, 2],
            {"default": list(range(1, 21)), "twin": [1, 2, 3], "defects": [1, 2, 3]},
            COLUMNS,
        )
        by_column = Counter((p.column, p.defect is None) for p in planned)
        checks["plan: 2 defects x 2 seeds per column; clean 20 default, 3 twin, 3 per defect campaign"] = by_column == {
            ("default", False): 4,
            ("twin", False): 4,
            ("defects", False): 4,
            ("default", True): 20,
            ("twin", True): 3,
            ("defects", True): 6,
        }
        checks["plan: each column's campaign file"] = (
            {p.path for p in planned if p.column == "default"} == {DEFAULT_CAMPAIGN}
            and {p.path for p in planned if p.column == "twin"} == {TWIN_CAMPAIGN}
            and {p.path.name for p in planned if p.column == "defects"} == {"handoff.yaml", "aborts.yaml"}
        )
        checks["plan: seed-major, the extra clean seeds last"] = [p.seed for p in planned[:9]] == [1] * 9 and {
            p.column for p in planned[-17:]
        } == {"default"}
        checks["plan: run directories and records are one per key"] = len({p.run_dir(root) for p in planned}) == len(
            planned
        ) and len({record_path(root, p.defect or CLEAN, p.campaign, p.seed) for p in planned}) == len(planned)
        covered = {p.relative_to(REPO).as_posix() for p in source_files()}
        checks["digest: covers the campaigns of every column, not the other engines' targets"] = (
            {
                "campaigns/default.yaml",
                "benchmarks/campaigns/sglang-launch-sim.yaml",
                "campaigns/defects/handoff.yaml",
                "faults/window.py",
                "chaos/runner.py",
                "loadprofiles/users.py",
            }
            <= covered
            and {p for p in covered if p.startswith(SOURCE_EXCLUDED)}
            == {"chaos/targets/sglang/__init__.py", "chaos/targets/sglang/router.py"}
            and "campaigns/sglang-launch.yaml" not in covered
        )
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
    p.add_argument(
        "--campaigns",
        default=",".join(COLUMNS),
        help="columns to run, comma-separated: default, twin, defects (default: all three)",
    )
    p.add_argument("--seeds", type=int, default=3, help="seeds per defect in each column (default 3)")
    p.add_argument(
        "--clean-seeds",
        type=int,
        default=None,
        help="clean-engine seeds per campaign (default: 20 for default, 3 for twin and each per-defect campaign)",
    )
    p.add_argument("--first-seed", type=int, default=1, help="seeds are FIRST .. FIRST+SEEDS-1 (default 1)")
    p.add_argument("--defects", default=",".join(EXPECTED), help="comma-separated; default every defect")
    p.add_argument("--no-clean", action="store_true", help="skip the clean-engine runs")
    p.add_argument(
        "--clean-campaigns",
        default=None,
        help="the defects column: campaigns (stems in campaigns/defects/) to run clean; default those of the chosen defects",
    )
    p.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="where the runs go (default runs/detection-matrix-<time>); complete runs of these sources in it are reused",
    )
    p.add_argument(
        "--doc", type=Path, default=DEFAULT_DOC, help="the Markdown to write (default docs/detection-matrix.md)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the summary as JSON")
    p.add_argument(
        "--from-runs",
        type=Path,
        action="append",
        default=None,
        metavar="DIR",
        help="run nothing: summarise every run directory under DIR (repeatable)",
    )
    p.add_argument(
        "--records",
        type=Path,
        default=DEFAULT_RECORDS,
        help="where each finished run's summary is recorded, and reused from (default %(default)s)",
    )
    p.add_argument(
        "--no-records", dest="records", action="store_const", const=None, help="record nothing, reuse nothing"
    )
    p.add_argument(
        "--from-records",
        type=Path,
        action="append",
        default=None,
        metavar="DIR",
        help="run nothing: summarise the run records of the current sources under DIR (repeatable)",
    )
    p.add_argument(
        "--any-source",
        action="store_true",
        help="diagnostic: also runs and records of other sources; the doc is headed as mixed-source",
    )
    p.add_argument(
        "--records-digest",
        default=None,
        metavar="DIGEST",
        help="diagnostic: the runs and records of this digest instead of the current sources'; "
        "the doc is headed as such when it is not the current one",
    )
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S, help="seconds per run before it is interrupted")
    p.add_argument(
        "--stop-at-detection",
        action="store_true",
        help="interrupt a defect's run (SIGINT) once one of its intended oracles already FAILs on its journal; "
        "the doc counts the runs so stopped",
    )
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="runs at a time, taken in plan order (default 1; 2 on two cores: the doc states the load)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the runs it would make and stop")
    p.add_argument("--digest", action="store_true", help="print the current sources' digest and stop")
    p.add_argument("--self-test", action="store_true", help="check the summary on synthetic journals; runs nothing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.self_test:
        return self_test()
    if args.digest:
        print(source_digest())
        return 0
    command = "benchmarks/detection_matrix.py " + " ".join(sys.argv[1:] if argv is None else argv)
    stems = campaign_stems()
    found: list[RunSummary] = []
    if args.from_records:
        sources = [str(p) for p in args.from_records]
        found = [run for _, run in read_records(args.from_records)]
    elif args.from_runs:
        sources = [str(p) for p in args.from_runs]
        found = summarize_dirs(find_runs(args.from_runs), stems)
    else:
        outcome = run_matrix(args, stems)
        if isinstance(outcome, int):
            return outcome
        found, sources = outcome
    digest = source_digest()  # now: the sources may have changed while the matrix ran
    runs, left = select(found, digest, any_source=args.any_source, records_digest=args.records_digest)
    if left:
        wanted = args.records_digest or digest
        print(
            f"[matrix] {len(left)} run(s) or record(s) not of digest {wanted} left out (digests "
            f"{', '.join(str(d) for d in _digests(left))}; a stale record is never summarised into the matrix)",
            file=sys.stderr,
        )
    if not runs:
        print(f"no runs or records of digest {args.records_digest or digest} (of {len(found)} found)", file=sys.stderr)
        return 1
    matrix = aggregate(runs)
    text = markdown(runs, matrix, command=command, sources=[_relative(s) for s in sources], digest=digest)
    args.doc.parent.mkdir(parents=True, exist_ok=True)
    args.doc.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"matrix": matrix, "runs": [asdict(r) for r in runs]}, indent=2))
    print(text)
    print(
        f"[matrix] wrote {args.doc}"
        + ("" if _digests(runs) == [digest] else " (a diagnostic: not of the current sources)"),
        flush=True,
    )
    false_positives = sum(c["false_positives"] for col in matrix["columns"].values() for c in col["clean"].values())
    missed = sum(d["runs"] - d["detected"] for d in matrix["columns"].get("defects", {}).get("defects", {}).values())
    return 1 if false_positives or missed else 0


def run_matrix(args: argparse.Namespace, stems: dict[str, str]) -> tuple[list[RunSummary], list[str]] | int:
    """Make (or reuse) the planned runs. Returns what to summarise: with records, every record of
    the --records directory (the matrix accumulates there); without, the runs made now."""
    columns = [c.strip() for c in args.campaigns.split(",") if c.strip()]
    if not columns or any(c not in COLUMNS for c in columns):
        print(f"--campaigns: {args.campaigns!r}; columns are {', '.join(COLUMNS)}", file=sys.stderr)
        return 2
    columns = column_order(columns)
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
    clean_seeds = (
        {}
        if args.no_clean
        else {
            c: list(
                range(
                    args.first_seed,
                    args.first_seed + (args.clean_seeds if args.clean_seeds is not None else CLEAN_SEEDS[c]),
                )
            )
            for c in columns
        }
    )
    out = args.out_dir or REPO / "runs" / f"detection-matrix-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%MZ')}"
    planned = plan(defects, seeds, clean_seeds, columns, clean_campaigns)
    digest = source_digest()
    print(f"[matrix] {len(planned)} runs into {out}; columns {', '.join(columns)}; sources {digest}", flush=True)
    if args.dry_run:
        for item in planned:
            print(f"  {item.column:8} {item.key} seed {item.seed}: {_relative(str(item.path))} -> {item.run_dir(out)}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    commit = current_commit()
    runs = run_in_order(planned, lambda item: matrix_run(item, out, args, stems, commit), args.parallel)
    if args.records:
        return [run for _, run in read_records([args.records])], [str(args.records)]
    return runs, [str(out)]


def run_in_order(
    planned: list[Planned], work: Callable[[Planned], RunSummary | None], parallel: int = 1
) -> list[RunSummary]:
    """The planned runs, `parallel` at a time, each started when one ends, in plan order
    (seed-major: a matrix cut short still covers every defect); their summaries in plan order.
    A Ctrl-C starts nothing more, interrupts the runs in flight (each heals and reports; none is
    recorded) and returns what had finished."""
    width = max(1, parallel)
    queue = iter(enumerate(planned))
    in_flight: dict[Future[RunSummary | None], int] = {}
    finished: dict[int, RunSummary | None] = {}
    with ThreadPoolExecutor(max_workers=width, thread_name_prefix="matrix") as pool:
        try:
            while True:
                for index, item in itertools.islice(queue, width - len(in_flight)):
                    in_flight[pool.submit(work, item)] = index
                if not in_flight:
                    break
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    finished[in_flight.pop(future)] = future.result()
        except KeyboardInterrupt:
            print("[matrix] interrupted: summarising the runs made so far", flush=True)
            interrupt_in_flight()
    return [run for _, run in sorted(finished.items()) if run is not None]


def summarize_dirs(run_dirs: list[Path], stems: dict[str, str]) -> list[RunSummary]:
    runs = []
    for run_dir in run_dirs:
        try:
            runs.append(summarize_run(run_dir, stems))
        except (sqlite3.Error, JournalError, OSError, ValueError, TypeError) as exc:  # keep the rest
            print(
                f"[matrix] {run_dir}: cannot read the journal ({type(exc).__name__}: {exc}); left out", file=sys.stderr
            )
    return runs


def matrix_run(
    item: Planned, out: Path, args: argparse.Namespace, stems: dict[str, str], commit: str | None
) -> RunSummary | None:
    """One planned run: its record when one of the current sources exists, else the run (made or
    reused) summarised, and recorded when the sources did not change while it ran."""
    digest = source_digest()  # per run: other people's edits change it while a long matrix runs
    if args.records:
        existing = record_path(args.records, item.defect or CLEAN, item.campaign, item.seed)
        if existing.is_file():
            try:
                recorded = read_record(existing)
            except (ValueError, TypeError, OSError):
                recorded = None
            if recorded is not None and recorded.source_digest == digest:
                print(
                    f"[matrix] {item.key} seed {item.seed} ({item.column}): recorded for these sources, reused "
                    f"({_relative(str(existing))})",
                    flush=True,
                )
                return recorded
    if INTERRUPTED.is_set():
        return None
    execute(item, out, args.timeout, digest, commit, stop_at_detection=args.stop_at_detection)
    run_dir = item.run_dir(out)
    if INTERRUPTED.is_set() or not (run_dir / JOURNAL_FILENAME).is_file():
        return None
    summaries = summarize_dirs([run_dir], stems)
    if not summaries:
        return None
    [run] = summaries
    if args.records and run.verdict is not None and run.source_digest is not None:
        write_record(args.records, run)
    return run


if __name__ == "__main__":
    sys.exit(main())
