"""One SGLang server's settings, fully resolved: the spec's shared values, its role's overrides, ports.

`restart(role, **overrides)` replaces fields of this record, so what the memory-fraction fault
changes (`mem_fraction_static`, `max_total_tokens`, `context_length`) and what engine_failure
changes (`env`) are fields here. Where the server listens is not restartable: the router and
the peer keep the URLs they were given.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.errors import TargetError
from chaos.targets.sglang.spec import SGLangSpec


@dataclass(frozen=True)
class Ports:
    """Every port of the deployment, chosen once so `plan()` and `up()` agree."""

    prefill: int
    decode: int
    prefill_nccl: int
    decode_nccl: int
    bootstrap: int
    router: int
    router_metrics: int


@dataclass(frozen=True)
class WorkerSettings:
    role: str  # "prefill" or "decode": --disaggregation-mode
    python: str
    model_path: str
    host: str
    port: int
    bootstrap_port: int
    nccl_port: int
    gpu_ids: tuple[int, ...]
    tp_size: int = 1
    served_model_name: str | None = None
    mem_fraction_static: float | None = None
    context_length: int | None = None
    max_total_tokens: int | None = None
    page_size: int | None = None
    transfer_backend: str = "mooncake"
    ib_device: str | None = None
    deterministic: bool = False
    random_seed: int | None = None
    kv_canary: str = "none"
    kv_canary_real_data: str | None = None
    kv_canary_sweep_interval: int | None = None
    kv_checksum: bool = False
    enable_metrics: bool = True
    cache_report: bool = True
    trust_remote_code: bool = False
    bootstrap_timeout_s: int | None = None
    waiting_timeout_s: int | None = None
    heartbeat_interval_s: float | None = None
    heartbeat_max_failure: int | None = None
    env: dict[str, str] = field(default_factory=dict)  # the spec's env and the role's, or what a restart gave
    extra_args: tuple[str, ...] = ()
    device: str = "cuda"  # "cpu": the CPU tier's flags and environment (commands.py)
    native_libs: str | None = None  # the CPU tier's private libibverbs & co, for LD_LIBRARY_PATH

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


# Fields a restart may not change: the server must come back where everyone else expects it.
FIXED_ON_RESTART = frozenset({"role", "host", "port", "bootstrap_port", "nccl_port", "device", "native_libs"})
REPO = Path(__file__).resolve().parents[3]


def cpu_venv(spec: SGLangSpec) -> Path:
    """The CPU tier's venv (`make sglang-env`), absolute."""
    venv = Path(spec.venv)
    return venv if venv.is_absolute() else REPO / venv


RESTARTABLE = frozenset(f.name for f in dataclasses.fields(WorkerSettings)) - FIXED_ON_RESTART


def worker_settings(spec: SGLangSpec, role: str, host: str, ports: Ports) -> WorkerSettings:
    r = spec.role(role)

    def pick(name: str) -> Any:
        value = getattr(r, name)
        return value if value is not None else getattr(spec, name)

    python, model_path, native_libs = spec.python or sys.executable, spec.model_path, None
    if spec.device == "cpu":
        venv = cpu_venv(spec)
        python = spec.python or str(venv / "bin" / "python")
        model_path = model_path or str(venv / "models" / "tiny-llama")
        native_libs = str(venv / "native" / "lib")
    return WorkerSettings(
        role=role,
        python=python,
        model_path=model_path,
        host=host,
        device=spec.device,
        native_libs=native_libs,
        port=ports.prefill if role == "prefill" else ports.decode,
        bootstrap_port=ports.bootstrap,
        nccl_port=ports.prefill_nccl if role == "prefill" else ports.decode_nccl,
        gpu_ids=tuple(spec.gpu_ids_of(role)),
        tp_size=spec.tp_of(role),
        served_model_name=spec.served_model_name,
        mem_fraction_static=pick("mem_fraction_static"),
        context_length=pick("context_length"),
        max_total_tokens=pick("max_total_tokens"),
        page_size=spec.page_size,
        transfer_backend=spec.transfer_backend,
        ib_device=spec.ib_device,
        deterministic=spec.deterministic,
        random_seed=spec.random_seed,
        kv_canary=spec.kv_canary,
        kv_canary_real_data=spec.kv_canary_real_data,
        kv_canary_sweep_interval=spec.kv_canary_sweep_interval,
        kv_checksum=spec.kv_checksum,
        enable_metrics=spec.enable_metrics,
        cache_report=spec.cache_report,
        trust_remote_code=spec.trust_remote_code,
        bootstrap_timeout_s=spec.bootstrap_timeout_s,
        waiting_timeout_s=spec.waiting_timeout_s,
        heartbeat_interval_s=spec.heartbeat_interval_s,
        heartbeat_max_failure=spec.heartbeat_max_failure,
        env={**spec.env, **r.env},
        extra_args=(*spec.extra_args, *r.extra_args),
    )


def with_overrides(settings: WorkerSettings, env: dict[str, str] | None, overrides: dict[str, Any]) -> WorkerSettings:
    """The settings a restart runs with; a field it may not change is a TargetError naming it."""
    fixed = sorted(set(overrides) & FIXED_ON_RESTART)
    unknown = sorted(set(overrides) - RESTARTABLE - FIXED_ON_RESTART)
    if fixed or unknown:
        problems = ([f"{', '.join(fixed)} cannot change on restart"] if fixed else []) + (
            [f"unknown setting(s) {', '.join(unknown)}"] if unknown else []
        )
        raise TargetError(
            f"restart {settings.role}: {'; '.join(problems)}; restartable: {', '.join(sorted(RESTARTABLE))}"
        )
    values = dict(overrides)
    for name in ("gpu_ids", "extra_args"):  # lists from a journaled undo plan
        if isinstance(values.get(name), list):
            values[name] = tuple(values[name])
    if env is not None:
        values["env"] = dict(env)
    return dataclasses.replace(settings, **values)


def as_restart_settings(settings: WorkerSettings) -> dict[str, Any]:
    """The restartable settings as plain JSON values, the form `restart()` takes back."""
    data = dataclasses.asdict(settings)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items() if k in RESTARTABLE}
