"""Provocations: the band a window computes from the limits it read, and that its requests landed
there; the waves that hand freed pages to fresh requests, during the fault and after its heal."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from chaos.errors import UsageError
from chaos.journal import Journal
from chaos.limits import WorkerLimits
from chaos.targets.sim.settings import TransferTimeouts, WorkerSettings
from chaos.targets.sim.stack import SimStack, SimStackConfig
from faults.base import FaultContext
from faults.provoke import (
    KIND_PROVOCATION,
    PROVOCATIONS,
    Provoker,
    ProvokeSettings,
    RoleLimits,
    plan_band,
    plan_wave,
    split_params,
)
from faults.registry import FAULTS, build_fault
from faults.window import run_window
from tests.conftest import start_stack

ROOT = Path(__file__).resolve().parent.parent
STALL_SPAN = ROOT / "tests" / "campaigns" / "stall-span.yaml"
ASYMMETRIC = [
    RoleLimits("prefill", WorkerLimits(2048, 4096, 2042)),
    RoleLimits("decode", WorkerLimits(39312, 4096, 4090)),
]


# ------------------------------------------------------------------------------- planning ----


def test_the_band_lies_between_the_two_roles_limits_with_each_boundary_probed() -> None:
    shots = plan_band(ASYMMETRIC, count=4)
    by_tokens = {s.tokens: s for s in shots}
    # right under, at and over each role's first rejected length
    for limit in (2042, 4090):
        assert {limit - 1, limit, limit + 1} <= set(by_tokens)
    assert not by_tokens[2041].over_limit and by_tokens[2042].over_limit
    band = [s for s in shots if s.label.startswith("band")]
    assert len(band) == 4 and all(2042 < s.tokens < 4090 and s.over_limit for s in band)
    # the prefill pool itself, smaller than the context
    assert 2048 in by_tokens
    # prompt + generated tokens stay within the context, so only the check under test can reject
    assert all(s.tokens + s.max_new_tokens <= 4096 for s in shots if s.tokens < 4096)


def test_symmetric_pools_give_only_the_boundaries() -> None:
    symmetric = [RoleLimits(r, WorkerLimits(39312, 4096, 4090)) for r in ("prefill", "decode")]
    assert [s.tokens for s in plan_band(symmetric, count=4)] == [4089, 4090, 4091]


def test_a_target_that_reports_no_limits_gets_no_band() -> None:
    assert plan_band([RoleLimits("router", WorkerLimits())], count=4) == []


def test_a_wave_stays_under_every_limit_and_carries_a_multi_chunk_prompt() -> None:
    wave = plan_wave(ASYMMETRIC, size=3, n=0)
    assert len(wave) == 4 and all(not s.over_limit for s in wave)
    assert max(s.tokens for s in wave) > 3 * 128  # several transfer chunks of the embedded engine
    assert all(s.tokens + s.max_new_tokens < 2042 for s in wave)


def test_every_fault_family_names_its_provocations() -> None:
    assert set(PROVOCATIONS) == set(FAULTS)


def test_a_window_that_freezes_the_kv_sender_holds_a_span_probe_across_it() -> None:
    def kinds(fault: str, params: dict, settings: ProvokeSettings | None = None) -> tuple[str, ...]:
        return (settings or ProvokeSettings()).kinds_for(fault, build_fault(fault, params, "w").freezes_sender())

    assert "span" in kinds("transfer_stall", {"role": "prefill"})
    assert "span" in kinds("process_kill", {"role": "prefill", "signal": "STOP"})
    # a frozen receiver or a dead sender writes nothing late
    assert "span" not in kinds("transfer_stall", {"role": "decode"})
    assert "span" not in kinds("process_kill", {"role": "prefill", "signal": "KILL"})
    assert "span" not in kinds("kv_transfer", {"mode": "latency", "latency_ms": 100})
    # the campaign's own list and `provoke: false` win
    assert kinds("transfer_stall", {"role": "prefill"}, ProvokeSettings(kinds=("reuse",))) == ("reuse",)
    assert kinds("transfer_stall", {"role": "prefill"}, ProvokeSettings(enabled=False)) == ()


def test_the_inject_waits_until_the_span_probe_decodes() -> None:
    """The span probe is started as the window opens and the fault waits for its
    first token; `join` waits for the probe to end."""
    events: list[str] = []
    release = threading.Event()

    def span(decoding: threading.Event) -> None:
        events.append("sent")
        time.sleep(0.3)
        events.append("decoding")
        decoding.set()
        release.wait(5)
        events.append("ended")

    provoker = Provoker("transfer_stall", ProvokeSettings(kinds=("span",)), span_probe=span)
    provoker.start_span("w1")
    events.append("inject")
    assert events == ["sent", "decoding", "inject"]
    release.set()
    provoker.join()
    assert events[-1] == "ended"


def test_reuse_waves_outlast_the_longest_write_a_delaying_fault_holds_back() -> None:
    # A write held 3.0-5.4 s lands up to 5.4 s after the heal: waves must still be coming then.
    held = build_fault("kv_transfer", {"mode": "latency", "latency_ms": 4200, "jitter_ms": 1200}, "w")
    assert held.lingers_s() == pytest.approx(5.4)
    assert Provoker(
        "kv_transfer", ProvokeSettings(after_heal_s=4.0), lingers_s=held.lingers_s()
    ).after_heal_s == pytest.approx(6.4)
    # A fault that holds nothing back keeps the configured time; a longer configured time wins.
    stall = build_fault("transfer_stall", {"role": "prefill"}, "w")
    assert stall.lingers_s() == 0.0
    assert (
        Provoker("transfer_stall", ProvokeSettings(after_heal_s=4.0), lingers_s=stall.lingers_s()).after_heal_s == 4.0
    )
    assert Provoker("kv_transfer", ProvokeSettings(after_heal_s=9.0), lingers_s=5.4).after_heal_s == 9.0
    assert build_fault("router_link", {"link": "decode", "mode": "partition"}, "w").lingers_s() == 0.0


def test_provoke_settings_are_validated_with_the_field_named() -> None:
    params, settings = split_params(
        {"role": "prefill", "provoke": {"wave_size": 5, "kinds": ["reuse"]}}, "faults.windows[0].params"
    )
    assert (
        params == {"role": "prefill"} and settings.wave_size == 5 and settings.kinds_for("transfer_stall") == ("reuse",)
    )
    assert split_params({"provoke": False}, "w")[1].kinds_for("memory_fraction") == ()
    assert split_params({}, "w")[1].kinds_for("memory_fraction") == ("band", "reuse")
    with pytest.raises(UsageError, match=r"faults.windows\[0\].params.provoke: unknown setting\(s\) waves"):
        split_params({"provoke": {"waves": 3}}, "faults.windows[0].params")
    with pytest.raises(UsageError, match=r"provoke.kinds"):
        ProvokeSettings.from_value({"kinds": ["everything"]}, "provoke")
    with pytest.raises(UsageError, match=r"provoke.interval_s"):
        ProvokeSettings.from_value({"interval_s": 0}, "provoke")
    # a campaign's fault params may carry `provoke:`; the fault itself never sees it
    assert build_fault("transfer_stall", {"role": "prefill", "provoke": False}, "w").params.role == "prefill"  # type: ignore[attr-defined]


# ----------------------------------------------------------------- on the embedded engine ----

STACK = SimStackConfig(
    worker=WorkerSettings(
        context_length=4096, timeouts=replace(TransferTimeouts(), waiting_timeout_s=2.0, bootstrap_timeout_s=3.0)
    ),
)


@pytest.fixture()
def stack(tmp_path: Path) -> Iterator[SimStack]:
    s = start_stack(tmp_path, STACK)
    try:
        yield s
    finally:
        s.down()


def _provoke_event(journal: Journal) -> dict:
    events = [e.data for e in journal.iter_events(kind="fault") if e.data.get("step") == "provoke"]
    assert len(events) == 1, events
    return events[0]


@pytest.mark.integration
def test_memory_fraction_provokes_the_band_and_its_prompts_land_in_it(stack: SimStack, tmp_path: Path) -> None:
    fault = build_fault("memory_fraction", {"role": "prefill", "max_total_tokens": 2048}, "w")
    provoker = Provoker("memory_fraction", ProvokeSettings(after_heal_s=0.5))
    with Journal.create(tmp_path / "run") as journal:
        result = run_window(
            fault, FaultContext(target=stack, journal=journal, window_id="w1"), duration_s=4.0, provoker=provoker
        )
        assert result.confirmation.confirmed, result.confirmation.evidence
        provoker.join()
        plan = _provoke_event(journal)
        records = [r for r in journal.iter_requests() if r.phase == "fault"]
    # the limits were read after the restart: the shrunken prefill pool, decode's untouched one
    assert (
        plan["limits"]["prefill"]["max_input_tokens"] == 2042 and plan["limits"]["decode"]["max_input_tokens"] == 4090
    )
    band = [s for s in plan["band"] if s["label"].startswith("band")]
    assert band and all(2042 < s["tokens"] < 4090 for s in band)
    # the target's own counts put every band prompt inside the band
    for label, counted in plan["landed"].items():
        if label.startswith("band"):
            assert all(2042 <= n < 4090 for n in counted), (label, counted)
    assert sum(len(v) for k, v in plan["landed"].items() if k.startswith("band")) == len(band)
    # the clean pair rejects everything over prefill's limit with a 4xx and serves what is under it
    over = [r for r in records if r.user_kind == "over_length"]
    assert over and all(r.status is not None and 400 <= r.status < 500 for r in over), [
        (r.status, r.error_detail) for r in over
    ]
    under = [r for r in records if r.error_detail and "under the prefill limit" in r.error_detail]
    assert [r.status for r in under] == [200]


@pytest.mark.integration
def test_a_stall_hands_freed_pages_to_fresh_requests_during_it_and_after_its_heal(
    stack: SimStack, tmp_path: Path
) -> None:
    fault = build_fault("transfer_stall", {"role": "prefill"}, "w")
    replayed: list[float] = []  # the runner's reference probe, sent with each wave
    provoker = Provoker(
        "transfer_stall", ProvokeSettings(after_heal_s=2.5, burst=6), replay_probe=lambda: replayed.append(time.time())
    )
    with Journal.create(tmp_path / "run") as journal:
        result = run_window(
            fault, FaultContext(target=stack, journal=journal, window_id="w1"), duration_s=4.5, provoker=provoker
        )
        provoker.join()
        plan = _provoke_event(journal)
        heal = next(e.t for e in journal.iter_events(kind="fault") if e.data.get("step") == "heal")
        inject = next(e.t for e in journal.iter_events(kind="fault") if e.data.get("step") == "inject")
        reuse = [
            r for r in journal.iter_requests() if r.user_kind == KIND_PROVOCATION and "reuse" in (r.error_detail or "")
        ]
        burst = [
            r
            for r in journal.iter_requests()
            if r.user_kind == KIND_PROVOCATION and "provoke burst" in (r.error_detail or "")
        ]
    # the provocation is what a stall nobody waits on lacks: the stall is confirmed
    assert result.confirmation.confirmed, result.confirmation.evidence
    assert plan["sent"]["reuse"] >= 8 and plan["sent"]["burst"] == 12  # at inject and after the heal
    assert any(inject <= r.t_send <= heal for r in reuse) and any(r.t_send > heal for r in reuse)
    assert any("multi-chunk" in (r.error_detail or "") for r in reuse)
    assert len(burst) == 12
    assert len(replayed) == plan["waves"] == plan["sent"]["reuse reference probe"]
    assert any(inject <= t <= heal for t in replayed) and any(t > heal for t in replayed)
    # every fresh request after the heal was answered: the clean engine gave the pages back in order
    assert all(r.status == 200 for r in reuse if r.t_send > heal + 0.5), [
        (r.status, r.error_detail) for r in reuse if r.t_send > heal
    ]


@pytest.mark.integration
def test_waves_wait_while_the_connection_pool_is_full(stack: SimStack, tmp_path: Path) -> None:
    """A target that answers slower than the waves come (here: a stalled prefill) gets as many
    requests as the provoker's connection pool holds, not a queue that times out in the client."""
    from faults.provoke import MAX_IN_FLIGHT

    fault = build_fault("transfer_stall", {"role": "prefill"}, "w")
    provoker = Provoker("transfer_stall", ProvokeSettings(interval_s=0.05, wave_size=8, after_heal_s=0.5, burst=0))
    with Journal.create(tmp_path / "run") as journal:
        run_window(
            fault, FaultContext(target=stack, journal=journal, window_id="w1"), duration_s=3.0, provoker=provoker
        )
        provoker.join()
        plan = _provoke_event(journal)
        sent = [r for r in journal.iter_requests() if r.user_kind == KIND_PROVOCATION and r.t_send is not None]
    assert plan.get("waves_held", 0) > 0, plan
    moments = sorted({r.t_send for r in sent})
    in_flight = max(sum(1 for r in sent if r.t_send <= t and (r.t_end is None or r.t_end > t)) for t in moments)
    assert in_flight <= MAX_IN_FLIGHT, in_flight


