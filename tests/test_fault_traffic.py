"""Traffic faults against the embedded stack: aborts at each phase, over-length bursts, cache flushes.

Each is injected, confirmed (or, where it cannot take effect, reported unconfirmed), healed and
audited; every request a fault sends is in the journal with the run's canary markers.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from chaos.journal import Journal, Outcome
from chaos.markers import MarkerCodec
from chaos.targets.sim.settings import TransferTimeouts, WorkerSettings
from chaos.targets.sim.stack import SimStack, SimStackConfig
from faults.base import FaultContext
from faults.registry import FAULTS, build_fault
from faults.traffic.client_abort import AbortPlan
from faults.traffic.exchange import Exchange
from faults.traffic.source import FAULT_INDEX_BASE, INDEX_SPAN, window_index_base
from faults.window import run_window
from loadprofiles.sizing import plan_thresholds
from tests.conftest import start_stack, wait_until

pytestmark = pytest.mark.integration

RUN_PREFIX = "K7QX"
# Slow enough prefill and transfer (about 100 ms each for 2000 tokens) that each phase is a
# window an abort can be aimed at.
TRAFFIC_STACK = SimStackConfig(
    worker=WorkerSettings(
        prefill_tokens_per_s=20000.0,
        transfer_tokens_per_s=20000.0,
        timeouts=replace(TransferTimeouts(), waiting_timeout_s=3.0, bootstrap_timeout_s=3.0),
    ),
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimStack]:
    s = start_stack(tmp_path_factory.mktemp("traffic"), TRAFFIC_STACK)
    try:
        yield s
    finally:
        s.down()


@pytest.fixture()
def journal(tmp_path: Path) -> Iterator[Journal]:
    with Journal.create(tmp_path / "run") as j:
        j.set_meta("run_prefix", RUN_PREFIX)
        yield j


def _ctx(stack: SimStack, journal: Journal, window: str = "w1") -> FaultContext:
    return FaultContext(target=stack, journal=journal, window_id=window)


def _idle(stack: SimStack) -> bool:
    for role in ("prefill", "decode"):
        data = httpx.get(f"{stack.worker_url(role)}/v1/loads", timeout=5).json()
        if (
            data["num_used_tokens"]
            or data["quarantined_tokens"]
            or data["num_running_reqs"]
            or data["num_waiting_reqs"]
        ):
            return False
    return True


@pytest.mark.parametrize(
    "phase, method",
    [
        ("decode", "abort_request"),
        ("transfer", "abort_request"),
        ("prefill", "disconnect"),
        ("queued", "abort_request"),
    ],
)
def test_client_abort_at_each_phase_is_confirmed_and_journaled(
    stack: SimStack, journal: Journal, phase: str, method: str
) -> None:
    fault = build_fault("client_abort", {"phase": phase, "method": method, "count": 2}, "faults[0]")
    result = run_window(fault, _ctx(stack, journal), duration_s=0.5)
    assert result.confirmation.confirmed, result.confirmation.evidence
    assert "sglang:num_aborted_requests_total +" in result.confirmation.evidence
    assert result.healed and not result.leftovers

    journal.flush()
    records = list(journal.iter_requests())
    aborted = [r for r in records if r.user_kind == "fault_abort"]
    assert len(aborted) == 2
    assert {r.user_kind for r in records} == {"fault_abort", "fault_calibration"}
    assert len({r.id for r in records}) == len(records) and len({r.request_index for r in records}) == len(records)
    codec = MarkerCodec(RUN_PREFIX)
    for record in records:
        assert record.request_index >= FAULT_INDEX_BASE
        assert record.markers == [codec.marker(record.request_index, 0), codec.marker(record.request_index, 1)]
        assert record.markers[0] in record.prompt and record.id.startswith(f"{RUN_PREFIX}-fault-w1-")
    for record in aborted:
        assert record.outcome is Outcome.INFO
        assert record.error_class == ("disconnect" if method == "disconnect" else "abort")
        assert record.status is None or record.finish_reason == "abort"
    wait_until(lambda: _idle(stack), timeout_s=15, what="pools back at baseline after the aborts")


def test_over_length_burst_hits_every_reported_threshold(stack: SimStack, journal: Journal) -> None:
    fault = build_fault("over_length_burst", {}, "faults[0]")
    result = run_window(fault, _ctx(stack, journal), duration_s=0.2)
    assert result.confirmation.confirmed, result.confirmation.evidence
    info = httpx.get(f"{stack.worker_url('prefill')}/server_info", timeout=5).json()
    pool, context, max_input = info["max_total_num_tokens"], info["context_length"], info["max_req_input_len"]
    for label in (f"pool {pool}", f"context {context}", f"band [{max_input},{context})"):
        assert f"{label}: 400" in result.confirmation.evidence
    assert result.healed and not result.leftovers

    journal.flush()
    probes = [r for r in journal.iter_requests() if r.user_kind == "over_length"]
    assert len(probes) == 3
    assert all(r.status == 400 and r.outcome is Outcome.FAIL and r.error_class == "http_400" for r in probes)
    band = next(r for r in probes if "band" in (r.error_detail or ""))
    assert "exceeds the maximum allowed length" in (band.error_detail or "")  # the scheduler check, not the tokenizer's


def test_cache_flush_when_idle_is_confirmed(stack: SimStack, journal: Journal) -> None:
    fault = build_fault("cache_flush", {"interval_s": 0.2}, "faults[0]")
    result = run_window(fault, _ctx(stack, journal), duration_s=0.6)
    assert result.confirmation.confirmed, result.confirmation.evidence
    assert result.healed and not result.leftovers
    notes = [e for e in journal.iter_events(kind="note") if e.name == "cache_flush"]
    assert notes and notes[0].data["flush_answers"].get("200", 0) >= 2


def test_cache_flush_while_a_request_runs_is_reported_unconfirmed(stack: SimStack, journal: Journal) -> None:
    """SGLang refuses /flush_cache while requests run: under load the flush cannot take effect."""
    started = threading.Event()

    def long_request() -> None:
        body = {
            "text": "Please keep talking about the harbour.",
            "stream": True,
            "sampling_params": {"max_new_tokens": 450, "ignore_eos": True},
        }
        with httpx.Client(timeout=30) as client, client.stream("POST", f"{stack.router_url}/generate", json=body) as r:
            for _ in r.iter_lines():
                started.set()

    runner = threading.Thread(target=long_request, daemon=True)
    runner.start()
    assert started.wait(10)
    # Decode holds the request while it generates (prefill let go of it after the handoff).
    fault = build_fault("cache_flush", {"interval_s": 0.2, "role": "decode"}, "faults[0]")
    result = run_window(fault, _ctx(stack, journal), duration_s=0.6)
    runner.join(30)
    assert not result.confirmation.confirmed
    assert "400" in result.confirmation.evidence and "refuses" in result.confirmation.evidence
    assert result.healed and not result.leftovers


def test_abort_plan_and_index_ranges() -> None:
    plan = AbortPlan(ttft_small=0.02, ttft_full=0.22, transfer_s=0.1, transfer_measured=True)
    queued, prefill, transfer = (plan.delay(p) for p in ("queued", "prefill", "transfer"))
    assert queued is not None and prefill is not None and transfer is not None
    assert queued < 0.02 < prefill < 0.12 < transfer < 0.22 and plan.delay("decode") is None
    assert window_index_base("w3") == FAULT_INDEX_BASE + 3 * INDEX_SPAN != window_index_base("w4")
    asymmetric = plan_thresholds([(4096, 8192, 4090), (39312, 8192, 8186)])
    assert [t.label for t in asymmetric] == [
        "pool 4096",
        "band [4090,8192)",
        "band [8186,8192)",
        "context 8192",
        "pool 39312",
    ]
    assert all(t.target + t.max_new_tokens() <= 8192 for t in asymmetric if t.upper is not None)


def test_traffic_families_are_registered() -> None:
    assert {"client_abort", "over_length_burst", "cache_flush"} <= set(FAULTS)


def test_an_over_length_prompt_that_lands_over_the_smallest_limit_is_judged_whatever_it_was_aimed_at() -> None:
    """The incident's pools: prefill's max input 1,018, decode's 2,042, context 2,048. A prompt
    aimed past decode's limit that the tokenizer counts at 2,015 tokens is still over prefill's:
    answered 200, it is the incident, not a miss."""
    from faults.traffic.over_length import undershot
    from loadprofiles.sizing import plan_thresholds

    thresholds = plan_thresholds([(1024, 2048, 1018), (8192, 2048, 2042)])
    aimed_at_decode = next(t for t in thresholds if t.label == "band [2042,2048)")
    assert aimed_at_decode.tokens == 2042
    assert not undershot(thresholds, 2015)  # under the limit it was aimed at, over prefill's: judged
    assert undershot(thresholds, 1011)  # under every limit: a miss, not judged


def _exchange(**fields: Any) -> Exchange:
    """A fault's request as the client saw it, for a confirmation or a timing to read."""
    return Exchange(index=0, prompt="x", markers=[], actor="fault", **fields)


