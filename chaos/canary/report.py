"""What the canary found: each probe's and each victim's verdict, and the run's."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from chaos.canary.judging import Leak
from chaos.canary.sizing import ProbeSpec
from chaos.canary.target import CanaryTarget
from chaos.verdict import Verdict
from loadprofiles.exchange import ROUTES
from loadprofiles.sse import Api

SKIPPED = "SKIPPED"  # a probe's verdict when it was not sent


def verdict_name(verdict: Verdict | None) -> str:
    return SKIPPED if verdict is None else verdict.value


@dataclass(frozen=True)
class ProbeResult:
    spec: ProbeSpec
    planned_tokens: int | None  # None: not sent
    exact: bool  # sized from the server's own token counts
    verdict: Verdict | None  # None: not sent (no size to aim with, or its route is not served)
    reason: str
    http_status: int | None = None
    stream_error_status: int | None = None
    rejected_status: int | None = None  # the 4xx that counts as the rejection
    measured_tokens: int | None = None
    content_chars: int = 0
    leaks: tuple[Leak, ...] = ()
    elapsed_s: float = 0.0
    excerpt: str = ""

    def to_dict(self) -> dict[str, Any]:
        threshold = self.spec.threshold
        return {
            "name": self.spec.name,
            "marker_index": self.spec.index,
            "threshold": threshold.name,
            "threshold_label": threshold.label,
            "threshold_tokens": threshold.tokens,
            "upper_tokens": threshold.upper,
            "target_tokens": threshold.target,
            "planned_tokens": self.planned_tokens,
            "exact_size": self.exact,
            "measured_tokens": self.measured_tokens,
            "route": self.spec.route,
            "path": ROUTES[self.spec.route],
            "stream": self.spec.stream,
            "max_tokens": self.spec.max_tokens,
            "http_status": self.http_status,
            "stream_error_status": self.stream_error_status,
            "rejected_status": self.rejected_status,
            "content_chars": self.content_chars,
            "verdict": verdict_name(self.verdict),
            "reason": self.reason,
            "leaks": [leak.to_dict() for leak in self.leaks],
            "elapsed_s": round(self.elapsed_s, 4),
            "excerpt": self.excerpt,
        }


@dataclass(frozen=True)
class VictimResult:
    name: str
    index: int
    route: Api
    repeat: bool
    verdict: Verdict
    reason: str
    http_status: int | None = None
    markers: tuple[str, ...] = ()
    leaks: tuple[Leak, ...] = ()
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "marker_index": self.index,
            "route": self.route,
            "repeat": self.repeat,
            "http_status": self.http_status,
            "markers": list(self.markers),
            "verdict": self.verdict.value,
            "reason": self.reason,
            "leaks": [leak.to_dict() for leak in self.leaks],
            "elapsed_s": round(self.elapsed_s, 4),
        }


@dataclass(frozen=True)
class CanaryReport:
    run_prefix: str
    target: CanaryTarget
    routes: tuple[str, ...]
    victims: tuple[VictimResult, ...]
    probes: tuple[ProbeResult, ...]
    notes: tuple[str, ...] = ()
    elapsed_s: float = 0.0

    def count(self, verdict: Verdict | None) -> int:
        """Probes with this verdict (None: those not sent)."""
        return sum(1 for probe in self.probes if probe.verdict is verdict)

    @property
    def leaks(self) -> tuple[Leak, ...]:
        found = [leak for probe in self.probes for leak in probe.leaks]
        found += [leak for victim in self.victims for leak in victim.leaks]
        return tuple(found)

    @property
    def verdict(self) -> Verdict:
        if any(p.verdict is Verdict.FAIL for p in self.probes) or any(v.verdict is Verdict.FAIL for v in self.victims):
            return Verdict.FAIL
        sent = [p for p in self.probes if p.verdict is not None]
        if (
            not sent
            or any(p.verdict is Verdict.INCONCLUSIVE for p in sent)
            or any(v.verdict is not Verdict.PASS for v in self.victims)
        ):
            return Verdict.INCONCLUSIVE
        return Verdict.PASS

    @property
    def exit_code(self) -> int:
        """0 PASS, 1 FAIL, 3 INCONCLUSIVE (the project's exit codes; 2 is a usage error)."""
        return self.verdict.exit_code

    def summary_line(self) -> str:
        skipped = self.count(None)
        parts = [
            (
                f"{len(self.probes) - skipped} over-length probes sent: {self.count(Verdict.PASS)} rejected (4xx, clean), "
                f"{self.count(Verdict.FAIL)} FAIL, {self.count(Verdict.INCONCLUSIVE)} INCONCLUSIVE"
            )
        ]
        if skipped:
            parts.append(f"{skipped} skipped")
        clean = sum(1 for v in self.victims if v.verdict is Verdict.PASS)
        parts.append(f"victims {clean}/{len(self.victims)} clean")
        leaks = self.leaks
        parts.append(f"{len(leaks)} leaked marker{'s' if len(leaks) != 1 else ''}")
        return f"canary {self.verdict.value}: " + "; ".join(parts) + f" (run {self.run_prefix}, exit {self.exit_code})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value,
            "exit_code": self.exit_code,
            "run_prefix": self.run_prefix,
            "target": self.target.to_dict(),
            "routes": list(self.routes),
            "summary": {
                "probes": len(self.probes),
                "pass": self.count(Verdict.PASS),
                "fail": self.count(Verdict.FAIL),
                "inconclusive": self.count(Verdict.INCONCLUSIVE),
                "skipped": self.count(None),
                "victims": len(self.victims),
                "victims_clean": sum(1 for v in self.victims if v.verdict is Verdict.PASS),
                "leaks": len(self.leaks),
            },
            "probes": [probe.to_dict() for probe in self.probes],
            "victims": [victim.to_dict() for victim in self.victims],
            "notes": list(self.notes),
            "elapsed_s": round(self.elapsed_s, 3),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)