def _run_stall_span(out: Path, defect: str | None) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "chaos.cli", "run", str(STALL_SPAN), "--out", str(out), "--quiet"]
    return subprocess.run(
        args + (["--defect", defect] if defect else []), capture_output=True, text=True, timeout=600, cwd=ROOT
    )


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_the_span_probe_reads_the_late_write_of_a_stall_on_a_decode_that_frees_early(tmp_path: Path) -> None:
    """A prefill stall with no link proxy (an attached deployment): the span probe decodes across
    it, so the engine that frees pages before their transfer is done (K1) hands it a freed page and
    the stalled write lands in it when prefill resumes; the clean engine passes the same run."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        k1, clean = pool.map(
            lambda args: _run_stall_span(*args),
            [(tmp_path / "k1", "free_before_transfer_done"), (tmp_path / "clean", None)],
        )
    assert clean.returncode == 0, clean.stdout + clean.stderr[-3000:]
    assert k1.returncode == 1, k1.stdout + k1.stderr[-3000:]
    with Journal.open(tmp_path / "k1", readonly=True) as journal:
        reference = next(
            e.data for e in journal.iter_events(kind="verdict", name="oracle") if e.data["name"] == "reference"
        )
        spans = {r.id for r in journal.iter_requests() if r.phase == "span"}
        plan = _provoke_event(journal)
    assert plan["span"]["decoding"] is True, plan
    assert reference["verdict"] == "FAIL"
    assert {f["request_id"] for f in reference["findings"]} & spans, reference["findings"]
    # sent as the window opens, before the fault acts: its mismatch names that window
    assert all(f["window"] == "transfer_stall#w1" for f in reference["findings"] if f["request_id"] in spans)
