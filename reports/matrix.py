"""The fault × oracle matrix: for each fault window, what each oracle concluded about it.

Cell (window W, oracle O):
- FAIL when O has a FAIL finding whose `window` is W's label (a leak seen during an unconfirmed
  fault is still a leak, so FAIL wins);
- INCONCLUSIVE when W was not confirmed, when a run gate names W, or when O has an INCONCLUSIVE
  finding for W;
- INCONCLUSIVE too when O as a whole is INCONCLUSIVE with no finding to place (it checked
  nothing): such an oracle proves no window;
- PASS otherwise; `None` when O was never evaluated (a crashed run).
One more row, "outside fault windows", holds findings with no window, or one naming a window the
journal does not know.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from chaos.verdict import Finding, OracleResult, Verdict, combine
from reports.fault_record import FaultRecord

OUTSIDE = "outside fault windows"


@dataclass(frozen=True)
class MatrixCell:
    oracle: str
    verdict: Verdict | None  # None: the oracle has no result in the journal
    findings: tuple[Finding, ...]  # this oracle's findings for this row
    why: str  # one line a tooltip can show

    @property
    def label(self) -> str:
        return self.verdict.value if self.verdict else "NOT RUN"


@dataclass(frozen=True)
class MatrixRow:
    key: str  # the window label, or OUTSIDE
    fault: FaultRecord | None
    cells: tuple[MatrixCell, ...]

    @property
    def verdict(self) -> Verdict | None:
        evaluated = [c.verdict for c in self.cells if c.verdict is not None]
        return combine(evaluated) if evaluated else None

    def cell(self, oracle: str) -> MatrixCell | None:
        return next((c for c in self.cells if c.oracle == oracle), None)


def build_matrix(
    faults: Sequence[FaultRecord],
    oracles: Sequence[OracleResult],
    gates: Sequence[Finding],
    expected: Sequence[str] = (),
) -> list[MatrixRow]:
    """`expected`: the oracles the campaign enabled; those without a result get NOT RUN columns."""
    results = {o.name: o for o in oracles}
    columns = list(dict.fromkeys([*expected, *results]))
    by_label = {f.label: f for f in faults}
    ids = {f.window_id: f.label for f in faults}

    def row_of(window: str | None) -> str:
        if window is None:
            return OUTSIDE
        return window if window in by_label else ids.get(window, OUTSIDE)

    # Index findings once by (row, oracle): the matrix is built in O(findings + cells).
    found: dict[tuple[str, str], list[Finding]] = {}
    for oracle in oracles:
        for finding in oracle.findings:
            found.setdefault((row_of(finding.window), oracle.name), []).append(finding)
    gated: dict[str, list[Finding]] = {}
    for gate in gates:
        if gate.window is not None and row_of(gate.window) != OUTSIDE:
            gated.setdefault(row_of(gate.window), []).append(gate)

    rows = []
    for fault in faults:
        cells = tuple(
            _cell(name, results.get(name), found.get((fault.label, name), []), fault, gated.get(fault.label, []))
            for name in columns
        )
        rows.append(MatrixRow(fault.label, fault, cells))
    rows.append(
        MatrixRow(
            OUTSIDE,
            None,
            tuple(_cell(name, results.get(name), found.get((OUTSIDE, name), []), None, []) for name in columns),
        )
    )
    return rows


def _cell(
    name: str, oracle: OracleResult | None, findings: list[Finding], fault: FaultRecord | None, gates: list[Finding]
) -> MatrixCell:
    if oracle is None:
        return MatrixCell(name, None, (), "not evaluated: the journal holds no result of this oracle")
    fails = [f for f in findings if f.verdict is Verdict.FAIL]
    if fails:
        return MatrixCell(
            oracle.name, Verdict.FAIL, tuple(findings), f"{len(fails)} failing finding(s): {fails[0].summary}"
        )
    if fault is not None and fault.confirmed is not True:
        why = (
            ("fault not confirmed: " + (fault.confirm_evidence or "no evidence it took effect"))
            if fault.confirmed is False
            else "fault never confirmed (no confirm step recorded)"
        )
        return MatrixCell(oracle.name, Verdict.INCONCLUSIVE, tuple(findings), why)
    if gates:
        return MatrixCell(oracle.name, Verdict.INCONCLUSIVE, tuple(findings), gates[0].summary)
    unsure = [f for f in findings if f.verdict is Verdict.INCONCLUSIVE]
    if unsure:
        return MatrixCell(oracle.name, Verdict.INCONCLUSIVE, tuple(findings), unsure[0].summary)
    if oracle.verdict is Verdict.INCONCLUSIVE and all(f.verdict is Verdict.PASS for f in oracle.findings):
        # Inconclusive as a whole with no finding to place (e.g. it checked nothing): no cell may pass.
        why = oracle.notes[0] if oracle.notes else "the oracle concluded nothing for the whole run"
        return MatrixCell(oracle.name, Verdict.INCONCLUSIVE, tuple(findings), why)
    return MatrixCell(oracle.name, Verdict.PASS, tuple(findings), f"no finding ({oracle.checked} checked in the run)")
