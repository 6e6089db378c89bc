"""A fault window as the reports see it (`FaultRecord`): the run model builds it, the fault x oracle
matrix reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FaultRecord:
    """One fault window: what the plan, inject, confirm, heal and audit events say."""

    window_id: str
    fault: str
    params: dict[str, Any] = field(default_factory=dict)
    start: float | None = None  # inject; None: never injected (the fault raised, or the run died)
    end: float | None = None  # heal; None: not healed (yet)
    confirmed: bool | None = None  # None: no confirm step recorded
    confirm_evidence: str = ""
    healed: bool = False
    error: str | None = None
    audit_clean: bool | None = None
    leftovers: list[str] = field(default_factory=list)
    provocation: str = ""  # what the window sent to provoke its bug classes (faults/provoke.py)

    @property
    def label(self) -> str:
        return f"{self.fault}#{self.window_id}"

    @property
    def duration_s(self) -> float | None:
        return None if self.start is None or self.end is None else self.end - self.start

    @property
    def proves_something(self) -> bool:
        """Only a confirmed fault can make its window PASS (docs/architecture.md: unconfirmed is INCONCLUSIVE)."""
        return self.confirmed is True
