"""Fault windows, rebuilt from the journal: when each fault was active, confirmed and healed.

The fault runner journals `fault/<name>` events with data `{"window": ID, "step": "inject" |
"confirm" | "heal", ...}`; a window spans inject to heal (open-ended while unhealed).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from chaos.journal import EventKind, JournalEvent

AFTERSHOCK_S = 10.0  # corruption can outlive its fault: requests this soon after heal still count


@dataclass
class FaultWindow:
    window_id: str
    fault: str
    params: dict[str, Any] = field(default_factory=dict)
    start: float | None = None
    end: float | None = None
    confirmed: bool | None = None
    confirm_evidence: str = ""
    healed: bool = False

    def active_at(self, t: float | None, aftershock_s: float = 0.0) -> bool:
        if t is None or self.start is None or t < self.start:
            return False
        return self.end is None or t <= self.end + aftershock_s

    @property
    def label(self) -> str:
        return f"{self.fault}#{self.window_id}"


def windows_from_events(events: Iterable[JournalEvent]) -> list[FaultWindow]:
    windows: dict[str, FaultWindow] = {}
    for event in events:
        if event.kind != EventKind.FAULT.value:
            continue
        data = dict(event.data)
        wid = str(data.get("window", event.name))
        window = windows.setdefault(
            wid, FaultWindow(window_id=wid, fault=event.name, params=dict(data.get("params", {})))
        )
        step = data.get("step")
        if step == "inject":
            window.start = event.t
        elif step == "confirm":
            window.confirmed = bool(data.get("confirmed"))
            window.confirm_evidence = str(data.get("evidence", ""))
        elif step == "heal":
            window.end = event.t
            window.healed = bool(data.get("ok", True))
    return sorted(windows.values(), key=lambda w: (w.start or 0.0, w.window_id))


def active_windows(windows: Iterable[FaultWindow], t: float | None, aftershock_s: float = AFTERSHOCK_S) -> list[str]:
    return [w.label for w in windows if w.active_at(t, aftershock_s)]
