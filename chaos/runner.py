"""`pdchaos run`: one campaign from start to verdict.

validate -> start or attach the target -> pool preflight -> baseline (isolated reference probes)
-> load with the fault schedule (chaos/fault_schedule.py), probe replays and aftershock probes
(chaos/probe_traffic.py), pool sampling and the progress watchdog (chaos/pools.py,
chaos/watchdog.py) -> drain -> judge (chaos/judging/) -> reports. Everything lands in the journal
first; the verdict and the reports are computed from it alone. Ctrl-C, SIGTERM or SIGHUP heals
the active fault, stops the load and still judges and reports what was journaled
(chaos/stop_signals.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from chaos import transport
from chaos.campaign import Campaign
from chaos.errors import TargetError, UsageError
from chaos.fault_schedule import FaultSchedule, span_needed_s
from chaos.fingerprint import fingerprint
from chaos.journal import EventKind, Journal, JournalEvent, RequestRecord
from chaos.judging.judge import judge, record_judgement
from chaos.limits import tightest
from chaos.load import LoadPlan, run_load, terminal_progress
from chaos.markers import MarkerCodec, new_run_prefix
from chaos.pools import PoolReader
from chaos.preflight import PreflightInputs, run_preflight
from chaos.probe_traffic import ProbeTraffic
from chaos.probes import (
    ADAPTERS,
    ASSUMED_CONTEXT_TOKENS,
    Probe,
    build_probes,
    build_span_probe,
    chars_per_token,
    isolated_itl,
    send_probe,
    span_tokens,
)
from chaos.run_evidence import journal_judging, journal_logs, journal_pool_preflight, journal_stopped
from chaos.stop_signals import Interrupted, StopSignals
from chaos.targets.base import Stack, Target
from chaos.targets.dialect import get_json
from chaos.targets.discovery import discover_facts, served_adapters
from chaos.targets.factory import attach, build_stack, launcher_for
from chaos.tenant_probe import run_tenant_probe
from chaos.verdict import OracleResult, Verdict
from chaos.watchdog import ProgressWatchdog
from loadprofiles.clock import ScheduleClock
from loadprofiles.profiles import PROFILES

log = logging.getLogger("pdchaos.runner")

PROBE_INDEX_LIMIT = 10_000  # load traffic numbers its requests from here on
TENANT_INDEX_BASE = 5_000  # the tenant probe's requests, between the reference probes and the load
SIZING_INDEX = TENANT_INDEX_BASE - 1  # the one request that sizes the probes
SPAN_FALLBACK_ITL_S = 0.02  # the span probe's pace when no baseline timed one (a GPU engine's order)
SPAN_ROOM_MARGIN = 16  # tokens kept free of the context besides the span probe's prompt
POOL_SAMPLE_S = 0.5  # often enough that a lull of a few seconds yields two idle samples
SERVER_INFO_TIMEOUT_S = 5.0


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
    def __init__(
        self, campaign: Campaign, run_dir: Path, ray_address: str | None = None, progress: bool = True
    ) -> None:
        self.campaign = campaign
        self.run_dir = run_dir
        self.ray_address = ray_address
        self.show_progress = progress
        self.stop = threading.Event()
        self.signals: StopSignals | None = None  # while the run runs
        self.run_prefix = new_run_prefix()
        self.codec = MarkerCodec(self.run_prefix)
        self.target: Target | None = None
        self.stack: Stack | None = None  # the target, when the suite launched it
        self.journal: Journal | None = None
        self.pools: PoolReader | None = None  # once the target is up
        self.watchdog: ProgressWatchdog | None = None  # once the journal is open
        self.schedule: FaultSchedule | None = None  # once the load starts
        self.probes: list[Probe] = []
        self.span_probe: Probe | None = None
        self.api = "sglang"
        self.adapters: tuple[str, ...] | None = None  # LoRA adapters the workers serve; None: they do not say
        self.leaks_so_far = 0
        self.clock = ScheduleClock()  # the load's, made with its first barrier when the load starts

    # --------------------------------------------------------------------------- the flow ----

    def run(self) -> RunOutcome:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "campaign.yaml").write_text(
            yaml.safe_dump(self.campaign.model_dump(mode="json"), sort_keys=False)
        )
        self.journal = Journal.create(self.run_dir)
        self.watchdog = ProgressWatchdog(self.journal, self.campaign.gates.wedged_after_s, self._say)
        self._meta()
        with StopSignals(self.stop, self._say) as signals:
            self.signals = signals
            try:
                self._say(f"run directory {self.run_dir}")
                self._start_target()
                self._pool_preflight()
                self._baseline()
                self._load_with_faults()
                self._drain()
            except (Interrupted, KeyboardInterrupt):
                self._interrupted()
            except (UsageError, TargetError):
                raise  # a setup problem: the CLI names it (exit 2); the journal still gets its verdict below
            except Exception as exc:
                # A signal's `Interrupted` raised inside Ray's C code comes back wrapped (a SystemError)
                # or lost; only a signal sets the stop event.
                if _caused_by_a_stop(exc) or self.stop.is_set():
                    self._interrupted()
                else:  # the suite's own machinery broke (e.g. Ray lost a node): no verdict on the target
                    self._suite_failed(exc)
            finally:
                signals.disarm()  # from here a signal only hurries: judging and stopping the stack finish
                outcome = self._judge()
                self._stop_target()
                self.journal.set_meta("ended_at", time.time())
                self.journal.close()
                self._render_reports()
                self._scrub_secrets()
        return outcome

    def _interrupted(self) -> None:
        assert self.journal is not None
        journal_stopped(self.journal, "the run was interrupted before it finished")
        self.stop.set()
        self._say("interrupted: healing and writing the report from the journal")

    def _suite_failed(self, exc: Exception) -> None:
        """Called in the `except` block: the traceback is the one being handled."""
        assert self.journal is not None
        (self.run_dir / "error.log").write_text(traceback.format_exc())
        stopped = f"the run stopped early, the suite failed: {type(exc).__name__}: {exc} (traceback in error.log)"
        journal_stopped(self.journal, stopped)
        self.stop.set()
        self._say(f"{stopped}; healing and writing the report from the journal")

    def _scrub_secrets(self) -> None:
        """The last guard: no byte of a key stays in the run directory, whatever echoed it."""
        if transport.current().has_secrets:
            for path in transport.scrub_tree(self.run_dir):
                self._say(f"removed a secret echoed into {path.relative_to(self.run_dir)}")

    def _say(self, text: str) -> None:
        if self.show_progress:
            with contextlib.suppress(OSError):  # a closed terminal (SIGHUP) must not stop the heal
                print(f"[pdchaos] {text}", flush=True)

    def _meta(self) -> None:
        assert self.journal is not None
        j = self.journal
        j.set_meta("campaign", self.campaign.model_dump(mode="json"))
        j.set_meta("campaign_yaml", (self.run_dir / "campaign.yaml").read_text())
        j.set_meta("seed", self.campaign.seed)
        j.set_meta("run_prefix", self.run_prefix)
        j.set_meta("started_at", time.time())
        j.set_meta(
            "windows_planned",
            [
                {"fault": w.fault, "at_s": w.at_s, "duration_s": w.duration_s, "params": w.params}
                for w in self.campaign.windows()
            ],
        )

    # ----------------------------------------------------------------------------- target ----

    def _start_target(self) -> None:
        assert self.journal is not None
        spec = self.campaign.target
        transport.configure(spec.transport())
        transport.current().check_variables()  # an unset key variable stops the run before anything starts
        self.journal.append_event(JournalEvent(EventKind.PHASE, "target:start", {"kind": spec.kind}))
        if spec.kind == "attach":
            self.target = attach(self.campaign, self.run_dir)
        else:
            stack = self.stack = build_stack(self.campaign, self.run_dir, launcher_for(self.ray_address))
            self._say(f"starting the {spec.kind} target")
            stack.up()
            self.target = stack
        endpoints = self.target.endpoints
        transport.configure(spec.transport().with_workers(w.url for w in endpoints.workers))
        for url in (endpoints.router_url, *(w.url for w in endpoints.workers)):
            transport.check_access(url)  # 401/403: exit 2 naming the variable, before any load
        self.journal.set_meta(
            "target",
            {
                "kind": spec.kind,
                "router_url": endpoints.router_url,
                "workers": [{"role": w.role, "url": w.url} for w in endpoints.workers],
                "placement": self._placement(),
            },
        )
        info_path = self.target.dialect.server_info_path  # versions and flags, where the engine states them
        infos: dict[str, dict[str, Any]] = (
            {
                w.role: (get_json(f"{w.url}{info_path}", timeout_s=SERVER_INFO_TIMEOUT_S) or {})
                for w in endpoints.workers
            }
            if info_path
            else {}
        )
        environment = fingerprint(self.campaign.seed, infos)
        if self.stack is not None and self.stack.pool_report:  # expected vs reported KV pool, where the stack set one
            environment["pool_check"] = self.stack.pool_report
        self.journal.set_meta("environment", environment)
        self.adapters = served_adapters(infos)
        self.facts = discover_facts(endpoints.router_url, tuple(w.url for w in endpoints.workers))
        if self.facts.context_length is None and infos:
            # A router that states no limits (sglang-router has no /v1/models or /server_info):
            # the tightest each worker states, or None where none does.
            least = tightest(discover_facts(w.url) for w in endpoints.workers)
            self.facts = dataclasses.replace(
                self.facts,
                context_length=least.context_length,
                max_total_num_tokens=least.max_total_num_tokens,
                max_req_input_len=least.max_req_input_len,
                api="sglang",
            )
        self.api = self.facts.api
        self.journal.set_meta(
            "limits",
            {
                "context_length": self.facts.context_length,
                "max_total_num_tokens": self.facts.max_total_num_tokens,
                "max_req_input_len": self.facts.max_req_input_len,
            },
        )
        self.pools = PoolReader(self.target, self.journal)
        self._say(f"target up: router {endpoints.router_url}")

    def _pool_preflight(self) -> None:
        """The incident's check, first: every worker's KV pool must hold its context length. Read
        before any load, as the target started; the judge reads the journaled report."""
        assert self.journal is not None and self.target is not None
        if not self.campaign.oracles.pool_preflight:
            return
        report = run_preflight(PreflightInputs(urls=[(w.role, w.url) for w in self.target.endpoints.workers]))
        journal_pool_preflight(self.journal, report.to_dict())

    def _placement(self) -> dict[str, str]:
        """Where each role's processes run (this machine, or which Ray node)."""
        if self.stack is None:
            return {}
        return {role: self.stack.launcher.placement(role) for role in ("prefill", "decode", "router")}

    def _stop_target(self) -> None:
        if self.stack is not None:
            try:
                self.stack.down()
            except Exception:
                log.exception("stopping the target failed; `pdchaos heal %s` stops what is left", self.run_dir)

    # --------------------------------------------------------------------------- baseline ----

    def _baseline(self) -> None:
        assert self.journal is not None and self.target is not None and self.pools is not None
        j, endpoints = self.journal, self.target.endpoints
        j.append_event(JournalEvent(EventKind.PHASE, "baseline:start"))
        self.pools.snapshot("idle_before", "before")
        with transport.client(trust_env=False) as client:
            per_token, sizing = chars_per_token(
                client, endpoints.router_url, self.api, SIZING_INDEX, model=self.facts.model
            )
            j.append_request(sizing)
            adapters = ADAPTERS if self.adapters is None else self.adapters
            self.probes = build_probes(
                self.codec,
                self.campaign.probes.count,
                self.facts.context_length,
                self.campaign.load.max_tokens,
                adapters=adapters,
                chars_per_token=per_token,
            )
            baselines = self._record_baselines(client, self.probes)
            self.span_probe = self._span_probe(baselines)
            if self.span_probe is not None:
                self._record_baselines(client, [self.span_probe], timeout_s=self.campaign.oracles.past_deadline_s)
            j.set_meta(
                "probes",
                {
                    "chars_per_token": round(per_token, 3),
                    "adapters": list(adapters),
                    "span_tokens": self.span_probe.max_tokens if self.span_probe else None,
                },
            )
            if "tenant_isolation" in self.campaign.oracles.enabled:
                run_tenant_probe(
                    client,
                    endpoints.router_url,
                    j,
                    self.codec,
                    TENANT_INDEX_BASE,
                    self.api,
                    model=self.facts.model,
                    stop=self.stop,
                )
                if self.stop.is_set():
                    raise Interrupted("stop")
        j.flush()
        j.append_event(JournalEvent(EventKind.PHASE, "baseline:end", {"probes": len(self.probes)}))
        span = " and the span probe" if self.span_probe else ""
        self._say(f"baseline: {len(self.probes)} reference probes{span} recorded alone, twice each")

    def _record_baselines(
        self, client: httpx.Client, probes: list[Probe], timeout_s: float = 60.0
    ) -> list[RequestRecord]:
        """Each probe alone, twice (a baseline that does not reproduce proves nothing), journaled."""
        assert self.journal is not None and self.target is not None
        records = []
        for _ in range(2):
            for probe in probes:
                if self.stop.is_set():
                    raise Interrupted("stop")
                self._flush_caches(client)  # a reference must be computed cold, from its own prompt
                record = send_probe(
                    client,
                    self.target.endpoints.router_url,
                    probe,
                    "baseline",
                    self.api,
                    timeout_s=timeout_s,
                    model=self.facts.model,
                )
                self.journal.append_request(record)
                records.append(record)
        return records

    def _span_probe(self, baselines: list[RequestRecord]) -> Probe | None:
        """The span probe, sized to decode through the longest window that holds one at the
        probes' isolated pace; None when no window does (faults/provoke.py, `span`)."""
        span_s = span_needed_s(self.campaign)
        if span_s <= 0:
            return None
        itl_s = isolated_itl(baselines) or SPAN_FALLBACK_ITL_S
        probe = build_span_probe(self.codec, self.campaign.probes.count, 1)
        context = self.facts.context_length or ASSUMED_CONTEXT_TOKENS
        pool = self.facts.max_total_num_tokens or context
        # Room for the prompt (estimated generously), and never more than half the pool: the
        # load must still find pages while it decodes.
        room = min(context - len(probe.prompt) // 2 - SPAN_ROOM_MARGIN, pool // 2)
        tokens = span_tokens(span_s, itl_s, max(1, room))
        self._say(
            f"span probe: {tokens} tokens, to decode {span_s:.0f} s at the isolated {itl_s * 1000:.1f} ms a token"
        )
        return dataclasses.replace(probe, max_tokens=tokens)

    def _flush_caches(self, client: httpx.Client) -> None:
        """Empty the prefix caches (SGLang's /flush_cache; refused while requests run, absent on
        some engines: either way the probe is still sent)."""
        assert self.target is not None
        path = self.target.dialect.flush_cache_path
        for worker in self.target.endpoints.workers if path else ():
            with contextlib.suppress(httpx.HTTPError):
                client.post(f"{worker.url}{path}", timeout=5.0)

    # ------------------------------------------------------------------- load with faults ----

    def _load_with_faults(self) -> None:
        assert self.journal is not None and self.target is not None and self.watchdog is not None
        load = self.campaign.load
        plan = LoadPlan(
            target_url=self.target.endpoints.router_url,
            facts=self.facts,
            profile=PROFILES[load.profile],
            run_prefix=self.run_prefix,
            users=load.users,
            duration_s=load.duration_s,
            actors=load.actors,
            shape=load.shape,
            max_tokens=load.max_tokens,
            seed=self.campaign.seed,
            phase="load",
            index_base=PROBE_INDEX_LIMIT,
            stages=tuple((s.until_s, s.users) for s in load.stages),
        )
        load_done, load_started = threading.Event(), threading.Event()
        wedged = self.watchdog.wedged
        windows = self.campaign.windows()
        self.clock = ScheduleClock(barrier_s=windows[0].at_s if windows else None)
        probes = ProbeTraffic(
            self.probes,
            self.target.endpoints.router_url,
            self.api,
            self.facts.model,
            self.campaign.probes,
            self.journal,
            self.watchdog,
            self.stop,
            self._say,
            span=self.span_probe,
            span_timeout_s=self.campaign.oracles.past_deadline_s,
        )
        self.schedule = FaultSchedule(
            self.campaign,
            self.target,
            self.journal,
            self.clock,
            self.stop,
            self.watchdog,
            self._say,
            replayer=probes.replayer,
            aftershock=probes.aftershock,
            span_probe=probes.span_sender(),
        )
        fault_thread = threading.Thread(
            target=self.schedule.run, args=(windows, load_started, load_done), name="faults", daemon=True
        )
        in_lull = lambda: self._in_lull(self.clock.now())  # noqa: E731
        helpers = [
            threading.Thread(
                target=probes.replay_through_load, args=(load_started, load_done, in_lull), name="probes", daemon=True
            ),
            threading.Thread(target=self._sample_pools, args=(load_done, load_started), name="pools", daemon=True),
        ]
        for thread in (fault_thread, *helpers):
            thread.start()
        progress = terminal_progress(load.duration_s, self._live_status) if self.show_progress else None
        try:
            outcome = run_load(
                plan,
                self.run_dir,
                self.journal,
                ray_address=self.ray_address,
                progress=progress,
                on_started=lambda _: self._on_load_started(load_started),
                on_records=self._scan_live,
                clock=self.clock,
                # A stop too: a signal that lands while Ray starts the load can be swallowed in its C
                # code, leaving only the stop event set.
                cut_short=lambda: wedged.is_set() or self.stop.is_set(),
            )
        finally:
            load_done.set()
            # A heal is bounded by its own timeouts (a vLLM restart: several minutes); the journal
            # must stay open until it is written, so the fault thread is waited for in full.
            fault_thread.join()
            for thread in helpers:
                self._join_unless_hurried(thread, timeout_s=120.0)
            if self.show_progress:
                print(flush=True)
        if outcome.interrupted or self.stop.is_set():
            raise Interrupted("load interrupted")

    def _join_unless_hurried(self, thread: threading.Thread, timeout_s: float) -> None:
        """Wait for a helper (probes in flight, a pool sample), but not past a second stop signal."""
        deadline = time.monotonic() + timeout_s
        while thread.is_alive() and time.monotonic() < deadline:
            if self.signals is not None and self.signals.hurry.is_set():
                return
            thread.join(timeout=0.5)

    def _on_load_started(self, load_started: threading.Event) -> None:
        assert self.watchdog is not None
        self.watchdog.load_started()
        load_started.set()

    def _scan_live(self, records: list[RequestRecord]) -> None:
        """Count leaks as records arrive, for the live line (the canary oracle judges later)."""
        assert self.watchdog is not None
        for record in records:
            self.watchdog.note(record)
            if record.response_text and self.codec.scan_others(
                record.response_text, record.request_index, record.markers
            ):
                self.leaks_so_far += 1

    def _live_status(self) -> str:
        active = self.schedule.active_fault if self.schedule is not None else None
        return f"  fault {active or '-'}  leaks so far {self.leaks_so_far}"

    def _in_lull(self, t: float) -> bool:
        """Whether the load's shape has no users at schedule time `t`."""
        load = self.campaign.load
        if load.shape != "stages":
            return False
        current = next((stage for stage in load.stages if t < stage.until_s), None)
        return current is not None and current.users == 0

    def _sample_pools(self, load_done: threading.Event, load_started: threading.Event) -> None:
        """Every worker's loads through the load (the liveness oracle's idle moments), each also
        shown to the progress watchdog, which excuses fault windows and lulls."""
        assert self.pools is not None and self.watchdog is not None and self.schedule is not None
        while not load_done.wait(POOL_SAMPLE_S) and not self.stop.is_set():
            loads = self.pools.snapshot("during", None)
            if load_started.is_set() and not self.watchdog.wedged.is_set():
                excused = self.schedule.active_fault is not None or self._in_lull(self.clock.now())
                self.watchdog.check(loads, excused)

    def _drain(self) -> None:
        assert self.pools is not None and self.watchdog is not None
        wedged = self.watchdog.wedged
        self.pools.drain(self.campaign.oracles.drain_timeout_s, give_up=lambda: self.stop.is_set() or wedged.is_set())

    # ------------------------------------------------------------------------------ judge ----

    def _judge(self) -> RunOutcome:
        """Journal what the oracles read beside the requests (the logs), then judge the journal."""
        assert self.journal is not None
        j = self.journal
        j.flush()
        journal_logs(
            j, {role: self.target.logs(role) for role in ("prefill", "decode", "router")} if self.target else {}
        )
        journal_judging(j)
        judgement = judge(j)
        record_judgement(j, judgement)
        return RunOutcome(self.run_dir, judgement.verdict, judgement.reasons, judgement.oracles, judgement.interrupted)

    def _render_reports(self) -> None:
        try:
            from reports.render import render_all
        except ImportError:
            return
        try:
            render_all(self.run_dir, list(self.campaign.report.formats))
        except Exception:
            log.exception("rendering the reports failed; `pdchaos report %s` retries", self.run_dir)


def _caused_by_a_stop(exc: BaseException) -> bool:
    """Whether a stop signal is behind `exc`: the signal handler's `Interrupted` raised inside a
    library's C code comes back wrapped (as its `__cause__` or `__context__`)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        if isinstance(link, (Interrupted, KeyboardInterrupt)):
            return True
        seen.add(id(link))
        link = link.__cause__ or link.__context__
    return False
