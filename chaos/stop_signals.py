"""The signals that stop a run: SIGINT (Ctrl-C), SIGTERM (a CI time limit, a scheduler, `kill`) and
SIGHUP (a closed terminal or SSH session) all mean the same.

The first one ends the phase the run is in (`Interrupted` is raised in the main thread): the fault
in effect heals, the load stops, the stack the run launched stops, and the journal is judged and
reported. Later ones never cut that short, since a half-done heal leaves the target broken and a
half-stopped stack leaves processes behind: they only hurry it (`hurry`: no waiting on probes
still in flight) and say so. SIGKILL cannot be caught; `pdchaos heal RUN_DIR` then does what the
run could not.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    """A stop signal (or the stop event): heal, stop and report from what was journaled."""


class StopSignals:
    """Handles the stop signals for the length of a `with` block (in the main thread only: Python
    delivers signals there). `armed` while the run may still be cut short; once judging starts,
    `disarm()`: a signal then only hurries the end."""

    def __init__(self, stop: threading.Event, say: Callable[[str], None]) -> None:
        self.stop = stop  # set by any stop signal: every thread of the run watches it
        self.hurry = threading.Event()  # set by a second signal
        self.received: list[str] = []
        self.armed = False
        self._say = say
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
            self.armed = True
        return self

    def __exit__(self, *_: type[BaseException] | BaseException | TracebackType | None) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        self.armed = False

    def disarm(self) -> None:
        self.armed = False

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self.received.append(name)
        self.stop.set()
        if len(self.received) == 1 and self.armed:
            raise Interrupted(name)
        self.hurry.set()
        self._say(
            f"{name}: already stopping; the fault heals and the stack stops first "
            "(a SIGKILL now leaves them to `pdchaos heal RUN_DIR`)"
        )
