"""What the runner journals for the judge beside the requests and the fault steps, and how it is read back.

- `phase` `run:stopped` `{"reason"}`: the run ended before its end (interrupted, or the suite broke).
- `phase` `oracles:start`: the run reached its judging, so everything it collects is journaled. A
  journal without it (and without `run:stopped`) belongs to a run that was killed, or still runs.
- `probe` `pool_preflight`: the pool preflight over the workers, taken before the load, as
  `pdchaos preflight --json` prints it (`chaos/preflight.py`).
- `probe` `log` `{"role", "text"}`: each role's log as the run ends (the integrity oracle reads it).
- `probe` `generator` `{"actor", "cpu_percent", "rss_mb", "running"}`: a load generator's own
  health, as the load polls it (`chaos/load.py`); the saturated-generator gate reads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from chaos.journal import EventKind, Journal, JournalEvent

STOPPED = "run:stopped"
JUDGING = "oracles:start"
POOL_PREFLIGHT = "pool_preflight"
LOG = "log"
GENERATOR = "generator"


def journal_stopped(journal: Journal, reason: str) -> None:
    journal.append_event(JournalEvent(EventKind.PHASE, STOPPED, {"reason": reason}))


def journal_judging(journal: Journal) -> None:
    journal.append_event(JournalEvent(EventKind.PHASE, JUDGING))


def journal_pool_preflight(journal: Journal, report: Mapping[str, Any]) -> None:
    journal.append_event(JournalEvent(EventKind.PROBE, POOL_PREFLIGHT, report))


def journal_logs(journal: Journal, logs: Mapping[str, str]) -> None:
    for role, text in logs.items():
        journal.append_event(JournalEvent(EventKind.PROBE, LOG, {"role": role, "text": text}))


class GeneratorHealth(Protocol):
    """A load generator's health sample (`chaos.cluster.HealthSample`), as it is journaled."""

    actor: str
    cpu_percent: float
    rss_mb: float
    running: bool
    t: float


def journal_generator_health(journal: Journal, sample: GeneratorHealth) -> None:
    journal.append_event(
        JournalEvent(
            EventKind.PROBE,
            GENERATOR,
            {
                "actor": sample.actor,
                "cpu_percent": sample.cpu_percent,
                "rss_mb": sample.rss_mb,
                "running": sample.running,
            },
            t=sample.t,
        )
    )


@dataclass(frozen=True)
class RunEvidence:
    """What the runner journaled for the judge, read back."""

    stopped: str | None = None  # why the run ended before its end, journaled or told by where its journal ends
    pool_preflight: dict[str, Any] | None = None  # None: the run never took it
    logs: dict[str, str] = field(default_factory=dict)  # role -> log text
    generator_cpu: list[float] = field(default_factory=list)  # % of a core, of the generators while they ran


def read_evidence(journal: Journal) -> RunEvidence:
    phases = [event.name for event in journal.iter_events(kind=EventKind.PHASE)]
    stop = next((dict(e.data) for e in journal.iter_events(kind=EventKind.PHASE, name=STOPPED)), None)
    if stop is not None:
        stopped: str | None = str(stop.get("reason") or "the run stopped early")
    elif JUDGING not in phases:
        stopped = (
            "no verdict recorded: the run stopped before it judged itself (killed, or still running); "
            f"judged from what its journal holds, up to its last phase event: {phases[-1] if phases else 'none'}"
        )
    else:
        stopped = None
    preflight = next((dict(e.data) for e in journal.iter_events(kind=EventKind.PROBE, name=POOL_PREFLIGHT)), None)
    logs = {
        str(e.data.get("role")): str(e.data.get("text", ""))
        for e in journal.iter_events(kind=EventKind.PROBE, name=LOG)
    }
    cpu = [
        float(e.data["cpu_percent"])
        for e in journal.iter_events(kind=EventKind.PROBE, name=GENERATOR)
        if e.data.get("running")
    ]
    return RunEvidence(stopped=stopped, pool_preflight=preflight, logs=logs, generator_cpu=cpu)
