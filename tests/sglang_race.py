"""A race in SGLang's Mooncake sender that the real-SGLang tests must tell apart from the suite's verdicts.

When a transfer finishes, the sender's transfer thread checks `kv_chunk.room not in
self.request_status or self.check_status(kv_chunk.room) == ...` while the scheduler thread may clear
that room in between (`clear()` in `disaggregation/common/conn.py`). The thread then dies of the
KeyError ("Transfer thread failed because of ...  Prefill instance ... is dead."), and prefill hands
off nothing more while its /health still says 200: every request afterwards waits out decode's
timeout. Seen in 0.5.23 and the same code is in 0.5.19 (docs/sglang-cpu-tier.md, "A race that
stops prefill's transfers"). It strikes at random under ordinary traffic, so a test that meets it
judged a dead engine, not the suite.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

TRANSFER_THREAD_DIED = "Transfer thread failed because of"


def transfer_thread_deaths(*logs: str) -> int:
    return sum(text.count(TRANSFER_THREAD_DIED) for text in logs)


def deaths_in_run(run_dir: Path) -> int:
    """The deaths in the worker logs a launched stack wrote under RUN_DIR/logs."""
    return transfer_thread_deaths(*(p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*.log"))))


class Restartable(Protocol):
    def logs(self, role: str) -> str: ...
    def restart(self, role: str) -> None: ...


class RaceWatch:
    """Watches a long-lived pair's logs (they append across restarts) for new deaths, and
    restarts prefill when there is one, so the next test starts on an engine that transfers."""

    def __init__(self, pair: Restartable) -> None:
        self.pair = pair
        self.revived_at = 0

    def deaths(self) -> int:
        return transfer_thread_deaths(self.pair.logs("prefill"), self.pair.logs("decode"))

    def revive(self) -> bool:
        """Restart prefill if its transfer thread died since the last revival; True if it did."""
        deaths = self.deaths()
        if deaths <= self.revived_at:
            return False
        self.pair.restart("prefill")
        self.revived_at = deaths
        return True
