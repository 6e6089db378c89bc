"""Keep NIXL's KV-transfer core inside the cores the engine was given.

On CPU, vLLM 0.32's NIXL worker (`nixl/base_worker.py`, `NixlBaseConnectorWorker.__init__`) moves
its own main thread to the last core of each NUMA node (`os.sched_setaffinity(0, ...)` over
`CpuPlatform.discover_numa_topology()`), read from the host's topology alone. That thread is also
the worker's compute thread, so every engine on a one-node host lands on the same core whatever
`VLLM_CPU_OMP_THREADS_BIND` says: here prefill, bound to core 0, was moved onto core 1 beside
decode, and a killed prefill then waited its turn on that core for tens of seconds before it
could exit. Where the process may not run on that core at all (a cpuset), the call fails with
EINVAL (vllm-project/vllm#58033).

The fix is the one proposed upstream (vllm-project/vllm#58036): each node's cores are taken only
where this process may run, so the transfer core is one of the engine's own. An unrestricted
process sees the topology unchanged.

Stdlib only: this runs in the vLLM venv.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from pdchaos_import_hook import patch_on_import

PLATFORM_MODULE = "vllm.platforms.cpu"


def own_cores(topology: list[list[int]], allowed: set[int]) -> list[list[int]]:
    """Each node's cores this process may run on; nodes with none are left out."""
    kept = [[core for core in node if core in allowed] for node in topology]
    return [node for node in kept if node]


def patch(module: Any) -> None:
    platform = getattr(module, "CpuPlatform", None)
    original = getattr(platform, "discover_numa_topology", None)
    if platform is None or original is None or getattr(original, "_pdchaos", False):
        return

    def discover_numa_topology(cls: Any) -> list[list[int]]:
        topology: list[list[int]] = original()
        allowed = os.sched_getaffinity(0)
        kept = own_cores(topology, allowed)
        if kept != topology:
            print(
                f"[pdchaos] NIXL transfer cores {topology} -> {kept} (this process runs on {sorted(allowed)})",
                file=sys.stderr,
                flush=True,
            )
        return kept

    discover_numa_topology._pdchaos = True  # type: ignore[attr-defined]
    platform.discover_numa_topology = classmethod(discover_numa_topology)


def install() -> None:
    if hasattr(os, "sched_getaffinity"):
        patch_on_import([PLATFORM_MODULE], patch)
