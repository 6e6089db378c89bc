"""A run as every report sees it: `load_run(run_dir)` reads the journal into a typed `RunReport`.

The journal is read once: one pass over the events, one column query over the requests
(`reports/columns.py`), then lookups by id for the leaks' two requests. Everything a renderer needs is computed
here once, so the renderers stay dumb and always agree with one another.

A run that stopped before it judged itself (killed, or still running) has no `verdict/run` event:
its journal is judged here as the runner judges it (`chaos/judging/judge.py`), so its verdict is
PASS, FAIL or INCONCLUSIVE like any run's, and every renderer says first that the run did not
record it itself. Malformed events do not stop a report; they are listed in `problems`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from chaos.journal import EventKind, Journal, JournalEvent, RequestRecord
from chaos.judging.judge import judge
from chaos.verdict import Finding, OracleResult, Verdict
from chaos.windows import windows_from_events
from reports.columns import read_columns
from reports.fault_record import FaultRecord
from reports.matrix import MatrixRow, build_matrix
from reports.outcomes import OutcomeClasses, classify
from reports.traffic import Span, Traffic, compute_traffic

CANARY_ORACLE = "canary"
LEAK_DETAIL_LIMIT = 100  # a broken engine can leak thousands of times; fetch both requests for the first ones


@dataclass(frozen=True)
class RunVerdict:
    """The run's verdict: its `verdict/run` event or, where it recorded none, the judge's over its journal."""

    verdict: Verdict
    exit_code: int
    reasons: list[str]
    requests: dict[str, int]
    generator_saturated: bool | None


@dataclass(frozen=True)
class Leak:
    """A canary FAIL finding, with both requests fetched for the side-by-side view."""

    finding: Finding
    marker: str
    kind: str
    offset: int | None
    excerpt: str
    faults_active: list[str]
    victim_faults_active: list[str]
    offender: RequestRecord | None
    victim: RequestRecord | None


@dataclass(frozen=True)
class PoolPoint:
    t: float  # epoch seconds
    role: str
    phase: str
    used_tokens: float
    total_tokens: float | None

    @property
    def used_fraction(self) -> float | None:
        return self.used_tokens / self.total_tokens if self.total_tokens else None


@dataclass(frozen=True)
class PhaseMark:
    name: str  # e.g. "load:start"
    t: float


@dataclass
class RunReport:
    run_dir: Path
    meta: dict[str, Any]
    origin: float  # t = 0 on every time axis (the run's start)
    faults: list[FaultRecord]
    oracles: list[OracleResult]
    gates: list[Finding]
    run_verdict: RunVerdict
    complete: bool  # the run recorded its verdict itself; False: judged here from what its journal holds
    phases: list[PhaseMark]
    pool: list[PoolPoint]
    traffic: Traffic
    leaks: list[Leak]
    matrix: list[MatrixRow]
    problems: list[str] = field(default_factory=list)
    endings: OutcomeClasses = field(default_factory=OutcomeClasses)  # answered, as intended, under a fault, unexplained

    # -- the headline --------------------------------------------------------------------------

    @property
    def verdict_label(self) -> str:
        return self.run_verdict.verdict.value

    @property
    def exit_code(self) -> int:
        return self.run_verdict.exit_code

    @property
    def reasons(self) -> list[str]:
        return list(self.run_verdict.reasons)

    # -- convenient views ----------------------------------------------------------------------

    @property
    def campaign_name(self) -> str:
        campaign = self.meta.get("campaign")
        name = campaign.get("name") if isinstance(campaign, dict) else None
        return str(name or self.run_dir.name)

    @property
    def seed(self) -> int | None:
        seed = self.meta.get("seed")
        if seed is None and isinstance(self.meta.get("campaign"), dict):
            seed = self.meta["campaign"].get("seed")
        return seed if isinstance(seed, int) else None

    @property
    def environment(self) -> dict[str, Any]:
        env = self.meta.get("environment")
        return env if isinstance(env, dict) else {}

    @property
    def gpu_summary(self) -> str:
        """The fingerprint's GPUs in one line, or why there are none ("no GPU: ...")."""
        gpus = self.environment.get("gpus")
        if isinstance(gpus, dict) and not gpus.get("available", False):
            return str(gpus.get("reason") or "no GPU")
        return str(self.environment.get("gpu_summary") or "no GPU")

    @property
    def target(self) -> dict[str, Any]:
        target = self.meta.get("target")
        return target if isinstance(target, dict) else {}

    @property
    def started_at(self) -> float | None:
        return _number(self.meta.get("started_at"))

    @property
    def ended_at(self) -> float | None:
        return _number(self.meta.get("ended_at"))

    def oracle(self, name: str) -> OracleResult | None:
        return next((o for o in self.oracles if o.name == name), None)

    def offset(self, t: float | None) -> float | None:
        return None if t is None else t - self.origin


# ------------------------------------------------------------------------------ reading ----


