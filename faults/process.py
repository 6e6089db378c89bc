"""Process faults: stall a role past the transfer timeouts, kill or pause it, restart the router.

Signals go to whole process groups (a real engine's workers outlive a killed API server). The
stall is how a late write after a free happens: the sender is frozen mid-transfer, decode gives
up and frees (or, correctly, quarantines) the pages, then the sender wakes and writes.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Literal

from chaos.errors import UsageError
from faults.base import Confirmation, Fault, FaultContext, FaultParams
from chaos.targets.dialect import dialect_of
from faults.signals import LogCursor, healthy, transfer_failures
from faults.undo import UndoAction, group_members, process_state



def _groups(ctx: FaultContext, role: str) -> list[int]:
    procs = ctx.target.processes(role)
    if not procs:
        raise UsageError(f"the target gives no process access to {role}: this fault needs a launched target or process ids")
    return [p.pgid for p in procs]


def _peer(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"


@dataclass(frozen=True)
class StallParams(FaultParams):
    role: Literal["prefill", "decode"] = "prefill"  # hold the window longer than the waiting timeout


class TransferStall(Fault):
    name = "transfer_stall"
    summary = "SIGSTOP a role's process group past the transfer waiting timeout, then SIGCONT"
    Params = StallParams
    targets = frozenset({"sim", "sglang", "vllm"})

    def undo_plan(self, ctx: FaultContext) -> list[UndoAction]:
        role = self.params.role  # type: ignore[attr-defined]
        return [UndoAction("sigcont", role=role, pgid=pgid) for pgid in _groups(ctx, role)]

    def inject(self, ctx: FaultContext) -> None:
        role = self.params.role  # type: ignore[attr-defined]
        # Only the peer can say it timed out: the stalled role answers nothing while stopped.
        ctx.baseline["failures"] = transfer_failures(ctx.target, _peer(role))
        ctx.baseline["peer_log"] = LogCursor.at_end(ctx.target.logs(_peer(role)))
        for pgid in _groups(ctx, role):
            signal_group(pgid, signal.SIGSTOP)
        ctx.baseline["stopped"] = all(
            process_state(pid) == "T" for pgid in _groups(ctx, role) for pid in group_members(pgid)
        )

    def confirm(self, ctx: FaultContext) -> Confirmation:
        """Stopped, and the peer really timed out on it: a stall nobody waited on proves nothing."""
        peer = _peer(self.params.role)  # type: ignore[attr-defined]
        timeouts = ctx.baseline["peer_log"].count(ctx.target.logs(peer), dialect_of(ctx.target).transfer_timeout_log)
        failed = transfer_failures(ctx.target, peer) - ctx.baseline["failures"]
        evidence = f"stopped={ctx.baseline['stopped']}, transfer timeouts in {peer} log={timeouts}, {peer} failed-transfer counters +{failed:.0f}"
        return Confirmation(bool(ctx.baseline["stopped"]) and (timeouts > 0 or failed > 0), evidence)


def signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


@dataclass(frozen=True)
class KillParams(FaultParams):
    role: Literal["prefill", "decode", "router"] = "prefill"
    signal: Literal["KILL", "TERM", "STOP"] = "KILL"  # the window's length is the time it stays down


class ProcessKill(Fault):
    name = "process_kill"
    summary = "kill -9, SIGTERM or pause a role's process group (router included), then restart it"
    Params = KillParams
    targets = frozenset({"sim", "sglang", "vllm"})

    def undo_plan(self, ctx: FaultContext) -> list[UndoAction]:
        p: KillParams = self.params  # type: ignore[assignment]
        if p.signal == "STOP":
            return [UndoAction("sigcont", role=p.role, pgid=pgid) for pgid in _groups(ctx, p.role)]
        return [UndoAction("revive_role", role=p.role)]

    def inject(self, ctx: FaultContext) -> None:
        p: KillParams = self.params  # type: ignore[assignment]
        groups = _groups(ctx, p.role)
        ctx.baseline["groups"] = groups
        for pgid in groups:
            signal_group(pgid, getattr(signal, f"SIG{p.signal}"))
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and not self._took_effect(ctx):
            time.sleep(0.1)
        ctx.baseline["effect"] = self._took_effect(ctx)
        ctx.baseline["health_during"] = self._role_healthy(ctx)

    def _took_effect(self, ctx: FaultContext) -> bool:
        p: KillParams = self.params  # type: ignore[assignment]
        members = [pid for pgid in ctx.baseline["groups"] for pid in group_members(pgid)]
        if p.signal == "STOP":
            return bool(members) and all(process_state(pid) == "T" for pid in members)
        return all(process_state(pid) in (None, "Z") for pid in members)

    def _role_healthy(self, ctx: FaultContext) -> bool:
        p: KillParams = self.params  # type: ignore[assignment]
        endpoints = ctx.target.endpoints
        url = endpoints.router_url if p.role == "router" else endpoints.of(p.role)[0].url  # type: ignore[arg-type]
        return healthy(url, timeout_s=1.0)

    def confirm(self, ctx: FaultContext) -> Confirmation:
        p: KillParams = self.params  # type: ignore[assignment]
        effect, health = ctx.baseline.get("effect"), ctx.baseline.get("health_during")
        what = "stopped" if p.signal == "STOP" else "gone"
        return Confirmation(bool(effect) and not health, f"process group {what}={effect}, {p.role} health during fault={health}")
