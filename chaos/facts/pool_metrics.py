"""The pool constants a worker states on ``/metrics``: pool size, context length and page size,
per scheduler rank (SGLang's gauges, vLLM's cache-config info gauge)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from chaos.facts.prometheus import Sample, parse_prometheus_text
from chaos.facts.values import to_int

METRIC_POOL = "sglang:max_total_num_tokens"
METRIC_CONTEXT = "sglang:context_len"
METRIC_PAGE_SIZE = "sglang:page_size"
METRIC_VLLM_CACHE_CONFIG = "vllm:cache_config_info"  # labels num_gpu_blocks and block_size: the pool


@dataclass(frozen=True)
class PoolMetricSeries:
    """The pool constants reported under one label set (one scheduler rank)."""

    labels: dict[str, str] = field(default_factory=dict, hash=False)
    max_total_num_tokens: int | None = None
    context_len: int | None = None
    page_size: int | None = None


@dataclass(frozen=True)
class PoolMetrics:
    """``sglang:max_total_num_tokens``, ``sglang:context_len`` and ``sglang:page_size`` per rank."""

    series: tuple[PoolMetricSeries, ...] = ()

    def _values(self, attribute: str) -> list[int]:
        return [value for item in self.series if (value := getattr(item, attribute)) is not None]

    @property
    def max_total_num_tokens(self) -> int | None:
        """Smallest pool over the ranks that report one."""
        values = self._values("max_total_num_tokens")
        return min(values) if values else None

    @property
    def context_len(self) -> int | None:
        """Largest context length over the ranks that report one."""
        values = self._values("context_len")
        return max(values) if values else None

    @property
    def page_size(self) -> int | None:
        values = self._values("page_size")
        return max(values) if values else None

    @property
    def engine_types(self) -> tuple[str, ...]:
        """The ``engine_type`` labels seen (prefill, decode, unified), sorted."""
        types = {item.labels["engine_type"] for item in self.series if "engine_type" in item.labels}
        return tuple(sorted(types))


def read_pool_metrics(samples: Iterable[Sample] | str) -> PoolMetrics:
    """Group the pool constants by label set. Accepts samples or the raw ``/metrics`` text."""
    if isinstance(samples, str):
        samples = parse_prometheus_text(samples)
    attribute = {
        METRIC_POOL: "max_total_num_tokens",
        METRIC_CONTEXT: "context_len",
        METRIC_PAGE_SIZE: "page_size",
    }
    grouped: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for sample in samples:
        if sample.name == METRIC_VLLM_CACHE_CONFIG:  # vLLM states its pool as labels of an info gauge
            blocks, block_size = to_int(sample.labels.get("num_gpu_blocks")), to_int(sample.labels.get("block_size"))
            if blocks is not None and block_size is not None:
                key = tuple(sorted(sample.labels.items()))
                grouped.setdefault(key, {}).update(max_total_num_tokens=blocks * block_size, page_size=block_size)
            continue
        if sample.name not in attribute:
            continue
        key = tuple(sorted(sample.labels.items()))
        grouped.setdefault(key, {})[attribute[sample.name]] = to_int(sample.value)
    return PoolMetrics(series=tuple(PoolMetricSeries(labels=dict(key), **values) for key, values in grouped.items()))
