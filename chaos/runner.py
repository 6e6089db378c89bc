"""`pdchaos run`: one campaign from start to verdict.

validate -> start or attach the target -> preflight -> baseline (isolated reference probes) ->
load with the fault schedule, probe replays and aftershock probes -> drain -> oracles and gates
-> verdict -> reports. Everything lands in the journal first; the verdict and the reports are
computed from it. Ctrl-C (or SIGTERM) heals the active fault, stops the load and still writes
the report from what was journaled.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from chaos.campaign import Campaign, WindowSpec
from chaos.errors import TargetError, UsageError
from chaos.fingerprint import fingerprint
from chaos.journal import EventKind, Journal, JournalEvent
from chaos.load import LoadPlan, LoadOutcome, run_load, terminal_progress
from chaos.loadstats import compute, generator_saturated
from chaos.oracles.base import OracleContext
from chaos.oracles.canary import MarkerCodec, new_run_prefix
from chaos.oracles.registry import ALL_ORACLES
from chaos.preflight import PreflightInputs, run_preflight
from chaos.probes import Probe, build_probes, replay_order, send_probe
from chaos.targets.dialect import dialect_of
from chaos.targets.factory import attach, build_stack, launcher_for
from chaos.targets.base import Target
from chaos.targets.discovery import discover_facts
from chaos.tenant_probe import run_tenant_probe
from chaos.verdict import Finding, OracleResult, Verdict, combine
from chaos.windows import windows_from_events
from faults.base import FaultContext
from faults.registry import build_fault
from faults.window import run_window
from loadprofiles.profiles import PROFILES

log = logging.getLogger("pdchaos.runner")

PROBE_INDEX_LIMIT = 10_000  # load traffic numbers its requests from here on
TENANT_INDEX_BASE = 5_000  # the tenant probe's requests, between the reference probes and the load
POOL_SAMPLE_S = 0.5  # often enough that a lull of a few seconds yields two idle samples


class Interrupted(Exception):
    """SIGINT or SIGTERM: heal, stop and report from what was journaled."""


@dataclass
class RunOutcome:
    run_dir: Path
    verdict: Verdict
    reasons: list[str] = field(default_factory=list)
    oracles: list[OracleResult] = field(default_factory=list)
    interrupted: bool = False

    @property
    def exit_code(self) -> int:
        return self.verdict.exit_code


class Runner:
    def __init__(self, campaign: Campaign, run_dir: Path, ray_address: str | None = None, progress: bool = True) -> None:
        self.campaign = campaign
        self.run_dir = run_dir
        self.ray_address = ray_address
        self.show_progress = progress
        self.stop = threading.Event()
        self.run_prefix = new_run_prefix()
        self.codec = MarkerCodec(self.run_prefix)
        self.target: Target | None = None
        self.stack: Any = None
        self.journal: Journal | None = None
        self.probes: list[Probe] = []
        self.api = "sglang"
        self.load_outcome = LoadOutcome()
        self.window_results: list[Any] = []
        self.active_fault: str | None = None
        self.leaks_so_far = 0

    # --------------------------------------------------------------------------- the flow ----

    def run(self) -> RunOutcome:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "campaign.yaml").write_text(yaml.safe_dump(self.campaign.model_dump(mode="json"), sort_keys=False))
        self.journal = Journal.create(self.run_dir)
        self._meta()
        stopped_early: str | None = None  # why the run ended before its end, if it did
        previous = self._install_signal_handlers()
        try:
            self._say(f"run directory {self.run_dir}")
            self._start_target()
            self._baseline()
            self._load_with_faults()
            self._drain()
        except (Interrupted, KeyboardInterrupt):
            stopped_early = "the run was interrupted before it finished"
            self.stop.set()
            self._say("interrupted: healing and writing the report from the journal")
        except (UsageError, TargetError):
            raise  # a setup problem: the CLI names it (exit 2); the journal still gets its verdict below
        except Exception as exc:  # the suite's own machinery broke (e.g. Ray lost a node): no verdict on the target
            (self.run_dir / "error.log").write_text(traceback.format_exc())
            stopped_early = f"the run stopped early, the suite failed: {type(exc).__name__}: {exc} (traceback in error.log)"
            self.stop.set()
            self._say(f"{stopped_early}; healing and writing the report from the journal")
        finally:
            self._restore_signal_handlers(previous)
            outcome = self._judge(stopped_early)
            self._stop_target()
            self.journal.set_meta("ended_at", time.time())
            self.journal.close()
            self._render_reports()
        return outcome

    def _say(self, text: str) -> None:
        if self.show_progress:
            print(f"[pdchaos] {text}", flush=True)

    def _meta(self) -> None:
        assert self.journal is not None
        j = self.journal
        j.set_meta("campaign", self.campaign.model_dump(mode="json"))
        j.set_meta("campaign_yaml", (self.run_dir / "campaign.yaml").read_text())
        j.set_meta("seed", self.campaign.seed)
        j.set_meta("run_prefix", self.run_prefix)
        j.set_meta("started_at", time.time())
        j.set_meta("windows_planned", [{"fault": w.fault, "at_s": w.at_s, "duration_s": w.duration_s, "params": w.params}
                                       for w in self.campaign.windows()])

    def _install_signal_handlers(self) -> Any:
        def interrupt(signum: int, _: Any) -> None:
            self.stop.set()
            raise Interrupted(signal.Signals(signum).name)

        if threading.current_thread() is not threading.main_thread():
            return None
        return signal.signal(signal.SIGINT, interrupt), signal.signal(signal.SIGTERM, interrupt)

    def _restore_signal_handlers(self, previous: Any) -> None:
        if previous is not None:
            signal.signal(signal.SIGINT, previous[0])
            signal.signal(signal.SIGTERM, previous[1])

    # ----------------------------------------------------------------------------- target ----

    def _start_target(self) -> None:
        assert self.journal is not None
        spec = self.campaign.target
        self.journal.append_event(JournalEvent(EventKind.PHASE, "target:start", {"kind": spec.kind}))
        if spec.kind == "attach":
            self.target = attach(self.campaign, self.run_dir)
        else:
            self.stack = build_stack(self.campaign, self.run_dir, launcher_for(self.ray_address))
            self._say(f"starting the {spec.kind} target")
            self.stack.up()
            self.target = self.stack
        endpoints = self.target.endpoints
        self.journal.set_meta("target", {"kind": spec.kind, "router_url": endpoints.router_url,
                                         "workers": [{"role": w.role, "url": w.url} for w in endpoints.workers],
                                         "placement": self._placement()})
        info_path = dialect_of(self.target).server_info_path  # versions and flags, where the engine states them
        infos = {w.role: (_get_json(f"{w.url}{info_path}") or {}) for w in endpoints.workers} if info_path else {}
        environment = fingerprint(self.campaign.seed, infos)
        pool_report = getattr(self.stack, "pool_report", None)  # a launched SGLang stack: expected vs reported KV pool
        if pool_report:
            environment["pool_check"] = pool_report
        self.journal.set_meta("environment", environment)
        self.facts = discover_facts(endpoints.router_url, tuple(w.url for w in endpoints.workers))
        if self.facts.context_length is None and infos:
            self.facts = dataclasses.replace(self.facts, context_length=min(i.get("context_length") or 10**9 for i in infos.values()),
                                             max_total_num_tokens=min(i.get("max_total_num_tokens") or 10**12 for i in infos.values()),
                                             max_req_input_len=min(i.get("max_req_input_len") or 10**9 for i in infos.values()),
                                             api="sglang")
        self.api = self.facts.api
        self._say(f"target up: router {endpoints.router_url}")

    def _placement(self) -> dict[str, str]:
        """Where each role's processes run (this machine, or which Ray node)."""
        launcher = getattr(self.stack, "launcher", None)
        if launcher is None:
            return {}
        return {role: launcher.placement(role) for role in ("prefill", "decode", "router")}

    def _stop_target(self) -> None:
        if self.stack is not None:
            try:
                self.stack.down()
            except Exception:
                log.exception("stopping the target failed; `pdchaos heal %s` stops what is left", self.run_dir)

    # --------------------------------------------------------------------------- baseline ----

    def _baseline(self) -> None:
        assert self.journal is not None and self.target is not None
        j, endpoints = self.journal, self.target.endpoints
        j.append_event(JournalEvent(EventKind.PHASE, "baseline:start"))
        self._snapshot("idle_before", "before")
        self.probes = build_probes(self.codec, self.campaign.probes.count, self.facts.context_length, self.campaign.load.max_tokens)
        with httpx.Client(trust_env=False) as client:
            for _ in range(2):  # twice: a baseline that does not reproduce proves nothing
                for probe in self.probes:
                    if self.stop.is_set():
                        raise Interrupted("stop")
                    self._flush_caches(client)  # a reference must be computed cold, from its own prompt
                    j.append_request(send_probe(client, endpoints.router_url, probe, "baseline", self.api))
            if "tenant_isolation" in self.campaign.oracles.enabled:
                run_tenant_probe(client, endpoints.router_url, j, self.codec, TENANT_INDEX_BASE, self.api, stop=self.stop)
                if self.stop.is_set():
                    raise Interrupted("stop")
        j.flush()
        j.append_event(JournalEvent(EventKind.PHASE, "baseline:end", {"probes": len(self.probes)}))
        self._say(f"baseline: {len(self.probes)} reference probes recorded alone, twice each")

    def _flush_caches(self, client: httpx.Client) -> None:
        """Empty the prefix caches (SGLang's /flush_cache; refused while requests run, absent on
        some engines: either way the probe is still sent)."""
        assert self.target is not None
        path = dialect_of(self.target).flush_cache_path
        for worker in self.target.endpoints.workers if path else ():
            try:
                client.post(f"{worker.url}{path}", timeout=5.0)
            except httpx.HTTPError:
                pass

    def _snapshot(self, loads_phase: str, metrics_phase: str | None) -> None:
        assert self.journal is not None and self.target is not None
        for worker in self.target.endpoints.workers:
            data = _get_json(f"{worker.url}/v1/loads")
            if data is not None:
                self.journal.append_event(JournalEvent(EventKind.PROBE, "loads", {"role": worker.role, "phase": loads_phase, "data": data}))
            if metrics_phase:
                try:
                    text = httpx.get(f"{worker.url}/metrics", timeout=5.0, trust_env=False).text
                    self.journal.append_event(JournalEvent(EventKind.PROBE, "metrics", {"role": worker.role, "phase": metrics_phase, "text": text}))
                except httpx.HTTPError:
                    pass

    # ------------------------------------------------------------------- load with faults ----

    def _load_with_faults(self) -> None:
        assert self.journal is not None and self.target is not None
        load = self.campaign.load
        plan = LoadPlan(target_url=self.target.endpoints.router_url, facts=self.facts, profile=PROFILES[load.profile],
                        run_prefix=self.run_prefix, users=load.users, duration_s=load.duration_s, actors=load.actors,
                        shape=load.shape, max_tokens=load.max_tokens, seed=self.campaign.seed, phase="load",
                        index_base=PROBE_INDEX_LIMIT, stages=tuple((s.until_s, s.users) for s in load.stages))
        load_done, load_started = threading.Event(), threading.Event()
        started_at: list[float] = []

        def mark_started(t: float) -> None:
            started_at.append(t)
            load_started.set()

        fault_thread = threading.Thread(target=self._fault_schedule, args=(load_started, started_at, load_done), name="faults",
                                        daemon=True)
        helpers = [
            threading.Thread(target=self._replay_probes, args=(load_started, started_at, load_done), name="probes", daemon=True),
            threading.Thread(target=self._sample_pools, args=(load_done,), name="pools", daemon=True),
        ]
        for thread in (fault_thread, *helpers):
            thread.start()
        progress = terminal_progress(load.duration_s, self._live_status) if self.show_progress else None
        try:
            self.load_outcome = run_load(plan, self.run_dir, self.journal, ray_address=self.ray_address,
                                         progress=progress, on_started=mark_started, on_records=self._scan_live)
        finally:
            load_done.set()
            # A heal is bounded by its own timeouts (a vLLM restart: several minutes); the journal
            # must stay open until it is written, so the fault thread is waited for in full.
            fault_thread.join()
            for thread in helpers:
                thread.join(timeout=120)
            if self.show_progress:
                print(flush=True)
        if self.load_outcome.interrupted:
            raise Interrupted("load interrupted")

    def _scan_live(self, records: list[Any]) -> None:
        """Count leaks as records arrive, for the live line (the canary oracle judges later)."""
        for record in records:
            if record.response_text and self.codec.scan_others(record.response_text, record.request_index):
                self.leaks_so_far += 1

    def _live_status(self) -> str:
        return f"  fault {self.active_fault or '-'}  leaks so far {self.leaks_so_far}"

    def _fault_schedule(self, load_started: threading.Event, started_at: list[float], load_done: threading.Event) -> None:
        """Windows at their times after the load started; one at a time, each healed before the next."""
        while not load_started.wait(0.5):
            if self.stop.is_set() or load_done.is_set():
                return
        started = started_at[0]
        for n, window in enumerate(self.campaign.windows()):
            wait = started + window.at_s - time.time()
            if wait > 0 and (self.stop.wait(wait) or load_done.is_set()):
                return
            if self.stop.is_set() or load_done.is_set():
                return
            self._run_window(n, window)
            self._aftershock(window)

    def _run_window(self, n: int, window: WindowSpec) -> None:
        assert self.target is not None
        fault = build_fault(window.fault, window.params, f"faults.windows[{n}]")
        ctx = FaultContext(target=self.target, journal=self.journal, window_id=f"w{n + 1}")
        self._say(f"fault {window.fault} ({ctx.window_id}) for {window.duration_s:.0f}s")
        self.active_fault = f"{window.fault}#{ctx.window_id}"
        try:
            result = run_window(fault, ctx, window.duration_s, params=window.params, keep_going=lambda: not self.stop.is_set())
        finally:
            self.active_fault = None
        self.window_results.append(result)
        state = "confirmed" if result.confirmation.confirmed else "NOT confirmed"
        self._say(f"fault {window.fault} ({ctx.window_id}) healed; {state}: {result.confirmation.evidence}")

    def _aftershock(self, window: WindowSpec) -> None:
        """Replay every probe right after the heal: corruption can outlive its fault."""
        assert self.journal is not None and self.target is not None
        with httpx.Client(trust_env=False) as client:
            for probe in self.probes:
                if self.stop.is_set():
                    return
                self.journal.append_request(send_probe(client, self.target.endpoints.router_url, probe, "aftershock", self.api))

    def _replay_probes(self, load_started: threading.Event, started_at: list[float], load_done: threading.Event) -> None:
        """Probes at their interval through the load, except in its lulls: a lull is kept idle,
        as the liveness oracle's idle-moment check needs."""
        assert self.journal is not None and self.target is not None
        interval = self.campaign.probes.interval_s
        order = replay_order(self.probes)
        with httpx.Client(trust_env=False) as client:
            n = 0
            while not load_done.wait(interval) and not self.stop.is_set():
                if load_started.is_set() and self._in_lull(time.time() - started_at[0]):
                    continue
                probe = order[n % len(order)]
                self.journal.append_request(send_probe(client, self.target.endpoints.router_url, probe, "load", self.api))
                n += 1

    def _in_lull(self, t: float) -> bool:
        """Whether the load's shape has no users `t` seconds after it started."""
        load = self.campaign.load
        if load.shape != "stages":
            return False
        current = next((stage for stage in load.stages if t < stage.until_s), None)
        return current is not None and current.users == 0

    def _sample_pools(self, load_done: threading.Event) -> None:
        while not load_done.wait(POOL_SAMPLE_S) and not self.stop.is_set():
            self._snapshot("during", None)

    # ------------------------------------------------------------------------------ drain ----

    def _drain(self) -> None:
        """After the load: wait (bounded) for queues to empty and pools to return to idle."""
        assert self.journal is not None and self.target is not None
        self.journal.append_event(JournalEvent(EventKind.PHASE, "drain:start"))
        deadline = time.monotonic() + self.campaign.oracles.drain_timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            if all(_idle(_get_json(f"{w.url}/v1/loads")) for w in self.target.endpoints.workers):
                break
            time.sleep(0.5)
        self._snapshot("after_drain", "after")
        self.journal.append_event(JournalEvent(EventKind.PHASE, "drain:end"))

    # ------------------------------------------------------------------------------ judge ----

    def _judge(self, stopped_early: str | None) -> RunOutcome:
        assert self.journal is not None
        j = self.journal
        j.flush()
        j.append_event(JournalEvent(EventKind.PHASE, "oracles:start"))
        logs = {role: self.target.logs(role) for role in ("prefill", "decode", "router")} if self.target else {}
        ctx = OracleContext(journal=j, run_prefix=self.run_prefix, logs=logs,
                            settings=self.campaign.oracles.settings(self.campaign.gates))
        results: list[OracleResult] = []
        for name in self.campaign.oracles.enabled:
            try:
                results.append(ALL_ORACLES[name]().evaluate(ctx))
            except Exception as exc:  # an oracle that breaks proves nothing
                log.exception("oracle %s failed", name)
                results.append(OracleResult(name, Verdict.INCONCLUSIVE, notes=[f"the oracle raised {type(exc).__name__}: {exc}"]))
        results.append(self._preflight_result())
        for result in results:
            j.append_event(JournalEvent(EventKind.VERDICT, "oracle", _as_json(result)))
        gates = self._gates(ctx, stopped_early)
        interrupted = stopped_early is not None
        for finding in gates:
            j.append_event(JournalEvent(EventKind.VERDICT, "gate", _as_json(finding)))
        verdict = combine([r.verdict for r in results] + [g.verdict for g in gates])
        reasons = [_reason(r) for r in results if r.verdict is not Verdict.PASS] + [g.summary for g in gates]
        counts = {"total": 0, "ok": 0, "fail": 0, "info": 0}
        for record in j.iter_requests():
            counts["total"] += 1
            counts[record.outcome.value] += 1
        saturated = generator_saturated(self.load_outcome.cpu_samples(), compute(j.iter_requests(phase="load")).send_lag_s)
        j.append_event(JournalEvent(EventKind.VERDICT, "run", {"verdict": verdict.value, "exit_code": verdict.exit_code,
                                                       "reasons": reasons, "requests": counts,
                                                       "generator_saturated": saturated, "interrupted": interrupted}))
        return RunOutcome(self.run_dir, verdict, reasons, results, interrupted)

    def _preflight_result(self) -> OracleResult:
        """The incident's check, first-class: every node's pool must hold its context length."""
        if self.target is None or not self.target.endpoints.workers:
            return OracleResult("pool_preflight", Verdict.INCONCLUSIVE, notes=["no worker URLs to read"])
        report = run_preflight(PreflightInputs(logs=[], urls=[(w.role, w.url) for w in self.target.endpoints.workers]))
        findings = []
        for row in report.rows:
            status = row.status.value
            if status != "OK":
                findings.append(Finding("pool_preflight", Verdict.FAIL if status == "FAIL" else Verdict.INCONCLUSIVE,
                                        f"{row.name}: pool {row.pool_tokens} vs context {row.context_len}: {status} ({row.reason})"))
        return OracleResult.from_findings("pool_preflight", len(report.rows), findings)

    def _gates(self, ctx: OracleContext, stopped_early: str | None) -> list[Finding]:
        """Run-level reasons the oracles' silence may prove nothing."""
        gates: list[Finding] = []
        if stopped_early:
            gates.append(Finding("run", Verdict.INCONCLUSIVE, stopped_early))
        load = [r for r in ctx.requests if r.phase == "load"]
        for window in windows_from_events(ctx.journal.iter_events(kind="fault")):
            if self.campaign.gates.require_confirmed_faults and not window.confirmed:
                gates.append(Finding("gate", Verdict.INCONCLUSIVE, f"fault {window.label} was not confirmed: {window.confirm_evidence}",
                                     window=window.label))
            inside = sum(1 for r in load if _overlaps(r, window))
            if inside < self.campaign.gates.min_window_requests:
                gates.append(Finding("gate", Verdict.INCONCLUSIVE,
                                     f"fault {window.label} saw {inside} requests in flight, fewer than {self.campaign.gates.min_window_requests}",
                                     window=window.label))
        for result in self.window_results:
            if result.leftovers:
                gates.append(Finding("gate", Verdict.INCONCLUSIVE, f"heal of {result.fault} left: {'; '.join(result.leftovers)}"))
        stats = compute(load)
        if generator_saturated(self.load_outcome.cpu_samples(), stats.send_lag_s):
            gates.append(Finding("gate", Verdict.INCONCLUSIVE, "the load generator was saturated: it measured itself, not the target"))
        if not stopped_early and not load:
            gates.append(Finding("gate", Verdict.INCONCLUSIVE, "no load traffic was recorded"))
        return gates

    def _render_reports(self) -> None:
        try:
            from reports.render import render_all
        except ImportError:
            return
        try:
            render_all(self.run_dir, list(self.campaign.report.formats))
        except Exception:
            log.exception("rendering the reports failed; `pdchaos report %s` retries", self.run_dir)


