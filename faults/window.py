"""Run one fault window: journal the undo plan, inject, hold, confirm, heal, audit.

Heal runs on every exit path: normal end, exception, and SIGINT/SIGTERM (the caller turns those
into exceptions). Every step lands in the journal as a `fault/<name>` event with the window id,
so the oracles and `pdchaos heal` can rebuild what happened.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chaos.journal import EventKind, Journal, JournalEvent
from faults.base import Confirmation, Fault, FaultContext
from faults.provoke import Provoker
from faults.undo import UndoAction

log = logging.getLogger("pdchaos.faults")

CONFIRM_POLL_S = 0.5


@dataclass
class WindowResult:
    window_id: str
    fault: str
    started: float = 0.0
    ended: float = 0.0
    confirmation: Confirmation = field(default_factory=lambda: Confirmation(False, "not run"))
    healed: bool = False
    leftovers: list[str] = field(default_factory=list)
    error: str | None = None


def _journal(journal: Journal | None, fault: Fault, window_id: str, step: str, **data: object) -> None:
    if journal is not None:
        journal.append_event(JournalEvent(EventKind.FAULT, fault.name, {"window": window_id, "step": step, **data}))


def run_window(
    fault: Fault,
    ctx: FaultContext,
    duration_s: float,
    params: dict[str, Any] | None = None,
    keep_going: Callable[[], bool] = lambda: True,
    provoker: Provoker | None = None,
) -> WindowResult:
    """Hold the fault for `duration_s` (or until `keep_going` turns False), always healing it.
    A `provoker` sends its traffic from the inject on, and on past the heal (faults/provoke.py):
    the caller joins it."""
    result = WindowResult(window_id=ctx.window_id, fault=fault.name)
    journal = ctx.journal
    plan: list[UndoAction] = fault.undo_plan(ctx)
    _journal(journal, fault, ctx.window_id, "plan", params=params or {}, undo=[a.to_json() for a in plan])
    try:
        if provoker is not None:
            provoker.prepare(ctx)  # sized on the whole target, before the fault
        result.started = time.time()
        # The window opens when injection starts: a kill takes effect during inject().
        _journal(journal, fault, ctx.window_id, "inject", params=params or {})
        if provoker is not None:
            provoker.opened(ctx)  # in the window, and in flight before the fault acts
        fault.inject(ctx)
        if provoker is not None:
            provoker.start(ctx)
        deadline = time.monotonic() + duration_s
        early: Confirmation | None = None
        while time.monotonic() < deadline and keep_going():
            time.sleep(min(CONFIRM_POLL_S, max(0.0, deadline - time.monotonic())))
            if early is None:
                attempt = fault.confirm(ctx)
                early = attempt if attempt.confirmed else None
        result.confirmation = early or fault.confirm(ctx)
        _journal(
            journal,
            fault,
            ctx.window_id,
            "confirm",
            confirmed=result.confirmation.confirmed,
            evidence=result.confirmation.evidence,
        )
    except Exception as exc:  # the fault itself broke: record it, still heal
        result.error = f"{type(exc).__name__}: {exc}"
        log.exception("fault %s failed", fault.name)
        _journal(journal, fault, ctx.window_id, "error", error=result.error)
        if result.confirmation.evidence == "not run":
            result.confirmation = Confirmation(False, f"fault raised {result.error}")
            _journal(journal, fault, ctx.window_id, "confirm", confirmed=False, evidence=result.confirmation.evidence)
    finally:
        try:
            fault.heal(ctx, plan)
            result.healed = True
        except Exception as exc:
            result.error = (result.error or "") + f" heal failed: {type(exc).__name__}: {exc}"
            log.exception("heal of %s failed", fault.name)
        result.ended = time.time()
        _journal(journal, fault, ctx.window_id, "heal", ok=result.healed, error=result.error)
        if provoker is not None:
            provoker.healed()
        result.leftovers = fault.audit(ctx, plan)
        _journal(journal, fault, ctx.window_id, "audit", clean=not result.leftovers, leftovers=result.leftovers)
    return result
