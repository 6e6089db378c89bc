"""The schedule's clock: seconds of a campaign's timeline, which stand still while the faults are behind.

A campaign puts its fault windows and its load stages on one timeline: "a lull from 128 s to 145 s
around the cache flush at 131 s". Wall time drifts from that timeline whenever a window takes
longer than planned: a restart planned for 6 s can take 30 s on a busy machine. Counted in wall
time, every later window then starts late while the load's stages go on, and a flush meant for a
lull meets full load (the engine refuses to flush, the window stays unconfirmed, the run is
INCONCLUSIVE for a reason that has nothing to do with the target).

So the load's shape reads schedule time, and the fault schedule holds it: the clock may not run
past its *barrier*, the next point of the timeline the faults have not caught up with. That is a
window's start until the previous window's traffic is done and it starts; while a window runs,
the next window's start or, if it comes first, the first stage boundary at or after the window's
planned end (the lull meant to follow it, the load's end), until it is healed and its aftershock
probes are in. A window's tail may use the quiet time its campaign left after it; it never
carries into the stage meant to follow it. While the clock stands at the barrier the load stays in
the stage it is in; once the schedule catches up the barrier moves on, and the time held is added
to `held_s` (the load lasts that much longer).

The runner owns a `ScheduleClock`; each Locust process gets its `ClockState` through a small file
beside it (`read_state`), written by its Ray actor, so the shape needs no connection of its own.
The state carries the wall time the runner counts from, so a Locust process that took seconds to
import does not run that far behind the fault schedule (Ray keeps its machines' clocks close
enough for a schedule counted in seconds).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from chaos.files import replace_file


@dataclass(frozen=True)
class ClockState:
    started_at: float | None = None  # wall time the schedule counts from (None: not started)
    held_s: float = 0.0  # schedule time = seconds since started_at - held_s, ...
    barrier_s: float | None = None  # ... but never past the barrier (None: no barrier)

    def schedule_time(self, elapsed_s: float) -> float:
        """Schedule seconds after `elapsed_s` seconds of wall time since `started_at`."""
        t = elapsed_s - self.held_s
        return t if self.barrier_s is None else min(t, self.barrier_s)

    def now(self, wall: float) -> float | None:
        """Schedule seconds at wall time `wall`; None before the start."""
        return None if self.started_at is None else self.schedule_time(wall - self.started_at)


class ScheduleClock:
    """The runner's side: wall time since the load started, less what was held (thread-safe)."""

    def __init__(self, barrier_s: float | None = None) -> None:
        self._state = ClockState(barrier_s=barrier_s)  # until `start`, the clock reads 0
        self._lock = threading.Lock()

    def start(self, started_at: float) -> None:
        with self._lock:
            self._state = dataclasses.replace(self._state, started_at=started_at)

    def now(self) -> float:
        with self._lock:
            return self._state.schedule_time(self._elapsed())

    def held_s(self) -> float:
        """Seconds held so far, the hold in progress included."""
        with self._lock:
            return self._fold()

    def state(self) -> ClockState:
        with self._lock:
            return self._state

    def wall_until(self, schedule_s: float) -> float:
        """Wall seconds until the clock reads `schedule_s`, were the barrier at or beyond it."""
        with self._lock:
            return max(0.0, schedule_s - (self._elapsed() - self._state.held_s))

    def hold_at(self, barrier_s: float | None) -> float:
        """Move the barrier (None: none). The time the clock stood at the old one is added to the
        held seconds; a barrier behind the clock's reading holds it where it is, never back.
        Returns the seconds held at the old barrier."""
        with self._lock:
            before = self._state.held_s
            held = self._fold()
            now = self._elapsed() - held
            if barrier_s is not None:
                barrier_s = max(barrier_s, now)
            self._state = dataclasses.replace(self._state, held_s=held, barrier_s=barrier_s)
            return held - before

    def _elapsed(self) -> float:
        started = self._state.started_at
        return 0.0 if started is None else time.time() - started

    def _fold(self) -> float:
        """The held seconds, counting the clock's present stand at its barrier."""
        state = self._state
        over = self._elapsed() - state.held_s - (state.barrier_s if state.barrier_s is not None else float("inf"))
        return state.held_s + max(0.0, over)


def write_state(path: str | Path, state: ClockState) -> None:
    """Replace the file at once (a reader never sees half of it)."""
    replace_file(Path(path), json.dumps(asdict(state)))


def read_state(path: str | Path) -> ClockState | None:
    """The state in the file; None while there is none (the load runs on its own clock)."""
    try:
        data = json.loads(Path(path).read_text())
        optional: Callable[[str], float | None] = lambda key: None if data[key] is None else float(data[key])  # noqa: E731
        return ClockState(
            started_at=optional("started_at"), held_s=float(data["held_s"]), barrier_s=optional("barrier_s")
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
