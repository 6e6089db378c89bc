"""`target.sim`: the embedded engine as a campaign sets it up (chaos/targets/sim/settings.py holds
what one worker runs with; chaos/targets/sim/stack.py builds the stack from this section)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import Field

from chaos.spec import Strict
from chaos.targets.sim.defects import DEFECTS
from chaos.targets.sim.settings import WorkerSettings

# WorkerSettings fields the stack sets itself for each role; a campaign cannot override them.
_SET_BY_STACK = {"role", "host", "port", "bootstrap_port"}


class RouterSpec(Strict):
    retries: bool = Field(False, description="keep the router's 5xx retries (they hide transfer faults)")
    circuit_breaker: bool = False
    health_check_interval_s: int = Field(5, ge=1)


class SimSpec(Strict):
    """Settings of the embedded engine (both workers unless a role override says otherwise)."""

    page_size: int = Field(16, ge=1)
    context_length: int = Field(4096, ge=64)
    max_total_tokens: int | None = Field(
        None, ge=64, description="pool size in tokens (default: from the memory fraction)"
    )
    mem_fraction_static: float = Field(0.88, gt=0, lt=1)
    prefill_tokens_per_s: float = Field(10000.0, gt=0, description="prefill speed; TTFT grows with prompt length")
    decode_step_ms: float = Field(4.0, gt=0)
    transfer_tokens_per_s: float = Field(100000.0, gt=0)
    waiting_timeout_s: float = Field(4.0, gt=0, description="SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
    bootstrap_timeout_s: float = Field(6.0, gt=0, description="SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")
    heartbeat_interval_s: float = Field(5.0, ge=2)
    kv_checksum: bool = False
    proxied_links: bool = Field(False, description="put fault proxies on router->worker and KV transfer links")
    defects: list[str] = Field(default_factory=list, description="defect switches to turn on (pdchaos sim defects)")
    prefill: dict[str, Any] = Field(default_factory=dict, description="settings for prefill only")
    decode: dict[str, Any] = Field(default_factory=dict, description="settings for decode only")
    router: RouterSpec = Field(default_factory=RouterSpec)

    @property
    def shortest_transfer_timeout_s(self) -> float:
        return min(self.waiting_timeout_s, self.bootstrap_timeout_s)

    def problems(self, where: str) -> list[str]:
        """What the engine would refuse in this section (at `where` in the campaign): per-role
        settings it does not have or cannot take, defect switches it does not know."""
        problems = []
        known = {f.name for f in dataclasses.fields(WorkerSettings)} - _SET_BY_STACK
        for role in ("prefill", "decode"):
            overrides = getattr(self, role)
            unknown = sorted(set(overrides) - known)
            if unknown:
                problems.append(
                    f"{where}.{role}: unknown setting(s) {', '.join(unknown)}; settable: {', '.join(sorted(known))}"
                )
                continue
            try:
                dataclasses.replace(WorkerSettings(), **overrides)
            except (TypeError, ValueError) as exc:
                problems.append(f"{where}.{role}: {exc}")
        for name in self.defects:
            if name not in DEFECTS:
                problems.append(
                    f"{where}.defects: unknown defect {name!r}; known: {', '.join(DEFECTS)} (pdchaos sim defects)"
                )
        return problems
