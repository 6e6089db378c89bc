"""The verdict as a function of the journal (chaos/judging/): the judge reads nothing else, so a
killed run's journal gets a verdict with its reasons, and what the runner journals during the run
(a stop, the pool preflight, the logs, the generators' health, the audits) decides the gates.
Journals come from tests/run_fixtures.py; a real run's is judged in tests/test_run.py."""

from __future__ import annotations

from pathlib import Path

from chaos.cluster import HealthSample
from chaos.journal import EventKind, Journal, JournalEvent
from chaos.judging.judge import judge, record_judgement
from chaos.judging.pool_preflight import pool_preflight_result
from chaos.preflight import PreflightReport, PreflightRow
from chaos.run_evidence import (
    journal_generator_health,
    journal_judging,
    journal_logs,
    journal_pool_preflight,
    journal_stopped,
    read_evidence,
)
from chaos.verdict import Verdict
from reports.model import load_run
from tests.run_fixtures import write_crashed_run, write_pass_run


def _gates(run_dir: Path) -> list[str]:
    with Journal.open(run_dir, readonly=True) as journal:
        return [g.summary for g in judge(journal).gates]


def test_a_killed_runs_journal_is_judged_with_its_reasons(tmp_path: Path) -> None:
    run_dir = write_crashed_run(tmp_path / "crashed")  # no oracles:start, no verdict, a window never healed
    with Journal.open(run_dir, readonly=True) as journal:
        judgement = judge(journal)
    assert judgement.verdict is Verdict.INCONCLUSIVE and judgement.exit_code == 3 and judgement.interrupted
    assert any(
        "stopped before it judged itself" in r and "last phase event: load:start" in r for r in judgement.reasons
    )
    assert any(
        r.startswith("fault(s) never healed: transfer_stall#w1") and f"pdchaos heal {run_dir}" in r
        for r in judgement.reasons
    )
    assert {o.name for o in judgement.oracles} >= {"canary", "reference", "liveness", "pool_preflight"}
    assert judgement.requests["total"] > 0


def test_a_journal_that_reached_its_judging_is_not_taken_for_a_killed_one(tmp_path: Path) -> None:
    run_dir = write_crashed_run(tmp_path / "run")
    with Journal.open(run_dir) as journal:
        journal_judging(journal)
        judgement = judge(journal)
    assert not judgement.interrupted and not any("stopped before it judged itself" in r for r in judgement.reasons)


def test_a_journaled_stop_is_the_runs_gate(tmp_path: Path) -> None:
    run_dir = write_pass_run(tmp_path / "run")
    with Journal.open(run_dir) as journal:
        journal_stopped(journal, "the run was interrupted before it finished")
        journal_judging(journal)
        judgement = judge(journal)
    assert judgement.interrupted and judgement.verdict is not Verdict.PASS
    assert [g.summary for g in judgement.gates if g.oracle == "run"] == ["the run was interrupted before it finished"]


def test_a_journal_without_a_campaign_is_inconclusive_and_says_why(tmp_path: Path) -> None:
    Journal.create(tmp_path).close()  # a run that died right after creating its journal
    with Journal.open(tmp_path, readonly=True) as journal:
        judgement = judge(journal)
    assert judgement.verdict is Verdict.INCONCLUSIVE and judgement.oracles == []
    assert any("no valid campaign" in r for r in judgement.reasons)
    assert judgement.requests == {"total": 0, "ok": 0, "fail": 0, "info": 0}


def test_the_pool_preflight_is_judged_from_its_journaled_report(tmp_path: Path) -> None:
    rows = [
        PreflightRow(
            "prefill", "url", "http://p", Verdict.FAIL, "pool < context", pool_tokens=681280, context_len=1048576
        ),
        PreflightRow(
            "decode", "url", "http://d", Verdict.PASS, "pool >= context", pool_tokens=2_000_000, context_len=1048576
        ),
        PreflightRow("decode-1", "url", "http://e", Verdict.INCONCLUSIVE, "cannot reach http://e"),
    ]
    run_dir = write_pass_run(tmp_path / "run")
    with Journal.open(run_dir) as journal:
        journal_pool_preflight(journal, PreflightReport(rows).to_dict())
        result = next(o for o in judge(journal).oracles if o.name == "pool_preflight")
    assert result.verdict is Verdict.FAIL and result.checked == 3
    assert [(f.verdict, f.summary) for f in result.findings] == [
        (Verdict.FAIL, "prefill: pool 681280 vs context 1048576: FAIL (pool < context)"),
        (Verdict.INCONCLUSIVE, "decode-1: pool None vs context None: UNKNOWN (cannot reach http://e)"),
    ]
    assert pool_preflight_result(None).verdict is Verdict.INCONCLUSIVE
    assert pool_preflight_result(PreflightReport([]).to_dict()).notes == ["no worker URLs to read"]


def test_the_generators_journaled_health_and_the_audits_decide_their_gates(tmp_path: Path) -> None:
    run_dir = write_pass_run(tmp_path / "run")
    with Journal.open(run_dir) as journal:
        journal_judging(journal)
        for n in range(5):
            journal_generator_health(journal, HealthSample("actor-0", 1000.0 + n, 97.0, 120.0, running=True))
        journal.append_event(
            JournalEvent(
                EventKind.FAULT,
                "transfer_stall",
                {"window": "w1", "step": "audit", "clean": False, "leftovers": ["prefill group 4242 still stopped"]},
            )
        )
        judgement = judge(journal)
    assert judgement.generator_saturated
    assert any(
        g.startswith("the load generator was saturated (its Locust processes ran at 97 %") for g in judgement.reasons
    )
    assert "heal of transfer_stall left: prefill group 4242 still stopped" in judgement.reasons


def test_the_logs_journaled_at_the_end_are_what_the_integrity_oracle_scans(tmp_path: Path) -> None:
    run_dir = write_pass_run(tmp_path / "run")
    with Journal.open(run_dir) as journal:
        journal_logs(
            journal, {"prefill": "[2026-01-01 00:00:00] KV checksum mismatch for bootstrap_room=7\n", "router": ""}
        )
        journal_judging(journal)
        assert read_evidence(journal).logs.keys() == {"prefill", "router"}
        integrity = next(o for o in judge(journal).oracles if o.name == "integrity")
    assert integrity.verdict is Verdict.FAIL and "of 2 role(s): prefill, router" in integrity.notes[0]


def test_a_recorded_judgement_is_what_every_report_shows(tmp_path: Path) -> None:
    run_dir = write_crashed_run(tmp_path / "run")
    with Journal.open(run_dir) as journal:
        judged = judge(journal)
    afterwards = load_run(run_dir)  # judged by the report, as the run had recorded nothing
    assert not afterwards.complete
    assert (afterwards.verdict_label, afterwards.reasons) == (judged.verdict.value, judged.reasons)
    with Journal.open(run_dir) as journal:
        record_judgement(journal, judged)
    recorded = load_run(run_dir)
    assert recorded.complete and (recorded.verdict_label, recorded.reasons) == (judged.verdict.value, judged.reasons)
    assert [o.name for o in recorded.oracles] == [o.name for o in judged.oracles]
