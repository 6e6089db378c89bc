"""Drive load at a target with Ray-placed Locust processes and journal every request.

The campaign runner and `pdchaos load` both call `run_load`. Records reach the journal within a
poll interval of finishing (the journal commits them within half a second), so a driver killed
with SIGKILL leaves a journal holding what finished before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.cluster import HealthSample, LoadCluster, PollResult, locust_request_count
from chaos.journal import EventKind, Journal, JournalEvent, RequestRecord
from chaos.loadstats import LoadStats, generator_saturated
from chaos.run_evidence import journal_generator_health
from chaos.targets.discovery import TargetFacts
from loadprofiles.clock import ScheduleClock
from loadprofiles.config import LoadConfig, ShapeKind, ShapeSpec, Stage
from loadprofiles.profiles import Profile

POLL_INTERVAL_S = 0.5
_RECORD_FIELDS = {f.name for f in dataclasses.fields(RequestRecord)}


@dataclass(frozen=True)
class LoadPlan:
    target_url: str
    facts: TargetFacts
    profile: Profile
    run_prefix: str
    users: int = 8
    duration_s: float = 30.0
    actors: int = 1
    shape: ShapeKind = "steady"
    max_tokens: int | None = None
    seed: int = 0
    phase: str = "load"
    index_base: int = 0  # request indices below it belong to the runner's probes
    stages: tuple[tuple[float, int], ...] = ()  # shape "stages": (until_s, users) for the whole load

    def configs(self, workdir: Path, scheduled: bool = False) -> list[LoadConfig]:
        """One LoadConfig per actor; users are split as evenly as possible. Paths are absolute:
        the actor and its Locust process run in other working directories. `scheduled`: the
        shapes read the schedule clock their actors write beside them."""
        workdir = workdir.resolve()
        out = []
        for i in range(self.actors):
            users = _share(self.users, self.actors, i)
            if users == 0:
                continue
            stages = tuple(
                Stage(until_s=until, users=_share(n, self.actors, i), spawn_rate=max(1.0, users / 2))
                for until, n in self.stages
            )
            out.append(
                LoadConfig(
                    run_prefix=self.run_prefix,
                    target_url=self.target_url,
                    records_path=str(workdir / f"actor-{i}" / "records.jsonl"),
                    clock_path=str(workdir / f"actor-{i}" / "clock.json") if scheduled else None,
                    actor_index=i,
                    actor_count=self.actors,
                    facts=self.facts,
                    mix=dict(self.profile.mix),
                    shape=ShapeSpec(
                        kind=self.shape,
                        duration_s=self.duration_s,
                        users=users,
                        spawn_rate=max(1.0, users / 2),
                        stages=stages,
                    ),
                    max_tokens=self.max_tokens or self.profile.max_tokens,
                    seed=self.seed + i,
                    phase=self.phase,
                    index_base=self.index_base,
                )
            )
        return out


def _share(total: int, parts: int, index: int) -> int:
    """Actor `index`'s share of `total` users, as even as possible."""
    return total // parts + (1 if index < total % parts else 0)


@dataclass
class LoadOutcome:
    journaled: int = 0
    locust_requests: int = 0
    health: list[HealthSample] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)
    interrupted: bool = False
    cut_short: bool = False  # ended before its shape did (see run_load's `cut_short`)

    def cpu_samples(self) -> list[float]:
        return [h.cpu_percent for h in self.health if h.running]


Progress = Callable[[float, int, int, int], None]  # elapsed_s, requests, errors, running actors


def _to_record(data: dict[str, Any]) -> RequestRecord:
    return RequestRecord(**{k: v for k, v in data.items() if k in _RECORD_FIELDS})


def _absorb(
    journal: Journal,
    results: list[PollResult],
    outcome: LoadOutcome,
    on_records: Callable[[list[RequestRecord]], None] | None = None,
) -> tuple[int, int]:
    added = errors = 0
    for result in results:
        records = []
        for data in result.records:
            try:
                records.append(_to_record(data))
            except (TypeError, ValueError) as exc:
                outcome.anomalies.append(f"unreadable record: {exc}")
        journal.append_requests(records)
        if on_records is not None:
            on_records(records)
        added += len(records)
        errors += sum(1 for r in records if r.outcome.value != "ok")
        outcome.anomalies.extend(result.anomalies)
        if result.health is not None:
            outcome.health.append(result.health)
            journal_generator_health(journal, result.health)  # the saturated-generator gate reads it there
    outcome.journaled += added
    return added, errors


