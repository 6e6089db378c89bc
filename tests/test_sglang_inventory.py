"""The GPU inventory (chaos/gpu.py): the real no-GPU path here, NVML answers through a fake `pynvml`
module (our reading of NVML's API, not NVML), the answers a real H200 gave replayed through it, and
the pool-vs-fraction check."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from chaos.fingerprint import fingerprint
from chaos.gpu import Gpu, GpuProcess, compare_pool, read_inventory

GIB_MIB = 1024.0


def test_this_machine_without_a_gpu_says_no_gpu_and_nothing_fails() -> None:
    inventory = read_inventory()
    if inventory.available:
        pytest.skip(f"this machine has GPUs: {inventory.summary()}")
    assert inventory.reason.startswith("no GPU: ")
    assert inventory.gpus == () and inventory.summary() == inventory.reason
    env = fingerprint(0, {})
    assert env["gpus"]["available"] is False and env["gpu_summary"].startswith("no GPU")


@dataclass
class FakeProc:
    pid: int
    usedGpuMemory: int | None


@dataclass
class FakeMemory:
    total: int
    used: int
    free: int


@dataclass
class FakePci:
    busId: bytes


def fake_nvml(init_error: str | None = None, fail_on_device: int | None = None) -> types.ModuleType:
    """A `pynvml` with two 80 GiB GPUs (bytes names, as older bindings return), one busy."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_LibraryNotFound(NVMLError):
        def __str__(self) -> str:
            return "NVML Shared Library Not Found"

    class NVMLError_NotSupported(NVMLError):
        pass

    calls: list[str] = []
    gib = 2**30
    devices = [
        {
            "name": b"NVIDIA H100 80GB HBM3",
            "uuid": "GPU-aaa",
            "bus": b"00000000:18:00.0",
            "memory": FakeMemory(80 * gib, 70 * gib, 10 * gib),
            "compute": [FakeProc(4242, 68 * gib), FakeProc(777, None)],
            "graphics": [FakeProc(4242, 68 * gib), FakeProc(555, gib)],
        },
        {
            "name": "NVIDIA H100 80GB HBM3",
            "uuid": "GPU-bbb",
            "bus": "00000000:2A:00.0",
            "memory": FakeMemory(80 * gib, gib // 2, 80 * gib - gib // 2),
            "compute": [],
            "graphics": [],
        },
    ]
    names = {4242: b"python3", 555: "Xorg"}

    def init() -> None:
        calls.append("init")
        if init_error == "library":
            raise NVMLError_LibraryNotFound()

    def device(index: int) -> dict[str, object]:
        if index == fail_on_device:
            raise NVMLError("Unknown Error")
        return devices[index]

    def process_name(pid: int) -> object:
        if pid not in names:
            raise NVMLError_NotSupported("Not Supported")
        return names[pid]

    nvml.NVMLError = NVMLError  # type: ignore[attr-defined]
    nvml.NVMLError_LibraryNotFound = NVMLError_LibraryNotFound  # type: ignore[attr-defined]
    nvml.nvmlInit = init  # type: ignore[attr-defined]
    nvml.nvmlShutdown = lambda: calls.append("shutdown")  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCount = lambda: len(devices)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = device  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetMemoryInfo = lambda h: h["memory"]  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetName = lambda h: h["name"]  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetUUID = lambda h: h["uuid"]  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetPciInfo = lambda h: FakePci(h["bus"])  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetComputeRunningProcesses = lambda h: h["compute"]  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetGraphicsRunningProcesses = lambda h: h["graphics"]  # type: ignore[attr-defined]
    nvml.nvmlSystemGetProcessName = process_name  # type: ignore[attr-defined]
    nvml.nvmlSystemGetDriverVersion = lambda: b"550.54.15"  # type: ignore[attr-defined]
    nvml.nvmlSystemGetCudaDriverVersion = lambda: 12040  # type: ignore[attr-defined]
    nvml.nvmlSystemGetNVMLVersion = lambda: "12.550.54.15"  # type: ignore[attr-defined]
    nvml.calls = calls  # type: ignore[attr-defined]
    return nvml


@pytest.fixture
def install_nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    def install(module: types.ModuleType) -> types.ModuleType:
        monkeypatch.setitem(sys.modules, "pynvml", module)
        return module

    yield install


def test_library_not_found_is_no_gpu(install_nvml) -> None:  # type: ignore[no-untyped-def]
    install_nvml(fake_nvml(init_error="library"))
    inventory = read_inventory()
    assert not inventory.available and inventory.reason == "no GPU: NVML Shared Library Not Found"


def test_missing_binding_is_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert read_inventory().reason == "no GPU: nvidia-ml-py is not installed"


def test_inventory_devices_memory_processes_and_driver(install_nvml) -> None:  # type: ignore[no-untyped-def]
    nvml = install_nvml(fake_nvml())
    inventory = read_inventory()
    assert inventory.available and nvml.calls == ["init", "shutdown"]
    assert (inventory.driver_version, inventory.cuda_driver_version, inventory.nvml_version) == (
        "550.54.15",
        "12.4",
        "12.550.54.15",
    )
    first, second = inventory.gpus
    assert (first.index, first.name, first.uuid, first.pci_bus_id) == (
        0,
        "NVIDIA H100 80GB HBM3",
        "GPU-aaa",
        "00000000:18:00.0",
    )
    assert (first.memory_total_mib, first.memory_used_mib, first.memory_free_mib) == (
        80 * GIB_MIB,
        70 * GIB_MIB,
        10 * GIB_MIB,
    )
    # compute and graphics lists merged by pid; names where NVML gives them; unknown use stays unknown
    assert first.processes == (
        GpuProcess(4242, 68 * GIB_MIB, "python3", "compute"),
        GpuProcess(777, None, None, "compute"),
        GpuProcess(555, GIB_MIB, "Xorg", "graphics"),
    )
    assert second.processes == () and second.memory_used_mib == 512.0
    assert inventory.summary() == (
        "2 GPU(s), driver 550.54.15, CUDA 12.4: 0: NVIDIA H100 80GB HBM3 (80 GiB, 70.0 used), "
        "1: NVIDIA H100 80GB HBM3 (80 GiB, 0.5 used)"
    )
    assert [g.index for g in inventory.by_index([1, 0, 5])] == [1, 0]
    assert inventory.to_json()["gpus"][0]["processes"][0]["name"] == "python3"


H200_RECORD = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "gpu-inventory-h200.json"


def nvml_from_record(record: dict[str, Any]) -> types.ModuleType:
    """A `pynvml` answering exactly what the real NVML answered on an H200 (driver 580,
    nvidia-ml-py 13.615.71): `benchmarks/gpu_inventory_check.py` recorded every call's value and type."""

    def value(answer: dict[str, Any]) -> Any:
        return answer["value"].encode() if answer["type"] == "bytes" else answer["value"]

    nvml = fake_nvml()
    raw = record["raw_nvml"]
    devices = [
        {
            "name": value(d["name"]),
            "uuid": value(d["uuid"]),
            "bus": value(d["pci_busId"]),
            "memory": FakeMemory(**d["memory"]),
            "compute": [],
            "graphics": [],
        }
        for d in raw["devices"]
    ]
    system = raw["system"]
    nvml.nvmlDeviceGetCount = lambda: len(devices)  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda index: devices[index]  # type: ignore[attr-defined]
    nvml.nvmlSystemGetDriverVersion = lambda: value(system["nvmlSystemGetDriverVersion"])  # type: ignore[attr-defined]
    nvml.nvmlSystemGetCudaDriverVersion = lambda: value(system["nvmlSystemGetCudaDriverVersion"])  # type: ignore[attr-defined]
    nvml.nvmlSystemGetNVMLVersion = lambda: value(system["nvmlSystemGetNVMLVersion"])  # type: ignore[attr-defined]
    return nvml


def test_the_answers_of_a_real_h200_give_the_inventory_the_real_run_gave(install_nvml) -> None:  # type: ignore[no-untyped-def]
    """The fake above is our reading of NVML's API; this one replays a real H200's answers (str,
    not bytes, in current bindings; CUDA 13000 for 13.0) and must give what read_inventory gave there."""
    record = json.loads(H200_RECORD.read_text())
    install_nvml(nvml_from_record(record))
    assert json.loads(json.dumps(read_inventory().to_json())) == record["inventory"]
    assert (
        record["inventory"]["cuda_driver_version"] == "13.0" and record["inventory"]["gpus"][0]["name"] == "NVIDIA H200"
    )


def test_the_pool_check_on_a_real_h200_said_ok_alone_and_named_the_process_beside_it() -> None:
    """Recorded by benchmarks/gpu_inventory_check.py: an engine sized its pool as SGLang does, alone
    and beside a process holding 20 GiB; NVML listed that process under the pid the OS gave it."""
    record = json.loads(H200_RECORD.read_text())
    alone, beside = record["alone"]["check"], record["beside_squatter"]["check"]
    assert alone["status"] == "ok" and beside["status"] == "low"
    squatter = record["squatter"]
    assert [p["pid"] for p in beside["other_processes"]] == [squatter["pid"]]
    assert any(p["is_child"] and p["used_memory_mib"] >= squatter["gib"] * 1024 for p in squatter["seen"])
    # And compare_pool, given what NVML listed there, judges now as it judged then.
    gpu = record["inventory"]["gpus"][0]
    for case in (record["alone"], record["beside_squatter"]):
        check, engine = case["check"], case["engine"]
        others = tuple(GpuProcess(**p) for p in check["other_processes"])
        listed = (*others, GpuProcess(engine["pid"], None))
        assert sorted(p.pid for p in listed) == sorted(case["nvml_pids"])
        gpus = [Gpu(gpu["index"], gpu["name"], gpu["uuid"], gpu["memory_total_mib"], gpu["memory_used_mib"], listed)]
        again = compare_pool(
            check["role"],
            gpus,
            check["mem_fraction_static"],
            check["weights_gib"],
            engine["kv_bytes"] / 2**30,
            None,
            own_pids={engine["pid"]},
        )
        assert json.loads(json.dumps(again.to_json())) == check


def test_an_nvml_error_mid_inventory_is_reported_and_nvml_shut_down(install_nvml) -> None:  # type: ignore[no-untyped-def]
    nvml = install_nvml(fake_nvml(fail_on_device=1))
    inventory = read_inventory()
    assert not inventory.available and inventory.reason == "GPU inventory failed: Unknown Error"
    assert nvml.calls == ["init", "shutdown"]


def test_fingerprint_carries_the_inventory(install_nvml) -> None:  # type: ignore[no-untyped-def]
    install_nvml(fake_nvml())
    env = fingerprint(3, {"prefill": {"version": "0.5.17", "mem_fraction_static": 0.85}})
    assert env["gpus"]["available"] and len(env["gpus"]["gpus"]) == 2 and env["gpu_summary"].startswith("2 GPU(s)")
    assert env["engine"]["prefill"]["mem_fraction_static"] == 0.85


# ------------------------------------------------------------------------ the pool check ----


def gpu(index: int, total_gib: float = 80.0, processes: tuple[GpuProcess, ...] = ()) -> Gpu:
    return Gpu(index, "H100", f"GPU-{index}", total_gib * GIB_MIB, 0.0, processes)


def test_pool_as_the_fraction_gives_is_ok_with_expected_tokens() -> None:
    # 80 GiB x 0.85 - 30 GiB weights = 38 GiB expected; the engine holds 36.5 GiB in 400,000 tokens.
    check = compare_pool("prefill", [gpu(0)], 0.85, 30.0, 36.5, 400_000)
    assert check.status == "ok" and check.expected_kv_gib == pytest.approx(38.0)
    assert check.expected_pool_tokens == pytest.approx(38.0 / 36.5 * 400_000, rel=1e-4)
    assert "36.50 GiB vs 38.00 GiB expected" in check.reason


def test_pool_smaller_than_the_fraction_names_other_processes_on_the_gpu() -> None:
    other = GpuProcess(999, 20 * GIB_MIB, "python3")
    own = GpuProcess(100, 66 * GIB_MIB, "sglang")
    check = compare_pool("decode", [gpu(1, processes=(own, other))], 0.85, 30.0, 18.0, 200_000, own_pids={100})
    assert check.status == "low" and check.other_processes == (other,)
    assert "other processes on these GPUs hold 20.00 GiB" in check.reason


def test_pool_larger_than_the_fraction_allows_and_tp_sized_by_the_smallest_gpu() -> None:
    assert compare_pool("prefill", [gpu(0)], 0.5, 30.0, 36.0, 400_000).status == "high"
    check = compare_pool("prefill", [gpu(0, 80.0), gpu(1, 40.0)], 0.85, 10.0, 24.0, 100_000)
    assert check.gpu_total_gib == 40.0 and check.expected_kv_gib == pytest.approx(24.0) and check.status == "ok"
    assert (
        compare_pool("prefill", [gpu(0)], 0.3, 30.0, 1.0, 10).status == "low"
    )  # the fraction does not hold the weights


def test_pool_without_a_reading_is_unknown_and_says_which() -> None:
    check = compare_pool("prefill", [], 0.85, None, 36.0, 400_000)
    assert check.status == "unknown"
    assert check.reason == "cannot compare: no reading of the role's GPUs in the inventory, the weights' memory"
