"""The detection matrix's summary, and the committed document against the committed run records."""

from __future__ import annotations

import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pytest import MonkeyPatch

from chaos.journal import JOURNAL_FILENAME
from tests.run_fixtures import write_crashed_run

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import detection_matrix as dm  # noqa: E402
import detection_watch  # noqa: E402

failing_so_far = detection_watch.failing_so_far

RERUN = (
    "re-run the matrix (.venv/bin/python benchmarks/detection_matrix.py, see benchmarks/README.md) and commit "
    "its records under benchmarks/results/detection-matrix/ with docs/detection-matrix.md"
)


def test_the_summary_self_test_passes() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "detection_matrix.py"), "--self-test"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "self-test passed" in result.stdout


def test_every_committed_record_reads_back_and_names_a_known_defect() -> None:
    found = dm.read_records([dm.DEFAULT_RECORDS])
    assert found, f"no run records under {dm.DEFAULT_RECORDS}"
    campaigns = {f.stem for f in dm.campaign_files().values()}
    for path, run in found:
        assert run.campaign in campaigns, path
        assert all(d in dm.DEFECTS for d in run.defects), path
        assert run.verdict in ("PASS", "FAIL", "INCONCLUSIVE"), path
        assert run.source_digest and run.commit, f"{path}: no provenance"
        assert path == dm.record_path(dm.DEFAULT_RECORDS, run.key, run.campaign, run.seed)


def _tables(text: str) -> list[str]:
    """The document's table rows, without the generated-at and command lines."""
    return [line for line in text.splitlines() if line.startswith("|")]


def _doc_digest() -> str | None:
    """The one source digest the committed document says it was made from (None: mixed or none)."""
    text = (ROOT / "docs" / "detection-matrix.md").read_text()
    found = [m.group(1) for line in text.splitlines() if (m := dm.DIGEST_LINE.match(line))]
    return found[0] if len(found) == 1 else None


def test_the_committed_document_is_what_the_committed_records_of_its_digest_say(tmp_path: Path) -> None:
    digest = _doc_digest()
    assert digest, f"docs/detection-matrix.md names no single source digest (a mixed-source diagnostic?): {RERUN}"
    doc = tmp_path / "matrix.md"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "detection_matrix.py"),
            "--from-records",
            str(dm.DEFAULT_RECORDS),
            "--records-digest",
            digest,
            "--doc",
            str(doc),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert doc.is_file(), f"no records of digest {digest}: {RERUN}\n" + result.stdout + result.stderr
    committed = (ROOT / "docs" / "detection-matrix.md").read_text()
    assert _tables(doc.read_text()) == _tables(committed), (
        f"docs/detection-matrix.md is not what the records of digest {digest} say: regenerate it with "
        f"benchmarks/detection_matrix.py --from-records benchmarks/results/detection-matrix"
    )


def test_the_matrix_doc_is_of_the_current_sources() -> None:
    digest, current = _doc_digest(), dm.source_digest()
    assert digest == current, (
        f"docs/detection-matrix.md was made from runs of sources {digest}; the current sources are {current} "
        f"(benchmarks/detection_matrix.py --digest): its figures say nothing about these sources: {RERUN}"
    )


def test_the_twin_has_the_windows_of_sglang_launch_in_its_order() -> None:
    """benchmarks/campaigns/sglang-launch-sim.yaml mirrors campaigns/sglang-launch.yaml: every window
    of a fault that runs on the embedded engine, in the same order, on the same role or link."""
    import yaml

    from faults.registry import FAULTS

    def windows(path: Path) -> list[tuple[str, object]]:
        spec = yaml.safe_load(path.read_text())["faults"]["windows"]
        return [
            (w["fault"], (w.get("params") or {}).get("role") or (w.get("params") or {}).get("link"))
            for w in spec
            if "sim" in FAULTS[w["fault"]].targets
        ]

    launch, twin = windows(ROOT / "campaigns" / "sglang-launch.yaml"), windows(dm.TWIN_CAMPAIGN)
    assert twin == launch, (
        f"{dm.TWIN_CAMPAIGN.relative_to(ROOT)} is out of step with campaigns/sglang-launch.yaml: {twin} != {launch}"
    )
    assert yaml.safe_load(dm.TWIN_CAMPAIGN.read_text())["target"]["kind"] == "sim"


