"""`campaigns/sglang-gpu-smoke.yaml` against real SGLang on this machine's GPUs (`-m gpu`).

Skipped, with the reason, unless all of these hold: NVML sees a GPU, `PDCHAOS_SGLANG_MODEL` names
a model SGLang can load, and the Python in `PDCHAOS_SGLANG_PYTHON` (default: this one) imports
sglang and the transfer backend's package. One GPU runs both roles at 0.4 of its memory each;
two or more put prefill on GPU 0 and decode on GPU 1.

    PDCHAOS_SGLANG_MODEL=/models/Qwen3-0.6B PDCHAOS_SGLANG_BACKEND=mooncake_tcp \\
        .venv/bin/python -m pytest -m gpu tests/test_sglang_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from chaos.gpu import read_inventory

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parent.parent
MODEL_ENV, PYTHON_ENV, BACKEND_ENV = "PDCHAOS_SGLANG_MODEL", "PDCHAOS_SGLANG_PYTHON", "PDCHAOS_SGLANG_BACKEND"
BACKEND_MODULES = {"mooncake": "mooncake.engine", "mooncake_tcp": "mooncake.engine", "nixl": "nixl"}
RUN_TIMEOUT_S = 3600  # two model loads, a stall, a restart-free schedule


def _imports(python: str, module: str) -> str | None:
    """None if `python -c 'import module'` works, else the last line of its error."""
    try:
        result = subprocess.run(
            [python, "-c", f"import {module}"], capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    return (
        None
        if result.returncode == 0
        else (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
    )


def _requirements() -> tuple[int, str, str, str]:
    """(GPU count, model, python, backend), or skip saying what is missing."""
    inventory = read_inventory()
    if not inventory.available:
        pytest.skip(f"needs a GPU: {inventory.reason}")
    model = os.environ.get(MODEL_ENV)
    if not model:
        pytest.skip(f"set {MODEL_ENV} to a model SGLang can load (a local directory or a hub id)")
    python = os.environ.get(PYTHON_ENV, sys.executable)
    backend = os.environ.get(BACKEND_ENV, "mooncake_tcp")
    if backend not in BACKEND_MODULES:
        pytest.skip(f"{BACKEND_ENV}={backend!r}: choose one of {', '.join(BACKEND_MODULES)}")
    for module in ("sglang", BACKEND_MODULES[backend]):
        error = _imports(python, module)
        if error is not None:
            pytest.skip(f"`import {module}` fails in {python}: {error}")
    return len(inventory.gpus), model, python, backend


SMOKE = ROOT / "campaigns" / "sglang-gpu-smoke.yaml"


def short_campaign(gpus: int, model: str, python: str, backend: str) -> dict[str, Any]:
    """The shipped smoke campaign, pointed at this machine's model, Python, backend and GPUs."""
    campaign: dict[str, Any] = yaml.safe_load(SMOKE.read_text())
    sglang = campaign["target"]["sglang"]
    sglang.update({"model_path": model, "python": python, "transfer_backend": backend})
    if gpus < 2:  # one GPU runs both roles at 0.4 of its memory each
        sglang["prefill"] = {"gpu_ids": [0], "mem_fraction_static": 0.4}
        sglang["decode"] = {"gpu_ids": [0], "mem_fraction_static": 0.4}
    return campaign


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_a_short_campaign_against_real_sglang_passes(tmp_path: Path) -> None:
    gpus, model, python, backend = _requirements()
    campaign = tmp_path / "campaign.yaml"
    campaign.write_text(yaml.safe_dump(short_campaign(gpus, model, python, backend), sort_keys=False))
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "chaos.cli", "run", str(campaign), "--out", str(out), "--quiet"],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd=ROOT,
        check=False,
    )
    logs = (
        "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((out / "logs").glob("*.log"))
        )
        if (out / "logs").exists()
        else ""
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:] + logs
    report = json.loads((out / "report.json").read_text())
    assert report["verdict"] == "PASS" and report["leaks"] == []
    assert not (out / "target.json").exists()  # every server stopped
