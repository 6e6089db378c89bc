"""Process faults: stall a role past the transfer timeouts, kill or pause it, restart the router.

Signals go to whole process groups (a real engine's workers outlive a killed API server). The
stall is how a late write after a free happens: the sender is frozen mid-transfer, decode gives
up and frees (or, correctly, quarantines) the pages, then the sender wakes and writes.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any, Literal

from chaos.errors import UsageError
from chaos.process import kernel_wait, live_states
from faults.base import Confirmation, Fault, FaultContext, FaultParams
from faults.signals import LogCursor, healthy, transfer_failures
from faults.undo import UndoAction

# A killed engine's exit unmaps gigabytes and a TERMed one shuts down gracefully: on a busy
# 2-core machine either took longer than 10 s in CI.
EFFECT_TIMEOUT_S = 30.0


def _procs(ctx: FaultContext, role: str) -> list[Any]:
    """The role's process groups, as handles that act beside them (on their Ray node, if remote)."""
    procs = ctx.target.processes(role)
    if not procs:
        raise UsageError(
            f"the target gives no process access to {role}: this fault needs a launched target or process ids"
        )
    return procs


def _wait_stopped(procs: list[Any], timeout_s: float = 5.0) -> bool:
    """A signal is acted on when its process next runs: on a busy machine that takes a moment."""
    deadline = time.monotonic() + timeout_s
    while not (stopped := _all_stopped(procs)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return stopped


def _all_stopped(procs: list[Any]) -> bool:
    """Every live member stopped. Zombies (an engine's exited helpers not yet reaped) cannot stop
    and run nothing, so they do not count."""
    states = [s for p in procs for s in live_states(p.group_states()).values()]
    return bool(states) and all(s == "T" for s in states)


def _states(states: dict[int, str]) -> str:
    """`pid N S`, and where in the kernel each one waits when that can be read."""
    return ", ".join(
        f"pid {pid} {state}" + (f" in {where}" if (where := kernel_wait(pid)) else "")
        for pid, state in sorted(states.items())
    )


def _peer(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"


@dataclass(frozen=True)
class StallParams(FaultParams):
    role: Literal["prefill", "decode"] = "prefill"  # hold the window longer than the waiting timeout


class TransferStall(Fault):
    name = "transfer_stall"
    summary = "SIGSTOP a role's process group past the transfer waiting timeout, then SIGCONT"
    Params = StallParams
    # Pause and resume only: an attached deployment qualifies when its campaign gives the role's pid.
    targets = frozenset({"sim", "sglang", "vllm", "attach"})
    signals_processes = True

    def freezes_sender(self) -> bool:
        p: StallParams = self.params  # type: ignore[assignment]
        return p.role == "prefill"

    def undo_plan(self, ctx: FaultContext) -> list[UndoAction]:
        role = self.params.role  # type: ignore[attr-defined]
        return [UndoAction("sigcont", role=role, pgid=p.pgid) for p in _procs(ctx, role)]

    def inject(self, ctx: FaultContext) -> None:
        role = self.params.role  # type: ignore[attr-defined]
        # Only the peer can say it timed out: the stalled role answers nothing while stopped.
        ctx.baseline["failures"] = transfer_failures(ctx.target, _peer(role))
        ctx.baseline["peer_log"] = LogCursor.at_end(ctx.target.logs(_peer(role)))
        procs = _procs(ctx, role)
        for proc in procs:
            proc.signal_group(signal.SIGSTOP)
        ctx.baseline["stopped"] = _wait_stopped(procs)

    def confirm(self, ctx: FaultContext) -> Confirmation:
        """Stopped, and the peer really timed out on it: a stall nobody waited on proves nothing."""
        peer = _peer(self.params.role)  # type: ignore[attr-defined]
        timeouts = ctx.baseline["peer_log"].count(ctx.target.logs(peer), ctx.target.dialect.transfer_timeout_log)
        failed = transfer_failures(ctx.target, peer) - ctx.baseline["failures"]
        evidence = f"stopped={ctx.baseline['stopped']}, transfer timeouts in {peer} log={timeouts}, {peer} failed-transfer counters +{failed:.0f}"
        return Confirmation(bool(ctx.baseline["stopped"]) and (timeouts > 0 or failed > 0), evidence)


@dataclass(frozen=True)
class KillParams(FaultParams):
    role: Literal["prefill", "decode", "router"] = "prefill"
    signal: Literal["KILL", "TERM", "STOP"] = "KILL"  # the window's length is the time it stays down


class ProcessKill(Fault):
    name = "process_kill"
    summary = "kill -9, SIGTERM or pause a role's process group (router included), then restart it"
    Params = KillParams
    targets = frozenset({"sim", "sglang", "vllm"})
    signals_processes = True

    def freezes_sender(self) -> bool:
        p: KillParams = self.params  # type: ignore[assignment]
        return p.signal == "STOP" and p.role == "prefill"

    def undo_plan(self, ctx: FaultContext) -> list[UndoAction]:
        p: KillParams = self.params  # type: ignore[assignment]
        if p.signal == "STOP":
            return [UndoAction("sigcont", role=p.role, pgid=proc.pgid) for proc in _procs(ctx, p.role)]
        return [UndoAction("revive_role", role=p.role)]

    def inject(self, ctx: FaultContext) -> None:
        p: KillParams = self.params  # type: ignore[assignment]
        procs = _procs(ctx, p.role)
        ctx.baseline["procs"] = procs
        for proc in procs:
            proc.signal_group(getattr(signal, f"SIG{p.signal}"))
        deadline = time.monotonic() + EFFECT_TIMEOUT_S
        while time.monotonic() < deadline and self._lingering(ctx):
            time.sleep(0.1)
        ctx.baseline["lingering"] = self._lingering(ctx)
        ctx.baseline["health_during"] = self._role_healthy(ctx)

    def _lingering(self, ctx: FaultContext) -> dict[int, str]:
        """pid -> state of each member the signal has not yet acted on (not stopped, or not dead)."""
        p: KillParams = self.params  # type: ignore[assignment]
        procs = ctx.baseline["procs"]
        live = {pid: state for proc in procs for pid, state in live_states(proc.group_states()).items()}
        if p.signal != "STOP":
            return live
        if not live:  # nothing left to pause is not a pause
            return {proc.pgid: "gone" for proc in procs}
        return {pid: state for pid, state in live.items() if state != "T"}

    def _role_healthy(self, ctx: FaultContext) -> bool:
        p: KillParams = self.params  # type: ignore[assignment]
        endpoints = ctx.target.endpoints
        url = endpoints.router_url if p.role == "router" else endpoints.of(p.role)[0].url
        return healthy(url, timeout_s=1.0)

    def confirm(self, ctx: FaultContext) -> Confirmation:
        p: KillParams = self.params  # type: ignore[assignment]
        lingering, health = ctx.baseline["lingering"], ctx.baseline["health_during"]
        what = "stopped" if p.signal == "STOP" else "gone"
        left = f" (after {EFFECT_TIMEOUT_S:.0f} s still: {_states(lingering)})" if lingering else ""
        return Confirmation(
            not lingering and not health,
            f"process group {what}={not lingering}{left}, {p.role} health during fault={health}",
        )
