"""Readings a fault uses to confirm itself: counters, queue gauges, log lines, health."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx

from chaos.targets.dialect import dialect_of

TIMEOUT_S = 3.0


def transfer_failures(target: Any, role: str | None = None) -> float:
    """Failed KV transfers counted by the workers (of `role`, else all), in the target's dialect;
    a worker that is down counts 0."""
    dialect = dialect_of(target)
    return sum(dialect.transfer_failures(w.url) or 0.0 for w in target.endpoints.workers if role in (None, w.role))


def healthy(url: str, timeout_s: float = TIMEOUT_S) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=timeout_s, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class LogCursor:
    """Counts a pattern in the part of a role's log written after the cursor was made."""

    start: int

    @classmethod
    def at_end(cls, text: str) -> LogCursor:
        return cls(len(text))

    def count(self, text: str, pattern: str) -> int:
        return len(re.findall(pattern, text[self.start :]))