def run_load(
    plan: LoadPlan,
    run_dir: Path,
    journal: Journal,
    ray_address: str | None = None,
    progress: Progress | None = None,
    on_started: Callable[[float], None] | None = None,
    on_records: Callable[[list[RequestRecord]], None] | None = None,
    clock: ScheduleClock | None = None,
    cut_short: Callable[[], bool] | None = None,
) -> LoadOutcome:
    """Run the plan to its end (or Ctrl-C). `on_started(t)` fires once Locust is running: fault
    schedules count from then, not from Ray's start-up. With a `clock` (started here), the load's
    shape follows it: what the fault schedule holds lengthens the load by as much. `cut_short()`
    true (a wedged target: more load only waits out more timeouts; a stop) ends the load at the
    next poll."""
    outcome = LoadOutcome()
    workdir = (run_dir / "load").resolve()  # a relative --out must mean the same in every process
    configs = plan.configs(workdir, scheduled=clock is not None)
    journal.append_event(
        JournalEvent(
            EventKind.PHASE,
            f"{plan.phase}:start",
            {
                "profile": plan.profile.name,
                "users": plan.users,
                "actors": len(configs),
                "shape": plan.shape,
                "duration_s": plan.duration_s,
                "target": plan.target_url,
            },
        )
    )
    errors = 0
    with LoadCluster(ray_address) as cluster:
        started = time.monotonic()
        try:
            cluster.start(configs, str(workdir))
            started = time.monotonic()
            now = time.time()  # one origin for the journal, the schedule clock and the fault schedule
            journal.set_meta("load_started_at", now)
            if clock is not None:
                clock.start(now)
            if on_started is not None:
                on_started(now)
            # The shape ends Locust; this bounds a stuck one.
            deadline: Callable[[], float] = lambda: (  # noqa: E731
                started + plan.duration_s + 30.0 + (clock.held_s() if clock else 0.0)
            )
            while time.monotonic() < deadline():
                results = cluster.poll(clock.state() if clock else None)
                _, new_errors = _absorb(journal, results, outcome, on_records)
                errors += new_errors
                running = sum(1 for r in results if r.running)
                if progress:
                    progress(time.monotonic() - started, outcome.journaled, errors, running)
                if running == 0:
                    break
                if cut_short is not None and cut_short():
                    outcome.cut_short = True
                    break
                time.sleep(POLL_INTERVAL_S)
        except KeyboardInterrupt:
            outcome.interrupted = True
        finally:
            for stats, last in cluster.stop_all():
                outcome.locust_requests += locust_request_count(stats)
                _absorb(journal, [last], outcome, on_records)
    journal.flush()
    journal.append_event(
        JournalEvent(
            EventKind.PHASE,
            f"{plan.phase}:end",
            {
                "journaled": outcome.journaled,
                "locust_requests": outcome.locust_requests,
                "interrupted": outcome.interrupted,
                "cut_short": outcome.cut_short,
            },
        )
    )
    return outcome


def summary(stats: LoadStats, outcome: LoadOutcome) -> dict[str, Any]:
    """The one-line JSON result of `pdchaos load`."""
    ms: Callable[[float | None], float | None] = lambda v: None if v is None else round(1000 * v, 1)  # noqa: E731
    return {
        "requests": stats.requests,
        "ok": stats.ok,
        "fail": stats.fail,
        "info": stats.info,
        "requests_per_s": round(stats.requests_per_s, 2),
        "ttft_p50_ms": ms(stats.ttft_s.p50),
        "ttft_p99_ms": ms(stats.ttft_s.p99),
        "itl_p50_ms": ms(stats.itl_s.p50),
        "tpot_p50_ms": ms(stats.tpot_s.p50),
        "e2e_p99_ms": ms(stats.e2e_s.p99),
        "goodput_per_s": round(stats.goodput_per_s, 2),
        "anomalies": stats.anomalies,
        "error_classes": stats.error_classes,
        "locust_requests": outcome.locust_requests,
        "generator_saturated": generator_saturated(outcome.cpu_samples(), stats.send_lag_s),
        "interrupted": outcome.interrupted,
    }


def terminal_progress(duration_s: float, extra: Callable[[], str] = lambda: "") -> Progress:
    """A live line on a terminal; a plain line every 5 s otherwise. `extra` adds to the line
    (the runner shows the active fault and the leaks seen so far)."""
    last_line = [0.0]

    def show(elapsed: float, requests: int, errors: int, running: int) -> None:
        rate = requests / elapsed if elapsed > 0 else 0.0
        text = f"[{elapsed:5.1f}/{duration_s:.0f}s] requests {requests}  non-ok {errors}  {rate:.1f} req/s  actors {running}{extra()}"
        with contextlib.suppress(OSError):  # a terminal closed under the run (SIGHUP) stops only the line
            if sys.stdout.isatty():
                print("\r" + text, end="", flush=True)
            elif elapsed - last_line[0] >= 5.0:
                last_line[0] = elapsed
                print(text, flush=True)

    return show


def write_summary(run_dir: Path, data: dict[str, Any]) -> None:
    (run_dir / "load-summary.json").write_text(json.dumps(data, indent=2))
