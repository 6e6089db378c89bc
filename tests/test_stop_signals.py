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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from chaos.journal import Journal, JournalError
from chaos.run_evidence import JUDGING
from chaos.stop_signals import Interrupted, StopSignals
from chaos.targets.state import state_path, stop_from_state
from tests.conftest import run_cli, selected_params, wait_until

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from soak import left_behind  # noqa: E402  (the soak benchmark's own check that nothing of a run is left)

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


def test_a_stop_wrapped_by_a_library_still_reads_as_a_stop() -> None:
    """A signal handler's `Interrupted` raised inside Ray's C code (`ray.get` while the load
    starts) came back as `SystemError: ... returned a result with an exception set`, the
    `Interrupted` as its cause: the run must report it as interrupted, not as the suite failing."""
    from chaos.runner import _caused_by_a_stop

    def wrapped(inner: BaseException, as_cause: bool) -> BaseException:
        try:
            try:
                raise inner
            except BaseException as exc:
                if as_cause:
                    raise SystemError("<built-in method> returned a result with an exception set") from exc
                raise RuntimeError("while handling it")  # noqa: B904 (the implicit context is the case)
        except BaseException as outer:
            return outer

    assert _caused_by_a_stop(wrapped(Interrupted("SIGINT"), as_cause=True))
    assert _caused_by_a_stop(wrapped(KeyboardInterrupt(), as_cause=False))
    assert not _caused_by_a_stop(wrapped(OSError("a lost node"), as_cause=True))
    looped = RuntimeError("a")
    looped.__context__ = RuntimeError("b")
    looped.__context__.__context__ = looped
    assert not _caused_by_a_stop(looped)


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


def _assert_nothing_left(stopped: Stopped) -> None:
    """Every process the run had started was gone (none merely stopped) and its stack's
    `target.json` cleared before the test's own cleanup ran, and every fault it injected healed."""
    assert stopped.left_running == [], f"left running by the run itself: {stopped.left_running}"
    assert not stopped.state_left, "target.json left behind: the run did not stop its stack"
    run_dir = stopped.out
    injected = [d["window"] for k, _, d in _events(run_dir) if k == "fault" and d.get("step") == "inject"]
    healed = {d["window"] for k, _, d in _events(run_dir) if k == "fault" and d.get("step") == "heal"}
    assert set(injected) <= healed, f"windows injected but never healed: {set(injected) - healed}"


def _report(run_dir: Path) -> tuple[dict, int]:
    result = run_cli("report", str(run_dir), "--json", "--exit-code", timeout=300)
    return json.loads(result.stdout), result.returncode


def _start(run_root: Path) -> tuple[subprocess.Popen[str], Path]:
    run_root.mkdir(parents=True)
    campaign = run_root / "stopped.yaml"
    campaign.write_text(CAMPAIGN)
    out = run_root / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos.cli", "run", str(campaign), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # a terminal's job, alone in its group: signals go to the driver only
    )
    return proc, out


@dataclass(frozen=True)
class Stop:
    """Where a run is stopped and how: the signals sent to the driver, one after the other."""

    phase: str
    signals: tuple[signal.Signals, ...]

    @property
    def id(self) -> str:
        return f"{self.phase}-{'-'.join(s.name for s in self.signals)}"

    @property
    def kills(self) -> bool:
        """The driver is SIGKILLed (as the OOM killer would): `pdchaos heal` must finish its undo."""
        return self.signals == (signal.SIGKILL,)


@dataclass
class Stopped:
    """What a stopped run left: its directory, the driver's exit and output, the processes it had
    started when the signal was sent, and, after a SIGKILL, what `pdchaos heal` said."""

    out: Path
    returncode: int | None = None
    stdout: str = ""
    processes: list[psutil.Process] = field(default_factory=list)
    healed: subprocess.CompletedProcess[str] | None = None
    # Read before the test's cleanup (`stop_from_state`), which would stop whatever the run left
    left_running: list[str] = field(default_factory=list)
    state_left: bool = False
    error: Exception | None = None  # raised while stopping it: the test re-raises it


