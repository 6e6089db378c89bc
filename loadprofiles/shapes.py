"""Load shapes: how many users run at each moment, from `ShapeSpec`.

`users_at(spec, t)` is the whole policy, a pure function (unit-testable without Locust);
`shape_class(spec)` hands it to Locust, which polls `tick()` about once a second and stops the run
when it returns None. In a campaign `t` is schedule time (loadprofiles/clock.py), not wall time. Kinds:

* steady: `users` for `duration_s`.
* ramp: linear from 1 up to `users` over `duration_s`.
* spike: low (a tenth of `users`, at least 1) for the first 40 %, `users` for the next 20 %, low
  again for the rest.
* stages: the explicit `stages` (each until its `until_s`); ends at the last one.
* soak: steady, meant for long durations.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from loadprofiles.clock import read_state
from loadprofiles.config import ShapeSpec

if TYPE_CHECKING:
    from locust import LoadTestShape

SPIKE_START, SPIKE_END = 0.4, 0.6  # fractions of the duration
SPIKE_LOW_FRACTION = 0.1
RAMP_SPAWN_RATE_FLOOR = 1.0


def spike_low(users: int) -> int:
    return max(1, round(users * SPIKE_LOW_FRACTION))


def end_of(spec: ShapeSpec) -> float:
    if spec.kind == "stages":
        return max((stage.until_s for stage in spec.stages), default=0.0)
    return spec.duration_s


def users_at(spec: ShapeSpec, t: float) -> tuple[int, float] | None:
    """(users, spawn rate) at `t` seconds into the run, or None once the run is over."""
    if t >= end_of(spec):
        return None
    kind = spec.kind
    if kind in ("steady", "soak"):
        return spec.users, spec.spawn_rate
    if kind == "ramp":
        # Rate high enough that Locust keeps up with the line between two ticks.
        rate = max(RAMP_SPAWN_RATE_FLOOR, spec.spawn_rate, spec.users / max(spec.duration_s, 1e-9))
        return max(1, min(spec.users, math.ceil(spec.users * t / spec.duration_s))), rate
    if kind == "spike":
        low = spike_low(spec.users)
        in_spike = SPIKE_START * spec.duration_s <= t < SPIKE_END * spec.duration_s
        # A burst arrives at once, and leaves at once.
        return (spec.users if in_spike else low), max(spec.spawn_rate, float(spec.users))
    if kind == "stages":
        for stage in sorted(spec.stages, key=lambda s: s.until_s):
            if t < stage.until_s:
                return stage.users, stage.spawn_rate
        return None
    raise ValueError(f"unknown shape kind {kind!r}")


def shape_class(spec: ShapeSpec, clock_path: str | None = None) -> type[LoadTestShape]:
    """Locust's shape hook over `users_at`, for the locustfile's namespace (Locust finds it there).
    With `clock_path`, the shape reads schedule time from the state its actor writes there
    (loadprofiles/clock.py): the stages stand still while the fault schedule is behind.

    Locust is imported here, not at module level: importing it monkey-patches the whole process
    with gevent, which a test or driver that only wants `users_at` must not suffer.
    """
    from locust import LoadTestShape

    class ConfiguredShape(LoadTestShape):
        def tick(self) -> tuple[int, float] | None:
            state = read_state(clock_path) if clock_path else None
            t = state.now(time.time()) if state is not None else None
            # get_run_time is locust's, unannotated
            return users_at(spec, self.get_run_time() if t is None else t)  # type: ignore[no-untyped-call]

    return ConfiguredShape
