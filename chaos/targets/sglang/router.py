"""The SGLang router in PD mode (`sglang_router.launch_router --pd-disaggregation`), as one argv.

The embedded stack and the SGLang stack start the same router the same way, so its flags live here
once. Retries and the circuit breaker are off by default: the router retries 5xx with a new pair
and a new bootstrap room, and opens its breakers after repeated failures, so a transfer fault
would be retried away or turned into 503s the suite never sees (docs/real-sglang.md).

Two fronts take these flags: sglang-router and smg, the Shepherd Model Gateway that succeeds it on
PyPI (`python -m smg launch`). They differ where it matters to the incident: when prefill rejects a
prompt decode admitted, smg 1.13 answers prefill's 400 at once and drops decode's request (decode
aborts it), while sglang-router 0.3.2 waits out decode's KV waiting timeout and answers its 500.
A streamed request behind smg still waits: decode's stream is already forwarded, 200, and ends in
an abort when the wait runs out (docs/sglang-cpu-tier.md).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Literal

RouterFront = Literal["sglang-router", "smg"]
FRONT_MODULES: dict[str, tuple[str, ...]] = {
    "sglang-router": ("-m", "sglang_router.launch_router"),
    "smg": ("-m", "smg", "launch"),
}

ROUTER_POLICIES = (
    "random",
    "round_robin",
    "cache_aware",
    "power_of_two",
    "bucket",
    "manual",
    "consistent_hashing",
    "prefix_hash",
)


@dataclass(frozen=True)
class RouterOptions:
    retries: bool = False
    circuit_breaker: bool = False
    policy: str = "round_robin"
    health_check_interval_s: int = 5  # the router's own default is 60 s: a dead worker would go unseen for a minute
    health_failure_threshold: int = 2
    health_check_timeout_s: int | None = None  # --health-check-timeout-secs (the router's default is 5 s)
    request_timeout_s: int = 1800
    max_retries: int | None = None  # --retry-max-retries, with retries on (the router's default is 5)
    cb_failure_threshold: int | None = None  # --cb-failure-threshold, with the breaker on (default 10)
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    front: RouterFront = "sglang-router"


def router_command(
    options: RouterOptions,
    port: int,
    metrics_port: int,
    prefill_url: str,
    bootstrap_port: int | None,
    decode_url: str,
    host: str = "127.0.0.1",
    python: str | None = None,
) -> list[str]:
    """argv of the router; `bootstrap_port` None lets prefill's own --disaggregation-bootstrap-port apply."""
    argv = [
        python or sys.executable,
        *FRONT_MODULES[options.front],
        "--host",
        host,
        "--port",
        str(port),
        "--pd-disaggregation",
        "--prefill",
        prefill_url,
        *([str(bootstrap_port)] if bootstrap_port is not None else []),
        "--decode",
        decode_url,
        "--policy",
        options.policy,
        # Its Prometheus port defaults to 29000 whatever --port says: always set it.
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        "--worker-startup-check-interval",
        "1",
        "--health-check-interval-secs",
        str(options.health_check_interval_s),
        "--health-failure-threshold",
        str(options.health_failure_threshold),
        "--health-success-threshold",
        "1",
        "--request-timeout-secs",
        str(options.request_timeout_s),
    ]
    if options.health_check_timeout_s is not None:
        argv += ["--health-check-timeout-secs", str(options.health_check_timeout_s)]
    if not options.retries:
        argv.append("--disable-retries")
    elif options.max_retries is not None:
        argv += ["--retry-max-retries", str(options.max_retries)]
    if not options.circuit_breaker:
        argv.append("--disable-circuit-breaker")
    elif options.cb_failure_threshold is not None:
        argv += ["--cb-failure-threshold", str(options.cb_failure_threshold)]
    return argv + list(options.extra_args)
