"""`pdchaos run` end to end on the embedded engine: the default campaign, a held schedule, a broken load, the verdict from the journal (stopped runs: tests/test_stop_signals.py)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from chaos.journal import Journal, JournalError
from chaos.judging.judge import judge
from chaos.targets.state import state_path, stop_from_state
from chaos.verdict import Verdict
from chaos.windows import windows_from_events
from tests.bystander import Bystander
from tests.conftest import run_cli, wait_until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from soak import left_behind  # noqa: E402  (the soak benchmark's own check that nothing of a run is left)


@pytest.mark.timeout(900)  # the whole default campaign: about four minutes here
def test_the_default_campaign_passes_with_every_fault_confirmed_and_healed(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Kills, stalls and restarts of every role and of the router, beside a process that looks
    # like one of them: it must come through untouched (issue: faults never touch what the
    # target does not own).
    bystander = Bystander.start(tmp_path / "bystander")
    try:
        result = subprocess.run(
            [sys.executable, "-m", "chaos.cli", "run", "campaigns/default.yaml", "--out", str(out), "--quiet"],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=ROOT,
        )
        untouched = bystander.check()
    finally:
        bystander.stop()
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert untouched == [], untouched
    assert "verdict: PASS" in result.stdout
    with Journal.open(out, readonly=True) as journal:
        windows = windows_from_events(journal.iter_events(kind="fault"))
        audits = [e.data for e in journal.iter_events(kind="fault") if e.data.get("step") == "audit"]
        phases = {r.phase for r in journal.iter_requests()}
    assert len(windows) == 10
    assert all(w.confirmed and w.healed for w in windows), [
        (w.label, w.confirm_evidence) for w in windows if not w.confirmed
    ]
    assert len(audits) == 10 and all(a["clean"] for a in audits)
    assert {"baseline", "load", "aftershock"} <= phases
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "PASS" and report["exit_code"] == 0 and report["leaks"] == []
    assert report["requests"]["total"] > 200
    # Every not-ok ending of the clean engine is explained: refused as it should be, or hit by a fault
    endings = report["requests"]["endings"]
    assert endings["unexplained"] <= report["requests"]["total"] // 100, endings
    assert len(ET.parse(out / "junit.xml").getroot().findall(".//testcase")) >= 10 * 8
    assert (out / "report.html").read_text().count("<svg") >= 4
    assert (out / "reproduce.yaml").exists() and (out / "summary.md").exists()
    assert not (out / "target.json").exists()  # the stack was stopped
    # The verdict is the journal's: judged again from the run directory alone, the same one
    again = subprocess.run(
        [sys.executable, "-m", "chaos.cli", "report", str(out), "--out", str(tmp_path / "again"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert again.returncode == 0, again.stderr[-2000:]
    rejudged = json.loads(again.stdout)
    assert (rejudged["verdict"], rejudged["reasons"]) == (report["verdict"], report["reasons"])


@pytest.mark.timeout(600)
def test_the_load_stages_wait_while_a_window_runs_past_its_planned_end(tmp_path: Path) -> None:
    """A restart planned for 1 s takes several (with its aftershock probes and provocation): the
    schedule clock stands still meanwhile, so the flush planned inside the lull (4-7 s) still meets
    the lull, not the load, though it starts after 7 s of wall time (loadprofiles/clock.py)."""
    out = tmp_path / "run"
    campaign = tmp_path / "held.yaml"
    campaign.write_text(HELD_SCHEDULE)
    result = subprocess.run(
        [sys.executable, "-m", "chaos.cli", "run", str(campaign), "--out", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    summary = json.loads(result.stdout)  # --json: one object and nothing else on stdout
    assert (summary["verdict"], summary["exit_code"], summary["run_dir"]) == ("PASS", 0, str(out))
    with Journal.open(out, readonly=True) as journal:
        held = [e.data for e in journal.iter_events(kind="phase") if e.name == "schedule:held"]
        windows = windows_from_events(journal.iter_events(kind="fault"))
        load_sends = [r.t_send for r in journal.iter_requests() if r.phase == "load" and r.t_send is not None]
        load_started = journal.get_meta("load_started_at")
    _restart, flush = windows
    assert held and held[-1]["total_held_s"] > 1.0, held  # the restart's tail, the flush's late start
    assert flush.confirmed, flush.confirm_evidence
    assert flush.start is not None and flush.end is not None
    # the restart, its aftershock and its provocation's last waves outlast the lull's wall time
    assert flush.start - load_started > 7.0, "the flush did not start after the lull's planned end: nothing was held"
    during = [t for t in load_sends if flush.start <= t <= flush.end]
    assert not during, f"{len(during)} load request(s) sent during the flush, which the campaign put in a lull"
    assert max(load_sends) > flush.end  # and the load came back after the lull


def test_a_run_whose_load_machinery_breaks_ends_inconclusive_with_the_cause_and_stops_everything(
    tmp_path: Path,
) -> None:
    """A load actor dies mid-run (what a crashed Ray node does): no verdict on the target, exit 3,
    the cause in the report, no traceback, and the stack stopped."""
    import psutil

    out = tmp_path / "run"
    campaign = tmp_path / "lost.yaml"
    campaign.write_text("name: lost-load\nload: {profile: canary-chat, users: 4, duration: 60s}\nprobes: {count: 4}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos.cli", "run", str(campaign), "--out", str(out), "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    family: list[psutil.Process] = []
    try:

        def command_line(process: psutil.Process) -> str:
            try:
                return " ".join(process.cmdline() or [process.name()])
            except psutil.Error:  # one of Ray's short-lived helpers, gone since the listing
                return ""

        def load_actor() -> psutil.Process | None:
            if not _load_started(out):
                return None
            family[:] = psutil.Process(proc.pid).children(recursive=True)
            return next((p for p in family if "LoadGenerator" in command_line(p)), None)

        actor = wait_until(load_actor, timeout_s=120, what="a load actor running")
        time.sleep(2.0)
        actor.kill()
        stdout, _ = proc.communicate(timeout=180)
        # What the run itself stopped, read before this test's own cleanup stops whatever is left
        left_running = left_behind(family)
        state_left = state_path(out).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_from_state(out)
    assert proc.returncode == 3, stdout
    assert "verdict: INCONCLUSIVE" in stdout and 'chaos/runner.py", line' not in stdout  # Ray may print its own
    assert "ActorDiedError" in (out / "error.log").read_text()
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "INCONCLUSIVE"
    assert any("the suite failed: ActorDiedError" in r for r in report.get("reasons", [])), report.get("reasons")
    assert left_running == [], f"left running by the run itself: {left_running}"
    assert not state_left, "target.json left behind: the run did not stop its stack"


def _load_started(out: Path) -> bool:
    try:
        with Journal.open(out, readonly=True) as journal:
            return any(e.name == "load:start" for e in journal.iter_events(kind="phase"))
    except (JournalError, OSError):
        return False


# The smallest campaign of this module: the held schedule's.
HELD_SCHEDULE = (
    "name: held-schedule\n"
    "target: {sim: {waiting_timeout_s: 3}}\n"
    "load: {profile: canary-chat, users: 4, shape: stages, duration: 30s,\n"
    "       stages: [{until: 4s, users: 4}, {until: 7s, users: 0}, {until: 30s, users: 4}]}\n"
    "probes: {count: 4, interval: 1s}\n"
    "faults: {windows: [\n"
    "  {fault: memory_fraction, at: 2s, duration: 1s, params: {role: prefill, max_total_tokens: 2048}},\n"
    "  {fault: cache_flush, at: 4.5s, duration: 2s, params: {role: both, interval_s: 0.5}}]}\n"
)


def _as_journaled(value: object) -> object:
    return json.loads(json.dumps(dataclasses.asdict(value)))  # type: ignore[call-overload]


def _cut_as_a_kill_would(run_dir: Path, copy: Path, at: float) -> None:
    """The journal as a run SIGKILLed at `at` leaves it: nothing journaled after, no verdict, no end."""
    copy.mkdir()
    for path in run_dir.glob("journal.sqlite*"):
        shutil.copy(path, copy / path.name)
    db = sqlite3.connect(copy / "journal.sqlite")
    with db:
        db.execute("DELETE FROM events WHERE t > ?", (at,))
        db.execute("DELETE FROM requests WHERE coalesce(t_end, t_send) > ?", (at,))
        db.execute("DELETE FROM meta WHERE key = 'ended_at'")
    db.close()


@pytest.mark.timeout(600)
def test_the_verdict_is_a_function_of_the_journal_whole_or_cut_short_by_a_kill(tmp_path: Path) -> None:
    out = tmp_path / "run"
    campaign = tmp_path / "held.yaml"
    campaign.write_text(HELD_SCHEDULE)
    result = subprocess.run(
        [sys.executable, "-m", "chaos.cli", "run", str(campaign), "--out", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
    )
    assert result.returncode in (0, 1, 3), result.stdout + result.stderr[-3000:]
    with Journal.open(out, readonly=True) as journal:
        recorded = next(journal.iter_events(kind="verdict", name="run")).data
        oracles = [dict(e.data) for e in journal.iter_events(kind="verdict", name="oracle")]
        gates = [dict(e.data) for e in journal.iter_events(kind="verdict", name="gate")]
        phases = {e.name: e.t for e in journal.iter_events(kind="phase")}
        preflight = [e for e in journal.iter_events(kind="probe", name="pool_preflight")]
        logs = {e.data["role"] for e in journal.iter_events(kind="probe", name="log")}
        load_started = journal.get_meta("load_started_at")
        judged = judge(journal)
    # Judged again from the journal alone: the verdict, the reasons and every oracle's result it recorded
    assert (judged.verdict.value, judged.reasons) == (recorded["verdict"], recorded["reasons"])
    assert (judged.requests, judged.generator_saturated, judged.interrupted) == (
        recorded["requests"],
        recorded["generator_saturated"],
        recorded["interrupted"],
    )
    assert [_as_journaled(o) for o in judged.oracles] == oracles and [_as_journaled(g) for g in judged.gates] == gates
    # The pool preflight was read before the load and journaled; the judge read it there
    assert len(preflight) == 1 and preflight[0].t < phases["baseline:start"] < phases["load:start"]
    assert next(o for o in judged.oracles if o.name == "pool_preflight").checked == len(preflight[0].data["nodes"]) == 2
    assert logs == {"prefill", "decode", "router"}

    killed = tmp_path / "killed"
    _cut_as_a_kill_would(out, killed, at=load_started + 10.0)
    with Journal.open(killed, readonly=True) as journal:
        assert not any(journal.iter_events(kind="verdict"))
        cut = judge(journal)
    assert cut.verdict in (Verdict.FAIL, Verdict.INCONCLUSIVE) and cut.interrupted
    assert any("stopped before it judged itself" in r for r in cut.reasons), cut.reasons
    again = run_cli("report", str(killed), "--json", "--exit-code", timeout=300)
    report = json.loads(again.stdout)
    assert (report["verdict"], report["reasons"], again.returncode) == (cut.verdict.value, cut.reasons, cut.exit_code)
