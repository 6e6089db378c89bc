"""The verdict of a run, computed from its journal alone.

`judge(journal)` runs the campaign's oracles (and the pool preflight, from its journaled report)
and the run-level gates over what the journal holds, and combines them: FAIL on any proof of a
leak, a corruption or a contract breach, INCONCLUSIVE where the run cannot prove their absence,
PASS otherwise. The runner calls it once the run is over and journals the result
(`record_judgement`); `pdchaos report` calls it on a run that stopped before it judged itself, so
a killed run's journal still gets a verdict, and a complete run's is the one it recorded.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import ValidationError

from chaos.campaign import Campaign
from chaos.journal import EventKind, Journal, JournalEvent, RequestRecord
from chaos.judging.gates import run_gates
from chaos.judging.pool_preflight import pool_preflight_result
from chaos.loadstats import compute, generator_saturated
from chaos.oracles.base import OracleContext
from chaos.oracles.registry import ALL_ORACLES
from chaos.run_evidence import RunEvidence, read_evidence
from chaos.verdict import Finding, OracleResult, Verdict, combine

log = logging.getLogger("pdchaos.judge")


@dataclass
class Judgement:
    verdict: Verdict
    reasons: list[str] = field(default_factory=list)
    oracles: list[OracleResult] = field(default_factory=list)
    gates: list[Finding] = field(default_factory=list)
    requests: dict[str, int] = field(default_factory=dict)  # total, ok, fail, info
    generator_saturated: bool = False
    interrupted: bool = False  # the run ended before its end

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code


def judge(journal: Journal) -> Judgement:
    evidence = read_evidence(journal)
    campaign = _campaign(journal)
    if campaign is None:
        return _without_campaign(journal, evidence)
    ctx = OracleContext(
        journal=journal,
        run_prefix=str(journal.get_meta("run_prefix", "")),
        logs=evidence.logs,
        settings=campaign.oracles.settings(campaign.gates),
    )
    results = [_evaluate(name, ctx) for name in campaign.oracles.enabled]
    if campaign.oracles.pool_preflight:
        results.append(pool_preflight_result(evidence.pool_preflight))
    load_stats = compute(r for r in ctx.requests if r.phase == "load")
    gates = run_gates(ctx, campaign, evidence, load_stats)
    verdict = combine([r.verdict for r in results] + [g.verdict for g in gates])
    reasons = [_reason(r) for r in results if r.verdict is not Verdict.PASS] + [g.summary for g in gates]
    return Judgement(
        verdict,
        reasons,
        results,
        gates,
        _request_counts(ctx.requests),
        generator_saturated(evidence.generator_cpu, load_stats.send_lag_s),
        evidence.stopped is not None,
    )


def record_judgement(journal: Journal, judgement: Judgement) -> None:
    """Journal the judgement: each oracle's result, each gate, and last the run's verdict."""
    for result in judgement.oracles:
        journal.append_event(JournalEvent(EventKind.VERDICT, "oracle", dataclasses.asdict(result)))
    for finding in judgement.gates:
        journal.append_event(JournalEvent(EventKind.VERDICT, "gate", dataclasses.asdict(finding)))
    journal.append_event(
        JournalEvent(
            EventKind.VERDICT,
            "run",
            {
                "verdict": judgement.verdict.value,
                "exit_code": judgement.exit_code,
                "reasons": judgement.reasons,
                "requests": judgement.requests,
                "generator_saturated": judgement.generator_saturated,
                "interrupted": judgement.interrupted,
            },
        )
    )


def _campaign(journal: Journal) -> Campaign | None:
    data = journal.get_meta("campaign")
    if not isinstance(data, dict):
        return None
    try:
        return Campaign.model_validate(data)
    except ValidationError:
        log.warning("the journal's campaign does not validate", exc_info=True)
        return None


def _without_campaign(journal: Journal, evidence: RunEvidence) -> Judgement:
    """A journal that holds no campaign (a run that died as it began) has nothing to be judged against."""
    gates = [Finding("run", Verdict.INCONCLUSIVE, evidence.stopped)] if evidence.stopped else []
    gates.append(
        Finding("gate", Verdict.INCONCLUSIVE, "the journal holds no valid campaign: nothing to judge the run against")
    )
    return Judgement(
        Verdict.INCONCLUSIVE,
        [g.summary for g in gates],
        [],
        gates,
        _request_counts(journal.iter_requests()),
        interrupted=evidence.stopped is not None,
    )


def _evaluate(name: str, ctx: OracleContext) -> OracleResult:
    try:
        return ALL_ORACLES[name]().evaluate(ctx)
    except Exception as exc:  # an oracle that breaks proves nothing
        log.exception("oracle %s failed", name)
        return OracleResult(name, Verdict.INCONCLUSIVE, notes=[f"the oracle raised {type(exc).__name__}: {exc}"])


def _request_counts(records: Iterable[RequestRecord]) -> dict[str, int]:
    counts = {"total": 0, "ok": 0, "fail": 0, "info": 0}
    for record in records:
        counts["total"] += 1
        counts[record.outcome.value] += 1
    return counts


def _reason(result: OracleResult) -> str:
    """One line per oracle that did not pass: how many findings, and the first of them."""
    bad = [f for f in result.findings if f.verdict is result.verdict] or result.findings
    if bad:
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        return f"{result.name} {result.verdict.value}: {bad[0].summary}{more}"
    note = result.notes[-1] if result.notes else "no evidence"
    return f"{result.name} {result.verdict.value}: {note}"