def _stop_run(stop: Stop, run_root: Path) -> Stopped:
    proc, out = _start(run_root)
    stopped = Stopped(out)
    try:
        wait_until(
            lambda: _reached(out, stop.phase), timeout_s=240, interval_s=0.2, what=f"the run to reach {stop.phase}"
        )
        if stop.kills:
            time.sleep(1.0)  # the stall well under way
        stopped.processes = _tree(proc.pid)
        if stop.kills:
            proc.kill()  # the driver alone
            proc.communicate(timeout=30)
            stopped.healed = run_cli("heal", str(out), timeout=180)
        else:
            for signum in stop.signals:
                proc.send_signal(signum)
                time.sleep(0.3)
            stopped.stdout, _ = proc.communicate(timeout=240)
        stopped.returncode = proc.returncode
        # A SIGKILLed driver cannot stop the Ray it started: its agents notice on their own (up to
        # a minute here); a driver that was signalled shuts Ray down itself
        stopped.left_running = left_behind(stopped.processes, wait_s=90 if stop.kills else 30)
        stopped.state_left = state_path(out).exists()
    except Exception as exc:  # the test that asked for this run reports it
        stopped.error = exc
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_from_state(out)
    return stopped


STOPS = [
    Stop("baseline:start", (signal.SIGTERM,)),  # before Ray is up
    # Ctrl-C in a stall; the second signal hurries, and the stall still heals
    Stop("transfer_stall", (signal.SIGINT, signal.SIGTERM)),
    Stop("client_abort", (signal.SIGHUP,)),
    Stop("drain:start", (signal.SIGTERM,)),  # after Ray's shutdown, which reset SIGTERM under Python
    Stop(JUDGING, (signal.SIGTERM,)),
]
KILLS = [Stop("transfer_stall", (signal.SIGKILL,))]  # mid-load: Ray's actors and Locust up, a process paused

# Two runs at a time: each lasts as long as its 24 s schedule, not as long as the CPU takes, so
# the six side by side two at a time take a little over half as long as one after the other.
PARALLEL = 2


@pytest.fixture(scope="module")
def stopped_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Stopped]:
    """One run per selected stop (all six unless `-k` narrows them), `PARALLEL` at a time."""
    selected = [stop for stop in selected_params(request, "stop") if isinstance(stop, Stop)]
    root = tmp_path_factory.mktemp("stopped")
    with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        runs = pool.map(lambda stop: (stop.id, _stop_run(stop, root / stop.id)), selected)
        return dict(runs)


def _stopped(stopped_runs: dict[str, Stopped], stop: Stop) -> Stopped:
    stopped = stopped_runs[stop.id]
    if stopped.error is not None:
        raise stopped.error
    return stopped


@pytest.mark.integration
@pytest.mark.timeout(900)  # the first one waits for all six runs
@pytest.mark.parametrize("stop", STOPS, ids=[s.id for s in STOPS])
def test_a_stop_signal_at_any_phase_heals_stops_and_reports(stopped_runs: dict[str, Stopped], stop: Stop) -> None:
    stopped = _stopped(stopped_runs, stop)
    out, stdout = stopped.out, stopped.stdout
    report, code = _report(out)
    written = json.loads((out / "report.json").read_text())
    assert stopped.returncode == code, stdout[-3000:]
    assert written["verdict"] == report["verdict"] and written["reasons"] == report["reasons"]
    if stop.phase == JUDGING or len(stop.signals) > 1:  # the driver took the signal that could no longer interrupt
        assert "already stopping" in stdout, stdout[-3000:]
    if stop.phase == JUDGING:  # the load was over: the signal waits for the verdict it was judging
        assert report["verdict"] == "PASS", report["reasons"]
    else:
        assert report["verdict"] == "INCONCLUSIVE" and code == 3, report["reasons"]
        assert any("interrupted" in r for r in report["reasons"]), report["reasons"]
    _assert_nothing_left(stopped)


@pytest.mark.integration
@pytest.mark.timeout(900)
@pytest.mark.parametrize("stop", KILLS, ids=[s.id for s in KILLS])
def test_a_sigkilled_driver_leaves_what_heal_stops_and_a_journal_that_gives_a_verdict(
    stopped_runs: dict[str, Stopped], stop: Stop
) -> None:
    stopped = _stopped(stopped_runs, stop)
    assert stopped.healed is not None and stopped.healed.returncode == 0, stopped.healed
    _assert_nothing_left(stopped)
    report, code = _report(stopped.out)
    assert report["verdict"] in ("FAIL", "INCONCLUSIVE") and code in (1, 3), report["reasons"]
    assert any("stopped before it judged itself" in r for r in report["reasons"]), report["reasons"]
