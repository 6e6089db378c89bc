"""From resolved settings to the exact SGLang command lines and environments (SGLang's `server_args.py`, `environ.py`).

Pure functions, no I/O: `pdchaos plan` prints what they build, the stack launches the same thing,
and the tests check every flag against SGLang's names without a GPU.
"""

from __future__ import annotations

from chaos.targets.sglang.router import RouterOptions, router_command
from chaos.targets.sglang.settings import Ports, WorkerSettings
from chaos.targets.sglang.spec import SGLangRouterSpec

BOOTSTRAP_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
WAITING_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
HEARTBEAT_INTERVAL_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"
HEARTBEAT_MAX_FAILURE_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"


def _number(value: float) -> str:
    """ "30", not "30.0": some of SGLang's environment variables are read as integers."""
    return str(int(value)) if float(value).is_integer() else str(value)


def server_command(s: WorkerSettings) -> list[str]:
    """`python -m sglang.launch_server ...` for one role of the PD pair."""
    argv = [
        s.python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        s.model_path,
        "--disaggregation-mode",
        s.role,
        "--host",
        s.host,
        "--port",
        str(s.port),
        "--tp-size",
        str(s.tp_size),
        # GPUs are chosen by CUDA_VISIBLE_DEVICES (server_env), so rank 0 is the first visible one.
        "--base-gpu-id",
        "0",
        # Two servers on one node must not race for NCCL's default port.
        "--nccl-port",
        str(s.nccl_port),
        "--disaggregation-transfer-backend",
        s.transfer_backend,
        # Both sides: prefill hosts the bootstrap server there, decode falls back to it.
        "--disaggregation-bootstrap-port",
        str(s.bootstrap_port),
    ]
    optional: list[tuple[str, object]] = [
        ("--served-model-name", s.served_model_name),
        ("--mem-fraction-static", s.mem_fraction_static),
        ("--context-length", s.context_length),
        ("--max-total-tokens", s.max_total_tokens),
        ("--page-size", s.page_size),
        ("--disaggregation-ib-device", s.ib_device),
        ("--random-seed", s.random_seed),
        ("--kv-canary-real-data", s.kv_canary_real_data),
        ("--kv-canary-sweep-interval", s.kv_canary_sweep_interval),
    ]
    for flag, value in optional:
        if value is not None:
            argv += [flag, str(value)]
    if s.kv_canary != "none":
        argv += ["--kv-canary", s.kv_canary]
    switches = [
        ("--enable-deterministic-inference", s.deterministic),
        ("--disaggregation-enable-kv-checksum", s.kv_checksum),
        ("--enable-metrics", s.enable_metrics),
        ("--enable-cache-report", s.cache_report),
        ("--trust-remote-code", s.trust_remote_code),
    ]
    argv += [flag for flag, on in switches if on]
    if s.device == "cpu":
        argv += cpu_flags(s.role)
    return argv + list(s.extra_args)


def cpu_flags(role: str) -> list[str]:
    """What SGLang needs on CPUs (docs/sglang-cpu-tier.md): no overlap scheduler and no CUDA graph
    (both CUDA streams); an idle scheduler that waits for its next request instead of spinning
    (`--sleep-on-idle`: a spinning idle prefill takes the core a lone decode needs, which then
    paces at 70-90 ms a token instead of 3); and on decode a retraction backup in plain tensors
    (the default pinned host pool registers CUDA host memory, which fails without a driver)."""
    flags = ["--device", "cpu", "--disable-overlap-schedule", "--disable-cuda-graph", "--sleep-on-idle"]
    if role == "decode":
        flags += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    return flags


def server_env(s: WorkerSettings) -> dict[str, str]:
    """What the server's environment adds to the inherited one: its GPUs (or the CPU tier's
    switches), the transfer timeouts, its env."""
    if s.device == "cpu":
        env = {
            "SGLANG_USE_CPU_ENGINE": "1",  # SGLang's CPU code paths (utils/common.py is_cpu)
            "SGLANG_HOST_IP": s.host,  # else Mooncake advertises the first interface's address
            "LD_LIBRARY_PATH": s.native_libs or "",  # Mooncake links libibverbs even over TCP
            "HF_HUB_OFFLINE": "1",
        }
    else:
        env = {
            # PCI order, so GPU ids mean what NVML and nvidia-smi (and the GPU inventory) call them.
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in s.gpu_ids),
        }
    timeouts = (
        (BOOTSTRAP_TIMEOUT_ENV, s.bootstrap_timeout_s),
        (WAITING_TIMEOUT_ENV, s.waiting_timeout_s),
        (HEARTBEAT_INTERVAL_ENV, s.heartbeat_interval_s),
        (HEARTBEAT_MAX_FAILURE_ENV, s.heartbeat_max_failure),
    )
    env.update({name: _number(value) for name, value in timeouts if value is not None})
    env.update(s.env)  # the campaign's env wins: it is the most specific thing anyone wrote
    return env


def router_options(spec: SGLangRouterSpec) -> RouterOptions:
    return RouterOptions(
        retries=spec.retries,
        circuit_breaker=spec.circuit_breaker,
        policy=spec.policy,
        health_check_interval_s=spec.health_check_interval_s,
        health_failure_threshold=spec.health_failure_threshold,
        health_check_timeout_s=spec.health_check_timeout_s,
        request_timeout_s=spec.request_timeout_s,
        max_retries=spec.max_retries,
        cb_failure_threshold=spec.cb_failure_threshold,
        extra_args=tuple(spec.extra_args),
        front=spec.front,
    )


def sglang_router_command(
    spec: SGLangRouterSpec, python: str, host: str, ports: Ports, prefill: WorkerSettings, decode: WorkerSettings
) -> list[str]:
    """The router in front of this pair; it tells decode prefill's bootstrap port in every request."""
    return router_command(
        router_options(spec),
        ports.router,
        ports.router_metrics,
        prefill.url,
        ports.bootstrap,
        decode.url,
        host=host,
        python=python,
    )
