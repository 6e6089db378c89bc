"""The SGLang CPU tier: a real SGLang PD pair (0.5.23, Mooncake over TCP) on this machine's CPUs.

One pair serves the whole module, launched through the same code that launches SGLang on GPUs
(`target.sglang` with `device: cpu`, from campaigns/sglang-cpu.yaml): preflight reads the real
startup line, `pdchaos canary` runs against its router, the campaign runs on the pair (the runner
is handed the started stack), then the findings campaign campaigns/sglang-cpu-router-500.yaml
shrinks prefill's pool to the incident's and FAILs for what sglang-router 0.3.2 does with a prompt
between the two limits (docs/sglang-cpu-tier.md), and an engine_failure restart of decode is
confirmed from its failed-transfer counter. SGLang's own transfer-thread race is told apart from
the suite's verdicts (tests/sglang_race.py). `make sglang-env` installs the venv; without it every
test here is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from chaos.campaign_validation import load_campaign
from chaos.journal import Journal
from chaos.runner import RunOutcome
from chaos.targets.dialect import SGLANG
from chaos.targets.sglang.stack import SGLangStack
from chaos.verdict import Verdict
from chaos.windows import windows_from_events
from faults.base import FaultContext
from faults.registry import build_fault
from tests.conftest import run_on, running
from tests.sglang_race import RaceWatch

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-sglang"
CAMPAIGN = REPO / "campaigns" / "sglang-cpu.yaml"
ROUTER_500 = REPO / "campaigns" / "sglang-cpu-router-500.yaml"  # the findings campaign, same target
ENV = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangStack]:
    if not (VENV / ".installed").exists() or not (VENV / "models" / "tiny-llama" / ".built").exists():
        pytest.skip(f"{VENV} or its tiny model is missing: run `make sglang-env` (about 4 min, 7 GB)")
    spec = load_campaign(CAMPAIGN).target.sglang
    assert spec is not None
    with running(SGLangStack(spec, tmp_path_factory.mktemp("sglang-cpu"))) as stack:
        yield stack


@pytest.fixture(scope="module")
def race(pair: SGLangStack) -> RaceWatch:
    return RaceWatch(pair)


@pytest.fixture(autouse=True)
def _serving(request: pytest.FixtureRequest) -> None:
    """Each test starts on a pair whose prefill still transfers (a test that takes no pair starts none)."""
    if "pair" in request.fixturenames:
        request.getfixturevalue("race").revive()


def _run_campaign(pair: SGLangStack, out: Path, path: Path = CAMPAIGN) -> RunOutcome:
    campaign = load_campaign(path)
    assert campaign.target.sglang == pair.spec  # its target section describes this very pair
    return run_on(pair, campaign, out)


@pytest.fixture(scope="module")
def run(pair: SGLangStack, race: RaceWatch, tmp_path_factory: pytest.TempPathFactory) -> RunOutcome:
    """campaigns/sglang-cpu.yaml on the module's pair (its target section describes this very pair).

    If SGLang's transfer thread dies during the run, the run judged a wedged engine: it must not
    PASS. The campaign then runs once more on a revived prefill, and that run is the one judged."""
    return _judged_run(pair, race, tmp_path_factory, CAMPAIGN)


# A judged run: about 6 minutes; if SGLang's transfer thread dies early in it, the dead engine's
# run takes 20 minutes (every request waits out decode's 20 s timeout) and a second run follows.
JUDGED_RUN_TIMEOUT_S = 2400


def _judged_run(pair: SGLangStack, race: RaceWatch, tmp_path_factory: pytest.TempPathFactory, path: Path) -> RunOutcome:
    race.revive()
    outcome = _run_campaign(pair, tmp_path_factory.mktemp(path.stem), path)
    if race.revive():
        assert outcome.verdict is not Verdict.PASS, "the engine's transfer thread died during the run, yet it PASSed"
        outcome = _run_campaign(pair, tmp_path_factory.mktemp(f"{path.stem}-again"), path)
    return outcome


def _pdchaos(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "chaos.cli", *args], capture_output=True, text=True, timeout=300, env=ENV, check=False
    )


@pytest.mark.timeout(900)
def test_preflight_reads_the_real_startup_line_and_endpoints(pair: SGLangStack) -> None:
    logs = [f"{role}={pair.log_dir / f'{role}.log'}" for role in ("prefill", "decode")]
    urls = [f"{role}={pair.worker_url(role)}" for role in ("prefill", "decode")]
    for source in (["--log", *logs], ["--url", *urls]):
        done = _pdchaos("preflight", *source, "--json")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        nodes = json.loads(done.stdout)["nodes"]
        assert [(n["role"], n["pool_tokens"], n["context_len"], n["status"]) for n in nodes] == [
            ("prefill", 8192, 2048, "OK"),
            ("decode", 8192, 2048, "OK"),
        ], nodes
    # The limits the faults read, from the worker's /server_info and /v1/models.
    assert SGLANG.limits(pair.worker_url("prefill")).as_tuple() == (8192, 2048, 2042)


@pytest.mark.timeout(900)
def test_canary_on_the_router_passes(pair: SGLangStack) -> None:
    done = _pdchaos("canary", "--url", pair.router_url, "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    summary = report["summary"]
    assert report["verdict"] == "PASS" and summary["leaks"] == 0
    assert summary["probes"] >= 6 and summary["pass"] == summary["probes"]
    assert summary["victims"] > 0 and summary["victims_clean"] == summary["victims"]
    assert report["target"]["context_length"] == 2048


@pytest.mark.timeout(JUDGED_RUN_TIMEOUT_S)
def test_campaign_windows_all_confirmed(run: RunOutcome) -> None:
    journal = Journal.open(run.run_dir)
    windows = windows_from_events(journal.iter_events(kind="fault"))
    assert sorted(w.fault for w in windows) == [
        "cache_flush",
        "client_abort",
        "client_abort",
        "over_length_burst",
        "process_kill",
        "transfer_stall",
    ]
    unconfirmed = {w.label: w.confirm_evidence for w in windows if not w.confirmed}
    assert not unconfirmed, unconfirmed
    stall = next(w for w in windows if w.fault == "transfer_stall")
    assert "transfer timeouts in decode log" in stall.confirm_evidence, stall.confirm_evidence


@pytest.mark.timeout(JUDGED_RUN_TIMEOUT_S)
def test_the_qualification_run_passes_on_the_clean_release(run: RunOutcome) -> None:
    """SGLang 0.5.23 with symmetric pools has none of the bugs the campaign provokes: every oracle
    PASSes. Each was a false FAIL or INCONCLUSIVE once (docs/sglang-cpu-tier.md lists them)."""
    verdicts = {r.name: r.verdict for r in run.oracles}
    reasons = {r.name: [f.summary for f in r.findings][:3] for r in run.oracles if r.verdict is not Verdict.PASS}
    assert all(v is Verdict.PASS for v in verdicts.values()), reasons
    assert run.verdict is Verdict.PASS, run.reasons
    journal = Journal.open(run.run_dir)
    assert journal.get_meta("limits")["context_length"] == 2048  # from the workers: the router states none
    assert journal.get_meta("probes")["adapters"] == []  # /server_info: no LoRA


def _band_request(router: str, tokens: int, timeout_s: float) -> tuple[int | None, float, str]:
    body = {
        "input_ids": [100 + i % 1500 for i in range(tokens)],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    }
    started = time.monotonic()
    try:
        response = httpx.post(f"{router}/generate", json=body, timeout=timeout_s, trust_env=False)
        return (
            response.status_code,
            time.monotonic() - started,
            response.text[:2000],
        )  # an abort's message is late in it
    except httpx.HTTPError as exc:
        return None, time.monotonic() - started, type(exc).__name__


@pytest.mark.timeout(JUDGED_RUN_TIMEOUT_S)
def test_the_router_500_findings_campaign_fails_for_its_reason(
    pair: SGLangStack, race: RaceWatch, run: RunOutcome, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """campaigns/sglang-cpu-router-500.yaml on the module's pair: a memory_fraction window restarts
    prefill with a 1,024-token pool under decode's 8,192 (context 2,048), the incident's
    configuration, and its band provocation sends prompts between the two limits. SGLang 0.5.23's
    prefill rejects each at intake (max_req_input_len 1,018) and never hands it off (PR #38935),
    while decode, which admitted it, waits for KV that never comes: sglang-router 0.3.2 returns
    decode's 500 after decode's waiting timeout. The run FAILs for that alone (status,
    over_length_5xx), and the heal restores the pool."""
    outcome = _judged_run(pair, race, tmp_path_factory, ROUTER_500)
    failing = {r.name: r for r in outcome.oracles if r.verdict is Verdict.FAIL}
    assert outcome.verdict is Verdict.FAIL and set(failing) == {"status"}, outcome.reasons
    rules = {f.evidence.get("rule") for f in failing["status"].findings}
    assert rules == {"over_length_5xx"}, rules
    journal = Journal.open(outcome.run_dir)
    (window,) = windows_from_events(journal.iter_events(kind="fault"))
    assert window.confirmed and "pool_tokens: 8192 -> 1024" in window.confirm_evidence, window.confirm_evidence
    waiting = pair.spec.waiting_timeout_s or 300
    failed = {f.request_id for f in failing["status"].findings}
    took = [r.t_end - r.t_send for r in journal.iter_requests() if r.id in failed and r.t_end and r.t_send]
    assert took and min(took) >= waiting - 2, f"a 500 came before decode's {waiting} s waiting timeout: {took}"
    assert "exceeds the maximum allowed length (1018 tokens)" in pair.logs("prefill")
    assert SGLANG.limits(pair.worker_url("prefill")).pool_tokens == 8192  # healed


@pytest.mark.timeout(JUDGED_RUN_TIMEOUT_S)
def test_engine_failure_is_confirmed_on_the_real_decode(pair: SGLangStack, run: RunOutcome, tmp_path: Path) -> None:
    """Decode restarted with SGLANG_TEST_DISAGG_FAILURE_PROB: its transfers fail at random and the
    clients see it ("Decode transfer failed ... KVTransferError", a 500 or a 200 ending in abort),
    yet decode logs none of them above DEBUG (an injected failure counts as another rank's). The
    fault confirms itself from decode's failed-transfer counter; the heal restarts decode without
    the variable, and requests are served again."""
    fault = build_fault("engine_failure", {"role": "decode", "probability": 0.05}, "failures")
    ctx = FaultContext(target=pair, journal=Journal.create(tmp_path), window_id="failures")
    plan = fault.undo_plan(ctx)
    try:
        fault.inject(ctx)
        replies = [_band_request(pair.router_url, 200, timeout_s=120) for _ in range(6)]
        failed = [r for r in replies if r[0] != 200 or "Decode transfer failed" in r[2]]
        assert failed, replies
        confirmation = fault.confirm(ctx)
        assert confirmation.confirmed, confirmation.evidence
        assert "failed transfers counted since the restart: 0" not in confirmation.evidence, confirmation.evidence
    finally:
        fault.heal(ctx, plan)
    assert fault.audit(ctx, plan) == []
    status, _, text = _band_request(pair.router_url, 200, timeout_s=120)
    assert status == 200 and "Decode transfer failed" not in text, text
