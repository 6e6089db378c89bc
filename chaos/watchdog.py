"""The progress watchdog: a target that stops answering while requests queue is wedged.

That is evidence (the liveness oracle judges the `probe/wedged` snapshot), and waiting out every
timeout after it would only delay the verdict: once wedged, the run sends no further load, faults
or probes. Fault windows and lulls are not counted: answers may stop there on purpose; nor is
anything before the load starts.

Progress is a request that finished having generated something, or the decode side's KV in use
moving between two samples of `/v1/loads` (every role's, where none is called decode): long
generations on a GPU may finish no request for longer than `wedged_after_s`, yet each step grows
their KV. A wedged pool holds still.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from chaos.facts.endpoints import loads_ranks
from chaos.journal import EventKind, Journal, JournalEvent, RequestRecord
from chaos.pools import queued

GENERATING_ROLE = "decode"


class ProgressWatchdog:
    def __init__(self, journal: Journal, wedged_after_s: float, say: Callable[[str], None]) -> None:
        self.journal = journal
        self.wedged_after_s = wedged_after_s  # 0: off
        self.say = say
        self.last_answer = time.time()
        self.quiet_since_window = time.time()
        self.wedged = threading.Event()
        self._kv_in_use: float | None = None  # the generating roles' num_used_tokens at the last sample

    def note(self, record: RequestRecord) -> None:
        """Progress is a request that generated something: a front end that still rejects
        over-length prompts with 400 while decode is stuck makes none."""
        if record.status == 200 and (record.completion_tokens or record.token_times) and record.t_end is not None:
            self.last_answer = max(self.last_answer, record.t_end)

    def load_started(self) -> None:
        """Quiet time counts from the load's start: the target's startup and the baseline before it
        (minutes, for a GPU engine loading its weights) are no wait for an answer."""
        self.last_answer = self.quiet_since_window = time.time()

    def window_ended(self) -> None:
        """Quiet time counts from the end of a window, in which answers may stop on purpose."""
        self.quiet_since_window = time.time()

    def check(self, loads: dict[str, Any], excused: bool) -> None:
        """Given the workers' loads by role; `excused`: in a fault window or a lull."""
        if self._kv_moved(loads):
            self.last_answer = max(self.last_answer, time.time())
        after = self.wedged_after_s
        if after <= 0 or excused:
            return
        quiet = time.time() - max(self.last_answer, self.quiet_since_window)
        waiting = {role: n for role, data in loads.items() if (n := queued(data))}
        if quiet < after or not waiting:
            return
        self.journal.append_event(
            JournalEvent(EventKind.PROBE, "wedged", {"quiet_s": round(quiet, 1), "queued": waiting, "loads": loads})
        )
        self.wedged.set()
        self.say(
            f"the target stopped making progress: nothing generated for {quiet:.0f} s with requests queued ({waiting}); "
            "no further load, faults or probes: judging now"
        )

    def _kv_moved(self, loads: dict[str, Any]) -> bool:
        """Whether the generating roles' tokens in use changed since the last sample (both known)."""
        roles = [role for role in loads if role == GENERATING_ROLE] or list(loads)
        counts = [rank.get("num_used_tokens") for role in roles for rank in loads_ranks(loads[role])]
        numbers = [float(c) for c in counts if isinstance(c, int | float) and not isinstance(c, bool)]
        in_use = sum(numbers) if numbers and len(numbers) == len(counts) else None
        moved = in_use is not None and self._kv_in_use is not None and in_use != self._kv_in_use
        self._kv_in_use = in_use
        return moved