def _reason(result: OracleResult) -> str:
    """One line per oracle that did not pass: how many findings, and the first of them."""
    bad = [f for f in result.findings if f.verdict is result.verdict] or result.findings
    if bad:
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        return f"{result.name} {result.verdict.value}: {bad[0].summary}{more}"
    note = result.notes[-1] if result.notes else "no evidence"
    return f"{result.name} {result.verdict.value}: {note}"


def _overlaps(record: Any, window: Any) -> bool:
    """The request was in flight while the fault was active (a stalled peer blocks new sends)."""
    if record.t_send is None or window.start is None:
        return False
    end = record.t_end if record.t_end is not None else record.t_send
    return end >= window.start and (window.end is None or record.t_send <= window.end)


def _get_json(url: str) -> dict[str, Any] | None:
    try:
        response = httpx.get(url, timeout=5.0, trust_env=False)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _idle(loads: dict[str, Any] | None) -> bool:
    if loads is None:
        return False
    queues = [v for k, v in loads.get("disaggregation", {}).items() if k.endswith("_reqs")]
    return not (loads.get("num_running_reqs") or loads.get("num_waiting_reqs") or any(queues)
                or loads.get("num_used_tokens") or loads.get("quarantined_tokens"))


def _as_json(value: Any) -> dict[str, Any]:
    return dataclasses.asdict(value)

