"""`pdchaos heal RUN_DIR`: finish the undo an interrupted run left behind.

It reads the run's journal: every fault window with a journaled undo plan but no heal gets its
plan performed (resume stopped process groups, clear or stop proxies), then the processes the
run launched are stopped (`target.json`). Every step is idempotent, so healing twice is harmless.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from chaos.errors import UsageError
from chaos.journal import JOURNAL_FILENAME, EventKind, Journal, JournalEvent
from chaos.targets.state import state_path, stop_from_state
from faults.undo import UndoAction, leftovers, perform


@dataclass
class HealReport:
    done: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.left


@dataclass
class PendingWindow:
    fault: str
    plan: list[UndoAction]


def pending_plans(journal: Journal) -> dict[str, PendingWindow]:
    """Undo plans of windows that were planned but never reported healed."""
    plans: dict[str, PendingWindow] = {}
    healed: set[str] = set()
    for event in journal.iter_events(kind=EventKind.FAULT.value):
        window = str(event.data.get("window", ""))
        step = event.data.get("step")
        if step == "plan":
            plans[window] = PendingWindow(event.name, [UndoAction.from_json(a) for a in event.data.get("undo", [])])
        elif step == "heal" and event.data.get("ok", True):
            healed.add(window)
    return {w: p for w, p in plans.items() if w not in healed}


def heal_run(run_dir: Path) -> HealReport:
    if not (run_dir / JOURNAL_FILENAME).exists() and not state_path(run_dir).exists():
        raise UsageError(
            f"{run_dir} holds no journal or target state: pass the run directory a `pdchaos run` or `pdchaos load` wrote"
        )
    report = HealReport()
    plans: dict[str, PendingWindow] = {}
    journal = Journal.open(run_dir) if (run_dir / JOURNAL_FILENAME).exists() else None
    try:
        if journal is not None:
            plans = pending_plans(journal)
            for window, pending in plans.items():
                for action in pending.plan:
                    report.done.append(f"window {window}: {perform(action, None)}")
        report.done.extend(stop_from_state(run_dir))
        for pending in plans.values():
            report.left.extend(leftovers(pending.plan, None))
        if journal is not None:
            for window, pending in plans.items():  # so the next heal knows it is done
                journal.append_event(
                    JournalEvent(
                        EventKind.FAULT,
                        pending.fault,
                        {"window": window, "step": "heal", "ok": report.clean, "by": "pdchaos heal"},
                    )
                )
    finally:
        if journal is not None:
            journal.close()
    return report
