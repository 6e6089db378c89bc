"""Synthetic but realistic run journals, written through the real Journal API per the contract in
docs/architecture.md ("What a run journals"): meta, requests with canary markers and per-token
times, fault plan/inject/confirm/heal/audit events, `probe/loads` snapshots, phase events, oracle
results, gates and the run verdict.

The canary oracle runs for real over the journal (so a leak finding has exactly the shape the
oracle produces); the other oracles' results are written as the runner would journal them.

Scenarios: `write_pass_run`, `write_fail_run` (a leak attributed to a victim, plus new error
classes and slower TTFT under faults), `write_inconclusive_run` (an unconfirmed fault),
`write_crashed_run` (no verdict, a fault never healed), `write_empty_run` (zero requests) and
`write_large_run` (50k requests, for the render-time budget).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from chaos.campaign import Campaign
from chaos.fingerprint import fingerprint
from chaos.journal import EventKind, Journal, JournalEvent, Outcome, RequestRecord
from chaos.markers import MarkerCodec
from chaos.oracles.base import OracleContext
from chaos.oracles.leaks import CanaryLeakOracle
from chaos.verdict import Finding, OracleResult, Verdict, combine

T0 = 1_767_225_600.0  # 2026-01-01T00:00:00Z: fixed, so reports of a fixture are reproducible
RUN_PREFIX = "K7QX"
POOL_TOKENS = 65_536
ORACLES = ("canary", "reference", "status", "usage", "timing", "integrity", "liveness")
HOSTILE = "<script>alert('x')</script> & <b>bold</b>"  # must come out escaped in every report


@dataclass(frozen=True)
class WindowPlan:
    fault: str
    window_id: str
    at_s: float  # after load start
    duration_s: float
    params: dict[str, Any] = field(default_factory=dict)
    confirmed: bool = True


@dataclass
class Scenario:
    name: str = "pd-qualification"
    seed: int = 7
    load_s: float = 60.0
    rate_per_s: float = 6.0
    max_tokens: int = 24
    probes: int = 6
    windows: tuple[WindowPlan, ...] = (
        WindowPlan("transfer_stall", "w1", 12.0, 8.0, {"role": "prefill"}),
        WindowPlan("process_kill", "w2", 34.0, 6.0, {"role": "decode", "signal": "KILL"}),
    )
    engine_version: str = "0.5.2"
    leak: bool = False
    slowdown_under_faults: float = 1.0  # multiplies TTFT inside fault windows
    extra_error_class: str | None = None  # a class only this run sees (inside fault windows)
    crash_at_s: float | None = None  # stop writing here (after load start): no oracles, no verdict
    with_requests: bool = True
    # Bulk mode for the 50k-request run: prompts not kept (as the recorder does for long ones) and
    # the canary finding written directly in the oracle's shape, since marker encoding and the
    # oracle's full scan would take the fixture most of a minute.
    light: bool = False


def write_pass_run(run_dir: Path, **overrides: Any) -> Path:
    return write_run(run_dir, Scenario(**overrides))


def write_fail_run(run_dir: Path, **overrides: Any) -> Path:
    base = {
        "leak": True,
        "engine_version": "0.5.3",
        "slowdown_under_faults": 2.5,
        "extra_error_class": "truncated_stream",
    }
    return write_run(run_dir, Scenario(**{**base, **overrides}))


def write_inconclusive_run(run_dir: Path, **overrides: Any) -> Path:
    windows = (
        WindowPlan("transfer_stall", "w1", 12.0, 8.0, {"role": "prefill"}),
        WindowPlan("process_kill", "w2", 34.0, 6.0, {"role": "decode", "signal": "KILL"}, confirmed=False),
    )
    return write_run(run_dir, Scenario(**{"windows": windows, **overrides}))


def write_crashed_run(run_dir: Path, **overrides: Any) -> Path:
    return write_run(run_dir, Scenario(**{"crash_at_s": 16.0, **overrides}))


def write_empty_run(run_dir: Path, **overrides: Any) -> Path:
    return write_run(run_dir, Scenario(**{"with_requests": False, **overrides}))


def write_large_run(run_dir: Path, requests: int = 50_000, **overrides: Any) -> Path:
    load_s = 600.0
    windows = tuple(
        WindowPlan("transfer_stall", f"w{i + 1}", 60.0 + 150.0 * i, 20.0, {"role": "prefill"}) for i in range(4)
    )
    scenario = Scenario(
        **{
            "load_s": load_s,
            "rate_per_s": requests / load_s,
            "max_tokens": 16,
            "probes": 12,
            "windows": windows,
            "leak": True,
            "light": True,
            **overrides,
        }
    )
    return write_run(run_dir, scenario)


# ------------------------------------------------------------------------------ writer ----


def campaign_of(s: Scenario) -> Campaign:
    return Campaign.model_validate(
        {
            "name": s.name,
            "seed": s.seed,
            "description": "fixture campaign",
            "load": {"profile": "mixed", "users": 8, "duration": f"{s.load_s:g}s", "max_tokens": s.max_tokens},
            "probes": {"count": s.probes, "interval": "2s"},
            "oracles": {"enabled": list(ORACLES)},  # pinned: the matrix columns must not follow the defaults
            "faults": {
                "windows": [
                    {"fault": w.fault, "at": f"{w.at_s:g}s", "duration": f"{w.duration_s:g}s", "params": w.params}
                    for w in s.windows
                ]
            },
        }
    )


class _Writer:
    def __init__(self, journal: Journal, s: Scenario) -> None:
        self.j, self.s = journal, s
        self.rng = random.Random(s.seed)
        self.codec = MarkerCodec(RUN_PREFIX)
        self.index = 0
        self.load_start = T0 + 6.0
        self.crash_t = None if s.crash_at_s is None else self.load_start + s.crash_at_s

    def alive(self, t: float) -> bool:
        return self.crash_t is None or t < self.crash_t

    def event(self, kind: EventKind | str, event_name: str, t: float, **data: Any) -> None:
        if self.alive(t):
            self.j.append_event(JournalEvent(kind=kind, name=event_name, data=data, t=t))

    def window_at(self, t: float) -> WindowPlan | None:
        for w in self.s.windows:
            start = self.load_start + w.at_s
            if start <= t <= start + w.duration_s:
                return w
        return None

    def request(self, t_send: float, phase: str, user_kind: str, *, note: str = "") -> RequestRecord:
        i = self.index
        self.index += 1
        if self.s.light:
            words, markers, prompt = "alpha bravo cargo delta", [], ""
        else:
            words = " ".join(
                self.rng.choice(("alpha", "bravo", "cargo", "delta", "ember", "fjord", "gamma")) for _ in range(8)
            )
            markers = [self.codec.marker(i, 0), self.codec.marker(i, 1)]
            prompt = f"{markers[0]} Repeat this note exactly: {note or words} {markers[1]}"
        window = self.window_at(t_send) if phase == "load" else None
        slow = self.s.slowdown_under_faults if window else 1.0
        ttft = self.rng.lognormvariate(-2.8, 0.35) * slow  # about 60 ms
        status: int | None
        error_class: str | None
        finish: str | None
        outcome, status, error_class, finish, tokens = Outcome.OK, 200, None, "length", self.s.max_tokens
        if window is not None:
            ttft += self.rng.uniform(0.5, 2.5) * slow
            roll = self.rng.random()
            if window.fault == "transfer_stall" and roll < 0.25:
                outcome, status, error_class, finish, tokens = Outcome.FAIL, 500, "http_500", None, 0
            elif window.fault == "process_kill" and roll < 0.3:
                outcome, status, error_class, finish, tokens = Outcome.INFO, None, "disconnect", None, 0
            elif self.s.extra_error_class and roll > 0.9:
                outcome, status, error_class, finish, tokens = Outcome.INFO, 200, self.s.extra_error_class, None, 3
        itl = self.rng.uniform(0.004, 0.008)
        first = t_send + ttft
        token_times = [first + k * itl for k in range(tokens)]
        t_end = (token_times[-1] if token_times else first) + 0.002
        return RequestRecord(
            id=f"req-{i:06d}",
            request_index=i,
            phase=phase,
            user_kind=user_kind,
            actor="actor0/user3",
            endpoint="/v1/chat/completions",
            stream=True,
            markers=markers,
            prompt=prompt,
            prompt_chars=len(prompt) or 2400,
            max_tokens=self.s.max_tokens,
            planned_send=t_send - 0.001,
            t_send=t_send,
            t_first_byte=first - 0.001 if tokens else None,
            t_first_token=first if tokens else None,
            t_end=t_end,
            token_times=token_times,
            status=status,
            finish_reason=finish,
            prompt_tokens=(len(prompt) or 2400) // 4,
            completion_tokens=tokens,
            cached_tokens=0,
            response_text=("Sure. " + (note or words))[: tokens * 5] if tokens else "",
            body_bytes=400 + tokens * 40,
            outcome=outcome,
            error_class=error_class,
            error_detail={
                "http_500": "HTTP 500: KVTransferError: waiting timeout",
                "disconnect": "connection reset before the first byte",
            }.get(error_class or ""),
        )


def write_run(run_dir: Path, s: Scenario) -> Path:
    campaign = campaign_of(s)
    with Journal.create(run_dir) as journal:
        w = _Writer(journal, s)
        _write_meta(journal, s, campaign, w)
        w.event(EventKind.PHASE, "baseline:start", T0 + 1.0)
        for role in ("prefill", "decode"):
            w.event(EventKind.PROBE, "loads", T0 + 0.5, role=role, phase="idle_before", data=_loads(0, 0))
        records = (
            [w.request(T0 + 1.2 + 0.5 * k, "baseline", "probe") for k in range(s.probes)] if s.with_requests else []
        )
        w.event(EventKind.PHASE, "baseline:end", T0 + 5.0)
        w.event(EventKind.PHASE, "load:start", w.load_start)
        if s.with_requests:
            records += _load_records(w)
        journal.append_requests(r for r in records if w.alive(r.t_send or 0.0))
        _write_faults(w)
        _write_pool(w)
        end = w.load_start + s.load_s
        w.event(EventKind.PHASE, "load:end", end)
        w.event(EventKind.PHASE, "drain:start", end + 0.1)
        for role in ("prefill", "decode"):
            w.event(EventKind.PROBE, "loads", end + 2.0, role=role, phase="after_drain", data=_loads(0, 0))
            w.event(
                EventKind.PROBE,
                "metrics",
                end + 2.0,
                role=role,
                phase="after",
                text=f'sglang:num_transfer_failed_reqs_total{{engine_type="{role}"}} 3\n',
            )
        w.event(EventKind.PHASE, "drain:end", end + 2.5)
        if w.crash_t is not None:
            return run_dir  # the process died: no oracles, no verdict, no ended_at
        _write_verdict(w, end + 3.0, records)
        journal.set_meta("ended_at", end + 4.0)
    return run_dir


def _write_meta(journal: Journal, s: Scenario, campaign: Campaign, w: _Writer) -> None:
    data = campaign.model_dump(mode="json")
    info = {
        "version": s.engine_version,
        "disaggregation_mode": None,
        "disaggregation_transfer_backend": "mooncake",
        "page_size": 16,
        "context_length": 4096,
        "max_total_num_tokens": POOL_TOKENS,
        "mem_fraction_static": 0.88,
    }
    journal.set_meta("campaign", data)
    journal.set_meta(
        "campaign_yaml",
        f"# {s.name}\n" + yaml.safe_dump({"name": s.name, "seed": s.seed, "faults": data["faults"]}, sort_keys=False),
    )
    journal.set_meta("seed", s.seed)
    journal.set_meta("run_prefix", RUN_PREFIX)
    journal.set_meta(
        "target",
        {
            "kind": "sim",
            "router_url": "http://127.0.0.1:30000",
            "workers": [
                {"role": "prefill", "url": "http://127.0.0.1:30001"},
                {"role": "decode", "url": "http://127.0.0.1:30002"},
            ],
        },
    )
    journal.set_meta(
        "environment",
        fingerprint(
            s.seed,
            {
                "prefill": {**info, "disaggregation_mode": "prefill"},
                "decode": {**info, "disaggregation_mode": "decode"},
            },
        ),
    )
    journal.set_meta("started_at", T0)
    journal.set_meta("load_started_at", w.load_start)
    journal.set_meta(
        "windows_planned",
        [{"fault": x.fault, "at_s": x.at_s, "duration_s": x.duration_s, "params": x.params} for x in s.windows],
    )


def _load_records(w: _Writer) -> list[RequestRecord]:
    s, records = w.s, []
    n = int(s.load_s * s.rate_per_s)
    for k in range(n):
        t = w.load_start + (k + w.rng.random()) / s.rate_per_s
        kind = "probe" if k % 40 == 0 else "canary_chat"
        records.append(w.request(t, "load", kind, note=HOSTILE if k == 3 else ""))
    if s.leak and s.windows:
        first = s.windows[0]
        t = w.load_start + first.at_s + first.duration_s / 2
        victim = min(
            (r for r in records if r.t_send and r.t_send >= t and r.outcome is Outcome.OK),
            key=lambda r: r.t_send or 0.0,
        )
        offender = next(
            r for r in records if r.t_send and r.t_send > (victim.t_send or 0.0) + 0.3 and r.outcome is Outcome.OK
        )
        if not victim.markers:
            victim.markers = [w.codec.marker(victim.request_index, 0), w.codec.marker(victim.request_index, 1)]
        victim.prompt = f"{victim.markers[0]} Patient record 4471: {HOSTILE} diagnosis pending {victim.markers[1]}"
        # The offender's 200 carries the victim's head marker and prompt text: a fluent leak.
        offender.response_text = (
            f"Sure. Here is the note: {victim.markers[0]} Patient record 4471: {HOSTILE} "
            "diagnosis pending, as requested."
        )
    return records


def _write_faults(w: _Writer) -> None:
    for plan in w.s.windows:
        start = w.load_start + plan.at_s
        end = start + plan.duration_s
        role = plan.params.get("role", "prefill")
        undo = [
            {
                "kind": "sigcont" if plan.fault == "transfer_stall" else "revive_role",
                "role": role,
                "pgid": 4242,
                "pid": None,
                "url": None,
                "settings": {},
            }
        ]
        w.event(
            EventKind.FAULT, plan.fault, start - 0.05, window=plan.window_id, step="plan", params=plan.params, undo=undo
        )
        w.event(EventKind.FAULT, plan.fault, start, window=plan.window_id, step="inject", params=plan.params)
        evidence = (
            "stopped=True, transfer timeouts in decode log=3, decode failed-transfer counters +3"
            if plan.confirmed
            else f"{role} restarted but no request failed and no log line changed: the kill did not take"
        )
        w.event(
            EventKind.FAULT,
            plan.fault,
            start + plan.duration_s * 0.6,
            window=plan.window_id,
            step="confirm",
            confirmed=plan.confirmed,
            evidence=evidence,
        )
        w.event(EventKind.FAULT, plan.fault, end, window=plan.window_id, step="heal", ok=True, error=None)
        w.event(EventKind.FAULT, plan.fault, end + 0.2, window=plan.window_id, step="audit", clean=True, leftovers=[])


def _loads(used: float, running: int) -> dict[str, Any]:
    return {
        "num_running_reqs": running,
        "num_waiting_reqs": 0,
        "num_used_tokens": int(used),
        "num_total_tokens": POOL_TOKENS,
        "max_total_num_tokens": POOL_TOKENS,
        "token_usage": round(used / POOL_TOKENS, 4),
        "disaggregation": {
            "prefill_bootstrap_queue_reqs": 0,
            "prefill_inflight_queue_reqs": 0,
            "decode_prealloc_queue_reqs": 0,
            "decode_transfer_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 1.2,
            "kv_transfer_latency_ms": 3.5,
        },
        "quarantined_tokens": 0,
    }


def _write_pool(w: _Writer) -> None:
    t = w.load_start
    while t < w.load_start + w.s.load_s:
        stalled = w.window_at(t)
        for role in ("prefill", "decode"):
            used = 9000 + w.rng.uniform(-1500, 1500)
            if stalled and role == "decode":
                used += 30000  # decode holds preallocated pages while prefill is stopped
            w.event(EventKind.PROBE, "loads", t, role=role, phase="during", data=_loads(used, 8))
        t += 2.0


def _write_verdict(w: _Writer, t: float, records: list[RequestRecord]) -> None:
    s, j = w.s, w.j
    w.event(EventKind.PHASE, "oracles:start", t)
    labels = {x.window_id: f"{x.fault}#{x.window_id}" for x in s.windows}
    n = len(records)
    results = [
        _bulk_canary(w, records, labels)
        if s.light
        else CanaryLeakOracle().evaluate(OracleContext(journal=j, run_prefix=RUN_PREFIX))
    ]
    for name in ORACLES[1:]:
        findings: list[Finding] = []
        if name == "timing" and results[0].findings:
            leak = results[0].findings[0]
            findings.append(
                Finding(
                    name,
                    Verdict.FAIL,
                    f"{leak.request_id}: first token 4 ms after send, below the "
                    "calibrated 41 ms prefill of its prompt: it skipped its own prefill",
                    request_id=leak.request_id,
                    window=leak.window,
                    evidence={"ttft_s": 0.004, "expected_s": 0.041},
                )
            )
        if name == "liveness" and any(not x.confirmed for x in s.windows):
            findings.append(
                Finding(
                    name,
                    Verdict.INCONCLUSIVE,
                    "req-000031: the client gave up after 30.0 s, before the 120 s deadline",
                    request_id="req-000031",
                )
            )
        results.append(OracleResult.from_findings(name, max(1, n), findings, notes=[f"fixture {name} oracle"]))
    for result in results:
        w.event("verdict", "oracle", t + 0.5, **dataclasses.asdict(result))
    gates = [
        Finding(
            "gates",
            Verdict.INCONCLUSIVE,
            f"fault {labels[x.window_id]} was not confirmed: its window proves nothing",
            window=labels[x.window_id],
            evidence={"gate": "unconfirmed_fault"},
        )
        for x in s.windows
        if not x.confirmed
    ]
    for gate in gates:
        w.event("verdict", "gate", t + 0.6, **dataclasses.asdict(gate))
    verdict = combine([*(r.verdict for r in results), *(g.verdict for g in gates)])
    reasons = [f"{r.name}: {f.summary}" for r in results for f in r.findings if f.verdict is Verdict.FAIL]
    reasons += [g.summary for g in gates]
    if verdict is Verdict.PASS:
        reasons = [f"every oracle passed in {len(s.windows)} confirmed fault window(s); no leak in {n} responses"]
    counts = {
        "total": n,
        "ok": sum(r.outcome is Outcome.OK for r in records),
        "fail": sum(r.outcome is Outcome.FAIL for r in records),
        "info": sum(r.outcome is Outcome.INFO for r in records),
    }
    w.event(EventKind.PHASE, "oracles:end", t + 0.7)
    w.event(
        "verdict",
        "run",
        t + 0.8,
        verdict=verdict.value,
        exit_code=verdict.exit_code,
        reasons=reasons,
        requests=counts,
        generator_saturated=False,
    )


def _bulk_canary(w: _Writer, records: list[RequestRecord], labels: dict[str, str]) -> OracleResult:
    """The canary result for a light run, in exactly the shape CanaryLeakOracle produces."""
    findings = []
    for record in records:
        hits = w.codec.scan(record.response_text) if "UUL" in record.response_text else []
        for hit in hits:
            victim = next(r for r in records if r.request_index == hit.request_index)
            active = [
                labels[x.window_id]
                for x in w.s.windows
                if w.load_start + x.at_s <= (record.t_send or 0) <= w.load_start + x.at_s + x.duration_s + 10.0
            ]
            victim_active = [
                labels[x.window_id]
                for x in w.s.windows
                if w.load_start + x.at_s <= (victim.t_send or 0) <= w.load_start + x.at_s + x.duration_s + 10.0
            ]
            evidence = {
                "marker": hit.text,
                "kind": hit.kind.value,
                "offset": hit.offset,
                "verified": hit.verified,
                "excerpt": record.response_text[max(0, hit.offset - 40) : hit.end + 40],
                "faults_active": active,
                "victim_faults_active": victim_active,
                "victim_outcome": victim.outcome.value,
            }
            findings.append(
                Finding(
                    "canary",
                    Verdict.FAIL,
                    f"LEAK: response to {record.id} contains {hit.kind.value} marker of request {victim.id}",
                    request_id=record.id,
                    victim_request_id=victim.id,
                    window=active[0] if active else None,
                    evidence=evidence,
                )
            )
    return OracleResult.from_findings("canary", sum(1 for r in records if r.response_text), findings)
