"""The GPU inventory and the pool-vs-fraction check (chaos/gpu.py) on a real GPU, with real NVML.

The tests drive `chaos/gpu.py` through a fake `pynvml` (tests/test_sglang_inventory.py); this
script checks that reading against the real library on a machine with an NVIDIA GPU, and writes
what NVML really answered, so the fake can be corrected from it:

1. **Raw NVML answers**: the type and value of every call `read_inventory` makes (names as str or
   bytes, the PCI bus id's format, the CUDA version's encoding, process entries and their fields).
2. **The inventory** `read_inventory()` builds from them.
3. **Processes seen**: a child process holds `--squat-gib` GiB on GPU 0; is it listed, under which
   pid (a container's pid namespace may hide the host pids NVML reports), with how much memory?
4. **The pool check against an engine's sizing**: a child "engine" loads `--weights-gib` GiB of
   weights, then sizes its KV pool the way SGLang does (free memory at that moment, less what
   `1 - mem_fraction_static` of the GPU must leave), once alone and once while the squatter holds
   its memory. `compare_pool` must say `ok` for the first and `low`, naming the squatter, for the
   second.

Needs PyTorch with CUDA and `nvidia-ml-py`; writes one JSON document:

    python benchmarks/gpu_inventory_check.py --json gpu-check.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from chaos.gpu import GIB, compare_pool, read_inventory

# A child that holds GiB of GPU memory until its stdin closes, and prints its pid once it does.
HOLD = """
import os, sys, torch
x = torch.empty(int(float(sys.argv[1]) * 2**30), dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print(os.getpid(), flush=True)
sys.stdin.read()
"""

# A child that sizes a KV pool as SGLang does (`model_runner.py`: rest = free - total * (1 - fraction))
# after loading its weights, allocates it, prints what it got, and holds it until stdin closes.
ENGINE = """
import json, os, sys, torch
weights_gib, fraction = float(sys.argv[1]), float(sys.argv[2])
weights = torch.empty(int(weights_gib * 2**30), dtype=torch.uint8, device="cuda:0")
free, total = torch.cuda.mem_get_info(0)
kv_bytes = max(0, int(free - total * (1 - fraction)))
kv = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print(json.dumps({"pid": os.getpid(), "free_before_kv": free, "total": total, "kv_bytes": kv_bytes}), flush=True)
sys.stdin.read()
"""


def _typed(value: Any) -> dict[str, Any]:
    if isinstance(value, bytes):
        return {"type": "bytes", "value": value.decode(errors="replace")}
    if isinstance(value, (int, float, str, bool)) or value is None:
        return {"type": type(value).__name__, "value": value}
    return {"type": type(value).__name__, "value": repr(value)[:300]}


def raw_nvml() -> dict[str, Any]:
    """Every NVML answer read_inventory uses, with its Python type."""
    import pynvml

    out: dict[str, Any] = {"binding": getattr(pynvml, "__version__", None)}
    pynvml.nvmlInit()
    try:

        def call(name: str, *args: Any) -> dict[str, Any]:
            try:
                return _typed(getattr(pynvml, name)(*args))
            except Exception as exc:  # the point is to record what each call does
                return {"error": f"{type(exc).__name__}: {exc}"}

        out["system"] = {
            name: call(name)
            for name in (
                "nvmlSystemGetDriverVersion",
                "nvmlSystemGetCudaDriverVersion",
                "nvmlSystemGetNVMLVersion",
                "nvmlDeviceGetCount",
            )
        }
        devices = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            pci = pynvml.nvmlDeviceGetPciInfo(handle)
            device: dict[str, Any] = {
                "name": call("nvmlDeviceGetName", handle),
                "uuid": call("nvmlDeviceGetUUID", handle),
                "memory": {k: getattr(memory, k) for k in ("total", "used", "free")},
                "pci_busId": _typed(pci.busId),
                "pci_busIdLegacy": _typed(getattr(pci, "busIdLegacy", None)),
            }
            for kind in ("Compute", "Graphics"):
                try:
                    procs = getattr(pynvml, f"nvmlDeviceGet{kind}RunningProcesses")(handle)
                    device[kind.lower()] = [
                        {
                            "type": type(p).__name__,
                            "pid": p.pid,
                            "usedGpuMemory": _typed(getattr(p, "usedGpuMemory", None)),
                            "name": call("nvmlSystemGetProcessName", p.pid),
                        }
                        for p in procs
                    ]
                except Exception as exc:
                    device[kind.lower()] = {"error": f"{type(exc).__name__}: {exc}"}
            devices.append(device)
        out["devices"] = devices
    finally:
        pynvml.nvmlShutdown()
    return out


class Child:
    """A Python child on the GPU that holds its memory until closed."""

    def __init__(self, code: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        self.line = self.proc.stdout.readline().strip()
        if not self.line:
            raise RuntimeError(f"the child exited with {self.proc.wait()} before it held its memory")

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def processes_seen(pid: int) -> list[dict[str, Any]]:
    inventory = read_inventory()
    return [dict(p.__dict__, gpu=g.index, is_child=p.pid == pid) for g in inventory.gpus for p in g.processes]


def pool_check(weights_gib: float, fraction: float, squatter_pid: int | None) -> dict[str, Any]:
    engine = Child(ENGINE, str(weights_gib), str(fraction))
    try:
        sized = json.loads(engine.line)
        inventory = read_inventory()
        own = {sized["pid"]}
        check = compare_pool(
            "decode", inventory.by_index([0]), fraction, weights_gib, sized["kv_bytes"] / GIB, None, own_pids=own
        )
        return {
            "engine": sized,
            "squatter_pid": squatter_pid,
            "check": check.to_json(),
            "nvml_pids": [p.pid for g in inventory.gpus for p in g.processes],
        }
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="where the results go")
    parser.add_argument("--squat-gib", type=float, default=20.0, help="GiB a second process holds on GPU 0")
    parser.add_argument("--weights-gib", type=float, default=2.0, help="the emulated engine's weights")
    parser.add_argument("--fraction", type=float, default=0.5, help="the emulated engine's mem_fraction_static")
    args = parser.parse_args(argv)
    started = time.time()
    result: dict[str, Any] = {"python": sys.version.split()[0], "pid_namespace": os.readlink("/proc/self/ns/pid")}
    result["raw_nvml"] = raw_nvml()
    result["inventory"] = read_inventory().to_json()
    result["alone"] = pool_check(args.weights_gib, args.fraction, None)
    squatter = Child(HOLD, str(args.squat_gib))
    try:
        pid = int(squatter.line)
        result["squatter"] = {
            "pid": pid,
            "gib": args.squat_gib,
            "seen": processes_seen(pid),
            "inventory_used_mib": [g.memory_used_mib for g in read_inventory().gpus],
        }
        result["beside_squatter"] = pool_check(args.weights_gib, args.fraction, pid)
    finally:
        squatter.close()
    result["wall_s"] = round(time.time() - started, 1)
    args.json.write_text(json.dumps(result, indent=1, default=str) + "\n")
    alone, beside = result["alone"]["check"]["status"], result["beside_squatter"]["check"]["status"]
    print(f"inventory: {read_inventory().summary()}")
    print(f"pool check alone: {alone}; beside a {args.squat_gib:g} GiB squatter: {beside}")
    print(f"squatter pid {pid} listed by NVML: {any(p['is_child'] for p in result['squatter']['seen'])}")
    return 0 if (alone, beside) == ("ok", "low") else 1


if __name__ == "__main__":
    sys.exit(main())
