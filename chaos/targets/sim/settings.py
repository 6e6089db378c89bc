"""Settings of one embedded-engine worker, and how its KV pool size follows from them.

The pool is sized as SGLang sizes it: a memory fraction of a (simulated) GPU, minus the weights,
divided by the bytes one token of KV takes; or set directly with `max_total_tokens`. The limits
a worker enforces (`max_req_input_len`) follow from the pool and the context length exactly as in
SGLang (`validate_input_length`, `srt/managers/utils.py`), so an asymmetric pair behaves like an
asymmetric SGLang pair.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

from chaos.targets.sim.defects import DefectSet

Role = Literal["prefill", "decode", "null"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "null")

GIB = 1024**3


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}={raw!r} is not a number") from exc


@dataclass(frozen=True)
class TransferTimeouts:
    """SGLang's transfer-path timeouts; the environment variable names are SGLang's own."""

    bootstrap_timeout_s: float = 300.0  # SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (prefill)
    waiting_timeout_s: float = 300.0  # SGLANG_DISAGGREGATION_WAITING_TIMEOUT (decode)
    heartbeat_interval_s: float = 5.0  # SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL
    heartbeat_max_failure: int = 2  # SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE
    failure_prob: float = 0.0  # SGLANG_TEST_DISAGG_FAILURE_PROB

    @classmethod
    def from_env(cls) -> TransferTimeouts:
        base = cls()
        return cls(
            bootstrap_timeout_s=_env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", base.bootstrap_timeout_s),
            waiting_timeout_s=_env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", base.waiting_timeout_s),
            # SGLang clamps these two to their minimums (2 s, 1 failure).
            heartbeat_interval_s=max(
                2.0, _env_float("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", base.heartbeat_interval_s)
            ),
            heartbeat_max_failure=max(
                1,
                int(_env_float("SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", base.heartbeat_max_failure)),
            ),
            failure_prob=_env_float("SGLANG_TEST_DISAGG_FAILURE_PROB", base.failure_prob),
        )


@dataclass(frozen=True)
class WorkerSettings:
    role: Role = "null"
    host: str = "127.0.0.1"
    port: int = 30000
    bootstrap_port: int = 8998  # prefill hosts its bootstrap server here
    transfer_port: int = 0  # decode's KV receive port (0: pick a free one)
    # Where prefill should send KV for this decode worker; lets a fault proxy sit in the path.
    transfer_advertise: str | None = None
    model_path: str = "pdchaos/toy-1"
    served_model_name: str | None = None

    # Memory: pool = (gpu_memory_gb * mem_fraction_static - weights_gb) / kv_bytes_per_token.
    gpu_memory_gb: float = 80.0
    mem_fraction_static: float = 0.88
    weights_gb: float = 68.0
    kv_bytes_per_token: int = 65536
    max_total_tokens: int | None = None  # set the pool directly, like --max-total-tokens
    page_size: int = 16
    context_length: int = 8192

    # Scheduling and speed.
    max_running_requests: int = 256
    chunked_prefill_size: int = 8192
    prefill_tokens_per_s: float = 40000.0
    decode_step_s: float = 0.004  # one decode step (one token for every running request)
    transfer_tokens_per_s: float = 400000.0
    transfer_chunk_pages: int = 8

    kv_checksum: bool = False  # like --disaggregation-enable-kv-checksum
    defects: tuple[str, ...] = ()  # defect switches (defects.py); none in a clean engine
    timeouts: TransferTimeouts = field(default_factory=TransferTimeouts)
    log_level: str = "info"
    # Append each request's receive and first-token times here (timing.py); None: none kept.
    timing_log: str | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {self.role!r}")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.context_length < 2:
            raise ValueError("context_length must be >= 2")
        DefectSet.of(self.defects)  # unknown names fail here, before any process starts
        if self.pool_tokens < self.page_size:
            raise ValueError(
                f"the KV pool holds {self.pool_tokens} tokens, less than one page: raise "
                "mem_fraction_static or gpu_memory_gb, lower weights_gb, or set max_total_tokens"
            )

    @property
    def defect_set(self) -> DefectSet:
        return DefectSet.of(self.defects)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def kv_memory_gb(self) -> float:
        return self.gpu_memory_gb * self.mem_fraction_static - self.weights_gb

    @property
    def pool_tokens(self) -> int:
        """`max_total_num_tokens`: whole pages only, as SGLang rounds it."""
        if self.max_total_tokens is not None:
            raw = self.max_total_tokens
        else:
            raw = int(max(0.0, self.kv_memory_gb) * GIB // self.kv_bytes_per_token)
        return raw // self.page_size * self.page_size

    @property
    def num_pages(self) -> int:
        return self.pool_tokens // self.page_size

    @property
    def max_req_input_len(self) -> int:
        """SGLang: min(context_len - 1, max_total_num_tokens - 1) - 5."""
        return min(self.context_length - 1, self.pool_tokens - 1) - 5

    @property
    def available_gpu_mem_gb(self) -> float:
        return self.gpu_memory_gb * (1.0 - self.mem_fraction_static)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> WorkerSettings:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if "defects" in values:
            values["defects"] = tuple(values["defects"])
        if isinstance(values.get("timeouts"), dict):
            values["timeouts"] = TransferTimeouts(**values["timeouts"])
        return cls(**values)
