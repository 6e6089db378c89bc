"""`target.sglang`: how to launch a real SGLang PD deployment (SGLang's `server_args.py` has every flag).

Settings at the top apply to both servers; `prefill:` and `decode:` override them for one role
(the asymmetric pools of the incident are a per-role memory fraction or context length). Ports
and hosts left out are chosen at launch: a free port on the role's node, and the address the
launcher gives that node (loopback on one machine, the node's IP on a Ray cluster).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from chaos.spec import Strict
from chaos.targets.sglang.router import ROUTER_POLICIES

TransferBackend = Literal["mooncake", "mooncake_tcp", "nixl"]
Device = Literal["cuda", "cpu"]
# The CPU tier (`make sglang-env`, docs/sglang-cpu-tier.md): where its venv is, and the pool and
# memory fraction a CPU server gets when the campaign gives none (SGLang sizes a CPU pool from host
# memory otherwise, gigabytes of it per server).
CPU_VENV = ".venv-sglang"
CPU_MAX_TOTAL_TOKENS = 8192
CPU_MEM_FRACTION = 0.05
Policy = Literal[
    "random", "round_robin", "cache_aware", "power_of_two", "bucket", "manual", "consistent_hashing", "prefix_hash"
]
assert set(Policy.__args__) == set(ROUTER_POLICIES)  # type: ignore[attr-defined]

# Flags pdchaos sets itself from typed fields; repeating one in extra_args would make two values race.
MANAGED_SERVER_FLAGS = frozenset(
    {
        "--model-path",
        "--served-model-name",
        "--host",
        "--port",
        "--tp-size",
        "--tp",
        "--base-gpu-id",
        "--mem-fraction-static",
        "--context-length",
        "--max-total-tokens",
        "--page-size",
        "--nccl-port",
        "--disaggregation-mode",
        "--disaggregation-transfer-backend",
        "--disaggregation-bootstrap-port",
        "--disaggregation-ib-device",
        "--enable-deterministic-inference",
        "--random-seed",
        "--kv-canary",
        "--kv-canary-real-data",
        "--kv-canary-sweep-interval",
        "--disaggregation-enable-kv-checksum",
        "--enable-metrics",
        "--trust-remote-code",
        "--device",
        "--disaggregation-decode-retraction-backup",
        "--enable-cache-report",
    }
)
MANAGED_ROUTER_FLAGS = frozenset(
    {
        "--host",
        "--port",
        "--pd-disaggregation",
        "--prefill",
        "--decode",
        "--policy",
        "--prometheus-host",
        "--prometheus-port",
        "--disable-retries",
        "--disable-circuit-breaker",
        "--retry-max-retries",
        "--cb-failure-threshold",
        "--health-check-interval-secs",
        "--health-failure-threshold",
        "--request-timeout-secs",
        "--health-check-timeout-secs",
    }
)
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})
SGLANG_DEFAULT_TIMEOUT_S = 300.0  # SGLANG_DISAGGREGATION_{BOOTSTRAP,WAITING}_TIMEOUT when unset


def _managed_in(args: list[str], managed: frozenset[str]) -> list[str]:
    return sorted({a.split("=", 1)[0] for a in args if a.split("=", 1)[0] in managed})


def _check_extra_args(args: list[str], managed: frozenset[str], where: str) -> None:
    found = _managed_in(args, managed)
    if found:
        raise ValueError(
            f"{where}extra_args sets {', '.join(found)}, which pdchaos sets from its own fields; use those"
        )


def _check_host(host: str | None, where: str) -> None:
    # The router derives bootstrap_host from the prefill URL, and prefill binds its bootstrap server
    # on --host: a wildcard would be advertised to decode as an address to connect to.
    if host in WILDCARD_HOSTS:
        raise ValueError(f"{where}host {host!r} is a wildcard; give the address the other servers reach this one at")


class RoleSpec(Strict):
    """Overrides for one role; anything left out comes from the shared settings."""

    gpu_ids: list[int] | None = Field(
        None,
        description="GPUs of this role (CUDA_VISIBLE_DEVICES, in PCI bus order as NVML and "
        "nvidia-smi number them), one per TP rank. Default: prefill 0..tp-1, "
        "decode after prefill's (one node)",
    )
    tp_size: int | None = Field(None, ge=1, description="--tp-size of this role")
    mem_fraction_static: float | None = Field(None, gt=0, lt=1, description="--mem-fraction-static of this role")
    context_length: int | None = Field(None, ge=1, description="--context-length of this role")
    max_total_tokens: int | None = Field(
        None, ge=1, description="--max-total-tokens of this role (pool size, overrides the fraction)"
    )
    host: str | None = Field(
        None, description="address it binds and is reached at (default: the launcher's for the role's node)"
    )
    port: int | None = Field(None, ge=1, le=65535, description="HTTP port (default: a free port)")
    nccl_port: int | None = Field(
        None, ge=1, le=65535, description="--nccl-port (default: a free port; distinct per server on one node)"
    )
    env: dict[str, str] = Field(default_factory=dict, description="environment of this role only, over the shared env")
    extra_args: list[str] = Field(default_factory=list, description="more launch_server flags for this role only")

    @model_validator(mode="after")
    def _consistent(self) -> RoleSpec:
        _check_host(self.host, "")
        if self.gpu_ids is not None and len(set(self.gpu_ids)) != len(self.gpu_ids):
            raise ValueError(f"gpu_ids {self.gpu_ids} lists a GPU twice")
        _check_extra_args(self.extra_args, MANAGED_SERVER_FLAGS, "")
        return self


class SGLangRouterSpec(Strict):
    """The SGLang router in front (python -m sglang_router.launch_router --pd-disaggregation), or smg."""

    front: Literal["sglang-router", "smg"] = Field(
        "sglang-router",
        description="which router: sglang-router (python -m sglang_router.launch_router) or smg, the "
        "Shepherd Model Gateway that succeeds it (python -m smg launch), with the same flags. When prefill rejects a prompt "
        "decode admitted, smg 1.13 answers prefill's 400 at once and decode aborts the request (not when streamed: then "
        "200 and an abort when decode's KV wait runs out); sglang-router 0.3.2 waits out decode's KV waiting timeout and "
        "answers 500",
    )

    host: str | None = Field(
        None, description="address it binds and is reached at (default: the launcher's for the router)"
    )
    port: int | None = Field(None, ge=1, le=65535, description="HTTP port (default: a free port)")
    metrics_port: int | None = Field(
        None, ge=1, le=65535, description="--prometheus-port (default: a free port, not 29000)"
    )
    policy: Policy = Field("round_robin", description="--policy for both roles")
    retries: bool = Field(
        False,
        description="keep the router's 5xx retries: each retry takes a new pair and room, which hides "
        "transfer faults (off: --disable-retries)",
    )
    max_retries: int | None = Field(
        None, ge=0, description="--retry-max-retries when retries are on (router default 5)"
    )
    circuit_breaker: bool = Field(
        False,
        description="keep the circuit breaker: it turns repeated failures into 503s for 60 s "
        "while /workers says healthy (off: --disable-circuit-breaker)",
    )
    cb_failure_threshold: int | None = Field(
        None, ge=1, description="--cb-failure-threshold when the breaker is on (default 10)"
    )
    health_check_interval_s: int = Field(5, ge=1, description="--health-check-interval-secs (router default 60)")
    health_failure_threshold: int = Field(2, ge=1, description="--health-failure-threshold")
    health_check_timeout_s: int | None = Field(
        None,
        ge=1,
        description="--health-check-timeout-secs (router default 5 s). "
        "SGLang's /health runs a 1-token generate that may "
        "take up to 20 s on a busy server: a busy CPU worker "
        "answers later than 5 s and is marked unhealthy",
    )
    request_timeout_s: int = Field(1800, ge=1, description="--request-timeout-secs")
    env: dict[str, str] = Field(default_factory=dict, description="environment of the router")
    extra_args: list[str] = Field(default_factory=list, description="more launch_router flags")

    @model_validator(mode="after")
    def _consistent(self) -> SGLangRouterSpec:
        _check_host(self.host, "router.")
        if self.max_retries is not None and not self.retries:
            raise ValueError("max_retries needs retries: true (the router runs with --disable-retries otherwise)")
        if self.cb_failure_threshold is not None and not self.circuit_breaker:
            raise ValueError("cb_failure_threshold needs circuit_breaker: true")
        _check_extra_args(self.extra_args, MANAGED_ROUTER_FLAGS, "router.")
        return self


class SGLangSpec(Strict):
    """A real SGLang PD deployment launched by pdchaos: prefill, decode (Mooncake or NIXL between them), the router."""

    model_path: str = Field(
        "",
        description="--model-path of both servers (a local directory or a hub id); with device "
        "cpu it defaults to the tiny model `make sglang-env` builds in the venv",
    )
    served_model_name: str | None = Field(None, description="--served-model-name (default: the model path)")
    python: str | None = Field(
        None,
        description="Python that has sglang installed (default: the one running pdchaos; with device cpu, the venv's)",
    )
    device: Device = Field(
        "cuda",
        description="cpu: the SGLang CPU tier made by `make sglang-env` (--device cpu, no overlap "
        "schedule or CUDA graph, Mooncake over TCP, the venv's python and libraries; "
        "docs/sglang-cpu-tier.md)",
    )
    venv: str = Field(
        CPU_VENV, description="with device cpu: the venv `make sglang-env` made, relative to the repo or absolute"
    )
    host: str | None = Field(None, description="address of both servers (default: the launcher's for each role's node)")
    tp_size: int = Field(1, ge=1, description="--tp-size of both servers")
    mem_fraction_static: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="--mem-fraction-static: weights + KV pool as a share of each GPU (default: SGLang picks)",
    )
    context_length: int | None = Field(None, ge=1, description="--context-length (default: the model's)")
    max_total_tokens: int | None = Field(
        None,
        ge=1,
        description="--max-total-tokens: the KV pool in tokens, overriding the "
        "fraction (SGLang: for development and debugging)",
    )
    page_size: int | None = Field(None, ge=1, description="--page-size (default: the attention backend's)")
    transfer_backend: TransferBackend = Field(
        "mooncake",
        description="--disaggregation-transfer-backend: mooncake (RDMA), "
        "mooncake_tcp (Mooncake over TCP, no IB device), nixl",
    )
    ib_device: str | None = Field(
        None,
        description="--disaggregation-ib-device for mooncake: a device, a comma list, a "
        "per-GPU JSON map or a JSON file (default: auto-detect)",
    )
    bootstrap_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="--disaggregation-bootstrap-port, the same on both "
        "servers (default: a free port on prefill's node)",
    )
    deterministic: bool = Field(
        False,
        description="--enable-deterministic-inference, so reference probes can be compared "
        "exactly (oracles.reference_exact)",
    )
    random_seed: int | None = Field(None, description="--random-seed")
    kv_canary: Literal["none", "log", "raise"] = Field(
        "none",
        description="--kv-canary: SGLang's own KV canary (log or raise on a "
        "violation; needs the piecewise CUDA graph off)",
    )
    kv_canary_real_data: Literal["none", "partial", "all"] | None = Field(None, description="--kv-canary-real-data")
    kv_canary_sweep_interval: int | None = Field(
        None, ge=0, description="--kv-canary-sweep-interval (needs kv_canary log or raise)"
    )
    kv_checksum: bool = Field(
        False,
        description="--disaggregation-enable-kv-checksum: Adler-32 of every KV transfer, a mismatch "
        "aborts with 500 (SGLang with PR #39500, after 2026-08-16)",
    )
    enable_metrics: bool = Field(
        True, description="--enable-metrics: /metrics, which fault confirmations and the integrity oracle read"
    )
    cache_report: bool = Field(
        True,
        description="--enable-cache-report: the OpenAI routes report usage.prompt_tokens_details."
        "cached_tokens, which the tenant-isolation oracle reads (SGLang leaves it "
        "null without this flag; /generate reports it either way)",
    )
    trust_remote_code: bool = Field(False, description="--trust-remote-code")
    bootstrap_timeout_s: int | None = Field(
        30,
        ge=1,
        description="SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT (prefill waits this long "
        "for decode's KV indices). SGLang's default is 300 s; shortened so "
        "stall and kill windows end in a timeout. null keeps SGLang's",
    )
    waiting_timeout_s: int | None = Field(
        30,
        ge=1,
        description="SGLANG_DISAGGREGATION_WAITING_TIMEOUT (decode waits this long for "
        "the KV after publishing its pages). SGLang's default is 300 s; it must "
        "exceed the slowest prefill under load. null keeps SGLang's",
    )
    heartbeat_interval_s: float | None = Field(
        None, ge=2, description="SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL (SGLang: 5, minimum 2)"
    )
    heartbeat_max_failure: int | None = Field(
        None, ge=1, description="SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE (SGLang: 2)"
    )
    env: dict[str, str] = Field(
        default_factory=dict,
        description="environment of both servers (e.g. MC_TRANSFER_TIMEOUT, "
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE)",
    )
    extra_args: list[str] = Field(default_factory=list, description="more launch_server flags for both servers")
    prefill: RoleSpec = Field(default_factory=RoleSpec, description="prefill only")
    decode: RoleSpec = Field(default_factory=RoleSpec, description="decode only")
    router: SGLangRouterSpec = Field(default_factory=SGLangRouterSpec)
    startup_timeout_s: float = Field(
        1200.0,
        gt=0,
        description="how long each server may take to answer /health (model loading, CUDA graphs: minutes)",
    )

    def role(self, role: str) -> RoleSpec:
        return self.prefill if role == "prefill" else self.decode

    def host_of(self, role: str) -> str | None:
        if role == "router":
            return self.router.host
        return self.role(role).host or self.host

    def tp_of(self, role: str) -> int:
        return self.role(role).tp_size or self.tp_size

    def gpu_ids_of(self, role: str) -> list[int]:
        """The role's GPUs: given, or the one-node layout (prefill first, decode after it)."""
        given = self.role(role).gpu_ids
        if given is not None:
            return list(given)
        start = 0 if role == "prefill" else self.tp_of("prefill")
        return list(range(start, start + self.tp_of(role)))

    def fraction_of(self, role: str) -> float | None:
        override = self.role(role).mem_fraction_static
        return override if override is not None else self.mem_fraction_static

    @property
    def shortest_transfer_timeout_s(self) -> float:
        """The shorter of the two transfer timeouts, SGLang's default where the campaign keeps it."""
        return min(
            t if t is not None else SGLANG_DEFAULT_TIMEOUT_S for t in (self.waiting_timeout_s, self.bootstrap_timeout_s)
        )

    @model_validator(mode="after")
    def _consistent(self) -> SGLangSpec:
        _check_host(self.host, "")
        if self.device == "cpu":
            self._check_cpu()
        elif not self.model_path:
            raise ValueError("model_path is required (only device: cpu has a default, the tier's tiny model)")
        if self.ib_device is not None and self.transfer_backend != "mooncake":
            raise ValueError(
                f"ib_device applies to transfer_backend mooncake only; {self.transfer_backend} uses none "
                "(mooncake_tcp is Mooncake with MC_FORCE_TCP=1 and no IB device)"
            )
        if self.kv_canary == "none" and (
            self.kv_canary_real_data is not None or self.kv_canary_sweep_interval is not None
        ):
            raise ValueError("kv_canary_real_data and kv_canary_sweep_interval need kv_canary: log or raise")
        for role in ("prefill", "decode"):
            gpus = self.gpu_ids_of(role)
            if len(gpus) != self.tp_of(role):
                raise ValueError(
                    f"{role}.gpu_ids {gpus} has {len(gpus)} GPU(s) for tp_size {self.tp_of(role)}: give one per TP rank"
                )
        self._check_shared_gpus()
        self._check_ports()
        _check_extra_args(self.extra_args, MANAGED_SERVER_FLAGS, "")
        return self

    @model_validator(mode="before")
    @classmethod
    def _cpu_defaults(cls, data: Any) -> Any:
        """What a CPU server needs that the campaign left out: Mooncake over TCP, a small explicit
        pool and memory fraction (a role's own value wins)."""
        if not isinstance(data, dict) or data.get("device") != "cpu":
            return data
        data = dict(data)
        data.setdefault("transfer_backend", "mooncake_tcp")

        def role_value(role: str, name: str) -> Any:
            given = data.get(role)
            return given.get(name) if isinstance(given, dict) else getattr(given, name, None)

        for name, default in (("max_total_tokens", CPU_MAX_TOTAL_TOKENS), ("mem_fraction_static", CPU_MEM_FRACTION)):
            if data.get(name) is None and any(role_value(r, name) is None for r in ("prefill", "decode")):
                data[name] = default
        return data

    def _check_cpu(self) -> None:
        if self.transfer_backend == "mooncake":
            raise ValueError("device cpu has no RDMA device: use transfer_backend mooncake_tcp (or nixl)")
        if self.kv_canary != "none" or self.kv_checksum:
            raise ValueError("kv_canary and kv_checksum are CUDA-only in SGLang; leave them off with device cpu")

    def _check_shared_gpus(self) -> None:
        """Here only where the campaign itself puts both roles on one host; the stack checks again
        with the hosts the launcher gives (`shared_gpu_problem`)."""
        prefill_host = self.host_of("prefill")
        if prefill_host is not None and prefill_host == self.host_of("decode"):
            problem = self.shared_gpu_problem()
            if problem:
                raise ValueError(problem)

    def shared_gpu_problem(self) -> str | None:
        """Both roles on one node's GPU (a one-GPU machine) need a memory fraction each that leaves room."""
        if self.device == "cpu":
            return None
        shared = sorted(set(self.gpu_ids_of("prefill")) & set(self.gpu_ids_of("decode")))
        if not shared:
            return None
        fractions = [self.fraction_of(r) for r in ("prefill", "decode")]
        if None in fractions:
            return (
                f"prefill and decode share GPU(s) {shared} on one host: set mem_fraction_static for both (each takes "
                "its share of the whole GPU), or give them separate gpu_ids"
            )
        if sum(f for f in fractions if f is not None) >= 0.95:
            return (
                f"prefill and decode share GPU(s) {shared} on one host with memory fractions {fractions}, which "
                "leave no room for activations: keep their sum under 0.95"
            )
        return None

    def _check_ports(self) -> None:
        """Two servers on one node cannot share a port. Roles with no host given may be on different
        Ray nodes, so ports are compared across roles only where both name the same host."""
        groups = {
            "prefill": (
                ("prefill.port", self.prefill.port),
                ("prefill.nccl_port", self.prefill.nccl_port),
                ("bootstrap_port", self.bootstrap_port),
            ),
            "decode": (("decode.port", self.decode.port), ("decode.nccl_port", self.decode.nccl_port)),
            "router": (("router.port", self.router.port), ("router.metrics_port", self.router.metrics_port)),
        }
        seen: dict[tuple[str, int], str] = {}
        for role, ports in groups.items():
            node = self.host_of(role) or f"<{role}'s node>"
            for name, port in ports:
                if port is None:
                    continue
                if (node, port) in seen:
                    raise ValueError(f"{name} and {seen[(node, port)]} are both port {port} on the same host")
                seen[(node, port)] = name
