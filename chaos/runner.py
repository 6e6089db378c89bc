"""`pdchaos run`: one campaign from start to verdict.

validate -> start or attach the target -> preflight -> baseline (isolated reference probes) ->
load with the fault schedule, probe replays and aftershock probes -> drain -> oracles and gates
-> verdict -> reports. Everything lands in the journal first; the verdict and the reports are
computed from it. Ctrl-C (or SIGTERM) heals the active fault, stops the load and still writes
the report from what was journaled.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import traceback
import signal
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from chaos.campaign import Campaign, WindowSpec
from chaos.errors import TargetError, UsageError
from chaos.facts import parse_prometheus_text
from chaos.fingerprint import fingerprint
from chaos.journal import EventKind, Journal, JournalEvent, RequestRecord
from chaos.load import LoadPlan, LoadOutcome, run_load, terminal_progress
from chaos.loadstats import compute, generator_saturated, generator_saturation
from chaos.oracles.base import OracleContext
from chaos.oracles.canary import MarkerCodec, new_run_prefix
from chaos.oracles.liveness import HELD_BACK, TOKEN_KEYS, busy, loads_ranks, queue_counts
from chaos.oracles.registry import ALL_ORACLES
from chaos.preflight import PreflightInputs, run_preflight
from chaos.probes import ADAPTERS, Probe, build_probes, chars_per_token, reader_order, replay_order, send_probe
from chaos.targets.dialect import dialect_of
from chaos.targets.factory import attach, build_stack, launcher_for
from chaos.targets.base import Target
from chaos.targets.discovery import discover_facts, served_adapters
from chaos.tenant_probe import run_tenant_probe
from chaos.verdict import Finding, OracleResult, Verdict, combine
from chaos.windows import windows_from_events
from faults.base import FaultContext
from faults.provoke import KIND_PROVOCATION, Provoker, split_params
from faults.traffic import KIND_ABORT, KIND_OVER_LENGTH
from faults.registry import build_fault
from faults.window import run_window
from loadprofiles.clock import ScheduleClock
from loadprofiles.profiles import PROFILES

log = logging.getLogger("pdchaos.runner")

PROBE_INDEX_LIMIT = 10_000  # load traffic numbers its requests from here on
TENANT_INDEX_BASE = 5_000  # the tenant probe's requests, between the reference probes and the load
SIZING_INDEX = TENANT_INDEX_BASE - 1  # the one request that sizes the probes
EXPOSED_KINDS = (KIND_PROVOCATION, KIND_ABORT, KIND_OVER_LENGTH)  # besides the load, traffic a window's fault acts on
POOL_SAMPLE_S = 0.5  # often enough that a lull of a few seconds yields two idle samples
AFTERSHOCK_PARALLEL = 8
HOLD_WORTH_NOTING_S = 1.0  # the schedule clock stood still this long for a window: journaled and said


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
        self.adapters: tuple[str, ...] | None = None  # LoRA adapters the workers serve; None: they do not say
        self.load_outcome = LoadOutcome()
        self.window_results: list[Any] = []
        self.active_fault: str | None = None
        self.leaks_so_far = 0
        # The progress watchdog: when the target last answered, and whether it stopped answering.
        self.last_answer = time.time()
        self.quiet_since_window = time.time()
        self.wedged = threading.Event()
        self.clock = ScheduleClock()  # the load's, made with its first barrier when the load starts

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
        self.adapters = served_adapters(infos)
        self.facts = discover_facts(endpoints.router_url, tuple(w.url for w in endpoints.workers))
        if self.facts.context_length is None and infos:
            # A router that states no limits (sglang-router has no /v1/models or /server_info):
            # the tightest each worker states, or None where none does.
            workers = [discover_facts(w.url) for w in endpoints.workers]
            self.facts = dataclasses.replace(self.facts, context_length=_least(f.context_length for f in workers),
                                             max_total_num_tokens=_least(f.max_total_num_tokens for f in workers),
                                             max_req_input_len=_least(f.max_req_input_len for f in workers),
                                             api="sglang")
        self.api = self.facts.api
        self.journal.set_meta("limits", {"context_length": self.facts.context_length,
                                         "max_total_num_tokens": self.facts.max_total_num_tokens,
                                         "max_req_input_len": self.facts.max_req_input_len})
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
        with httpx.Client(trust_env=False) as client:
            per_token, sizing = chars_per_token(client, endpoints.router_url, self.api, SIZING_INDEX,
                                              model=self.facts.model)
            j.append_request(sizing)
            adapters = ADAPTERS if self.adapters is None else self.adapters
            self.probes = build_probes(self.codec, self.campaign.probes.count, self.facts.context_length,
                                       self.campaign.load.max_tokens, adapters=adapters, chars_per_token=per_token)
            j.set_meta("probes", {"chars_per_token": round(per_token, 3), "adapters": list(adapters)})
            for _ in range(2):  # twice: a baseline that does not reproduce proves nothing
                for probe in self.probes:
                    if self.stop.is_set():
                        raise Interrupted("stop")
                    self._flush_caches(client)  # a reference must be computed cold, from its own prompt
                    j.append_request(send_probe(client, endpoints.router_url, probe, "baseline", self.api,
                                                model=self.facts.model))
            if "tenant_isolation" in self.campaign.oracles.enabled:
                run_tenant_probe(client, endpoints.router_url, j, self.codec, TENANT_INDEX_BASE, self.api,
                                 model=self.facts.model, stop=self.stop)
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

    def _snapshot(self, loads_phase: str, metrics_phase: str | None) -> dict[str, Any]:
        """Journal every worker's `/v1/loads` (and `/metrics`); returns the loads by role."""
        assert self.journal is not None and self.target is not None
        taken: dict[str, Any] = {}
        for worker in self.target.endpoints.workers:
            data = _get_json(f"{worker.url}/v1/loads")
            if data is not None:
                taken[worker.role] = data
                sample: dict[str, Any] = {"role": worker.role, "phase": loads_phase, "data": data}
                if loads_phase != "idle_before" and not _queued(data) and (held := self._held_back(worker.url)):
                    sample[HELD_BACK] = held
                self.journal.append_event(JournalEvent(EventKind.PROBE, "loads", sample))
            if metrics_phase:
                try:
                    text = httpx.get(f"{worker.url}/metrics", timeout=5.0, trust_env=False).text
                    self.journal.append_event(JournalEvent(EventKind.PROBE, "metrics", {"role": worker.role, "phase": metrics_phase, "text": text}))
                except httpx.HTTPError:
                    pass
        return taken

    # ------------------------------------------------------------------- load with faults ----

    def _load_with_faults(self) -> None:
        assert self.journal is not None and self.target is not None
        load = self.campaign.load
        plan = LoadPlan(target_url=self.target.endpoints.router_url, facts=self.facts, profile=PROFILES[load.profile],
                        run_prefix=self.run_prefix, users=load.users, duration_s=load.duration_s, actors=load.actors,
                        shape=load.shape, max_tokens=load.max_tokens, seed=self.campaign.seed, phase="load",
                        index_base=PROBE_INDEX_LIMIT, stages=tuple((s.until_s, s.users) for s in load.stages))
        load_done, load_started = threading.Event(), threading.Event()
        windows = self.campaign.windows()
        self.clock = ScheduleClock(barrier_s=windows[0].at_s if windows else None)
        fault_thread = threading.Thread(target=self._fault_schedule, args=(windows, load_started, load_done), name="faults",
                                        daemon=True)
        helpers = [
            threading.Thread(target=self._replay_probes, args=(load_started, load_done), name="probes", daemon=True),
            threading.Thread(target=self._sample_pools, args=(load_done, load_started), name="pools", daemon=True),
        ]
        for thread in (fault_thread, *helpers):
            thread.start()
        progress = terminal_progress(load.duration_s, self._live_status) if self.show_progress else None
        try:
            self.load_outcome = run_load(plan, self.run_dir, self.journal, ray_address=self.ray_address,
                                         progress=progress, on_started=lambda _: load_started.set(), on_records=self._scan_live,
                                         clock=self.clock, cut_short=self.wedged)
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
            self._note_progress(record)
            if record.response_text and self.codec.scan_others(record.response_text, record.request_index):
                self.leaks_so_far += 1

    def _live_status(self) -> str:
        return f"  fault {self.active_fault or '-'}  leaks so far {self.leaks_so_far}"

    def _fault_schedule(self, windows: list[WindowSpec], load_started: threading.Event, load_done: threading.Event) -> None:
        """Windows at their schedule times; one at a time, each healed before the next. The
        schedule clock stands still where the faults are behind (`_hold_point`), so the load's
        stages (a lull around a flush) stay where the campaign put them."""
        clock = self.clock
        provoker: Provoker | None = None
        try:
            while not load_started.wait(0.5):
                if self.stop.is_set() or load_done.is_set():
                    return
            for n, window in enumerate(windows):
                wait = clock.wall_until(window.at_s)
                if wait > 0 and (self.stop.wait(wait) or load_done.is_set()):
                    return
                if provoker is not None:
                    provoker.join()  # one window's traffic at a time: findings name their window
                if self.stop.is_set() or load_done.is_set() or self.wedged.is_set():
                    return
                next_at = windows[n + 1].at_s if n + 1 < len(windows) else None
                late = clock.hold_at(self._hold_point(window, next_at))
                provoker = self._run_window(n, window)
                self._aftershock(window)  # while the provocation's after-heal waves still run
                over = clock.hold_at(next_at)
                self._journal_hold(f"w{n + 1}", late, over)
        finally:
            # However the schedule ends (the last window, a wedged target, a stop), nothing holds
            # the load any longer: it runs out its stages.
            clock.hold_at(None)
            if provoker is not None:
                provoker.join()

    def _hold_point(self, window: WindowSpec, next_at: float | None) -> float | None:
        """Where the clock waits while `window` runs: the next window's start, or the first stage
        boundary at or after the window's planned end (the lull after the aborts, the load's end)
        if that comes first. A window's heal and aftershock may overrun into the quiet time the
        campaign left after it; they never carry it into a stage meant to follow them."""
        load = self.campaign.load
        ends = [s.until_s for s in load.stages] if load.shape == "stages" else []
        planned_end = window.at_s + window.duration_s
        boundaries = [t for t in (*ends, load.duration_s) if t >= planned_end]
        points = [t for t in (next_at, min(boundaries, default=None)) if t is not None]
        return min(points, default=None)

    def _journal_hold(self, window_id: str, late_s: float, over_s: float) -> None:
        """What the schedule clock stood still for, when it is worth a line: a start held back by
        the previous window's traffic, or the window's heal and aftershock past its hold point."""
        assert self.journal is not None
        if late_s + over_s < HOLD_WORTH_NOTING_S:
            return
        self.journal.append_event(JournalEvent(EventKind.PHASE, "schedule:held", {
            "window": window_id, "late_start_s": round(late_s, 1), "overrun_s": round(over_s, 1),
            "total_held_s": round(self.clock.held_s(), 1)}))
        self._say(f"schedule held {late_s + over_s:.1f} s for {window_id} (started {late_s:.1f} s late, "
                  f"ran {over_s:.1f} s past its hold point); the load's stages wait with it")

    def _run_window(self, n: int, window: WindowSpec) -> Provoker:
        assert self.target is not None
        fault = build_fault(window.fault, window.params, f"faults.windows[{n}]")
        _, provoke = split_params(window.params, f"faults.windows[{n}].params")
        provoker = Provoker(window.fault, provoke, request_timeout_s=self.campaign.oracles.request_deadline_s + 1.0,
                            lingers_s=fault.lingers_s(), replay_probe=self._probe_replayer())
        ctx = FaultContext(target=self.target, journal=self.journal, window_id=f"w{n + 1}")
        self._say(f"fault {window.fault} ({ctx.window_id}) for {window.duration_s:.0f}s")
        self.active_fault = f"{window.fault}#{ctx.window_id}"
        try:
            result = run_window(fault, ctx, window.duration_s, params=window.params, keep_going=lambda: not self.stop.is_set(),
                                provoker=provoker)
        finally:
            self.active_fault = None
            self.quiet_since_window = time.time()
        self.window_results.append(result)
        state = "confirmed" if result.confirmation.confirmed else "NOT confirmed"
        self._say(f"fault {window.fault} ({ctx.window_id}) healed; {state}: {result.confirmation.evidence}")
        return provoker

    def _send_probe(self, client: httpx.Client, probe: Probe, phase: str) -> RequestRecord:
        assert self.target is not None
        return send_probe(client, self.target.endpoints.router_url, probe, phase, self.api,
                          timeout_s=self.campaign.probes.timeout_s, model=self.facts.model)

    def _record_probe(self, record: RequestRecord) -> None:
        assert self.journal is not None
        self.journal.append_request(record)
        self._note_progress(record)

    def _probe_replayer(self) -> Callable[[], None] | None:
        """Sends the next reference probe now and journals it: the provocation's reuse waves carry
        one each, so pages a fault freed also go to requests whose right answer is known (the
        longer probes: `reader_order`)."""
        if not self.probes:
            return None
        order, count = reader_order(self.probes), itertools.count()

        def replay() -> None:
            probe = order[next(count) % len(order)]
            try:
                with httpx.Client(trust_env=False) as client:
                    self._record_probe(self._send_probe(client, probe, "provocation"))
            except Exception:  # a probe the run can no longer journal (it is ending) proves nothing
                log.debug("reference probe of a provocation not journaled", exc_info=True)

        return replay

    def _aftershock(self, window: WindowSpec) -> None:
        """Replay every probe right after the heal, all at once: corruption can outlive its fault,
        and probes one after another would push the next window back by a round trip each."""
        assert self.journal is not None and self.target is not None
        if self.stop.is_set() or self.wedged.is_set() or not self.probes:
            return
        with httpx.Client(trust_env=False, limits=httpx.Limits(max_connections=len(self.probes))) as client, \
                ThreadPoolExecutor(max_workers=min(len(self.probes), AFTERSHOCK_PARALLEL), thread_name_prefix="aftershock") as pool:
            records = list(pool.map(lambda probe: self._send_probe(client, probe, "aftershock"), self.probes))
        for record in records:
            self._record_probe(record)
        unanswered = sum(1 for r in records if r.status is None)
        if unanswered:
            self._say(f"aftershock probes after {window.fault}: {unanswered} of {len(records)} got no answer "
                      f"in {self.campaign.probes.timeout_s:.0f} s")

    def _replay_probes(self, load_started: threading.Event, load_done: threading.Event) -> None:
        """Probes at their interval through the load, except in its lulls: a lull is kept idle,
        as the liveness oracle's idle-moment check needs."""
        assert self.journal is not None and self.target is not None
        interval = self.campaign.probes.interval_s
        order = replay_order(self.probes)
        with httpx.Client(trust_env=False) as client:
            n = 0
            while not load_done.wait(interval) and not self.stop.is_set() and not self.wedged.is_set():
                if load_started.is_set() and self._in_lull(self.clock.now()):
                    continue
                self._record_probe(self._send_probe(client, order[n % len(order)], "load"))
                n += 1

    def _in_lull(self, t: float) -> bool:
        """Whether the load's shape has no users at schedule time `t`."""
        load = self.campaign.load
        if load.shape != "stages":
            return False
        current = next((stage for stage in load.stages if t < stage.until_s), None)
        return current is not None and current.users == 0

    def _sample_pools(self, load_done: threading.Event, load_started: threading.Event) -> None:
        while not load_done.wait(POOL_SAMPLE_S) and not self.stop.is_set():
            loads = self._snapshot("during", None)
            if load_started.is_set() and not self.wedged.is_set():
                self._watch_progress(loads, self.clock.now())

    def _note_progress(self, record: Any) -> None:
        """Progress is a request that generated something: a front end that still rejects
        over-length prompts with 400 while decode is stuck makes none."""
        if record.status == 200 and (record.completion_tokens or record.token_times) and record.t_end is not None:
            self.last_answer = max(self.last_answer, record.t_end)

    def _watch_progress(self, loads: dict[str, Any], t: float) -> None:
        """A target that stops answering while requests queue is wedged: that is evidence (the
        liveness oracle judges it), and waiting out every timeout after it would only delay the
        verdict. Fault windows and lulls are not counted: answers may stop there on purpose."""
        after = self.campaign.gates.wedged_after_s
        if after <= 0 or self.active_fault is not None or self._in_lull(t):
            return
        quiet = time.time() - max(self.last_answer, self.quiet_since_window)
        queued = {role: n for role, data in loads.items() if (n := _queued(data))}
        if quiet < after or not queued:
            return
        assert self.journal is not None
        self.journal.append_event(JournalEvent(EventKind.PROBE, "wedged", {
            "quiet_s": round(quiet, 1), "queued": queued, "loads": loads}))
        self.wedged.set()
        self._say(f"the target stopped making progress: nothing generated for {quiet:.0f} s with requests queued ({queued}); "
                  "no further load, faults or probes: judging now")

    def _held_back(self, url: str) -> float:
        """Requests whose pages the engine holds back on purpose, counted only in `/metrics`
        (the dialect's `held_back_metrics`); 0 when it names none or does not answer."""
        assert self.target is not None
        names = set(dialect_of(self.target).held_back_metrics)
        if not names:
            return 0.0
        try:
            text = httpx.get(f"{url}/metrics", timeout=2.0, trust_env=False).text
        except httpx.HTTPError:
            return 0.0
        return sum(s.value for s in parse_prometheus_text(text) if s.name in names)

    # ------------------------------------------------------------------------------ drain ----

    def _drain(self) -> None:
        """After the load: wait (bounded) for queues to empty and pools to return to idle."""
        assert self.journal is not None and self.target is not None
        self.journal.append_event(JournalEvent(EventKind.PHASE, "drain:start"))
        deadline = time.monotonic() + self.campaign.oracles.drain_timeout_s
        while time.monotonic() < deadline and not self.stop.is_set() and not self.wedged.is_set():
            if all(_idle(_get_json(f"{w.url}/v1/loads")) and not self._held_back(w.url) for w in self.target.endpoints.workers):
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
        if self.campaign.oracles.pool_preflight:
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
        # A window's own provocation, and a traffic fault's own requests (the over-length prompts,
        # the aborted ones), are exposed to its fault as the load is; its calibration is not.
        exposed = [r for r in ctx.requests if r.phase == "load" or r.user_kind in EXPOSED_KINDS]
        windows = windows_from_events(ctx.journal.iter_events(kind="fault"))
        planned = len(self.campaign.windows())
        if not stopped_early and len(windows) < planned:
            why = ("the target was wedged (see liveness)" if any(True for _ in ctx.snapshots("wedged"))
                   else "the load ended first (lengthen load.duration or space the windows out)")
            gates.append(Finding("gate", Verdict.INCONCLUSIVE, f"{planned - len(windows)} of {planned} planned fault windows never ran: {why}"))
        for window in windows:
            if self.campaign.gates.require_confirmed_faults and not window.confirmed:
                gates.append(Finding("gate", Verdict.INCONCLUSIVE, f"fault {window.label} was not confirmed: {window.confirm_evidence}",
                                     window=window.label))
            inside = sum(1 for r in exposed if _overlaps(r, window))
            if inside < self.campaign.gates.min_window_requests:
                gates.append(Finding("gate", Verdict.INCONCLUSIVE,
                                     f"fault {window.label} saw {inside} requests in flight, fewer than {self.campaign.gates.min_window_requests}",
                                     window=window.label))
        for result in self.window_results:
            if result.leftovers:
                gates.append(Finding("gate", Verdict.INCONCLUSIVE, f"heal of {result.fault} left: {'; '.join(result.leftovers)}"))
        stats = compute(load)
        if saturation := generator_saturation(self.load_outcome.cpu_samples(), stats.send_lag_s):
            gates.append(Finding("gate", Verdict.INCONCLUSIVE, f"the load generator was saturated ({saturation}): it measured itself, not the target"))
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


def _least(values: Iterable[int | None]) -> int | None:
    stated = [v for v in values if v is not None]
    return min(stated) if stated else None


def _queued(loads: Any) -> int:
    """Requests a worker holds in any queue (running, waiting, or a disaggregation queue)."""
    return int(sum(sum(queue_counts(rank).values()) for rank in loads_ranks(loads)))


def _idle(loads: Any) -> bool:
    """Every rank of a `/v1/loads` answer has no request queued or in a forward pass and no
    pages in use (an unreadable answer is not idle: the drain waits it out)."""
    ranks = loads_ranks(loads)
    return bool(ranks) and not any(busy(rank) or any(rank.get(k) for k in TOKEN_KEYS) for rank in ranks)


def _as_json(value: Any) -> dict[str, Any]:
    return dataclasses.asdict(value)

