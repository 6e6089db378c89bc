"""`pdchaos compare BASE_RUN CANDIDATE_RUN`: did the new engine build regress under the same plan?

Fault windows are matched by fault name and occurrence (the 2nd `transfer_stall` of one run with
the 2nd of the other), which survives different window ids; "outside fault windows" matches
itself. Then:

Regressions (exit 1), each a line in `regressions`:
- the run verdict became FAIL, or any matched fault × oracle cell became FAIL;
- the candidate leaked more than the base;
- an error class the base never saw appears in the candidate (not `load_stopped`: the load's end
  stopping a request in flight is the suite's doing);
- under faults, TTFT p50/p99 or ITL p99 grew by `max_latency_ratio` or more (both runs with at
  least MIN_LATENCY_SAMPLES values; 0 turns the latency gate off).

A failure can change kind while its cell stays FAIL (an upgrade that turns a silent over-length
200 into a 500): the FAIL findings are also counted per oracle and rule (`evidence.rule`, else
the oracle), and a kind of failure the base never had is a regression; one that went away is an
improvement.

Not proven (exit 3, when nothing regressed), each a line in `unproven`: the candidate stopped
before it recorded a verdict (its journal judged afterwards), fell from PASS to INCONCLUSIVE, a
cell that passed in the base no longer passes, or a base fault window has no counterpart in the
candidate. Otherwise exit 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from chaos.exit_codes import ExitCode
from chaos.loadstats import Distribution
from chaos.verdict import Verdict
from reports.matrix import OUTSIDE, MatrixRow
from reports.model import RunReport
from reports.outcomes import SUITE_ENDINGS
from reports.traffic import LatencyStats

DEFAULT_MAX_LATENCY_RATIO = 2.0
MIN_LATENCY_SAMPLES = 20
EXIT_OK, EXIT_REGRESSED, EXIT_UNPROVEN = ExitCode.PASS, ExitCode.FAIL, ExitCode.INCONCLUSIVE
_RANK = {"PASS": 0, "INCONCLUSIVE": 1, "NOT RUN": 1, "absent": 1, "FAIL": 2}


@dataclass(frozen=True)
class CellChange:
    window: str  # the candidate's label (the base's when the candidate lacks the window)
    oracle: str
    base: str  # PASS | FAIL | INCONCLUSIVE | NOT RUN | absent
    candidate: str

    @property
    def regressed(self) -> bool:
        return self.candidate == "FAIL" and self.base != "FAIL"

    @property
    def weakened(self) -> bool:
        return self.base == "PASS" and self.candidate in ("INCONCLUSIVE", "NOT RUN", "absent")

    @property
    def improved(self) -> bool:
        return _RANK[self.candidate] < _RANK[self.base]


@dataclass(frozen=True)
class LatencyChange:
    span: str  # "under faults", "outside faults" or a window label
    metric: str  # e.g. "TTFT p99"
    base_s: float | None
    candidate_s: float | None
    base_count: int
    candidate_count: int

    @property
    def ratio(self) -> float | None:
        if self.base_s is None or self.candidate_s is None or self.base_s <= 0:
            return None
        return self.candidate_s / self.base_s

    @property
    def enough_samples(self) -> bool:
        return min(self.base_count, self.candidate_count) >= MIN_LATENCY_SAMPLES


@dataclass(frozen=True)
class ErrorClassChange:
    name: str
    base: int
    candidate: int
    base_under_faults: int
    candidate_under_faults: int

    @property
    def new(self) -> bool:
        return self.base == 0 and self.candidate > 0


@dataclass(frozen=True)
class FailureKindChange:
    oracle: str
    rule: str
    base: int  # FAIL findings of this kind
    candidate: int
    example: str  # a summary from the run that has them (the candidate's when both do)

    @property
    def new(self) -> bool:
        return self.base == 0 and self.candidate > 0

    @property
    def gone(self) -> bool:
        return self.base > 0 and self.candidate == 0


@dataclass
class Comparison:
    base: RunReport
    candidate: RunReport
    max_latency_ratio: float
    windows: list[tuple[MatrixRow | None, MatrixRow | None]] = field(default_factory=list)
    cells: list[CellChange] = field(default_factory=list)
    latency: list[LatencyChange] = field(default_factory=list)
    error_classes: list[ErrorClassChange] = field(default_factory=list)
    failure_kinds: list[FailureKindChange] = field(default_factory=list)
    regressions: list[str] = field(default_factory=list)
    unproven: list[str] = field(default_factory=list)
    improvements: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return EXIT_REGRESSED if self.regressions else EXIT_UNPROVEN if self.unproven else EXIT_OK

    @property
    def outcome(self) -> str:
        return "REGRESSED" if self.regressions else "NOT PROVEN" if self.unproven else "NO REGRESSION"


def compare_runs(
    base: RunReport, candidate: RunReport, max_latency_ratio: float = DEFAULT_MAX_LATENCY_RATIO
) -> Comparison:
    c = Comparison(base, candidate, max_latency_ratio)
    c.warnings += _plan_warnings(base, candidate)
    c.windows = match_rows(base.matrix, candidate.matrix)
    _verdicts(c)
    _cells(c)
    _failure_kinds(c)
    _leaks(c)
    _errors(c)
    _latency(c)
    return c


def match_rows(
    base: Sequence[MatrixRow], candidate: Sequence[MatrixRow]
) -> list[tuple[MatrixRow | None, MatrixRow | None]]:
    """Pairs of rows: same fault name and occurrence; OUTSIDE with OUTSIDE; unmatched ones alone."""

    def keyed(rows: Sequence[MatrixRow]) -> dict[tuple[str, int], MatrixRow]:
        seen: dict[str, int] = {}
        out = {}
        for row in rows:
            name = row.fault.fault if row.fault else OUTSIDE
            seen[name] = seen.get(name, 0) + 1
            out[(name, seen[name])] = row
        return out

    b, k = keyed(base), keyed(candidate)
    keys = list(dict.fromkeys([*b, *k]))
    keys.sort(key=lambda key: key[0] == OUTSIDE)  # outside last, as in the matrix
    return [(b.get(key), k.get(key)) for key in keys]


def _plan_warnings(base: RunReport, candidate: RunReport) -> list[str]:
    out = []
    if base.seed != candidate.seed:
        out.append(f"different seeds ({base.seed} vs {candidate.seed}): not the same seeded plan")
    if base.campaign_name != candidate.campaign_name:
        out.append(f"different campaigns ({base.campaign_name} vs {candidate.campaign_name})")
    plan_b, plan_c = base.meta.get("windows_planned"), candidate.meta.get("windows_planned")
    if plan_b and plan_c and plan_b != plan_c:
        out.append("the fault schedules differ: windows are matched by fault name and occurrence")
    return out


def _verdicts(c: Comparison) -> None:
    b, k = c.base.verdict_label, c.candidate.verdict_label
    if k == "FAIL" and b != "FAIL":
        c.regressions.append(f"run verdict {b} → FAIL")
    elif not c.candidate.complete:
        c.unproven.append(f"the candidate run stopped before it recorded a verdict ({k}, judged from its journal)")
    elif k == "INCONCLUSIVE" and b == "PASS":
        c.unproven.append("run verdict PASS → INCONCLUSIVE")
    elif _RANK.get(k, 1) < _RANK.get(b, 1):
        c.improvements.append(f"run verdict {b} → {k}")


def _cells(c: Comparison) -> None:
    weakened: dict[tuple[str, str, str], list[str]] = {}
    for base_row, cand_row in c.windows:
        label = (cand_row or base_row).key  # type: ignore[union-attr]
        if cand_row is None:
            c.unproven.append(f"fault window {label} of the base has no counterpart in the candidate")
        if base_row is None:
            c.warnings.append(f"fault window {label} is new in the candidate")
        cells = [*(base_row.cells if base_row else ()), *(cand_row.cells if cand_row else ())]
        oracles = list(dict.fromkeys(x.oracle for x in cells))
        for oracle in oracles:
            bc = base_row.cell(oracle) if base_row else None
            kc = cand_row.cell(oracle) if cand_row else None
            change = CellChange(label, oracle, bc.label if bc else "absent", kc.label if kc else "absent")
            if change.base == change.candidate:
                continue
            c.cells.append(change)
            where = f"{label} × {oracle}: {change.base} → {change.candidate}"
            if change.regressed:
                c.regressions.append(where + (f" ({kc.why})" if kc else ""))
            elif change.weakened and cand_row is not None:
                weakened.setdefault((label, change.base, change.candidate), []).append(oracle)
            elif change.improved:
                c.improvements.append(where)
    # One line per window and kind of change: a window that proved nothing weakens every oracle.
    c.unproven += [f"{label}: {old} → {new} for {', '.join(names)}" for (label, old, new), names in weakened.items()]


def failure_kinds(report: RunReport) -> dict[tuple[str, str], list[str]]:
    """(oracle, rule) -> the summaries of that kind of FAIL finding."""
    kinds: dict[tuple[str, str], list[str]] = {}
    for result in report.oracles:
        for finding in result.findings:
            if finding.verdict is Verdict.FAIL:
                rule = finding.evidence.get("rule") if isinstance(finding.evidence, dict) else None
                kinds.setdefault((result.name, str(rule or result.name)), []).append(finding.summary)
    return kinds


def _failure_kinds(c: Comparison) -> None:
    base, cand = failure_kinds(c.base), failure_kinds(c.candidate)
    for key in dict.fromkeys([*cand, *base]):
        b, k = base.get(key, []), cand.get(key, [])
        change = FailureKindChange(key[0], key[1], len(b), len(k), (k or b)[0])
        c.failure_kinds.append(change)
        name = key[1] if key[1] == key[0] else f"{key[0]} {key[1]}"
        if change.new:
            c.regressions.append(f"new kind of failure: {name} ×{change.candidate} (e.g. {change.example})")
        elif change.gone:
            c.improvements.append(f"failure gone: {name} ×{change.base} (e.g. {change.example})")


def _leaks(c: Comparison) -> None:
    b, k = len(c.base.leaks), len(c.candidate.leaks)
    if k > b:
        c.regressions.append(f"leaks {b} → {k}")
    elif k < b:
        c.improvements.append(f"leaks {b} → {k}")


def _errors(c: Comparison) -> None:
    tb, tk = c.base.traffic, c.candidate.traffic
    for name in dict.fromkeys([*tk.error_classes, *tb.error_classes]):
        change = ErrorClassChange(
            name,
            tb.error_classes.get(name, 0),
            tk.error_classes.get(name, 0),
            tb.error_classes_under_faults.get(name, 0),
            tk.error_classes_under_faults.get(name, 0),
        )
        c.error_classes.append(change)
        if change.new and name not in SUITE_ENDINGS:  # the load's end stopping a request is the suite's doing
            c.regressions.append(
                f"new error class {name}: {change.candidate} request(s), {change.candidate_under_faults} under faults"
            )
        elif change.candidate == 0 and change.base > 0:
            c.improvements.append(f"error class {name} gone (was {change.base})")


def _latency(c: Comparison) -> None:
    spans: list[tuple[str, LatencyStats, LatencyStats]] = [
        ("under faults", c.base.traffic.under_faults, c.candidate.traffic.under_faults),
        ("outside faults", c.base.traffic.outside_faults, c.candidate.traffic.outside_faults),
    ]
    for base_row, cand_row in c.windows:
        if base_row and cand_row and base_row.fault and cand_row.fault:
            spans.append(
                (
                    cand_row.key,
                    c.base.traffic.per_window.get(base_row.key, LatencyStats()),
                    c.candidate.traffic.per_window.get(cand_row.key, LatencyStats()),
                )
            )
    for span, b, k in spans:
        for metric, db, dk, q in (
            ("TTFT p50", b.ttft, k.ttft, "p50"),
            ("TTFT p99", b.ttft, k.ttft, "p99"),
            ("ITL p50", b.itl, k.itl, "p50"),
            ("ITL p99", b.itl, k.itl, "p99"),
            ("E2E p99", b.e2e, k.e2e, "p99"),
        ):
            change = LatencyChange(span, metric, _q(db, q), _q(dk, q), db.count, dk.count)
            c.latency.append(change)
            gated = span == "under faults" and metric in ("TTFT p50", "TTFT p99", "ITL p99")
            ratio = change.ratio
            if (
                gated
                and c.max_latency_ratio > 0
                and ratio is not None
                and change.enough_samples
                and ratio >= c.max_latency_ratio
            ):
                c.regressions.append(
                    f"{metric} under faults ×{ratio:.2f} ({_ms(change.base_s)} → {_ms(change.candidate_s)} ms), "
                    f"limit ×{c.max_latency_ratio:g}"
                )


def _q(d: Distribution, q: str) -> float | None:
    value = getattr(d, q)
    return float(value) if value is not None else None


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1000:.0f}"
