"""Undo actions: what a heal does, performed live by the runner or later by `pdchaos heal`.

Each action is idempotent (performing it twice is harmless) and checkable (`leftovers` says what
is still not undone), so a heal can be retried after any crash.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from chaos.process import group_members, kill_group, pid_alive, process_state

UndoKind = Literal["sigcont", "restart_role", "revive_role", "clear_proxy", "stop_pid"]


@dataclass(frozen=True)
class UndoAction:
    """One thing a heal must do; plain JSON so `pdchaos heal` can replay it from the journal."""

    kind: UndoKind
    role: str | None = None
    pgid: int | None = None
    pid: int | None = None
    url: str | None = None  # a proxy's control URL
    settings: dict[str, Any] = field(default_factory=dict)  # for restart_role: the original settings

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> UndoAction:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def describe(self) -> str:
        if self.kind == "sigcont":
            return f"resume process group {self.pgid} ({self.role})"
        if self.kind == "restart_role":
            return f"restore {self.role}'s settings"
        if self.kind == "revive_role":
            return f"restart {self.role} if it is down"
        if self.kind == "clear_proxy":
            return f"clear the faults of proxy {self.url}"
        return f"stop process {self.pid}"


def perform(action: UndoAction, target: Any | None) -> str:
    """Do one undo step; `target` is the live target, or None when healing a dead run."""
    if action.kind == "sigcont" and action.pgid is not None:
        handle = _handle(target, action)
        if handle is not None:  # beside the process, wherever its node is
            handle.signal_group(signal.SIGCONT)
            return action.describe()
        try:
            os.killpg(action.pgid, signal.SIGCONT)
        except ProcessLookupError:
            return f"{action.describe()}: already gone"
        return action.describe()
    if action.kind == "clear_proxy" and action.url:
        try:
            httpx.put(f"{action.url}/faults", json={}, timeout=5.0, trust_env=False).raise_for_status()
        except httpx.HTTPError as exc:
            return f"{action.describe()}: proxy unreachable ({type(exc).__name__})"
        return action.describe()
    if action.kind == "stop_pid" and action.pid is not None:
        if pid_alive(action.pid):
            kill_group(action.pid)
            return action.describe()
        return f"{action.describe()}: already gone"
    if action.kind == "restart_role" and action.role:
        if target is None:
            return f"{action.describe()}: skipped, the target is stopped instead"
        settings = dict(action.settings)
        if _settings_differ(target.role_settings(action.role), settings):
            target.restart(action.role, **settings)
            return action.describe()
        return f"{action.describe()}: already as before"
    if action.kind == "revive_role" and action.role:
        if target is None:
            return f"{action.describe()}: skipped, the target is stopped instead"
        if not role_alive(target, action.role):
            target.restart(action.role)
            return action.describe()
        return f"{action.describe()}: it is up"
    return f"nothing to do for {action.kind}"


def _handle(target: Any | None, action: UndoAction) -> Any | None:
    """The live target's handle of the action's process group, if the target is there to ask."""
    if target is None or action.role is None:
        return None
    return next((p for p in target.processes(action.role) if p.pgid == action.pgid), None)


def role_alive(target: Any, role: str) -> bool:
    procs = target.processes(role)
    return bool(procs) and all(p.alive() and p.group_states().get(p.pid) not in (None, "Z") for p in procs)


def _settings_differ(current: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    return any(current.get(k) != v for k, v in wanted.items())


def leftovers(plan: list[UndoAction], target: Any | None) -> list[str]:
    """What is still not undone, as sentences for the audit; empty when everything is clean."""
    problems = []
    for action in plan:
        if action.kind == "sigcont" and action.pgid is not None:
            handle = _handle(target, action)
            states = (
                handle.group_states()
                if handle is not None
                else {pid: process_state(pid) for pid in group_members(action.pgid)}
            )
            stopped = [pid for pid, state in states.items() if state == "T"]
            if stopped:
                problems.append(f"process group {action.pgid} ({action.role}) still has stopped processes {stopped}")
        elif action.kind == "stop_pid" and action.pid is not None and pid_alive(action.pid):
            problems.append(f"process {action.pid} is still running")
        elif action.kind == "clear_proxy" and action.url:
            try:
                faults = httpx.get(f"{action.url}/faults", timeout=5.0, trust_env=False).json()
                if faults:
                    problems.append(f"proxy {action.url} still has faults {faults}")
            except (httpx.HTTPError, ValueError):
                pass  # a proxy that is gone has no faults left
        elif (
            action.kind == "revive_role" and action.role and target is not None and not role_alive(target, action.role)
        ):
            problems.append(f"{action.role} is not running")
        elif (
            action.kind == "restart_role"
            and action.role
            and target is not None
            and _settings_differ(target.role_settings(action.role), action.settings)
        ):
            problems.append(f"{action.role} does not run with its original settings")
    return problems
