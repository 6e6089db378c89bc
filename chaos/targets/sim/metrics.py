"""Prometheus text for the embedded engine, with SGLang's `sglang:` metric names (`metrics_collector.py`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        self.total += value
        self.count += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1


@dataclass
class Metrics:
    """Counters the engine bumps; gauges are read live when rendering."""

    counters: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    histograms: dict[str, Histogram] = field(default_factory=lambda: defaultdict(Histogram))

    def inc(self, name: str, amount: float = 1.0) -> None:
        self.counters[name] += amount

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)


def _fmt(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def render(labels: dict[str, str], gauges: dict[str, float], metrics: Metrics) -> str:
    label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    lines: list[str] = []
    for name, value in gauges.items():
        lines += [f"# HELP sglang:{name} {name.replace('_', ' ')}", f"# TYPE sglang:{name} gauge"]
        lines.append(f"sglang:{name}{{{label_text}}} {_fmt(value)}")
    for name, value in sorted(metrics.counters.items()):
        lines += [f"# HELP sglang:{name} {name.replace('_', ' ')}", f"# TYPE sglang:{name} counter"]
        lines.append(f"sglang:{name}{{{label_text}}} {_fmt(value)}")
    for name, hist in sorted(metrics.histograms.items()):
        lines += [f"# HELP sglang:{name} {name.replace('_', ' ')}", f"# TYPE sglang:{name} histogram"]
        for bound, count in zip(hist.buckets, hist.counts, strict=True):  # observe() keeps counts cumulative
            lines.append(f'sglang:{name}_bucket{{{label_text},le="{_fmt(bound)}"}} {count}')
        lines.append(f"sglang:{name}_sum{{{label_text}}} {_fmt(hist.total)}")
        lines.append(f"sglang:{name}_count{{{label_text}}} {hist.count}")
    return "\n".join(lines) + "\n"
