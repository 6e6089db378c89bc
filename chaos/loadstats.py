"""Latency and throughput from our own request records (Locust rounds to 1 ms; we do not).

TTFT = first token - send; ITL = gaps between token chunks; TPOT = (end - first token) per
generated token after the first; goodput = requests/s that met the SLO. Load-generator health:
send lag (actual - planned send time) and the Locust processes' CPU.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from chaos.journal import Outcome, RequestRecord

SATURATED_CPU_PERCENT = 90.0  # a Locust process is one core at most
SATURATED_LAG_S = 0.25  # the send lag one request in ten may reach


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of already-sorted values (None when empty)."""
    if not values:
        return None
    rank = max(1, math.ceil(q / 100.0 * len(values)))
    return values[min(rank, len(values)) - 1]


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 2.0
    tpot_s: float = 0.2


@dataclass
class Distribution:
    count: int = 0
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values: Iterable[float]) -> Distribution:
        ordered = sorted(values)
        if not ordered:
            return cls()
        return cls(len(ordered), percentile(ordered, 50), percentile(ordered, 90), percentile(ordered, 99), ordered[-1])


@dataclass
class LoadStats:
    requests: int = 0
    ok: int = 0
    fail: int = 0
    info: int = 0
    anomalies: int = 0
    duration_s: float = 0.0
    requests_per_s: float = 0.0
    output_tokens_per_s: float = 0.0
    goodput_per_s: float = 0.0
    ttft_s: Distribution = field(default_factory=Distribution)
    itl_s: Distribution = field(default_factory=Distribution)
    tpot_s: Distribution = field(default_factory=Distribution)
    e2e_s: Distribution = field(default_factory=Distribution)
    send_lag_s: Distribution = field(default_factory=Distribution)
    error_classes: dict[str, int] = field(default_factory=dict)


def compute(records: Iterable[RequestRecord], slo: Slo = Slo()) -> LoadStats:
    stats = LoadStats()
    ttft: list[float] = []
    itl: list[float] = []
    tpot: list[float] = []
    e2e: list[float] = []
    lag: list[float] = []
    first_send, last_end = math.inf, -math.inf
    tokens = good = 0
    for r in records:
        stats.requests += 1
        if r.outcome is Outcome.OK:
            stats.ok += 1
        elif r.outcome is Outcome.FAIL:
            stats.fail += 1
        else:
            stats.info += 1
        if r.anomaly:
            stats.anomalies += 1
        if r.error_class:
            stats.error_classes[r.error_class] = stats.error_classes.get(r.error_class, 0) + 1
        if r.t_send is not None:
            first_send = min(first_send, r.t_send)
            if r.planned_send is not None:
                lag.append(max(0.0, r.t_send - r.planned_send))
        if r.t_end is not None:
            last_end = max(last_end, r.t_end)
        if r.t_send is None or r.t_end is None:
            continue
        e2e.append(r.t_end - r.t_send)
        r_ttft = r.t_first_token - r.t_send if r.t_first_token is not None else None
        if r_ttft is not None:
            ttft.append(r_ttft)
        times = r.token_times
        itl.extend(b - a for a, b in itertools.pairwise(times))
        generated = r.completion_tokens or 0
        tokens += generated
        r_tpot = None
        if r.t_first_token is not None and generated > 1:
            r_tpot = (r.t_end - r.t_first_token) / (generated - 1)
            tpot.append(r_tpot)
        if (
            r.outcome is Outcome.OK
            and (r_ttft is None or r_ttft <= slo.ttft_s)
            and (r_tpot is None or r_tpot <= slo.tpot_s)
        ):
            good += 1
    if last_end > first_send:
        stats.duration_s = last_end - first_send
        stats.requests_per_s = stats.requests / stats.duration_s
        stats.output_tokens_per_s = tokens / stats.duration_s
        stats.goodput_per_s = good / stats.duration_s
    stats.ttft_s, stats.itl_s, stats.tpot_s = Distribution.of(ttft), Distribution.of(itl), Distribution.of(tpot)
    stats.e2e_s, stats.send_lag_s = Distribution.of(e2e), Distribution.of(lag)
    return stats


def generator_saturation(cpu_samples: Sequence[float], lag: Distribution) -> str | None:
    """Why the load generator could not keep its schedule (it measured itself, not the target),
    or None when it could. The lag's p90, not its p99: on a shared machine a few sends in a few
    hundred are late by the OS scheduler's whim; a generator behind its schedule is late often."""
    busy = sorted(cpu_samples)
    cpu_p50 = percentile(busy, 50) if busy else None
    if cpu_p50 is not None and cpu_p50 >= SATURATED_CPU_PERCENT:
        return (
            f"its Locust processes ran at {cpu_p50:.0f} % of a core (median), at or above {SATURATED_CPU_PERCENT:.0f} %"
        )
    if lag.p90 is not None and lag.p90 >= SATURATED_LAG_S:
        return (
            f"one request in ten was sent {lag.p90 * 1000:.0f} ms or more after its planned time "
            f"(send lag p90, {lag.count} requests), at or above {SATURATED_LAG_S * 1000:.0f} ms"
        )
    return None


def generator_saturated(cpu_samples: Sequence[float], lag: Distribution) -> bool:
    return generator_saturation(cpu_samples, lag) is not None
