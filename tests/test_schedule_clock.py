"""The schedule clock (loadprofiles/clock.py): schedule time stands still at its barrier while the
fault schedule is behind, never runs backwards, and reaches the load's shape through its file."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadprofiles import clock as clock_module
from loadprofiles.clock import ClockState, ScheduleClock, read_state, write_state
from loadprofiles.config import ShapeSpec, Stage
from loadprofiles.shapes import users_at


class FakeTime:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def time(self) -> float:
        return self.now


@pytest.fixture
def wall(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(clock_module, "time", fake)
    return fake


def test_the_clock_runs_with_wall_time_up_to_its_barrier_and_stands_there(wall: FakeTime) -> None:
    clock = ScheduleClock(barrier_s=10.0)
    assert clock.now() == 0.0  # not started
    clock.start(wall.now)
    wall.now += 4.0
    assert clock.now() == pytest.approx(4.0)
    assert clock.wall_until(10.0) == pytest.approx(6.0)
    wall.now += 20.0  # the schedule is behind: a window could not start at 10 s
    assert clock.now() == pytest.approx(10.0)
    assert clock.held_s() == pytest.approx(14.0)
    assert clock.wall_until(10.0) == 0.0


def test_moving_the_barrier_adds_the_stand_to_the_held_time_and_resumes_from_the_old_barrier(wall: FakeTime) -> None:
    clock = ScheduleClock(barrier_s=10.0)
    clock.start(wall.now)
    wall.now += 24.0
    assert clock.hold_at(16.0) == pytest.approx(14.0)  # window at 10 s for 6 s starts, 14 s late
    assert clock.now() == pytest.approx(10.0)
    wall.now += 30.0  # its heal takes 30 s instead of 6
    assert clock.now() == pytest.approx(16.0)
    assert clock.hold_at(None) == pytest.approx(24.0)  # healed: no barrier after the last window
    wall.now += 5.0
    assert clock.now() == pytest.approx(21.0)
    assert clock.held_s() == pytest.approx(38.0)


def test_a_barrier_behind_the_clock_holds_it_where_it_is_never_back(wall: FakeTime) -> None:
    clock = ScheduleClock(barrier_s=None)
    clock.start(wall.now)
    wall.now += 30.0
    assert clock.hold_at(12.0) == 0.0  # windows overlapping in the plan: the next one is due already
    assert clock.now() == pytest.approx(30.0)
    wall.now += 3.0
    assert clock.now() == pytest.approx(30.0)
    assert clock.held_s() == pytest.approx(3.0)


def test_the_state_reaches_a_shape_through_its_file_and_the_stages_wait(tmp_path: Path) -> None:
    path = tmp_path / "clock.json"
    assert read_state(path) is None  # no file yet: the load runs on its own clock
    spec = ShapeSpec(kind="stages", stages=(Stage(10.0, 8, 4.0), Stage(20.0, 0, 4.0), Stage(30.0, 8, 4.0)))
    write_state(path, ClockState(started_at=1000.0, held_s=25.0, barrier_s=12.0))
    state = read_state(path)
    assert state == ClockState(started_at=1000.0, held_s=25.0, barrier_s=12.0)
    # 40 s of wall time: without the clock the load would be over; with it, it is in the lull at 12 s
    assert users_at(spec, 40.0) is None
    assert state.now(1040.0) == 12.0 and users_at(spec, 12.0) == (0, 4.0)
    assert ClockState().now(1040.0) is None  # not started: the shape keeps Locust's own run time
    path.write_text("{not json")
    assert read_state(path) is None


def test_a_window_holds_the_clock_at_the_next_start_or_the_stage_meant_to_follow_it(tmp_path: Path) -> None:
    """The default campaign: each window's hold point is the next window's start, unless a stage
    boundary comes first at or after its planned end (the lull after the aborts at 29 s, the lull
    around the flush at 128 s and its end at 145 s, the load's end at 170 s)."""
    from chaos.campaign_validation import load_campaign
    from chaos.fault_schedule import hold_point

    campaign = load_campaign(Path(__file__).resolve().parent.parent / "campaigns" / "default.yaml")
    windows = campaign.windows()
    points = [
        hold_point(campaign.load, w, windows[n + 1].at_s if n + 1 < len(windows) else None)
        for n, w in enumerate(windows)
    ]
    assert [(w.fault, p) for w, p in zip(windows, points, strict=True)] == [
        ("kv_transfer", 14.0),
        ("client_abort", 29.0),
        ("transfer_stall", 50.0),
        ("memory_fraction", 71.0),
        ("engine_failure", 97.0),
        ("router_link", 108.0),
        ("process_kill", 120.0),
        ("over_length_burst", 128.0),
        ("cache_flush", 145.0),
        ("process_kill", 170.0),
    ]


def test_a_schedule_that_stops_early_lets_the_load_run_out(tmp_path: Path) -> None:
    """A wedged target ends the fault schedule before its windows (chaos/fault_schedule.py): the
    barrier it held must go with it, or the load would wait at it forever (a run that never ends)."""
    import threading
    import time

    from chaos.campaign_validation import load_campaign
    from chaos.fault_schedule import FaultSchedule
    from chaos.journal import Journal
    from chaos.watchdog import ProgressWatchdog

    campaign = load_campaign(Path(__file__).resolve().parent.parent / "campaigns" / "default.yaml")
    windows = campaign.windows()
    clock = ScheduleClock(barrier_s=windows[0].at_s)
    clock.start(time.time() - 30.0)  # 30 s into the load, held at the first window's start
    with Journal.create(tmp_path) as journal:
        watchdog = ProgressWatchdog(journal, campaign.gates.wedged_after_s, say=print)
        watchdog.wedged.set()
        schedule = FaultSchedule(
            campaign,
            None,
            journal,
            clock,
            threading.Event(),
            watchdog,
            print,  # type: ignore[arg-type]
            replayer=lambda: None,
            aftershock=lambda _: None,
        )
        started = threading.Event()
        started.set()
        schedule.run(windows, started, threading.Event())
    assert clock.state().barrier_s is None
    assert clock.now() == pytest.approx(windows[0].at_s, abs=0.5)  # resumes where it stood
