"""Tenant isolation (bug class K9, docs/architecture.md): the two-sample KS test, the oracle's
rules on hand-written records, and the tenant probe against the embedded engine, clean (PASS), with
`prefix_cache_shared_across_tenants` (FAIL by telemetry and by timing) and with prompts too short
to fill a cache page (no reuse at all: INCONCLUSIVE, never a PASS)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from chaos.journal import Journal, Outcome, RequestRecord
from chaos.markers import MarkerCodec, new_run_prefix
from chaos.oracles.base import OracleContext
from chaos.oracles.contracts import StatusContractOracle, UsageContractOracle
from chaos.oracles.leaks import CanaryLeakOracle
from chaos.oracles.registry import ALL_ORACLES
from chaos.oracles.tenants import (
    ATTACKER_CONTROL,
    ATTACKER_GUESS,
    TENANT_KIND,
    VICTIM,
    VICTIM_REPEAT,
    TenantIsolationOracle,
    best_possible_p,
    kolmogorov_sf,
    ks_two_sample,
    smirnov_one_sided_sf,
)
from chaos.targets.sim.settings import WorkerSettings
from chaos.targets.sim.stack import SimStack, SimStackConfig
from chaos.tenant_probe import run_tenant_probe, secret_prefix, tenant_indices
from chaos.verdict import OracleResult, Verdict
from tests.conftest import start_stack

integration = pytest.mark.integration

# Slow enough that a 512-token prefix hit saves ~130 ms of TTFT, well above loopback noise; pages of
# 64 tokens let a short probe (prefix_tokens=0: ~35 tokens) fill none, so the same stack also
# serves the "caching is off" case.
PREFILL_TOKENS_PER_S = 4000.0
PAGE_SIZE = 64
INDEX_BASE = 20_000


def stack_config(*defects: str) -> SimStackConfig:
    return SimStackConfig(
        worker=WorkerSettings(prefill_tokens_per_s=PREFILL_TOKENS_PER_S, page_size=PAGE_SIZE, defects=tuple(defects))
    )


def summaries(result: OracleResult, verdict: Verdict) -> list[str]:
    return [f.summary for f in result.findings if f.verdict is verdict]


# ================================================================================ KS test ====


def brute_force_ks(a: list[float], b: list[float]) -> tuple[float, float]:
    """sup(F_a - F_b) and sup(F_b - F_a) by direct counting at every sample point."""
    plus = minus = 0.0
    for x in a + b:
        fa = sum(v <= x for v in a) / len(a)
        fb = sum(v <= x for v in b) / len(b)
        plus, minus = max(plus, fa - fb), max(minus, fb - fa)
    return plus, minus


def test_ks_statistic_on_separated_samples_and_its_direction() -> None:
    ks = ks_two_sample([1, 2, 3], [4, 5, 6])
    assert (ks.d, ks.d_plus, ks.d_minus) == (1.0, 1.0, 0.0)
    # en = 1.5: Q_KS(sqrt(1.5)) = 2 (e^-3 - e^-12 + e^-27 - ...)
    assert ks.p_two_sided == pytest.approx(2 * (math.exp(-3) - math.exp(-12) + math.exp(-27)), rel=1e-9)
    assert ks.p_a_smaller == pytest.approx(math.exp(-3), rel=1e-12)
    reverse = ks_two_sample([4, 5, 6], [1, 2, 3])
    assert (reverse.d_plus, reverse.d_minus) == (0.0, 1.0)
    assert reverse.p_a_smaller == 1.0


def test_ks_statistic_with_ties_and_unequal_sizes() -> None:
    # F_a at 1,2,3,5 = .25,.75,1,1; F_b at 1,2,3,5 = 0,1/3,1/3,1: D+ = max(.25,.4167,.6667,0).
    ks = ks_two_sample([1, 2, 2, 3], [2, 5, 5])
    assert ks.d_plus == pytest.approx(2 / 3)
    assert ks.d_minus == 0.0
    identical = ks_two_sample([1, 2, 3], [1, 2, 3])
    assert (identical.d, identical.p_two_sided, identical.p_a_smaller) == (0.0, 1.0, 1.0)


def test_ks_statistic_matches_brute_force_counting() -> None:
    rng = np.random.default_rng(7)
    for n, m in itertools.product((1, 3, 12), (2, 12, 17)):
        a = [float(v) for v in rng.integers(0, 6, n)]  # small integers: many ties
        b = [float(v) for v in rng.normal(2.5, 2.0, m).round(0)]
        ks = ks_two_sample(a, b)
        plus, minus = brute_force_ks(a, b)
        assert ks.d_plus == pytest.approx(plus) and ks.d_minus == pytest.approx(minus)
        assert ks.d == pytest.approx(max(plus, minus))


@pytest.mark.parametrize(
    ("lam", "sf"),
    [
        (0.5, 0.963945),  # P(K <= 0.5) = 0.036055
        (0.8276, 0.5),  # the median of Kolmogorov's distribution
        (1.0, 0.269999),
        (1.2238, 0.10),  # the classic critical values: 10%, 5%, 1%, 0.1%
        (1.3581, 0.05),
        (1.6276, 0.01),
        (1.9495, 0.001),
    ],
)
def test_kolmogorov_distribution_matches_known_values(lam: float, sf: float) -> None:
    assert kolmogorov_sf(lam) == pytest.approx(sf, abs=5e-5)  # the table's lambdas have 4 decimals


def test_kolmogorov_series_agree_where_they_switch_and_at_the_ends() -> None:
    assert kolmogorov_sf(1.18 - 1e-9) == pytest.approx(kolmogorov_sf(1.18 + 1e-9), abs=1e-8)
    assert kolmogorov_sf(0.0) == 1.0 and kolmogorov_sf(0.05) == 1.0
    assert kolmogorov_sf(3.0) == pytest.approx(2 * math.exp(-18), rel=1e-6)
    values = [kolmogorov_sf(x / 100) for x in range(1, 400)]
    assert all(x >= y for x, y in itertools.pairwise(values))  # a survival function never rises


def test_one_sided_asymptotic_p_values() -> None:
    assert smirnov_one_sided_sf(1.0) == pytest.approx(math.exp(-2))
    assert smirnov_one_sided_sf(0.0) == 1.0
    assert best_possible_p(12, 12) == pytest.approx(math.exp(-12))
    assert best_possible_p(3, 3) > 0.01 > best_possible_p(5, 5)
    with pytest.raises(ValueError):
        ks_two_sample([], [1.0])


# ========================================================================= oracle, by hand ====


@pytest.fixture()
def journal(tmp_path: Path) -> Iterator[Journal]:
    j = Journal.create(tmp_path / "run")
    try:
        yield j
    finally:
        j.close()


def evaluate(journal: Journal, records: list[RequestRecord] | None = None) -> OracleResult:
    if records:
        journal.append_requests(records)
    return TenantIsolationOracle().evaluate(OracleContext(journal=journal, run_prefix="K7QM"))


def tenant(role: str, index: int, ttft_s: float, cached: int | None, t: float) -> RequestRecord:
    return RequestRecord(
        id=f"tenant-{index}-{role}-{t}",
        request_index=index,
        phase=TENANT_KIND,
        user_kind=TENANT_KIND,
        actor=role,
        endpoint="/v1/completions",
        stream=True,
        status=200,
        outcome=Outcome.OK,
        finish_reason="length",
        t_send=t,
        t_first_token=t + ttft_s,
        t_end=t + ttft_s + 0.02,
        prompt_tokens=530,
        completion_tokens=4,
        cached_tokens=cached,
    )


def rounds(
    n: int,
    *,
    victim: float = 0.20,
    repeat: float = 0.08,
    guess: float = 0.20,
    control: float = 0.20,
    repeat_cached: int | None = 512,
    guess_cached: int | None = 0,
    jitter: float = 0.004,
) -> list[RequestRecord]:
    out = []
    for r in range(n):
        d = jitter * ((r * 7) % 5 - 2)  # deterministic spread, so the samples are not all tied
        t = 1000.0 + r
        control_cached = None if guess_cached is None else 0
        out += [
            tenant(VICTIM, 2 * r, victim + d, None if repeat_cached is None else 0, t),
            tenant(VICTIM_REPEAT, 2 * r, repeat + d, repeat_cached, t + 0.25),
            tenant(ATTACKER_GUESS, 2 * r, guess + d, guess_cached, t + 0.5),
            tenant(ATTACKER_CONTROL, 2 * r + 1, control - d, control_cached, t + 0.75),
        ]
    return out


def report_cached(records: list[RequestRecord], tokens: int, *roles: str) -> list[RequestRecord]:
    """Have every record of `roles` report `tokens` cached tokens (in place; returned for chaining)."""
    for r in records:
        if r.actor in roles:
            r.cached_tokens = tokens
    return records


def test_no_tenant_records_is_inconclusive(journal: Journal) -> None:
    result = evaluate(journal)
    assert result.verdict is Verdict.INCONCLUSIVE
    assert result.notes == ["tenant probe not run"]


def test_isolated_tenants_with_working_cache_pass(journal: Journal) -> None:
    result = evaluate(journal, rounds(12))
    assert result.verdict is Verdict.PASS, result
    assert result.checked == 12
    assert any("attacker guesses vs controls: KS n=12, m=12" in n for n in result.notes)


def test_cache_off_is_inconclusive_not_pass(journal: Journal) -> None:
    result = evaluate(journal, rounds(12, repeat=0.20, repeat_cached=0))
    assert result.verdict is Verdict.INCONCLUSIVE, result
    assert any(
        "prefix caching seems off: isolation cannot be shown" in s for s in summaries(result, Verdict.INCONCLUSIVE)
    )


def test_a_cross_tenant_cached_tokens_report_fails_even_without_timing(journal: Journal) -> None:
    records = rounds(12)
    records[2].cached_tokens = 512  # round 0's guess
    result = evaluate(journal, records)
    assert result.verdict is Verdict.FAIL
    [finding] = result.findings
    assert finding.summary.startswith("cross-tenant cache hit")
    assert finding.request_id == records[2].id and finding.victim_request_id == records[0].id


def test_fast_guesses_fail_on_timing_alone_when_the_engine_reports_no_cached_tokens(journal: Journal) -> None:
    result = evaluate(journal, rounds(12, guess=0.08, repeat_cached=None, guess_cached=None))
    assert result.verdict is Verdict.FAIL, result
    [finding] = result.findings
    assert finding.summary.startswith("timing side channel: another tenant's prompt is observable")
    assert finding.evidence["d_plus"] == 1.0 and finding.evidence["p_one_sided"] < 1e-4
    assert any("rule (b) could not be checked" in n for n in result.notes)


def test_slow_guesses_are_not_a_side_channel(journal: Journal) -> None:
    # Guesses significantly *slower* than controls prove nothing about reuse: the direction is checked.
    assert evaluate(journal, rounds(12, guess=0.35)).verdict is Verdict.PASS


def test_a_significant_but_tiny_speedup_is_drift_not_a_side_channel(journal: Journal) -> None:
    # Seen on a clean engine in CI: guesses 0.3 ms faster than controls in most rounds reached
    # p = 0.005, while a real hit saves 120 ms here. Below a quarter of that saving is not a hit.
    records = rounds(12, jitter=0.0004)
    for record in records:
        if record.actor == ATTACKER_GUESS:
            assert record.t_first_token is not None
            record.t_first_token -= 0.0015
    result = evaluate(journal, records)
    assert result.verdict is Verdict.PASS, result
    assert any("significantly but only 1.5 ms faster" in n and "margin is 30.0 ms" in n for n in result.notes), (
        result.notes
    )


def test_fast_guesses_are_noise_when_same_tenant_hits_do_not_show_in_ttft(journal: Journal) -> None:
    """A clean vLLM CPU pair in CI: its whole prefill takes 18 ms under 0.5 s of noisy overhead, so
    its same-tenant hits (reported by cached_tokens) do not show in TTFT, and once its guesses came
    out 260 ms faster than its controls at p = 0.005. A cross-tenant hit cannot save more than a
    same-tenant one: that gap is noise, and the timing test is not judged."""
    result = evaluate(journal, rounds(12, victim=0.69, repeat=0.69, guess=0.43, control=0.69, jitter=0.05))
    assert result.verdict is Verdict.PASS, result
    assert any("not judged: same-tenant hits were not visible in TTFT" in n for n in result.notes), result.notes
    assert any("significantly (260.0 ms) faster than controls" in n and "noise" in n for n in result.notes)


def test_the_same_fast_guesses_fail_once_same_tenant_hits_show_in_ttft(journal: Journal) -> None:
    # The same guesses and controls as above, with repeats 0.3 s faster than first sends: the
    # timing resolves a hit, and the guesses save most of what a hit saves.
    result = evaluate(journal, rounds(12, victim=0.69, repeat=0.39, guess=0.43, control=0.69, jitter=0.05))
    assert result.verdict is Verdict.FAIL, result
    [finding] = result.findings
    assert finding.summary.startswith("timing side channel") and finding.evidence["margin_s"] == pytest.approx(0.075)


def test_same_salt_reuse_can_be_shown_by_timing_alone(journal: Journal) -> None:
    result = evaluate(journal, rounds(12, repeat_cached=None, guess_cached=None))
    assert result.verdict is Verdict.PASS, result


def test_hits_visible_only_in_telemetry_pass_with_a_note(journal: Journal) -> None:
    result = evaluate(journal, rounds(12, repeat=0.20))
    assert result.verdict is Verdict.PASS, result
    assert any("no power" in n for n in result.notes)


def test_too_few_rounds_for_the_timing_test_is_inconclusive(journal: Journal) -> None:
    result = evaluate(journal, rounds(3))
    assert result.verdict is Verdict.INCONCLUSIVE
    assert any("too few usable attacker records" in s for s in summaries(result, Verdict.INCONCLUSIVE))


def test_controls_that_report_hits_make_the_telemetry_untrustworthy(journal: Journal) -> None:
    records = rounds(12)
    records[3].cached_tokens = 64
    result = evaluate(journal, records)
    assert result.verdict is Verdict.INCONCLUSIVE
    assert any("never sent before report cached tokens" in s for s in summaries(result, Verdict.INCONCLUSIVE))


def test_an_engine_that_reports_every_prompt_cached_is_inconclusive_not_a_leak(
    journal: Journal, tmp_path: Path
) -> None:
    """vLLM's PD connector reported the whole prompt as cached before vLLM PR #46898 (issues
    #47136, #44607): guesses and never-sent controls alike. Telemetry that cannot tell them apart
    is no evidence of a hit; a guess reporting far more than every control still is."""
    records = report_cached(rounds(12), 528, ATTACKER_GUESS, ATTACKER_CONTROL)
    result = evaluate(journal, records)
    assert result.verdict is Verdict.INCONCLUSIVE, result
    assert not summaries(result, Verdict.FAIL)
    assert any("never sent before report cached tokens" in s for s in summaries(result, Verdict.INCONCLUSIVE))
    assert any("a guess counts as a hit only above 544" in n for n in result.notes), result.notes

    report_cached(records, 100, ATTACKER_CONTROL)  # untrusted still, but the guesses report 428 more than any control
    with Journal.create(tmp_path / "leaky") as leaky:
        result = evaluate(leaky, records)
    assert result.verdict is Verdict.FAIL
    assert any("reused 528 cached token(s)" in s for s in summaries(result, Verdict.FAIL))


def test_the_attackers_own_opening_is_discounted_but_not_more(journal: Journal, tmp_path: Path) -> None:
    """SGLang's radix cache (page size 1) serves the run's marker opening, which every tenant
    prompt starts with, from the attacker's own earlier prompts: guesses and controls alike report
    about 9 cached tokens. That is no cross-tenant hit; a guess reusing more than its controls is."""
    records = report_cached(rounds(12), 9, ATTACKER_GUESS, ATTACKER_CONTROL)
    result = evaluate(journal, records)
    assert result.verdict is Verdict.PASS, result
    assert any("controls report up to 9 cached token(s)" in n for n in result.notes)

    records[2].cached_tokens = 200  # round 0's guess reuses the victim's prefix beyond the opening
    with Journal.create(tmp_path / "leaky") as leaky:
        result = evaluate(leaky, records)
    assert result.verdict is Verdict.FAIL
    assert any("reused 200 cached token(s)" in s for s in summaries(result, Verdict.FAIL))


def test_registry_names_the_oracle(journal: Journal) -> None:
    assert ALL_ORACLES["tenant_isolation"] is TenantIsolationOracle
    assert TenantIsolationOracle.name == "tenant_isolation"


def test_probe_refuses_generate_on_an_openai_target(journal: Journal) -> None:
    codec = MarkerCodec(new_run_prefix())
    with httpx.Client() as client, pytest.raises(ValueError, match="SGLang target"):
        run_tenant_probe(client, "http://127.0.0.1:9", journal, codec, INDEX_BASE, "openai", route="generate")


def test_victim_and_control_prefixes_have_the_same_shape() -> None:
    codec = MarkerCodec(new_run_prefix())
    victim, control = secret_prefix(codec, INDEX_BASE, 512, "a"), secret_prefix(codec, INDEX_BASE + 1, 512, "b")
    assert len(victim.split()) == len(control.split()) and victim != control
    assert victim.startswith(codec.marker(INDEX_BASE, 0)) and victim.endswith(codec.marker(INDEX_BASE, 1))
    assert "repeat" not in victim.lower()


# ============================================================================ embedded engine ====


@pytest.fixture(scope="module")
def clean_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimStack]:
    stack = start_stack(tmp_path_factory.mktemp("tenants-clean"), stack_config())
    try:
        yield stack
    finally:
        stack.down()


def probe(stack: SimStack, run_dir: Path, **kwargs: object) -> tuple[Journal, OracleContext]:
    codec = MarkerCodec(new_run_prefix())
    journal = Journal.create(run_dir)
    with httpx.Client(trust_env=False) as client:
        run_tenant_probe(client, stack.router_url, journal, codec, INDEX_BASE, "sglang", **kwargs)  # type: ignore[arg-type]
    return journal, OracleContext(journal=journal, run_prefix=codec.run_prefix)


@integration
def test_clean_engine_isolates_tenants(clean_stack: SimStack, tmp_path: Path) -> None:
    journal, ctx = probe(clean_stack, tmp_path / "run")
    try:
        records = ctx.requests
        assert len(records) == 48 and all(r.status == 200 and r.outcome is Outcome.OK for r in records)
        assert {r.request_index for r in records} == set(tenant_indices(INDEX_BASE, 12))
        assert all(r.user_kind == TENANT_KIND and r.phase == TENANT_KIND and r.stream for r in records)
        by_index = {(r.request_index, r.actor): r for r in records}
        for n in range(12):
            guess, control = (
                by_index[(INDEX_BASE + 2 * n, ATTACKER_GUESS)],
                by_index[(INDEX_BASE + 2 * n + 1, ATTACKER_CONTROL)],
            )
            assert guess.prompt_tokens == control.prompt_tokens  # same length: only the cache can tell them apart
            assert by_index[(INDEX_BASE + 2 * n, VICTIM_REPEAT)].cached_tokens >= 448  # same salt: the positive control
            assert guess.cached_tokens == 0 and control.cached_tokens == 0
        result = TenantIsolationOracle().evaluate(ctx)
        assert result.verdict is Verdict.PASS, result
        assert result.checked == 12
        assert any(n.startswith("attacker guesses vs controls: KS") for n in result.notes)
        # The probe's own traffic must not trip the other oracles (the guess carries the victim's markers).
        for other in (CanaryLeakOracle(), StatusContractOracle(), UsageContractOracle()):
            assert other.evaluate(ctx).verdict is not Verdict.FAIL, other.name
    finally:
        journal.close()


@integration
def test_prompts_shorter_than_a_page_cannot_show_isolation(clean_stack: SimStack, tmp_path: Path) -> None:
    journal, ctx = probe(clean_stack, tmp_path / "run", prefix_tokens=0, rounds=6)
    try:
        assert all(r.prompt_tokens is not None and r.prompt_tokens < PAGE_SIZE for r in ctx.requests)
        assert all(r.cached_tokens == 0 for r in ctx.requests)
        result = TenantIsolationOracle().evaluate(ctx)
        assert result.verdict is Verdict.INCONCLUSIVE, result
        assert any("prefix caching seems off" in s for s in summaries(result, Verdict.INCONCLUSIVE))
    finally:
        journal.close()


@integration
def test_shared_prefix_cache_across_tenants_fails_by_telemetry_and_timing(tmp_path: Path) -> None:
    stack = start_stack(tmp_path / "stack", stack_config("prefix_cache_shared_across_tenants"))
    try:
        journal, ctx = probe(stack, tmp_path / "run")
    finally:
        stack.down()
    try:
        result = TenantIsolationOracle().evaluate(ctx)
        assert result.verdict is Verdict.FAIL, result
        fails = summaries(result, Verdict.FAIL)
        assert sum(s.startswith("cross-tenant cache hit") for s in fails) == 12
        assert any(s.startswith("timing side channel: another tenant's prompt is observable") for s in fails), result
        assert CanaryLeakOracle().evaluate(ctx).verdict is not Verdict.FAIL
    finally:
        journal.close()


def test_the_probe_stops_on_a_target_that_stops_answering(tmp_path: Path) -> None:
    """A wedged engine answers each request only at its own timeout: three failures in a row end
    the probe (one failure does not), and the oracle judges what came back."""
    import json

    answered = iter([True, True, True, True, False, True, False, False, False, True, True])
    sent = 0

    def serve(request: httpx.Request) -> httpx.Response:
        nonlocal sent
        sent += 1
        if not next(answered, True):
            return httpx.Response(500, json={"error": {"message": "KV transfer timed out"}})
        chunk = {"choices": [{"text": "ok", "finish_reason": "length"}], "usage": {"prompt_tokens": 9}}
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(),
        )

    codec = MarkerCodec(new_run_prefix())
    with Journal.create(tmp_path / "run") as journal, httpx.Client(transport=httpx.MockTransport(serve)) as client:
        run_tenant_probe(client, "http://target", journal, codec, INDEX_BASE, "openai")
        statuses = [r.status for r in journal.iter_requests()]
    assert sent == 9 and statuses == [200, 200, 200, 200, 500, 200, 500, 500, 500]
