"""Faults made by restarting one role with other settings, restored on heal.

- memory_fraction: another memory fraction, pool size or context length on ONE role, so the
  pools become asymmetric (how the incident's decode admitted what prefill had rejected).
- engine_failure: SGLang's own `SGLANG_TEST_DISAGG_FAILURE_PROB` (the embedded engine honours the
  same name): each transfer poll may report failure without telling the peer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from chaos.errors import UsageError
from chaos.limits import WorkerLimits
from faults.base import Confirmation, Fault, FaultContext, FaultParams
from faults.signals import LogCursor, transfer_failures
from faults.undo import UndoAction

FAILURE_ENV = "SGLANG_TEST_DISAGG_FAILURE_PROB"


def _worker_url(ctx: FaultContext, role: str) -> str:
    return ctx.target.endpoints.of(role)[0].url  # type: ignore[arg-type]


def _readings(limits: WorkerLimits) -> dict[str, int | None]:
    """A restarted role's limits, by the names its confirmation evidence gives them."""
    return {
        "pool_tokens": limits.pool_tokens,
        "max_input_tokens": limits.max_req_input_len,
        "context_length": limits.context_length,
    }


@dataclass(frozen=True)
class MemoryParams(FaultParams):
    role: Literal["prefill", "decode"] = "prefill"
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    context_length: int | None = None

    def changes(self) -> dict[str, Any]:
        return {
            k: v
            for k, v in (
                ("mem_fraction_static", self.mem_fraction_static),
                ("max_total_tokens", self.max_total_tokens),
                ("context_length", self.context_length),
            )
            if v is not None
        }

    def validate(self, where: str) -> None:
        if not self.changes():
            raise UsageError(f"{where}: set at least one of mem_fraction_static, max_total_tokens, context_length")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise UsageError(f"{where}.mem_fraction_static: {self.mem_fraction_static} must be between 0 and 1")
        for name in ("max_total_tokens", "context_length"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"{where}.{name}: {value} must be a positive number of tokens")


class MemoryFraction(Fault):
    name = "memory_fraction"
    summary = "restart ONE role with another memory fraction / pool size / context length (asymmetric pools)"
    Params = MemoryParams
    targets = frozenset({"sim", "sglang", "vllm"})

    def undo_plan(self, ctx: FaultContext) -> list[UndoAction]:
        p: MemoryParams = self.params  # type: ignore[assignment]
        current = ctx.target.role_settings(p.role)
        return [UndoAction("restart_role", role=p.role, settings={k: current.get(k) for k in p.changes()})]

    def inject(self, ctx: FaultContext) -> None:
        p: MemoryParams = self.params  # type: ignore[assignment]
        dialect = ctx.target.dialect
        ctx.baseline["before"] = dialect.limits(_worker_url(ctx, p.role))
        ctx.target.restart(p.role, **p.changes())
        ctx.baseline["after"] = dialect.limits(_worker_url(ctx, p.role))

    def confirm(self, ctx: FaultContext) -> Confirmation:
        """The restarted role reports the new limits (re-read from the target, not assumed)."""
        before = _readings(ctx.baseline.get("before", WorkerLimits()))
        after = _readings(ctx.baseline.get("after", WorkerLimits()))
        changed = [k for k in after if before[k] != after[k] and after[k] is not None]
        evidence = ", ".join(f"{k}: {before[k]} -> {after[k]}" for k in after)
        return Confirmation(bool(changed), evidence)


@dataclass(frozen=True)
class EngineFailureParams(FaultParams):
    role: Literal["prefill", "decode", "both"] = "both"
    probability: float = 0.05

    def validate(self, where: str) -> None:
        if not 0 < self.probability <= 1:
            raise UsageError(f"{where}.probability: {self.probability} must be in (0, 1]")


class EngineFailure(Fault):
    name = "engine_failure"
    summary = f"restart role(s) with {FAILURE_ENV} (the engine's own transfer-failure injection)"
    Params = EngineFailureParams
    targets = frozenset({"sim", "sglang"})

    def _roles(self) -> list[str]:
        role = self.params.role  # type: ignore[attr-defined]
        return ["prefill", "decode"] if role == "both" else [role]

    def undo_plan(self, ctx: FaultContext) -> list[UndoAction]:
        return [
            UndoAction("restart_role", role=r, settings={"env": ctx.target.role_settings(r).get("env", {})})
            for r in self._roles()
        ]

    def inject(self, ctx: FaultContext) -> None:
        # Restarted workers append to the same log file, so a cursor taken now still holds; their
        # counters restart from zero, so they are read once every restarted role is up.
        ctx.baseline["cursors"] = {r: LogCursor.at_end(ctx.target.logs(r)) for r in self._roles()}
        for role in self._roles():
            env = dict(ctx.target.role_settings(role).get("env", {}))
            env[FAILURE_ENV] = str(self.params.probability)  # type: ignore[attr-defined]
            ctx.target.restart(role, env=env)
        ctx.baseline["failures"] = {r: transfer_failures(ctx.target, r) for r in self._roles()}

    def confirm(self, ctx: FaultContext) -> Confirmation:
        """A failed transfer on a restarted role: in its log, or in its failed-transfer counter.
        SGLang logs an injected failure only at DEBUG (it has no failure record, so
        `failure_exception()` in disaggregation/common/conn.py calls it another rank's), but its
        decode counts every failed transfer in `sglang:num_transfer_failed_reqs_total`."""
        lines = sum(
            cursor.count(ctx.target.logs(role), "injected failure|KVTransferError")
            for role, cursor in ctx.baseline["cursors"].items()
        )
        failed = sum(
            max(0.0, transfer_failures(ctx.target, role) - before)
            for role, before in ctx.baseline.get("failures", {}).items()
        )
        return Confirmation(
            lines > 0 or failed > 0,
            f"injected-failure or KVTransferError log lines since inject: {lines}; "
            f"failed transfers counted since the restart: {failed:g}",
        )
