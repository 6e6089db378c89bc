"""`pdchaos load`: Ray-placed Locust actors, every request journaled, a SIGKILL loses nothing done."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from chaos.journal import Journal, JournalError
from chaos.targets.sim.stack import SimStack
from chaos.targets.state import stop_from_state
from tests.conftest import wait_until

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent


def _locust_processes() -> list[int]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "loadprofiles/locustfile.py" in line]


def test_two_actors_journal_every_request_locust_sent(tmp_path: Path) -> None:
    """With a relative --out: the actors and Locust run elsewhere, and must write where it means here."""
    out = tmp_path / "load"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "chaos.cli",
            "load",
            "--target",
            "sim",
            "--profile",
            "mixed",
            "--users",
            "6",
            "--actors",
            "2",
            "--duration",
            "12s",
            "--out",
            "load",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["requests"] > 20
    assert summary["requests"] == summary["locust_requests"]  # nothing lost between Locust and the journal
    assert summary["ok"] + summary["fail"] + summary["info"] == summary["requests"]
    assert summary["ttft_p50_ms"] is not None and summary["generator_saturated"] in (True, False)
    with Journal.open(out, readonly=True) as journal:
        records = list(journal.iter_requests())
    assert {r.actor.split("/")[0] for r in records} == {"actor0", "actor1"}  # both Ray actors' Locusts
    assert len({r.request_index for r in records}) == len(records)  # indices interleave, never collide
    for r in records:
        if r.t_first_token is not None:
            assert r.t_send <= r.t_first_byte <= r.t_first_token <= r.t_end
        assert r.token_times == sorted(r.token_times)
    assert not _locust_processes()


def _journaled(run_dir: Path) -> int:
    try:
        with Journal.open(run_dir, readonly=True) as journal:
            return journal.count_requests()
    except (FileNotFoundError, JournalError):
        return 0


def test_a_sigkilled_driver_leaves_a_journal_with_the_finished_requests(tmp_path: Path) -> None:
    out = tmp_path / "load"
    driver = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "chaos.cli",
            "load",
            "--target",
            "sim",
            "--users",
            "4",
            "--duration",
            "60s",
            "--out",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        start_new_session=True,
    )
    family: list[psutil.Process] = []
    try:
        seen = wait_until(
            lambda: _journaled(out) >= 20 and _journaled(out), timeout_s=120, what="20 journaled requests"
        )
        family = psutil.Process(driver.pid).children(recursive=True)  # the local Ray it started, among others
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
        with Journal.open(out, readonly=True) as journal:
            assert journal.count_requests() >= seen
            assert all(r.t_end is not None for r in journal.iter_requests())
    finally:
        if driver.poll() is None:
            driver.kill()
        stop_from_state(out)  # the engine the driver launched
        # A SIGKILLed driver cannot stop the local Ray it started. Not `ray stop`: it would stop
        # every Ray session on the machine, other runs' included.
        for orphan in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                orphan.kill()


def test_a_load_cut_short_ends_at_the_next_poll_and_journals_why(tmp_path: Path, sim_stack: SimStack) -> None:
    """The runner cuts the load short when the target is wedged: more load would only wait out
    more timeouts before the verdict."""
    import threading

    from chaos.load import LoadPlan, run_load
    from chaos.markers import new_run_prefix
    from chaos.targets.discovery import discover_facts
    from loadprofiles.profiles import PROFILES

    url = sim_stack.router_url
    plan = LoadPlan(
        target_url=url,
        facts=discover_facts(url, ()),
        profile=PROFILES["canary-chat"],
        run_prefix=new_run_prefix(),
        users=2,
        duration_s=120.0,
        max_tokens=8,
    )
    cut = threading.Event()
    with Journal.create(tmp_path / "run") as journal:
        outcome = run_load(
            plan,
            tmp_path / "run",
            journal,
            on_started=lambda _: threading.Timer(3.0, cut.set).start(),
            cut_short=cut.is_set,
        )
        ends = [e for e in journal.iter_events(kind="phase") if e.name == "load:end"]
        started = journal.get_meta("load_started_at")
    assert outcome.cut_short and not outcome.interrupted
    assert len(ends) == 1 and ends[0].data["cut_short"] is True
    assert ends[0].t - started < 60.0  # the shape would have run 120 s
    assert outcome.journaled > 0
    assert not _locust_processes()