def load_run(run_dir: str | Path) -> RunReport:
    run_dir = Path(run_dir)
    with _open_journal(run_dir) as journal:
        meta = journal.all_meta()
        events = _EventReader()
        for event in journal.iter_events():
            events.add(event)
        faults = events.faults()
        columns = read_columns(journal.path)
        first_send = float(np.nanmin(columns.t_send)) if len(columns) and not np.isnan(columns.t_send).all() else None
        origin = _origin(meta, events.first_t, first_send)
        spans = [Span(f.label, f.start, f.end) for f in faults if f.start is not None]
        traffic = compute_traffic(columns, origin, spans)
        endings = classify(columns, spans)
        oracles, gates, run_verdict = list(events.oracles.values()), events.gates, events.recorded
        complete = run_verdict is not None
        if run_verdict is None:  # the run stopped before it judged itself: judge what its journal holds
            judgement = judge(journal)
            oracles, gates = judgement.oracles, judgement.gates
            run_verdict = RunVerdict(
                judgement.verdict,
                judgement.exit_code,
                judgement.reasons,
                judgement.requests,
                judgement.generator_saturated,
            )
        leaks = _leaks(journal, oracles)
    report = RunReport(
        run_dir=run_dir,
        meta=meta,
        origin=origin,
        faults=faults,
        oracles=oracles,
        gates=gates,
        run_verdict=run_verdict,
        complete=complete,
        phases=events.phases,
        pool=events.pool,
        traffic=traffic,
        leaks=leaks,
        matrix=build_matrix(faults, oracles, gates, _enabled_oracles(meta)),
        problems=events.problems,
        endings=endings,
    )
    return report


@contextmanager
def _open_journal(run_dir: Path) -> Iterator[Journal]:
    # Read-only, so rendering a live or crashed run never writes to its journal. A WAL journal
    # whose -shm file is gone cannot be opened read-only; only then do we open it normally.
    journal: Journal | None = None
    try:
        journal = Journal.open(run_dir, readonly=True)
        journal.get_meta("seed")
    except sqlite3.OperationalError:
        if journal is not None:
            journal.close()
        journal = Journal.open(run_dir)
    try:
        yield journal
    finally:
        journal.close()


def _enabled_oracles(meta: Mapping[str, Any]) -> list[str]:
    campaign = meta.get("campaign")
    oracles = campaign.get("oracles") if isinstance(campaign, dict) else None
    enabled = oracles.get("enabled") if isinstance(oracles, dict) else None
    return [str(n) for n in enabled] if isinstance(enabled, list) else []


def _origin(meta: Mapping[str, Any], *seen: float | None) -> float:
    """t = 0 on every axis: the run's start, else the earliest thing the journal saw."""
    started = _number(meta.get("started_at"))
    if started is not None:
        return started
    known = [t for t in (*seen, _number(meta.get("load_started_at"))) if t is not None]
    return min(known) if known else 0.0


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


class _EventReader:
    """Sorts the event stream into what the report needs, tolerating odd data."""

    def __init__(self) -> None:
        self.fault_events: list[JournalEvent] = []
        self.oracles: dict[str, OracleResult] = {}  # a re-evaluation replaces the earlier result
        self.gates: list[Finding] = []
        self.recorded: RunVerdict | None = None
        self.phases: list[PhaseMark] = []
        self.pool: list[PoolPoint] = []
        self.problems: list[str] = []
        self.first_t: float | None = None

    def add(self, event: JournalEvent) -> None:
        if self.first_t is None:
            self.first_t = event.t
        try:
            self._dispatch(event)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self.problems.append(
                f"event #{event.seq} {event.kind}/{event.name}: unreadable ({type(exc).__name__}: {exc})"
            )

    def _dispatch(self, event: JournalEvent) -> None:
        kind, data = event.kind, dict(event.data)
        if kind == EventKind.FAULT.value:
            self.fault_events.append(event)
        elif kind == EventKind.PHASE.value:
            self.phases.append(PhaseMark(event.name, event.t))
        elif kind == EventKind.PROBE.value and event.name == "loads":
            self.pool.extend(_pool_points(event.t, data))
        elif kind == "verdict" and event.name == "oracle":
            result = oracle_from_json(data)
            self.oracles[result.name] = result
        elif kind == "verdict" and event.name == "gate":
            self.gates.append(finding_from_json(data))
        elif kind == "verdict" and event.name == "run":
            self.recorded = RunVerdict(
                verdict=Verdict(data["verdict"]),
                exit_code=int(data.get("exit_code", Verdict(data["verdict"]).exit_code)),
                reasons=[str(r) for r in data.get("reasons") or []],
                requests={str(k): int(v) for k, v in (data.get("requests") or {}).items()},
                generator_saturated=data.get("generator_saturated"),
            )
        elif kind == EventKind.NOTE.value and event.name == "rejected_request":
            self.problems.append(f"journal rejected a request record: {data.get('error', '?')}")

    def faults(self) -> list[FaultRecord]:
        extra: dict[str, dict[str, Any]] = {}
        for event in self.fault_events:
            data = event.data
            wid = str(data.get("window", event.name))
            step = data.get("step")
            if step == "error":
                extra.setdefault(wid, {})["error"] = str(data.get("error"))
            elif step == "heal" and data.get("error"):
                extra.setdefault(wid, {}).setdefault("error", str(data.get("error")))
            elif step == "audit":
                extra.setdefault(wid, {}).update(
                    audit_clean=bool(data.get("clean")), leftovers=[str(x) for x in data.get("leftovers") or []]
                )
            elif step == "provoke":
                extra.setdefault(wid, {})["provocation"] = describe_provocation(data)
        return [
            FaultRecord(
                window_id=w.window_id,
                fault=w.fault,
                params=w.params,
                start=w.start,
                end=w.end,
                confirmed=w.confirmed,
                confirm_evidence=w.confirm_evidence,
                healed=w.healed,
                **extra.get(w.window_id, {}),
            )
            for w in windows_from_events(self.fault_events)
        ]


