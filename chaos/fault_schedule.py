"""The fault schedule of a run: its windows at their schedule times, one at a time, each healed
before the next, each with its provocation and followed by aftershock probes.

Schedule time is the load's (`loadprofiles/clock.py`): the clock stands still while the faults are
behind (a window's planned start until it starts; while it runs, its hold point), so the load's
stages (a lull around a flush) stay where the campaign put them (docs/architecture.md, "Decisions").
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from chaos.campaign import Campaign, LoadSpec, WindowSpec
from chaos.journal import EventKind, Journal, JournalEvent
from chaos.targets.base import Target
from chaos.watchdog import ProgressWatchdog
from faults.base import Fault, FaultContext
from faults.provoke import Provoker, ProvokeSettings, split_params
from faults.registry import build_fault
from faults.window import run_window
from loadprofiles.clock import ScheduleClock

HOLD_WORTH_NOTING_S = 1.0  # the schedule clock stood still this long for a window: journaled and said
SPAN_MARGIN_S = 3.0  # a span probe decodes this long past its window's heal and last held write


def window_fault(n: int, window: WindowSpec) -> tuple[Fault, ProvokeSettings]:
    """The fault of the campaign's `n`th window and its provocation settings (validated)."""
    fault = build_fault(window.fault, window.params, f"faults.windows[{n}]")
    _, provoke = split_params(window.params, f"faults.windows[{n}].params")
    return fault, provoke


def span_needed_s(campaign: Campaign) -> float:
    """How long a span probe must decode to cover every window that holds one (the window, the
    writes it held back, a margin); 0 when none does (faults/provoke.py, `span`)."""
    needed = 0.0
    for n, window in enumerate(campaign.windows()):
        fault, provoke = window_fault(n, window)
        if "span" in provoke.kinds_for(window.fault, fault.freezes_sender()):
            needed = max(needed, window.duration_s + fault.lingers_s() + SPAN_MARGIN_S)
    return needed


class FaultSchedule:
    def __init__(
        self,
        campaign: Campaign,
        target: Target,
        journal: Journal,
        clock: ScheduleClock,
        stop: threading.Event,
        watchdog: ProgressWatchdog,
        say: Callable[[str], None],
        replayer: Callable[[], Callable[[], None] | None],
        aftershock: Callable[[WindowSpec], None],
        span_probe: Callable[[threading.Event], None] | None = None,
    ) -> None:
        self.campaign = campaign
        self.target = target
        self.journal = journal
        self.clock = clock
        self.stop = stop
        self.watchdog = watchdog
        self.say = say
        self.replayer = replayer  # a fresh reference-probe replayer for each window's provocation
        self.aftershock = aftershock
        self.span_probe = span_probe  # sends the span probe of a window that freezes the KV sender
        self.active_fault: str | None = None  # "fault#window" while a window runs

    def run(self, windows: list[WindowSpec], load_started: threading.Event, load_done: threading.Event) -> None:
        """Windows at their schedule times; one at a time, each healed before the next. The
        schedule clock stands still where the faults are behind (`hold_point`)."""
        clock = self.clock
        provoker: Provoker | None = None
        try:
            while not load_started.wait(0.5):
                if self.stop.is_set() or load_done.is_set():
                    return
            for n, window in enumerate(windows):
                wait = clock.wall_until(window.at_s)
                if wait > 0 and (self.stop.wait(wait) or load_done.is_set()):
                    return
                if provoker is not None:
                    provoker.join()  # one window's traffic at a time: findings name their window
                if self.stop.is_set() or load_done.is_set() or self.watchdog.wedged.is_set():
                    return
                next_at = windows[n + 1].at_s if n + 1 < len(windows) else None
                late = clock.hold_at(hold_point(self.campaign.load, window, next_at))
                provoker = self._run_window(n, window)
                self.aftershock(window)  # while the provocation's after-heal waves still run
                over = clock.hold_at(next_at)
                self._journal_hold(f"w{n + 1}", late, over)
        finally:
            # However the schedule ends (the last window, a wedged target, a stop), nothing holds
            # the load any longer: it runs out its stages.
            clock.hold_at(None)
            if provoker is not None:
                provoker.join()

    def _journal_hold(self, window_id: str, late_s: float, over_s: float) -> None:
        """What the schedule clock stood still for, when it is worth a line: a start held back by
        the previous window's traffic, or the window's heal and aftershock past its hold point."""
        if late_s + over_s < HOLD_WORTH_NOTING_S:
            return
        self.journal.append_event(
            JournalEvent(
                EventKind.PHASE,
                "schedule:held",
                {
                    "window": window_id,
                    "late_start_s": round(late_s, 1),
                    "overrun_s": round(over_s, 1),
                    "total_held_s": round(self.clock.held_s(), 1),
                },
            )
        )
        self.say(
            f"schedule held {late_s + over_s:.1f} s for {window_id} (started {late_s:.1f} s late, "
            f"ran {over_s:.1f} s past its hold point); the load's stages wait with it"
        )

    def _run_window(self, n: int, window: WindowSpec) -> Provoker:
        fault, provoke = window_fault(n, window)
        provoker = Provoker(
            window.fault,
            provoke,
            request_timeout_s=self.campaign.oracles.past_deadline_s,
            lingers_s=fault.lingers_s(),
            replay_probe=self.replayer(),
            freezes_sender=fault.freezes_sender(),
            span_probe=self.span_probe,
        )
        ctx = FaultContext(target=self.target, journal=self.journal, window_id=f"w{n + 1}")
        self.say(f"fault {window.fault} ({ctx.window_id}) for {window.duration_s:.0f}s")
        self.active_fault = f"{window.fault}#{ctx.window_id}"
        try:
            result = run_window(
                fault,
                ctx,
                window.duration_s,
                params=window.params,
                keep_going=lambda: not self.stop.is_set(),
                provoker=provoker,
            )
        finally:
            self.active_fault = None
            self.watchdog.window_ended()
        state = "confirmed" if result.confirmation.confirmed else "NOT confirmed"
        self.say(f"fault {window.fault} ({ctx.window_id}) healed; {state}: {result.confirmation.evidence}")
        return provoker


def hold_point(load: LoadSpec, window: WindowSpec, next_at: float | None) -> float | None:
    """Where the clock waits while `window` runs: the next window's start, or the first stage
    boundary at or after the window's planned end (the lull after the aborts, the load's end) if
    that comes first. A window's heal and aftershock may overrun into the quiet time the campaign
    left after it; they never carry it into a stage meant to follow them."""
    ends = [s.until_s for s in load.stages] if load.shape == "stages" else []
    planned_end = window.at_s + window.duration_s
    boundaries = [t for t in (*ends, load.duration_s) if t >= planned_end]
    points = [t for t in (next_at, min(boundaries, default=None)) if t is not None]
    return min(points, default=None)
