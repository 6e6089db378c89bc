"""The workers' queues and KV pools as a run reads them: `/v1/loads` (and `/metrics`) snapshots
journaled as `probe/loads` and `probe/metrics`, the pages an engine holds back on purpose, and the
drain after the load (bounded: every queue empty and every pool back to idle)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from chaos import transport
from chaos.facts.endpoints import loads_ranks
from chaos.facts.prometheus import parse_prometheus_text
from chaos.journal import EventKind, Journal, JournalEvent
from chaos.oracles.liveness import HELD_BACK, TOKEN_KEYS, busy, queue_counts
from chaos.targets.base import Target
from chaos.targets.dialect import get_json

READ_TIMEOUT_S = 5.0
DRAIN_POLL_S = 0.5


class PoolReader:
    def __init__(self, target: Target, journal: Journal) -> None:
        self.target = target
        self.journal = journal

    def snapshot(self, loads_phase: str, metrics_phase: str | None) -> dict[str, Any]:
        """Journal every worker's `/v1/loads` (and `/metrics`); returns the loads by role."""
        taken: dict[str, Any] = {}
        for worker in self.target.endpoints.workers:
            data = get_json(f"{worker.url}/v1/loads", timeout_s=READ_TIMEOUT_S)
            if data is not None:
                taken[worker.role] = data
                sample: dict[str, Any] = {"role": worker.role, "phase": loads_phase, "data": data}
                if loads_phase != "idle_before" and not queued(data) and (held := self.held_back(worker.url)):
                    sample[HELD_BACK] = held
                self.journal.append_event(JournalEvent(EventKind.PROBE, "loads", sample))
            if metrics_phase:
                try:
                    text = transport.get(f"{worker.url}/metrics", timeout=READ_TIMEOUT_S, trust_env=False).text
                    self.journal.append_event(
                        JournalEvent(
                            EventKind.PROBE, "metrics", {"role": worker.role, "phase": metrics_phase, "text": text}
                        )
                    )
                except httpx.HTTPError:
                    pass
        return taken

    def held_back(self, url: str) -> float:
        """Requests whose pages the engine holds back on purpose, counted only in `/metrics`
        (the dialect's `held_back_metrics`); 0 when it names none or does not answer."""
        names = set(self.target.dialect.held_back_metrics)
        if not names:
            return 0.0
        try:
            text = transport.get(f"{url}/metrics", timeout=2.0, trust_env=False).text
        except httpx.HTTPError:
            return 0.0
        return sum(s.value for s in parse_prometheus_text(text) if s.name in names)

    def drain(self, timeout_s: float, give_up: Callable[[], bool]) -> None:
        """After the load: wait (up to `timeout_s`, until `give_up()`) for queues to empty and
        pools to return to idle, then snapshot them."""
        self.journal.append_event(JournalEvent(EventKind.PHASE, "drain:start"))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not give_up():
            if all(
                idle(get_json(f"{w.url}/v1/loads", timeout_s=READ_TIMEOUT_S)) and not self.held_back(w.url)
                for w in self.target.endpoints.workers
            ):
                break
            time.sleep(DRAIN_POLL_S)
        self.snapshot("after_drain", "after")
        self.journal.append_event(JournalEvent(EventKind.PHASE, "drain:end"))


def queued(loads: Any) -> int:
    """Requests a worker holds in any queue (running, waiting, or a disaggregation queue)."""
    return int(sum(sum(queue_counts(rank).values()) for rank in loads_ranks(loads)))


def idle(loads: Any) -> bool:
    """Every rank of a `/v1/loads` answer has no request queued or in a forward pass and no
    pages in use (an unreadable answer is not idle: the drain waits it out)."""
    ranks = loads_ranks(loads)
    return bool(ranks) and not any(busy(rank) or any(rank.get(k) for k in TOKEN_KEYS) for rank in ranks)