def _pool_points(t: float, data: Mapping[str, Any]) -> list[PoolPoint]:
    """One point per snapshot: data-parallel ranks (a list of /v1/loads) are summed."""
    loads = data.get("data")
    ranks = loads if isinstance(loads, list) else [loads] if isinstance(loads, dict) else []
    used = total = 0.0
    seen = False
    for rank in ranks:
        if not isinstance(rank, dict):
            continue
        u = _number(rank.get("num_used_tokens"))
        m = _number(rank.get("max_total_num_tokens")) or _number(rank.get("num_total_tokens"))
        if u is None and m and _number(rank.get("token_usage")) is not None:
            u = float(rank["token_usage"]) * m
        if u is None:
            continue
        seen = True
        used += u
        total += m or 0.0
    if not seen:
        return []
    return [PoolPoint(t, str(data.get("role", "?")), str(data.get("phase", "")), used, total or None)]


def finding_from_json(data: Mapping[str, Any]) -> Finding:
    return Finding(
        oracle=str(data.get("oracle", "")),
        verdict=Verdict(data["verdict"]),
        summary=str(data.get("summary", "")),
        request_id=data.get("request_id"),
        victim_request_id=data.get("victim_request_id"),
        window=data.get("window"),
        evidence=dict(data.get("evidence") or {}),
    )


def oracle_from_json(data: Mapping[str, Any]) -> OracleResult:
    name = str(data["name"])
    findings = []
    for item in data.get("findings") or []:
        finding = finding_from_json(item)
        findings.append(
            finding
            if finding.oracle
            else Finding(
                name,
                finding.verdict,
                finding.summary,
                finding.request_id,
                finding.victim_request_id,
                finding.window,
                finding.evidence,
            )
        )
    return OracleResult(
        name=name,
        verdict=Verdict(data["verdict"]),
        checked=int(data.get("checked", 0)),
        findings=findings,
        notes=[str(n) for n in data.get("notes") or []],
    )


def _leaks(journal: Journal, oracles: list[OracleResult]) -> list[Leak]:
    canary = next((o for o in oracles if o.name == CANARY_ORACLE), None)
    if canary is None:
        return []
    leaks: list[Leak] = []
    for f in canary.findings:
        if f.verdict is not Verdict.FAIL:
            continue
        detailed = len(leaks) < LEAK_DETAIL_LIMIT
        ev = f.evidence
        offset = ev.get("offset")
        leaks.append(
            Leak(
                finding=f,
                marker=str(ev.get("marker", "")),
                kind=str(ev.get("kind", "")),
                offset=offset if isinstance(offset, int) else None,
                excerpt=str(ev.get("excerpt", "")),
                faults_active=[str(x) for x in ev.get("faults_active") or []],
                victim_faults_active=[str(x) for x in ev.get("victim_faults_active") or []],
                offender=journal.get_request(f.request_id) if f.request_id and detailed else None,
                victim=journal.get_request(f.victim_request_id) if f.victim_request_id and detailed else None,
            )
        )
    return leaks


def describe_provocation(data: Mapping[str, Any]) -> str:
    """One line per window: the kinds, what was sent and answered, and where each band landed."""
    kinds = ", ".join(str(k) for k in data.get("kinds") or []) or "none"
    sent = ", ".join(f"{k} {v}" for k, v in sorted((data.get("sent") or {}).items())) or "nothing sent"
    answers = ", ".join(f"{k} x{v}" for k, v in sorted((data.get("statuses") or {}).items()))
    limits = "; ".join(
        f"{role}: pool {v.get('pool_tokens')}, context {v.get('context_length')}, max input {v.get('max_input_tokens')}"
        for role, v in sorted((data.get("limits") or {}).items())
        if isinstance(v, dict)
    )
    landed = "; ".join(
        f"{label}: {min(v)}..{max(v)} tokens" for label, v in sorted((data.get("landed") or {}).items()) if v
    )
    parts = [
        f"{kinds}: sent {sent}",
        f"answers {answers}" if answers else "",
        f"limits read {limits}" if limits else "",
        f"landed {landed}" if landed else "",
        f"error {data['error']}" if data.get("error") else "",
    ]
    return " · ".join(p for p in parts if p)
