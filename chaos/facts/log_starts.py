"""An SGLang log split into *starts* (launches of the server), with, per start and per rank,
the facts its lines state (`parse_log`, `read_log`).

Start-splitting rule (`parse_log`). Lines are read in order; a new start begins at:

1. a ``server_args=ServerArgs(...)`` line. The launching process prints it once, before any
   scheduler starts, so it is the most reliable boundary;
2. a scheduler startup line or a ``KV Cache is allocated`` line that comes after the current
   start's ready line. Neither is printed while the server is up, so this is a relaunch whose
   banner is missing (log level raised, log truncated, or only the scheduler's output captured);
3. a scheduler startup line for a rank that has already printed one in the current start. A rank
   initialises once per launch, so a second line is a restarted process.

Before the first start, the first startup, KV-allocation or ready line opens an implicit start;
lines before it are ignored. Before the ready line, ``KV Cache is allocated`` lines never open a
start, because one rank legitimately prints several per launch (hybrid SWA/Mamba pools, a
speculative draft model); they belong to the start that is current when they appear. Known limit:
a relaunch with no banner whose previous start crashed before its ready line is only detected at
the relaunch's startup line (rule 3), so the relaunch's KV lines stay with the crashed start; and
one whose previous start crashed before any startup line is indistinguishable from one start.
"""

from __future__ import annotations

import gzip
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from chaos.facts.log_facts import (
    KvAllocFacts,
    ServerArgsFacts,
    StartupFacts,
    is_ready_line,
    parse_kv_alloc_line,
    parse_server_args_line,
    parse_startup_line,
)
from chaos.facts.log_records import LogLine, iter_log_records

BOUNDARY_BANNER = "server_args banner"
BOUNDARY_AFTER_READY = "startup after ready"
BOUNDARY_RANK_AGAIN = "rank started again"
BOUNDARY_FIRST = "first startup facts"


@dataclass
class RankFacts:
    """What one rank printed during one start."""

    rank: str
    startup: StartupFacts | None = None
    kv_allocs: list[KvAllocFacts] = field(default_factory=list)


@dataclass
class LogStart:
    """One launch of the server, as seen in a log.

    ``index`` counts from 1 in file order; ``boundary`` says which rule opened it (see the module
    docstring).
    """

    index: int
    first_lineno: int
    timestamp: str | None
    boundary: str
    server_args: ServerArgsFacts | None = None
    ranks: dict[str, RankFacts] = field(default_factory=dict)
    ready_lineno: int | None = None
    last_lineno: int = 0

    @property
    def ready(self) -> bool:
        return self.ready_lineno is not None

    @property
    def startup_ranks(self) -> list[RankFacts]:
        """Ranks that printed the startup line, in first-seen order."""
        return [facts for facts in self.ranks.values() if facts.startup is not None]

    @property
    def pool_tokens(self) -> int | None:
        """Smallest ``max_total_num_tokens`` over the ranks that printed it.

        None when no rank printed it or any rank's value is unreadable.
        """
        values = [facts.startup.max_total_num_tokens for facts in self.startup_ranks if facts.startup]
        if not values or any(value is None for value in values):
            return None
        return min(value for value in values if value is not None)

    @property
    def context_len(self) -> int | None:
        """Largest ``context_len`` over the ranks that printed it (None as for `pool_tokens`)."""
        values = [facts.startup.context_len for facts in self.startup_ranks if facts.startup]
        if not values or any(value is None for value in values):
            return None
        return max(value for value in values if value is not None)

    @property
    def kv_tokens(self) -> int | None:
        """Smallest ``#tokens`` of the KV-allocation lines.

        Informational only: hybrid models allocate pools of different kinds and sizes.
        """
        values = [alloc.tokens for facts in self.ranks.values() for alloc in facts.kv_allocs if alloc.tokens]
        return min(values) if values else None

    @property
    def role(self) -> str | None:
        """``prefill`` / ``decode`` / ``unified`` from the banner, or None without a banner."""
        if self.server_args is None:
            return None
        mode = self.server_args.disaggregation_mode
        if mode is None or mode == "null":
            return "unified"
        return mode

    def rank(self, name: str) -> RankFacts:
        if name not in self.ranks:
            self.ranks[name] = RankFacts(rank=name)
        return self.ranks[name]


def parse_log(lines: Iterable[str]) -> list[LogStart]:
    """Split a log into starts and collect, per start and rank, the startup and KV facts.

    ``lines`` are physical lines (with or without their newline). See the module docstring for the
    rule that opens a new start.
    """
    starts: list[LogStart] = []
    current: LogStart | None = None

    def open_start(record: LogLine, boundary: str) -> LogStart:
        start = LogStart(
            index=len(starts) + 1,
            first_lineno=record.lineno,
            timestamp=record.timestamp,
            boundary=boundary,
            last_lineno=record.lineno,
        )
        starts.append(start)
        return start

    for record in iter_log_records(lines):
        message = record.message
        banner = parse_server_args_line(message, record.lineno)
        if banner is not None:
            current = open_start(record, BOUNDARY_BANNER)
            current.server_args = banner
            continue

        startup = parse_startup_line(message, record.lineno)
        if startup is not None:
            if current is None:
                current = open_start(record, BOUNDARY_FIRST)
            elif current.ready:
                current = open_start(record, BOUNDARY_AFTER_READY)
            elif record.rank in current.ranks and current.ranks[record.rank].startup is not None:
                current = open_start(record, BOUNDARY_RANK_AGAIN)
            current.rank(record.rank).startup = startup
            current.last_lineno = record.lineno
            continue

        kv_alloc = parse_kv_alloc_line(message, record.lineno)
        if kv_alloc is not None:
            if current is None:
                current = open_start(record, BOUNDARY_FIRST)
            elif current.ready:
                current = open_start(record, BOUNDARY_AFTER_READY)
            current.rank(record.rank).kv_allocs.append(kv_alloc)
            current.last_lineno = record.lineno
            continue

        if is_ready_line(message):
            if current is None:
                current = open_start(record, BOUNDARY_FIRST)
            if current.ready_lineno is None:
                current.ready_lineno = record.lineno
            current.last_lineno = record.lineno
            continue

        if current is not None:
            current.last_lineno = record.lineno
    return starts


def open_log(path: str | Path) -> Iterator[str]:
    """Physical lines of a log file (``.gz`` is decompressed), decoded leniently.

    Lines are split on ``\\n`` only, so carriage returns inside a line reach `iter_log_records`.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        for raw in handle:
            yield raw.decode("utf-8", errors="replace")


def read_log(path: str | Path) -> list[LogStart]:
    """`parse_log` of a file."""
    return parse_log(open_log(path))
