"""Traffic over time and under faults: counts, error rates and TTFT/ITL/E2E percentiles.

Everything is vectorised over the request columns: one grouped sort gives every time bucket's
percentiles, and a fault window is a boolean mask, so a 50k-request run with a million token
times takes well under a second here whatever the number of buckets or windows.

Percentiles are nearest-rank, as in `chaos.loadstats.percentile`, so the reports agree with it.
Latencies are in seconds. "Overall", "under faults" and "outside faults" leave the baseline phase
out: isolated reference requests would make the loaded system look faster than it is.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from chaos.loadstats import Distribution
from reports.columns import OUTCOME_CODES, RequestColumns

BASELINE_PHASE = "baseline"
MAX_BUCKETS = 120  # resolution enough for a plot 1100 px wide, few enough points to read
BUCKET_CHOICES_S = (1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
_OK, _FAIL = OUTCOME_CODES["ok"], OUTCOME_CODES["fail"]


@dataclass(frozen=True)
class OutcomeCounts:
    total: int = 0
    ok: int = 0
    fail: int = 0
    info: int = 0

    def to_json(self) -> dict[str, int]:
        return {"total": self.total, "ok": self.ok, "fail": self.fail, "info": self.info}


@dataclass(frozen=True)
class LatencyStats:
    """Requests sent in one span of time."""

    counts: OutcomeCounts = field(default_factory=OutcomeCounts)
    ttft: Distribution = field(default_factory=Distribution)
    itl: Distribution = field(default_factory=Distribution)
    e2e: Distribution = field(default_factory=Distribution)

    @property
    def error_rate(self) -> float | None:
        """Share of requests not definitely ok (fail and info alike: neither proves a good answer)."""
        return None if self.counts.total == 0 else 1.0 - self.counts.ok / self.counts.total


@dataclass(frozen=True)
class Bucket:
    start_s: float  # offset from the report's origin
    width_s: float
    stats: LatencyStats

    @property
    def mid_s(self) -> float:
        return self.start_s + self.width_s / 2

    @property
    def sent_per_s(self) -> float:
        return self.stats.counts.total / self.width_s

    @property
    def ok_per_s(self) -> float:
        return self.stats.counts.ok / self.width_s


@dataclass(frozen=True)
class Span:
    """A fault window in epoch seconds; `end` None while unhealed."""

    key: str
    start: float
    end: float | None


@dataclass
class Traffic:
    counts: OutcomeCounts = field(default_factory=OutcomeCounts)
    by_phase: dict[str, OutcomeCounts] = field(default_factory=dict)
    by_user_kind: dict[str, OutcomeCounts] = field(default_factory=dict)
    error_classes: dict[str, int] = field(default_factory=dict)
    error_classes_under_faults: dict[str, int] = field(default_factory=dict)
    first_send: float | None = None
    last_end: float | None = None
    bucket_s: float = 1.0
    buckets: list[Bucket] = field(default_factory=list)
    overall: LatencyStats = field(default_factory=LatencyStats)
    under_faults: LatencyStats = field(default_factory=LatencyStats)
    outside_faults: LatencyStats = field(default_factory=LatencyStats)
    per_window: dict[str, LatencyStats] = field(default_factory=dict)


def compute_traffic(cols: RequestColumns, origin: float, spans: Sequence[Span]) -> Traffic:
    n = len(cols)
    traffic = Traffic(
        counts=_counts(cols.outcome),
        by_phase=_counts_by(cols.phase, cols.outcome, "unknown"),
        by_user_kind=_counts_by(cols.user_kind, cols.outcome, "unknown"),
        error_classes=_ranked(Counter(e for e in cols.error_class if e)),
    )
    if n == 0:
        return traffic
    sent = ~np.isnan(cols.t_send)
    if sent.any():
        traffic.first_send = float(np.nanmin(cols.t_send))
    if not np.isnan(cols.t_end).all():
        traffic.last_end = float(np.nanmax(cols.t_end))
    ttft = cols.t_first_token - cols.t_send
    e2e = cols.t_end - cols.t_send
    gap_rows, gaps = _gaps(cols.token_counts, cols.token_times)
    baseline = np.fromiter((p == BASELINE_PHASE for p in cols.phase), dtype=bool, count=n)

    def stats(mask: np.ndarray) -> LatencyStats:
        return LatencyStats(
            _counts(cols.outcome[mask]), _dist(ttft[mask]), _dist(gaps[mask[gap_rows]]), _dist(e2e[mask])
        )

    loaded = ~baseline
    traffic.overall = stats(loaded)
    under = np.zeros(n, dtype=bool)
    for span in spans:
        inside = sent & (cols.t_send >= span.start)
        if span.end is not None:
            inside &= cols.t_send <= span.end
        traffic.per_window[span.key] = stats(inside)
        under |= inside
    traffic.under_faults = stats(under & loaded)
    traffic.outside_faults = stats(~under & sent & loaded)
    traffic.error_classes_under_faults = _ranked(
        Counter(e for e, m in zip(cols.error_class, under & loaded, strict=True) if m and e)
    )

    if sent.any():
        last = max(float(np.nanmax(cols.t_send)), traffic.last_end or -math.inf)
        traffic.bucket_s = choose_bucket_s(last - min(origin, traffic.first_send or origin))
        traffic.buckets = _buckets(cols, sent, origin, traffic.bucket_s, ttft, e2e, gap_rows, gaps)
    return traffic


def choose_bucket_s(span_s: float) -> float:
    """The smallest round bucket width that keeps a plot under MAX_BUCKETS points."""
    for width in BUCKET_CHOICES_S:
        if span_s / width <= MAX_BUCKETS:
            return width
    return math.ceil(span_s / MAX_BUCKETS / 3600.0) * 3600.0


def _buckets(
    cols: RequestColumns,
    sent: np.ndarray,
    origin: float,
    width: float,
    ttft: np.ndarray,
    e2e: np.ndarray,
    gap_rows: np.ndarray,
    gaps: np.ndarray,
) -> list[Bucket]:
    index = np.full(len(cols), -1, dtype=np.int64)
    index[sent] = np.floor((cols.t_send[sent] - origin) / width).astype(np.int64)
    first = int(index[sent].min())
    group = np.where(sent, index - first, -1)  # groups 0..k-1; unsent rows are -1 and drop out
    k = int(group.max()) + 1  # every bucket from first to last, empty ones too: a gap in traffic is news
    total = np.bincount(group[sent], minlength=k)
    ok = np.bincount(group[sent & (cols.outcome == _OK)], minlength=k)
    fail = np.bincount(group[sent & (cols.outcome == _FAIL)], minlength=k)
    ttfts, e2es, itls = _grouped(ttft, group, k), _grouped(e2e, group, k), _grouped(gaps, group[gap_rows], k)
    return [
        Bucket(
            (first + i) * width,
            width,
            LatencyStats(
                OutcomeCounts(int(total[i]), int(ok[i]), int(fail[i]), int(total[i] - ok[i] - fail[i])),
                ttfts[i],
                itls[i],
                e2es[i],
            ),
        )
        for i in range(k)
    ]


def _gaps(counts: np.ndarray, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inter-token gaps of every request, and the row each belongs to (no gap spans two rows)."""
    if times.size < 2:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    rows = np.repeat(np.arange(counts.size, dtype=np.int32), counts)  # int32: half the memory of a row per token
    same = rows[1:] == rows[:-1]
    return rows[1:][same], np.diff(times)[same]


