"""The run report's plots: throughput, error rate, TTFT and ITL percentiles, KV pool usage.

All share one time axis (seconds since the run started), the fault windows as shaded bands and
the load phase as dashed marks, so a spike lines up with the fault that caused it.
"""

from __future__ import annotations

import functools

from reports.model import RunReport
from reports.svg import Band, Mark, Series, line_plot

BLUE, GREEN, RED, ORANGE, PURPLE, PINK = "#0969da", "#1a7f37", "#cf222e", "#bc4c00", "#8250df", "#bf3989"
ROLE_COLORS = {"prefill": BLUE, "decode": PINK}
MARKED_PHASES = ("load:start", "load:end", "drain:end")


def x_range(report: RunReport) -> tuple[float, float]:
    xs = [0.0]
    xs += [b.start_s + b.width_s for b in report.traffic.buckets] + [b.start_s for b in report.traffic.buckets[:1]]
    xs += [t - report.origin for f in report.faults for t in (f.start, f.end) if t is not None]
    xs += [p.t - report.origin for p in report.pool]
    xs += [p.t - report.origin for p in report.phases if p.name in MARKED_PHASES]
    return min(xs), max(max(xs), 1.0)


def bands(report: RunReport) -> list[Band]:
    return [
        Band(f.start - report.origin, None if f.end is None else f.end - report.origin, f.label, f.confirmed)
        for f in report.faults
        if f.start is not None
    ]


def marks(report: RunReport) -> list[Mark]:
    return [Mark(p.t - report.origin, p.name) for p in report.phases if p.name in MARKED_PHASES]


def all_plots(report: RunReport) -> list[str]:
    """The SVGs in report order."""
    plot = functools.partial(line_plot, bands=bands(report), marks=marks(report), x_range=x_range(report))
    buckets = report.traffic.buckets
    width = report.traffic.bucket_s
    xs = [b.mid_s for b in buckets]

    def ms(values: list[float | None]) -> list[float | None]:
        return [None if v is None else v * 1000.0 for v in values]

    plots = [
        plot(
            "throughput",
            f"Throughput (requests per second, {width:g} s buckets, by send time)",
            [
                Series("sent/s", BLUE, list(zip(xs, [b.sent_per_s for b in buckets], strict=True)), area=True),
                Series("ok/s", GREEN, list(zip(xs, [b.ok_per_s for b in buckets], strict=True))),
            ],
            y_label="req/s",
        ),
        plot(
            "errors",
            "Error rate (share of requests not ok)",
            [
                Series(
                    "not ok (fail + info)",
                    RED,
                    list(zip(xs, [_pct(b.stats.error_rate) for b in buckets], strict=True)),
                    area=True,
                ),
                Series(
                    "fail",
                    ORANGE,
                    list(
                        zip(
                            xs,
                            [
                                _pct(b.stats.counts.fail / b.stats.counts.total if b.stats.counts.total else None)
                                for b in buckets
                            ],
                            strict=True,
                        )
                    ),
                    dashed=True,
                ),
            ],
            y_label="%",
            y_min_top=10.0,
        ),
        plot(
            "ttft",
            "Time to first token (ms)",
            [
                Series("TTFT p50", BLUE, list(zip(xs, ms([b.stats.ttft.p50 for b in buckets]), strict=True))),
                Series(
                    "TTFT p99", PURPLE, list(zip(xs, ms([b.stats.ttft.p99 for b in buckets]), strict=True)), dashed=True
                ),
            ],
            y_label="ms",
        ),
        plot(
            "itl",
            "Inter-token latency (ms)",
            [
                Series("ITL p50", BLUE, list(zip(xs, ms([b.stats.itl.p50 for b in buckets]), strict=True))),
                Series(
                    "ITL p99", PURPLE, list(zip(xs, ms([b.stats.itl.p99 for b in buckets]), strict=True)), dashed=True
                ),
            ],
            y_label="ms",
        ),
    ]
    roles = sorted({p.role for p in report.pool}, key=lambda r: (r not in ROLE_COLORS, r))
    pool_series = [
        Series(
            f"{role} KV pool used",
            ROLE_COLORS.get(role, ORANGE),
            [(p.t - report.origin, _pct(p.used_fraction)) for p in report.pool if p.role == role],
            area=True,
        )
        for role in roles
    ]
    plots.append(
        plot(
            "kvpool",
            "KV pool usage (% of max_total_num_tokens, from /v1/loads)",
            pool_series,
            y_label="%",
            y_min_top=10.0,
        )
    )
    return plots


def _pct(fraction: float | None) -> float | None:
    return None if fraction is None else fraction * 100.0
