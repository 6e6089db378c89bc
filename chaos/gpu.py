"""GPU inventory through NVML (the `nvidia-ml-py` distribution). No GPU is a fact, not an error.

Two things a qualification report needs from the GPUs: what was there (devices, memory, driver,
which processes held memory), and whether the KV pool an engine reports is the pool its memory
fraction should give on that GPU. A pool smaller than expected means something else held memory
when the engine sized it (another process on the GPU); a larger one means the fraction or the
GPU assignment is not what the campaign says.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

MIB = 2**20
GIB = 2**30


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory_mib: float | None  # None where NVML cannot say (no permission, MIG, some containers)
    name: str | None = None
    kind: Literal["compute", "graphics"] = "compute"


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML's index: PCI bus order, what CUDA_DEVICE_ORDER=PCI_BUS_ID numbers
    name: str
    uuid: str
    memory_total_mib: float
    memory_used_mib: float
    processes: tuple[GpuProcess, ...] = ()
    memory_free_mib: float | None = None
    pci_bus_id: str | None = None

    @property
    def memory_total_gib(self) -> float:
        return self.memory_total_mib * MIB / GIB


@dataclass(frozen=True)
class GpuInventory:
    available: bool
    reason: str = ""  # why there is no inventory ("no GPU: NVML Shared Library Not Found")
    driver_version: str | None = None
    gpus: tuple[Gpu, ...] = field(default_factory=tuple)
    cuda_driver_version: str | None = None  # the CUDA version the driver supports, "12.4"
    nvml_version: str | None = None

    def summary(self) -> str:
        if not self.available:
            return self.reason
        names = ", ".join(
            f"{g.index}: {g.name} ({g.memory_total_mib / 1024:.0f} GiB, {g.memory_used_mib / 1024:.1f} used)"
            for g in self.gpus
        )
        cuda = f", CUDA {self.cuda_driver_version}" if self.cuda_driver_version else ""
        return f"{len(self.gpus)} GPU(s), driver {self.driver_version}{cuda}: {names}"

    def by_index(self, indices: Sequence[int]) -> list[Gpu]:
        """The GPUs with these NVML indices, in that order; missing ones are left out."""
        known = {g.index: g for g in self.gpus}
        return [known[i] for i in indices if i in known]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(call: Any, *args: Any) -> Any:
    """An NVML query that older drivers or restricted containers may not answer: None then."""
    import pynvml

    try:
        return call(*args)
    except (pynvml.NVMLError, AttributeError):
        return None


def _cuda_version(value: Any) -> str | None:
    return f"{value // 1000}.{value % 1000 // 10}" if isinstance(value, int) and value > 0 else None


def _processes(handle: Any) -> tuple[GpuProcess, ...]:
    import pynvml

    found: dict[int, GpuProcess] = {}
    queries: tuple[tuple[Literal["compute", "graphics"], str], ...] = (
        ("compute", "nvmlDeviceGetComputeRunningProcesses"),
        ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
    )
    for kind, query in queries:
        call = getattr(pynvml, query, None)
        for p in (_optional(call, handle) if call is not None else None) or ():
            if p.pid in found:
                continue
            used = getattr(p, "usedGpuMemory", None)
            name = _optional(pynvml.nvmlSystemGetProcessName, p.pid)
            found[p.pid] = GpuProcess(
                p.pid, None if used is None else used / MIB, None if name is None else _text(name), kind
            )
    return tuple(found.values())


def read_inventory() -> GpuInventory:
    try:
        import pynvml
    except ImportError:
        return GpuInventory(False, "no GPU: nvidia-ml-py is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # NVMLError_LibraryNotFound on machines without a driver
        return GpuInventory(False, f"no GPU: {exc}")
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            pci = _optional(pynvml.nvmlDeviceGetPciInfo, handle)
            gpus.append(
                Gpu(
                    index,
                    _text(pynvml.nvmlDeviceGetName(handle)),
                    _text(pynvml.nvmlDeviceGetUUID(handle)),
                    memory.total / MIB,
                    memory.used / MIB,
                    _processes(handle),
                    memory.free / MIB,
                    None if pci is None else _text(pci.busId),
                )
            )
        if not gpus:
            return GpuInventory(
                False, "no GPU: NVML sees no device", driver_version=_text(pynvml.nvmlSystemGetDriverVersion())
            )
        nvml = _optional(pynvml.nvmlSystemGetNVMLVersion)
        return GpuInventory(
            True,
            driver_version=_text(pynvml.nvmlSystemGetDriverVersion()),
            gpus=tuple(gpus),
            cuda_driver_version=_cuda_version(_optional(pynvml.nvmlSystemGetCudaDriverVersion)),
            nvml_version=None if nvml is None else _text(nvml),
        )
    except pynvml.NVMLError as exc:
        return GpuInventory(False, f"GPU inventory failed: {exc}")
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def expected_pool_tokens(
    gpu_total_mib: float, mem_fraction_static: float, weights_gib: float, kv_bytes_per_token: int
) -> int:
    """What a memory fraction should give: (total * fraction - weights) / bytes per token."""
    kv_bytes = gpu_total_mib * MIB * mem_fraction_static - weights_gib * GIB
    return max(0, int(kv_bytes // kv_bytes_per_token))


PoolStatus = Literal["ok", "low", "high", "unknown"]


@dataclass(frozen=True)
class PoolCheck:
    """One role's KV pool: what its memory fraction should give on its GPUs vs what it reports.

    SGLang sizes the pool, per rank, as (total * fraction) minus the memory already used when it
    measures (its weights, the CUDA context, any other process): so `expected_kv_gib` (total *
    fraction - weights) is an upper bound the reported pool should come within `tolerance` of.
    """

    role: str
    status: PoolStatus
    reason: str
    gpu_ids: tuple[int, ...] = ()
    gpu_total_gib: float | None = None
    mem_fraction_static: float | None = None
    weights_gib: float | None = None
    expected_kv_gib: float | None = None
    reported_kv_gib: float | None = None
    reported_pool_tokens: int | None = None
    expected_pool_tokens: int | None = None
    other_processes: tuple[GpuProcess, ...] = ()  # on the role's GPUs, not the role's own

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compare_pool(
    role: str,
    gpus: Sequence[Gpu],
    mem_fraction_static: float | None,
    weights_gib: float | None,
    reported_kv_gib: float | None,
    reported_pool_tokens: int | None,
    own_pids: Collection[int] = (),
    tolerance: float = 0.10,
) -> PoolCheck:
    """Judge one role's pool. Inputs are per rank (weights and KV of one GPU); None is unknown."""
    ids = tuple(g.index for g in gpus)
    others = tuple(p for g in gpus for p in g.processes if p.pid not in own_pids)
    base: dict[str, Any] = {
        "role": role,
        "gpu_ids": ids,
        "mem_fraction_static": mem_fraction_static,
        "weights_gib": weights_gib,
        "reported_kv_gib": reported_kv_gib,
        "reported_pool_tokens": reported_pool_tokens,
        "other_processes": others,
    }
    missing = [
        name
        for name, value in (
            ("the role's GPUs in the inventory", gpus or None),
            ("the memory fraction", mem_fraction_static),
            ("the weights' memory", weights_gib),
            ("the KV pool's memory", reported_kv_gib),
        )
        if value is None
    ]
    if missing:
        return PoolCheck(status="unknown", reason="cannot compare: no reading of " + ", ".join(missing), **base)
    assert mem_fraction_static is not None and weights_gib is not None and reported_kv_gib is not None
    total_gib = min(g.memory_total_gib for g in gpus)  # SGLang sizes every rank by the smallest
    expected_kv = total_gib * mem_fraction_static - weights_gib
    expected_tokens = None
    if reported_pool_tokens and reported_kv_gib > 0:
        per_token = reported_kv_gib * GIB / reported_pool_tokens
        expected_tokens = expected_pool_tokens(
            total_gib * GIB / MIB, mem_fraction_static, weights_gib, max(1, round(per_token))
        )
    base.update(gpu_total_gib=total_gib, expected_kv_gib=expected_kv, expected_pool_tokens=expected_tokens)
    said = f"KV pool {reported_kv_gib:.2f} GiB vs {expected_kv:.2f} GiB expected ({total_gib:.1f} GiB x {mem_fraction_static} - {weights_gib:.2f} GiB weights)"
    if expected_kv <= 0:
        return PoolCheck(status="low", reason=f"{said}: the fraction does not even hold the weights", **base)
    if reported_kv_gib > expected_kv * (1 + tolerance):
        return PoolCheck(
            status="high",
            reason=f"{said}: more than the fraction allows; is the fraction or the GPU "
            "assignment what the campaign says?",
            **base,
        )
    if reported_kv_gib < expected_kv * (1 - tolerance):
        held = sum(p.used_memory_mib or 0.0 for p in others) / 1024
        who = f"; other processes on these GPUs hold {held:.2f} GiB now" if others else ""
        return PoolCheck(
            status="low", reason=f"{said}: something else held GPU memory when the engine sized its pool{who}", **base
        )
    return PoolCheck(status="ok", reason=said, **base)
