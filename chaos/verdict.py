"""The tri-state verdict and what an oracle hands back (docs/real-sglang.md, "Reading the report").

FAIL when anything proves a leak, a corruption or a contract breach. INCONCLUSIVE when the run
cannot prove the absence of one (a fault not confirmed, too little traffic in a fault window, a
saturated load generator, a baseline that did not reproduce). PASS only otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from chaos.exit_codes import ExitCode


class Verdict(str, Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    INCONCLUSIVE = "INCONCLUSIVE"

    @property
    def exit_code(self) -> int:
        return ExitCode[self.value]  # the codes share the verdicts' names


@dataclass(frozen=True)
class Finding:
    """One piece of evidence: what was seen, on which request, during which fault window."""

    oracle: str
    verdict: Verdict
    summary: str
    request_id: str | None = None
    victim_request_id: str | None = None
    window: str | None = None  # the fault window (name) active when it was seen
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class OracleResult:
    name: str
    verdict: Verdict
    checked: int = 0  # how many items the oracle looked at: 0 checks prove nothing
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def from_findings(
        cls, name: str, checked: int, findings: list[Finding], notes: list[str] | None = None, minimum_checked: int = 1
    ) -> OracleResult:
        """FAIL on any failing finding; INCONCLUSIVE on an inconclusive one or too few checks."""
        verdict = combine(f.verdict for f in findings)
        notes = list(notes or [])
        if verdict is Verdict.PASS and checked < minimum_checked:
            verdict = Verdict.INCONCLUSIVE
            notes.append(f"checked {checked} item(s), fewer than the {minimum_checked} needed to conclude")
        return cls(name=name, verdict=verdict, checked=checked, findings=findings, notes=notes)


def combine(verdicts: Iterable[Verdict]) -> Verdict:
    seen = set(verdicts)
    if Verdict.FAIL in seen:
        return Verdict.FAIL
    if Verdict.INCONCLUSIVE in seen:
        return Verdict.INCONCLUSIVE
    return Verdict.PASS