def _planned(n: int) -> list[dm.Planned]:
    return [
        dm.Planned("default", "clean-default", "default", dm.DEFAULT_CAMPAIGN, None, seed) for seed in range(1, n + 1)
    ]


def _summary(seed: int) -> dm.RunSummary:
    return dm.RunSummary(
        path=f"seed-{seed}",
        campaign="default",
        defects=[],
        seed=seed,
        verdict="PASS",
        exit_code=0,
        load_started_at=None,
    )


def test_runs_go_n_at_a_time_in_plan_order() -> None:
    import threading

    lock, running, most = threading.Lock(), [0], [0]

    def work(item: dm.Planned) -> dm.RunSummary:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.05 * (6 - item.seed))  # the early runs take longest: they finish last
        with lock:
            running[0] -= 1
        return _summary(item.seed)

    runs = dm.run_in_order(_planned(5), work, parallel=2)
    assert [r.seed for r in runs] == [1, 2, 3, 4, 5]
    assert most[0] == 2


def test_an_interrupt_starts_nothing_more_and_records_nothing_cut_short() -> None:
    started: list[int] = []

    def work(item: dm.Planned) -> dm.RunSummary:
        started.append(item.seed)
        if item.seed == 2:
            raise KeyboardInterrupt  # as if Ctrl-C reached the matrix while run 2 was in flight
        return _summary(item.seed)

    dm.INTERRUPTED.clear()
    try:
        runs = dm.run_in_order(_planned(6), work, parallel=1)
        assert [r.seed for r in runs] == [1]  # what finished before the interrupt
        assert started == [1, 2]  # nothing started after it
        assert dm.INTERRUPTED.is_set()  # matrix_run neither starts nor records a run from now on
    finally:
        dm.INTERRUPTED.clear()


def test_the_watcher_interrupts_a_run_once_an_oracle_asked_for_fails(tmp_path: Path, monkeypatch: MonkeyPatch) -> None:
    """benchmarks/detection_watch.py (the matrix's --stop-at-detection, tests/test_defects.py) on
    the journal of a run caught mid-run: a leak journaled, no verdict yet."""
    monkeypatch.setattr(detection_watch, "WATCH_S", 0.2)
    in_progress = write_crashed_run(tmp_path / "leaky", leak=True, crash_at_s=40.0)
    assert "canary" in detection_watch.failing_so_far(in_progress)
    assert detection_watch.failing_so_far(tmp_path / "not-made-yet") == set()
    earlier = shutil.copytree(in_progress, tmp_path / "before-its-load")  # the same journal, before the load: no look
    db = sqlite3.connect(earlier / JOURNAL_FILENAME)
    with db:
        db.execute("DELETE FROM meta WHERE key = 'load_started_at'")
    db.close()
    assert detection_watch.failing_so_far(earlier) == set()

    run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    interrupted = detection_watch.wait_until_caught(
        run, in_progress, {"canary", "reference"}, 30, lambda: run.send_signal(signal.SIGINT)
    )
    assert interrupted and run.returncode == -signal.SIGINT

    # Nothing asked for fails: the run is left to end on its own, looked at all along.
    looks: list[set[str]] = []
    monkeypatch.setattr(detection_watch, "failing_so_far", lambda d: looks.append(failing_so_far(d)) or looks[-1])
    asked: list[str] = []
    run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"])
    assert not detection_watch.wait_until_caught(run, in_progress, {"tenant_isolation"}, 30, lambda: asked.append("!"))
    assert run.returncode == 0 and not asked
    assert looks and all("canary" in look for look in looks)

    # Past its time the caller is told, and stops the run itself: SIGINT first.
    run = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            detection_watch.wait_until_caught(run, in_progress, {"tenant_isolation"}, 1, lambda: asked.append("!"))
        assert run.poll() is None and not asked
        sent: list[int] = []
        rc = detection_watch.stop_past_time(run, lambda signum: sent.append(signum) or run.send_signal(signum))
        assert rc == -signal.SIGINT and sent == [signal.SIGINT]
    finally:
        run.kill()
        run.wait()
