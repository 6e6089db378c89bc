"""What every oracle reads, and the contract it implements.

An oracle is a pure function of the run's evidence: the journal (requests, fault windows,
snapshots the runner journaled), the target's logs, and settings. It returns an `OracleResult`
(PASS / FAIL / INCONCLUSIVE with findings). Reports render those results; they never recompute.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

from chaos.journal import EventKind, Journal, RequestRecord
from chaos.verdict import OracleResult
from chaos.windows import AFTERSHOCK_S, FaultWindow, active_windows, windows_from_events

PROBE_KIND = "probe"  # user_kind of the runner's reference probes (baseline and replays)


@dataclass(frozen=True)
class OracleSettings:
    """Tolerances; defaults suit the embedded engine, campaigns override them for real engines."""

    reference_exact: bool = True  # exact greedy equality (embedded engine, deterministic modes)
    reference_prefix_tokens: int = 8  # else: the first N whitespace tokens must agree
    reference_max_mismatch_rate: float = 0.0  # calibrated on clean runs for real engines
    request_deadline_s: float = 120.0
    drain_timeout_s: float = 30.0
    timing_tell_factor: float = 0.5  # flag a TTFT below this fraction of the calibrated prefill time
    min_window_requests: int = 5  # fewer requests in a fault window prove nothing


@dataclass
class OracleContext:
    journal: Journal
    run_prefix: str
    logs: dict[str, str] = field(default_factory=dict)  # role -> captured log text
    settings: OracleSettings = field(default_factory=OracleSettings)

    @cached_property
    def windows(self) -> list[FaultWindow]:
        return windows_from_events(self.journal.iter_events(kind=EventKind.FAULT.value))

    @cached_property
    def requests(self) -> list[RequestRecord]:
        return list(self.journal.iter_requests())

    @cached_property
    def limits(self) -> dict[str, Any]:
        """The target's limits the run discovered (`context_length`, `max_total_num_tokens`,
        `max_req_input_len`; meta `limits`), empty for a journal that has none."""
        value = self.journal.get_meta("limits", {})
        return value if isinstance(value, dict) else {}

    def windows_at(self, t: float | None) -> list[str]:
        return active_windows(self.windows, t)

    def windows_during(self, start: float | None, end: float | None) -> list[str]:
        """Windows active at any moment of [start, end] (a request in flight when a fault began)."""
        if start is None:
            return []
        stop = end if end is not None else start
        return [
            w.label
            for w in self.windows
            if w.start is not None and stop >= w.start and (w.end is None or start <= w.end + AFTERSHOCK_S)
        ]

    def snapshots(self, name: str) -> Iterator[dict[str, Any]]:
        """Data of the `probe/<name>` events the runner journaled (e.g. pool usage at idle)."""
        for _, data in self.timed_snapshots(name):
            yield data

    def timed_snapshots(self, name: str) -> Iterator[tuple[float, dict[str, Any]]]:
        """The same, each with the time it was taken, in journal order."""
        for event in self.journal.iter_events(kind=EventKind.PROBE.value, name=name):
            yield event.t, dict(event.data)


class Oracle(Protocol):
    name: str

    def evaluate(self, ctx: OracleContext) -> OracleResult: ...