def _counts(outcome: np.ndarray) -> OutcomeCounts:
    total = int(outcome.size)
    ok, fail = int(np.count_nonzero(outcome == _OK)), int(np.count_nonzero(outcome == _FAIL))
    return OutcomeCounts(total, ok, fail, total - ok - fail)


def _counts_by(keys: Sequence[str | None], outcome: np.ndarray, missing: str) -> dict[str, OutcomeCounts]:
    tally: dict[str, list[int]] = {}
    for key, code in zip(keys, outcome.tolist(), strict=True):
        row = tally.setdefault(key or missing, [0, 0, 0])
        row[code] += 1
    return {k: OutcomeCounts(sum(v), v[0], v[1], v[2]) for k, v in sorted(tally.items())}


def _ranked(counter: Counter[str]) -> dict[str, int]:
    return dict(sorted(counter.items(), key=lambda kv: (-kv[1], kv[0])))


def _dist(values: np.ndarray) -> Distribution:
    v = values[~np.isnan(values)]  # a copy, so it can be sorted in place
    v.sort()
    return _of_sorted(v) if v.size else Distribution()


def _grouped(values: np.ndarray, groups: np.ndarray, k: int) -> list[Distribution]:
    """One distribution per group 0..k-1, from a single sort by (group, value)."""
    keep = ~np.isnan(values) & (groups >= 0)
    v, g = values[keep], groups[keep].astype(np.int32)  # k is a few hundred buckets at most
    order = np.lexsort((v, g))
    v, g = v[order], g[order]
    del order
    bounds = np.searchsorted(g, np.arange(k + 1))
    return [_of_sorted(v[bounds[i] : bounds[i + 1]]) if bounds[i + 1] > bounds[i] else Distribution() for i in range(k)]


def _of_sorted(v: np.ndarray) -> Distribution:
    n = int(v.size)

    def rank(q: float) -> float:
        return float(v[min(n, max(1, math.ceil(q / 100.0 * n))) - 1])

    return Distribution(n, rank(50), rank(90), rank(99), float(v[-1]))
