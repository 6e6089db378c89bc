"""`pdchaos heal`: after the driver is SIGKILLed mid-fault, nothing is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.journal import Journal, JournalError
from chaos.process import group_members, pid_alive
from chaos.targets.sim.stack import SimStack
from chaos.targets.state import stop_from_state
from tests.conftest import wait_until

pytestmark = pytest.mark.integration


def _injected(run_dir: Path) -> bool:
    try:
        with Journal.open(run_dir, readonly=True) as journal:
            return any(e.data.get("step") == "inject" for e in journal.iter_events(kind="fault"))
    except (FileNotFoundError, JournalError):  # not there yet, or still being created
        return False


@pytest.mark.parametrize(
    "fault, params",
    [
        ("transfer_stall", {"role": "prefill"}),
        ("process_kill", {"role": "decode", "signal": "STOP"}),
        ("process_kill", {"role": "prefill", "signal": "KILL"}),
        ("memory_fraction", {"role": "prefill", "max_total_tokens": 4096}),
        ("engine_failure", {"role": "decode", "probability": 0.2}),
    ],
)
def test_heal_after_the_driver_was_killed_mid_fault(
    tmp_path: Path, fault: str, params: dict, request: pytest.FixtureRequest
) -> None:
    run_dir = tmp_path / "run"
    request.addfinalizer(lambda: stop_from_state(run_dir))  # a failing test must not leave a stack behind
    driver = subprocess.Popen(
        [sys.executable, "-m", "tests.fault_driver", str(run_dir), fault, json.dumps(params)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        wait_until(lambda: _injected(run_dir), timeout_s=60, what="the fault to be injected")
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver dies; the engine it launched lives on
        driver.wait(10)
    state = json.loads(SimStack.state_path(run_dir).read_text())
    groups = [p["pgid"] for p in state["processes"]]
    assert any(pid_alive(g) for g in groups)

    healed = subprocess.run(
        [sys.executable, "-m", "chaos.cli", "heal", str(run_dir)], capture_output=True, text=True, timeout=120
    )
    assert healed.returncode == 0, healed.stdout + healed.stderr
    assert "stopped" in healed.stdout
    for pgid in groups:
        wait_until(lambda pgid=pgid: not group_members(pgid), timeout_s=15, what=f"group {pgid} to be gone")

    again = subprocess.run(
        [sys.executable, "-m", "chaos.cli", "heal", str(run_dir)], capture_output=True, text=True, timeout=60
    )
    assert again.returncode == 0
    assert "nothing to heal" in again.stdout or "already gone" in again.stdout


def test_heal_of_a_directory_without_a_run_is_a_usage_error(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "chaos.cli", "heal", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "run directory" in result.stderr
