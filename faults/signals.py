"""Readings a fault uses to confirm itself: counters, queue gauges, log lines, health, router errors."""

from __future__ import annotations

import re
from dataclasses import dataclass

import httpx

from chaos import transport
from chaos.facts.prometheus import parse_prometheus_text
from chaos.targets.base import Target
from faults.base import FaultContext

TIMEOUT_S = 3.0

# What the real sglang-router (smg) logs when a request or a health check to a worker fails.
ROUTER_ERROR_LINE = (
    r"request failed with server error|error sending request|returned error status|"
    r"[Hh]ealth check failed|marked (as )?unhealthy|[Cc]onnection (refused|reset)"
)


def transfer_failures(target: Target, role: str | None = None) -> float:
    """Failed KV transfers counted by the workers (of `role`, else all), in the target's dialect;
    a worker that is down counts 0."""
    return sum(
        target.dialect.transfer_failures(w.url) or 0.0 for w in target.endpoints.workers if role in (None, w.role)
    )


def healthy(url: str, timeout_s: float = TIMEOUT_S) -> bool:
    try:
        return transport.get(f"{url}/health", timeout=timeout_s, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class LogCursor:
    """Counts a pattern in the part of a role's log written after the cursor was made."""

    start: int

    @classmethod
    def at_end(cls, text: str) -> LogCursor:
        return cls(len(text))

    def count(self, text: str, pattern: str) -> int:
        return len(re.findall(pattern, text[self.start :]))


def router_errors(ctx: FaultContext) -> float:
    """5xx responses plus worker errors on the router's /metrics; 0 when unreadable."""
    url = ctx.target.endpoints.router_metrics_url
    if not url:
        return 0.0
    try:
        text = transport.get(url, timeout=TIMEOUT_S, trust_env=False).text
    except httpx.HTTPError:
        return 0.0
    total = 0.0
    for sample in parse_prometheus_text(text):
        server_error = sample.name == "smg_http_responses_total" and sample.labels.get("status_code", "").startswith(
            "5"
        )
        if server_error or sample.name == "smg_worker_errors_total":
            total += sample.value
    return total


def _router_log(ctx: FaultContext) -> str:
    try:
        return ctx.target.logs("router")  # "" where an attached target was given no router log
    except (OSError, KeyError, ValueError):
        return ""


@dataclass
class RouterReading:
    """Router-side errors since a point in time: metrics and log lines."""

    errors: float
    log: LogCursor

    @classmethod
    def now(cls, ctx: FaultContext) -> RouterReading:
        return cls(router_errors(ctx), LogCursor.at_end(_router_log(ctx)))

    def since(self, ctx: FaultContext) -> tuple[float, int]:
        return max(0.0, router_errors(ctx) - self.errors), self.log.count(_router_log(ctx), ROUTER_ERROR_LINE)