def test_an_over_length_burst_answered_404_is_not_confirmed() -> None:
    """A server without the route never ran its admission check: 404 is no answer to the prompt."""
    from faults.base import FaultContext
    from faults.traffic.over_length import OverLengthBurst

    def sent(rid: str, status: int) -> Exchange:
        return _exchange(rid=rid, user_kind="over_length", max_tokens=8, stream=False, status=status)

    fault = OverLengthBurst(OverLengthBurst.Params())
    ctx = FaultContext(target=None, baseline={"probes": [sent("a", 404), sent("b", 400)]})  # type: ignore[arg-type]
    confirmation = fault.confirm(ctx)
    assert not confirmation.confirmed and "1 answered by the server's admission" in confirmation.evidence
    ctx.baseline["probes"] = [sent("a", 413), sent("b", 400), sent("c", 200)]
    assert fault.confirm(ctx).confirmed


def test_a_calibration_reply_whose_tokens_decode_to_no_text_still_times_its_first_token() -> None:
    """vLLM streams a token that decodes to no text (a tiny model, a split UTF-8 sequence) as an
    empty delta; usage still counts it. client_abort's calibration asks for two tokens and needs
    a time-to-first-token: the reply's end bounds it. A reply with no token has none."""
    from loadprofiles.sse import ResponseReader

    def calibration(chunks: list[bytes]) -> Exchange:
        reader = ResponseReader("completions", sse=True)
        for i, chunk in enumerate(chunks):
            reader.feed(chunk, now=100.0 + 0.1 * (i + 1))
        ex = _exchange(
            rid="c", user_kind="fault_calibration", max_tokens=2, stream=True, route="completions", status=200
        )
        ex.t_send = 100.0
        ex.parsed = reader.close(now=100.5)
        ex.t_end = 100.5
        return ex

    def chunk(text: str, finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:
        body = {"choices": [{"index": 0, "text": text, "finish_reason": finish}], "usage": usage}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    empty = calibration(
        [chunk(""), chunk("", "length", {"prompt_tokens": 9, "completion_tokens": 2}), b"data: [DONE]\n\n"]
    )
    assert empty.reply.token_times == [] and empty.ttft == pytest.approx(0.5)
    with_text = calibration([chunk(""), chunk("hi", "length", {"prompt_tokens": 9, "completion_tokens": 2})])
    assert with_text.ttft == pytest.approx(0.2)  # the first chunk that carried text
    nothing = calibration([chunk("", "abort", {"prompt_tokens": 9, "completion_tokens": 0})])
    assert nothing.ttft is None
