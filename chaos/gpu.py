"""GPU inventory through NVML (the `nvidia-ml-py` distribution). No GPU is a fact, not an error."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_memory_mib: float | None


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str
    memory_total_mib: float
    memory_used_mib: float
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class GpuInventory:
    available: bool
    reason: str = ""  # why there is no inventory ("no GPU: NVML Shared Library Not Found")
    driver_version: str | None = None
    gpus: tuple[Gpu, ...] = field(default_factory=tuple)

    def summary(self) -> str:
        if not self.available:
            return self.reason
        names = ", ".join(f"{g.index}: {g.name} ({g.memory_total_mib / 1024:.0f} GiB)" for g in self.gpus)
        return f"{len(self.gpus)} GPU(s), driver {self.driver_version}: {names}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


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
            try:
                procs = tuple(
                    GpuProcess(p.pid, None if p.usedGpuMemory is None else p.usedGpuMemory / 2**20)
                    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                )
            except pynvml.NVMLError:
                procs = ()
            gpus.append(Gpu(index, _text(pynvml.nvmlDeviceGetName(handle)), _text(pynvml.nvmlDeviceGetUUID(handle)),
                            memory.total / 2**20, memory.used / 2**20, procs))
        return GpuInventory(True, driver_version=_text(pynvml.nvmlSystemGetDriverVersion()), gpus=tuple(gpus))
    except pynvml.NVMLError as exc:
        return GpuInventory(False, f"GPU inventory failed: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def expected_pool_tokens(gpu_total_mib: float, mem_fraction_static: float, weights_gib: float, kv_bytes_per_token: int) -> int:
    """What a memory fraction should give: (total * fraction - weights) / bytes per token."""
    kv_bytes = gpu_total_mib * 2**20 * mem_fraction_static - weights_gib * 2**30
    return max(0, int(kv_bytes // kv_bytes_per_token))
