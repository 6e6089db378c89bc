"""Every way a run can be stopped: SIGINT, SIGTERM and SIGHUP at each phase, a second signal, and
a SIGKILL followed by `pdchaos heal`. Nothing is left running or stopped, every fault heals, and
`pdchaos report` gives the verdict the run gave (or, killed, a verdict from what it journaled)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from chaos.journal import Journal, JournalError
from chaos.run_evidence import JUDGING
from chaos.stop_signals import Interrupted, StopSignals
from chaos.targets.state import stop_from_state
from tests.conftest import run_cli, wait_until

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from soak import still_running  # noqa: E402  (the soak benchmark's own check that nothing of a run is left)

# Three fault families (a paused process, a fault proxy, client traffic) in 24 s of load
CAMPAIGN = """\
name: stopped
target: {sim: {waiting_timeout_s: 2, proxied_links: true}}
load: {profile: canary-chat, users: 4, duration: 24s, max_tokens: 16}
probes: {count: 4}
faults:
  windows:
    - {fault: transfer_stall, at: 2s, duration: 4s, params: {role: prefill}}
    - {fault: kv_transfer, at: 9s, duration: 4s, params: {mode: latency, latency_ms: 800}}
    - {fault: client_abort, at: 15s, duration: 3s, params: {phase: transfer, method: abort_request, count: 2, prompt_tokens: 600}}
"""


# ------------------------------------------------------------------------------ the handler ----


def test_the_first_stop_signal_interrupts_and_a_second_only_hurries() -> None:
    said: list[str] = []
    stop = threading.Event()
    before = signal.getsignal(signal.SIGHUP)
    with StopSignals(stop, said.append) as signals:
        with pytest.raises(Interrupted, match="SIGHUP"):
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(1)  # the handler runs between bytecodes: well before this ends
        assert stop.is_set() and not signals.hurry.is_set()
        os.kill(os.getpid(), signal.SIGTERM)  # no exception: the heal it would cut short goes on
        time.sleep(0.1)
        assert signals.hurry.is_set() and signals.received == ["SIGHUP", "SIGTERM"]
        assert "already stopping" in said[-1]
    assert signal.getsignal(signal.SIGHUP) == before


def test_once_judging_starts_a_signal_no_longer_interrupts() -> None:
    stop = threading.Event()
    with StopSignals(stop, lambda _: None) as signals:
        signals.disarm()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert stop.is_set() and signals.hurry.is_set()


# ---------------------------------------------------------------------------- a whole run ----


def _events(run_dir: Path) -> list[tuple[str, str, dict]]:
    try:
        with Journal.open(run_dir, readonly=True) as journal:
            return [(e.kind, e.name, dict(e.data)) for e in journal.iter_events()]
    except (FileNotFoundError, JournalError):
        return []


def _reached(run_dir: Path, phase: str) -> bool:
    events = _events(run_dir)
    if phase in ("transfer_stall", "kv_transfer", "client_abort"):
        return any(k == "fault" and n == phase and d.get("step") == "inject" for k, n, d in events)
    return any(k == "phase" and n == phase for k, n, _ in events)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _assert_nothing_left(processes: list[psutil.Process], run_dir: Path) -> None:
    """Every process the run had started is gone (none merely stopped), and every fault it injected healed."""

    wait_until(lambda: not still_running(processes), timeout_s=60, interval_s=0.5, what="the run's processes to exit")
    injected = [d["window"] for k, _, d in _events(run_dir) if k == "fault" and d.get("step") == "inject"]
    healed = {d["window"] for k, _, d in _events(run_dir) if k == "fault" and d.get("step") == "heal"}
    assert set(injected) <= healed, f"windows injected but never healed: {set(injected) - healed}"


def _report(run_dir: Path) -> tuple[dict, int]:
    result = run_cli("report", str(run_dir), "--json", "--exit-code", timeout=300)
    return json.loads(result.stdout), result.returncode


def _start(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    campaign = tmp_path / "stopped.yaml"
    campaign.write_text(CAMPAIGN)
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos.cli", "run", str(campaign), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # a terminal's job, alone in its group: signals go to the driver only
    )
    return proc, out


STOPS = [
    ("baseline:start", (signal.SIGTERM,)),  # before Ray is up
    ("transfer_stall", (signal.SIGINT, signal.SIGTERM)),  # Ctrl-C in a stall; the second hurries, the stall still heals
    ("client_abort", (signal.SIGHUP,)),
    ("drain:start", (signal.SIGTERM,)),  # after Ray's shutdown, which reset SIGTERM under Python
    (JUDGING, (signal.SIGTERM,)),
]


@pytest.mark.integration
@pytest.mark.timeout(420)
@pytest.mark.parametrize(
    ("phase", "signals"), STOPS, ids=[f"{p}-{'-'.join(s.name for s in sigs)}" for p, sigs in STOPS]
)
def test_a_stop_signal_at_any_phase_heals_stops_and_reports(
    tmp_path: Path, phase: str, signals: tuple[signal.Signals, ...]
) -> None:
    proc, out = _start(tmp_path)
    try:
        wait_until(lambda: _reached(out, phase), timeout_s=240, interval_s=0.2, what=f"the run to reach {phase}")
        processes = _tree(proc.pid)
        for signum in signals:
            proc.send_signal(signum)
            time.sleep(0.3)
        stdout, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_from_state(out)
    report, code = _report(out)
    written = json.loads((out / "report.json").read_text())
    assert proc.returncode == code, stdout[-3000:]
    assert written["verdict"] == report["verdict"] and written["reasons"] == report["reasons"]
    if phase == JUDGING or len(signals) > 1:  # the driver took the signal that could no longer interrupt
        assert "already stopping" in stdout, stdout[-3000:]
    if phase == JUDGING:  # the load was over: the signal waits for the verdict it was judging
        assert report["verdict"] == "PASS", report["reasons"]
    else:
        assert report["verdict"] == "INCONCLUSIVE" and code == 3, report["reasons"]
        assert any("interrupted" in r for r in report["reasons"]), report["reasons"]
    _assert_nothing_left(processes, out)


@pytest.mark.integration
@pytest.mark.timeout(420)
@pytest.mark.parametrize("phase", ["transfer_stall"])  # mid-load: Ray's actors and Locust up, a process paused
def test_a_sigkilled_driver_leaves_what_heal_stops_and_a_journal_that_gives_a_verdict(
    tmp_path: Path, phase: str
) -> None:
    proc, out = _start(tmp_path)
    try:
        wait_until(lambda: _reached(out, phase), timeout_s=240, interval_s=0.2, what=f"the run to reach {phase}")
        time.sleep(1.0)  # the stall well under way
        processes = _tree(proc.pid)
        proc.kill()  # the driver alone, as the OOM killer would
        proc.communicate(timeout=30)
        healed = subprocess.run(
            [sys.executable, "-m", "chaos.cli", "heal", str(out)], capture_output=True, text=True, timeout=180, cwd=ROOT
        )
        assert healed.returncode == 0, healed.stdout + healed.stderr
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_from_state(out)
    _assert_nothing_left(processes, out)
    report, code = _report(out)
    assert report["verdict"] in ("FAIL", "INCONCLUSIVE") and code in (1, 3), report["reasons"]
    assert any("stopped before it judged itself" in r for r in report["reasons"]), report["reasons"]
