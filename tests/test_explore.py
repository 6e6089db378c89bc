"""`pdchaos run --explore`: drawn schedules, the first FAIL, its shrinking, and a reproduce.yaml
that still fails when re-run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.campaign_validation import load_campaign
from chaos.explore import confirmed, draw_schedule, shrink, shrink_steps
from chaos.verdict import Verdict

ROOT = Path(__file__).resolve().parent.parent
POOL = ROOT / "tests" / "campaigns" / "explore.yaml"


def test_drawn_schedules_are_seeded_valid_and_built_from_the_campaigns_own_windows() -> None:
    campaign = load_campaign(POOL)
    own = {(w.fault, tuple(sorted(w.params))) for w in campaign.windows()}
    for k in range(1, 6):
        drawn = draw_schedule(campaign, k)
        assert drawn.windows() == draw_schedule(campaign, k).windows()  # seeded: the same every time
        assert {(w.fault, tuple(sorted(w.params))) for w in drawn.windows()} <= own
        ends = [w.at_s + w.duration_s for w in drawn.windows()]
        assert drawn.load.duration_s > max(ends)  # the load outlasts every window
        originals = {w.fault: w.duration_s for w in campaign.windows()}
        assert all(w.duration_s >= originals[w.fault] for w in drawn.windows())  # a stall still outlasts the timeout


def test_shrinking_keeps_only_what_the_failure_needs(tmp_path: Path) -> None:
    """With a stand-in run that FAILs whenever a client_abort window is present."""
    campaign = draw_schedule(load_campaign(POOL), 1)
    assert {w.fault for w in campaign.windows()} == {"client_abort", "transfer_stall"}
    tried: list[str] = []

    def attempt(label: str, candidate, run_dir: Path) -> Verdict:  # type: ignore[no-untyped-def]
        tried.append(label)
        return Verdict.FAIL if any(w.fault == "client_abort" for w in candidate.windows()) else Verdict.PASS

    minimal = shrink(campaign, tmp_path, attempt)
    assert [w.fault for w in minimal.windows()] == ["client_abort"]
    assert minimal.load.duration_s < campaign.load.duration_s
    assert any("without transfer_stall" in t for t in tried) and any("without client_abort" in t for t in tried)


def test_a_shrunk_schedule_that_does_not_fail_again_gives_way_to_the_step_before_that_does(tmp_path: Path) -> None:
    """A timing-dependent FAIL: the smallest schedule failed once by luck and passes when confirmed;
    the counterexample is the last step that fails twice, not the lucky one."""
    campaign = draw_schedule(load_campaign(POOL), 1)
    steps = shrink_steps(campaign, tmp_path, lambda *_: Verdict.FAIL)  # every removal "fails" once
    assert len(steps) >= 3 and steps[0] is campaign
    lucky, before = steps[-1], steps[-2]
    tried: list[str] = []

    def attempt(label: str, candidate, run_dir: Path) -> Verdict:  # type: ignore[no-untyped-def]
        tried.append(label)
        return Verdict.PASS if candidate is lucky else Verdict.FAIL

    assert confirmed(steps, tmp_path, attempt) == (before, True)
    assert tried == ["confirm: the shrunk schedule once more", f"confirm: the shrink's step {len(steps) - 2} once more"]
    assert confirmed(steps, tmp_path, lambda *_: Verdict.PASS) == (lucky, False)  # none fails again: said in the file


@pytest.mark.integration
@pytest.mark.timeout(1500)  # up to six short runs: explore, shrink steps, the confirmation, the re-run
def test_explore_finds_the_defect_shrinks_it_and_the_reproduction_still_fails(tmp_path: Path) -> None:
    out = tmp_path / "explore"
    cmd = [
        sys.executable,
        "-m",
        "chaos.cli",
        "run",
        str(POOL),
        "--explore",
        "3",
        "--out",
        str(out),
        "--quiet",
        "--defect",
        "abort_reported_as_length",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    attempts = json.loads((out / "explore.json").read_text())
    assert attempts[0]["verdict"] == "FAIL" and attempts[0]["label"].startswith("explore 1/")
    assert attempts[-1]["label"].startswith("confirm") and attempts[-1]["verdict"] == "FAIL"
    reproduce = out / "reproduce.yaml"
    minimal = load_campaign(reproduce)
    # The stall was not needed. If it stays, the message shows why the run without it did not FAIL.
    assert [w.fault for w in minimal.windows()] == ["client_abort"], _why_not_failed(attempts)
    assert minimal.target.sim is not None and "abort_reported_as_length" in minimal.target.sim.defects
    rerun = subprocess.run(
        [sys.executable, "-m", "chaos.cli", "run", str(reproduce), "--out", str(tmp_path / "again"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert rerun.returncode == 1, rerun.stdout + rerun.stderr[-3000:]
    assert "status FAIL" in rerun.stdout


def _why_not_failed(attempts: list[dict[str, object]]) -> str:
    """The attempts, and the summary of each run that did not FAIL: a shrink step that keeps a
    window the defect does not need is a timing question, and this says which."""
    lines = [f"{a['label']}: {a['verdict']} {a['windows']}" for a in attempts]
    for a in attempts:
        summary = Path(str(a["run_dir"])) / "summary.md"
        if a["verdict"] != "FAIL" and summary.exists():
            lines += [f"--- {a['label']}", summary.read_text()[:2500]]
    return "\n".join(lines)
