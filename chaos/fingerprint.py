"""The environment a run qualified: versions, flags, GPUs, CPU, seed. Goes into every report."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from typing import Any

from chaos import __version__
from chaos.gpu import read_inventory


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fingerprint(seed: int, engine_info: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`engine_info`: role -> that worker's /server_info (versions and flags are read from it)."""
    gpus = read_inventory()
    flag_keys = (
        "disaggregation_mode",
        "disaggregation_transfer_backend",
        "page_size",
        "context_length",
        "max_total_num_tokens",
        "max_req_input_len",
        "mem_fraction_static",
        "disaggregation_enable_kv_checksum",
        "tp_size",
        "dp_size",
    )
    return {
        "pdchaos": __version__,
        "seed": seed,
        "engine": {
            role: {"version": info.get("version"), **{k: info.get(k) for k in flag_keys if k in info}}
            for role, info in engine_info.items()
        },
        "router": {"sglang-router": _version("sglang-router")},
        "mooncake": _version("mooncake-transfer-engine")
        or _version("mooncake-transfer-engine-non-cuda")
        or "not installed",
        "gpus": gpus.to_json(),
        "gpu_summary": gpus.summary(),
        "cpu": {"model": _cpu_model(), "cores": os.cpu_count()},
        "python": platform.python_version(),
        "platform": platform.platform(),
        "ray": _version("ray"),
        "locust": _version("locust"),
    }
