"""What a running SGLang server says about its memory, and the pool check against its GPUs.

Readings, per rank, best source first: `/metrics` (`sglang:weight_memory_usage_gb`,
`sglang:kv_cache_memory_usage_gb`, `sglang:max_total_num_tokens`), then the server's log
(`Load weight end. ... mem usage=X GB`, `KV Cache is allocated. ... K size: X GB, V size: Y GB`,
the scheduler's `max_total_num_tokens=` line). The memory fraction comes from `/server_info`,
which holds the value SGLang resolved when the campaign left it out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import httpx

from chaos import transport
from chaos.facts.log_records import iter_log_records
from chaos.facts.log_starts import parse_log
from chaos.facts.prometheus import parse_prometheus_text
from chaos.facts.values import to_int
from chaos.gpu import GpuInventory, PoolCheck, compare_pool
from chaos.targets.dialect import get_json
from chaos.targets.launcher import Launcher, ProcessHandle
from chaos.targets.sglang.settings import WorkerSettings

WEIGHTS_METRIC = "sglang:weight_memory_usage_gb"
KV_METRIC = "sglang:kv_cache_memory_usage_gb"
POOL_METRIC = "sglang:max_total_num_tokens"
_WEIGHTS_LINE = re.compile(r"Load weight end\..*\bmem usage=([0-9.]+)\s*GB")


@dataclass(frozen=True)
class EngineMemory:
    """One server's memory as it reports it, per rank (the worst rank); None where unsaid."""

    weights_gib: float | None = None  # the largest over ranks
    kv_gib: float | None = None  # the smallest over ranks
    pool_tokens: int | None = None  # the smallest over ranks

    def over(self, other: EngineMemory) -> EngineMemory:
        """These readings, with `other`'s where these have none."""
        return EngineMemory(
            self.weights_gib if self.weights_gib is not None else other.weights_gib,
            self.kv_gib if self.kv_gib is not None else other.kv_gib,
            self.pool_tokens if self.pool_tokens is not None else other.pool_tokens,
        )


def memory_from_metrics(text: str) -> EngineMemory:
    values: dict[str, list[float]] = {WEIGHTS_METRIC: [], KV_METRIC: [], POOL_METRIC: []}
    for sample in parse_prometheus_text(text):
        if sample.name in values and sample.value == sample.value:  # NaN is no reading
            values[sample.name].append(sample.value)
    pools = [p for p in (to_int(v) for v in values[POOL_METRIC]) if p is not None]
    return EngineMemory(
        max(values[WEIGHTS_METRIC], default=None), min(values[KV_METRIC], default=None), min(pools, default=None)
    )


def memory_from_log(lines: Iterable[str]) -> EngineMemory:
    """The readings of the server's latest start in its log (a restarted server appends to it)."""
    lines = list(lines)
    starts = parse_log(lines)
    if not starts:
        return EngineMemory()
    last = starts[-1]
    kv: list[float] = []
    for rank in last.ranks.values():
        for alloc in rank.kv_allocs[-1:]:
            size = (
                alloc.kv_size_gb
                if alloc.kv_size_gb is not None
                else (
                    alloc.k_size_gb + alloc.v_size_gb
                    if alloc.k_size_gb is not None and alloc.v_size_gb is not None
                    else None
                )
            )
            if size is not None:
                kv.append(size)
    weights = [
        float(m.group(1))
        for record in iter_log_records(lines[max(0, last.first_lineno - 1) :])
        if (m := _WEIGHTS_LINE.search(record.message))
    ]
    return EngineMemory(max(weights, default=None), min(kv, default=None), last.pool_tokens)


class LaunchedServers(Protocol):
    """What the pool check reads of a launched SGLang deployment (chaos/targets/sglang/stack.py)."""

    settings: dict[str, WorkerSettings]  # role -> the settings its server was started with
    launcher: Launcher

    def processes(self, role: str) -> list[ProcessHandle]: ...

    def logs(self, role: str) -> str: ...


def pool_checks(stack: LaunchedServers, inventory: GpuInventory | None = None) -> list[PoolCheck]:
    """Each role's pool against what its memory fraction gives on its GPUs, as NVML sees them on the
    role's own node (the launcher asks there); `inventory` overrides that for every role."""
    checks = []
    for role, settings in stack.settings.items():
        procs = stack.processes(role)
        seen = inventory or stack.launcher.inventory(role)
        if not seen.available:
            checks.append(PoolCheck(role, "unknown", seen.reason, tuple(settings.gpu_ids)))
            continue
        url = settings.url
        try:
            metrics = memory_from_metrics(transport.get(f"{url}/metrics", timeout=5.0, trust_env=False).text)
        except httpx.HTTPError:
            metrics = EngineMemory()
        memory = metrics.over(memory_from_log(stack.logs(role).splitlines()))
        info = get_json(f"{url}/server_info")
        fraction = info.get("mem_fraction_static") if isinstance(info, dict) else None
        fraction = fraction if isinstance(fraction, float) else settings.mem_fraction_static
        own = {pid for proc in procs for pid in proc.group_states()}  # the role's whole process group
        checks.append(
            compare_pool(
                role,
                seen.by_index(settings.gpu_ids),
                fraction,
                memory.weights_gib,
                memory.kv_gib,
                memory.pool_tokens,
                own,
            )
        )
    return checks
