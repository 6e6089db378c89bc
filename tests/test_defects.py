"""The campaign users run catches every defect of the embedded engine, through an oracle that
names the mechanism (a leak with its victim, a reference mismatch, a status or usage contract
breach, liveness); the clean engine passes the same campaign with the same seed
(tests/test_run.py).

The campaign is the shipped `campaigns/default.yaml`, as `make run` runs it, not the per-defect
campaigns of `campaigns/defects/` (the detection matrix measures those as a second column). A
leak finding must name a victim that is really in the journal and whose marker really is in the
offending response.

A run is watched while it runs (benchmarks/detection_watch.py, the detection matrix's watcher):
once its load has started and the product's own judge already FAILs its journal through one of
the defect's oracles, the run gets SIGINT, a user's Ctrl-C (it heals the fault, stops the load and judges what it
journaled). What the test asserts is that run's own verdict. A defect caught in the first window
so costs about a minute instead of the whole campaign (about four minutes here); a run in which
nothing fails runs to its end.

A defect caught in most seeds but not all (docs/detection-matrix.md gives each rate) is missed
by one seed now and then. A run that misses is followed by one
more, with the next seed, and the test says so (a warning naming both runs); two misses in a row
fail. The rate itself is the detection matrix's to measure, not this test's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from chaos.journal import Journal
from chaos.markers import MarkerCodec
from chaos.targets.sim.defects import DEFECTS
from tests.conftest import selected_params

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from detection_watch import stop_past_time, wait_until_caught  # noqa: E402  (the detection matrix's own watcher)

DEFAULT = ROOT / "campaigns" / "default.yaml"

# defect -> oracles of which at least one must FAIL, from the defect registry
EXPECTED = {d.name: set(d.caught_by) for d in DEFECTS.values()}
# Two runs at a time: ten default campaigns one after the other would take most of CI's hour. A
# defect must be caught on a busy machine too; the clean engine's PASS is tested alone (test_run).
PARALLEL = int(os.environ.get("PDCHAOS_DEFECT_RUNS_PARALLEL", "2"))
RUN_TIMEOUT_S = 900


def run(out: Path, defect: str, seed: int | None = None) -> subprocess.CompletedProcess[str]:
    """`pdchaos run` of the default campaign with the defect switched on, interrupted once its
    journal already FAILs through one of the defect's oracles (benchmarks/detection_watch.py)."""
    args = [sys.executable, "-m", "chaos.cli", "run", str(DEFAULT), "--out", str(out), "--quiet", "--defect", defect]
    if seed is not None:
        args += ["--seed", str(seed)]
    log = out.with_name(f"{out.name}.log")
    with log.open("w") as sink:
        process = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        try:
            wait_until_caught(process, out, EXPECTED[defect], RUN_TIMEOUT_S, lambda: process.send_signal(signal.SIGINT))
        except subprocess.TimeoutExpired:
            stop_past_time(process, process.send_signal)
    return subprocess.CompletedProcess(args, process.returncode, log.read_text(), "")


def caught(defect: str, out: Path, result: subprocess.CompletedProcess[str]) -> bool:
    return result.returncode == 1 and bool(EXPECTED[defect] & set(failing_oracles(out)))


@dataclass(frozen=True)
class DefectRun:
    out: Path
    result: subprocess.CompletedProcess[str]
    missed_by: Path | None = None  # the campaign's own seed's run, when it missed and SECOND_SEED ran


SECOND_SEED = 8  # the campaign's own is 7


@pytest.fixture(scope="module")
def defect_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, DefectRun]:
    """One run per selected defect (all ten unless `-k` narrows them), `PARALLEL` at a time."""
    selected = sorted(str(d) for d in selected_params(request, "defect"))
    root = tmp_path_factory.mktemp("defects")

    def one(defect: str) -> tuple[str, DefectRun]:
        out = root / defect
        result = run(out, defect)
        if caught(defect, out, result):
            return defect, DefectRun(out, result)
        again = root / f"{defect}-seed-{SECOND_SEED}"
        return defect, DefectRun(again, run(again, defect, SECOND_SEED), missed_by=out)

    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        return dict(pool.map(one, selected))


def failing_oracles(out: Path) -> dict[str, list[dict]]:
    with Journal.open(out, readonly=True) as journal:
        return {
            e.data["name"]: e.data["findings"]
            for e in journal.iter_events(kind="verdict", name="oracle")
            if e.data["verdict"] == "FAIL"
        }


@pytest.mark.parametrize("defect", sorted(EXPECTED))
@pytest.mark.timeout(3600)  # the first one waits for all ten runs
def test_the_default_campaign_fails_each_defect_through_its_oracle(defect_runs: dict, defect: str) -> None:
    oracles = EXPECTED[defect]
    done = defect_runs[defect]
    out, result = done.out, done.result
    if done.missed_by is not None:
        warnings.warn(
            f"{defect}: missed by the campaign's seed ({done.missed_by}); judged on seed {SECOND_SEED} ({out})",
            stacklevel=1,
        )
    assert result.returncode == 1, result.stdout[-3000:]
    failed = failing_oracles(out)
    assert oracles & set(failed), f"{defect}: expected one of {oracles} to fail, got {sorted(failed)}"
    with Journal.open(out, readonly=True) as journal:
        codec = MarkerCodec(journal.get_meta("run_prefix"))
        leaks = failed.get("canary", [])
        journaled = {r.request_index for r in journal.iter_requests()} if leaks else set()
        for finding in leaks:
            victim = finding.get("victim_request_id")
            if victim is None:
                # No victim named: then the marker's request really is in no record (its own
                # marker garbled, or a fragment too short to name one), not one attribution missed.
                (hit,) = codec.scan(finding["evidence"]["marker"])
                assert hit.request_index not in journaled, finding["summary"]
                continue
            offender, record = journal.get_request(finding["request_id"]), journal.get_request(victim)
            assert offender is not None and record is not None
            marker = finding["evidence"]["marker"]
            assert marker in offender.response_text
            # The victim's own marker. A leaked marker can arrive garbled (its check characters
            # from another page): then its visible id and slot must be the victim's.
            (hit,) = codec.scan(marker)
            own = marker if hit.verified else codec.marker(record.request_index, hit.slot or 0)
            assert hit.request_index == record.request_index, (marker, record.request_index)
            assert any(own in m for m in record.markers) or own in record.prompt
