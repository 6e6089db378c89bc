"""The fault contract: plan -> inject -> confirm -> heal, each step journaled.

A fault first says what its heal must undo (`undo_plan`), and the runner journals that before
`inject`, so `pdchaos heal RUN_DIR` can finish the job after the driver was SIGKILLed. `confirm`
must show the fault took effect (a metric moved, a log line appeared, a process was stopped):
an unconfirmed fault makes its window INCONCLUSIVE, never PASS. `heal` always runs.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from chaos.errors import UsageError
from chaos.journal import Journal
from chaos.targets.base import Target
from faults.undo import UndoAction, leftovers, perform


@dataclass(frozen=True)
class Confirmation:
    confirmed: bool
    evidence: str


class FaultNotAvailable(RuntimeError):
    """This fault cannot act on this target or host; the message says why ("not available here: ...")."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"not available here: {reason}")


@dataclass
class FaultContext:
    """What a fault acts on: the target, the journal, and the window it runs in."""

    target: Target
    journal: Journal | None = None
    window_id: str = ""
    baseline: dict[str, Any] = field(default_factory=dict)  # readings taken at inject, for confirm


@dataclass(frozen=True)
class FaultParams:
    """Base of every fault's parameters: typed, validated, built from campaign YAML."""

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str) -> FaultParams:
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise UsageError(
                f"{where}: unknown parameter(s) {', '.join(unknown)}; this fault takes: {', '.join(names) or 'none'}"
            )
        values: dict[str, Any] = {}
        for name, value in data.items():
            expected = names[name].type
            values[name] = _coerce(value, str(expected), f"{where}.{name}")
        try:
            params = cls(**values)
        except TypeError as exc:
            raise UsageError(f"{where}: {exc}") from None
        params.validate(where)
        return params

    def validate(self, where: str) -> None:
        """Raise UsageError naming the field and the fix."""


def _coerce(value: Any, type_name: str, where: str) -> Any:
    base = type_name.replace(" | None", "").strip()
    if value is None and "None" in type_name:
        return None
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(f"{where}: {value!r} must be a number")
        return float(value)
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(f"{where}: {value!r} must be an integer")
        return value
    if base == "bool":
        if not isinstance(value, bool):
            raise UsageError(f"{where}: {value!r} must be true or false")
        return value
    if base == "str" or base.startswith("Literal"):
        if not isinstance(value, str):
            raise UsageError(f"{where}: {value!r} must be a string")
        if base.startswith("Literal"):
            allowed = [part.strip().strip("'\"") for part in base[len("Literal[") : -1].split(",")]
            if value not in allowed:
                raise UsageError(f"{where}: {value!r} is not one of {', '.join(allowed)}")
        return value
    return value


class Fault(ABC):
    """One fault family. Subclasses set `name`, `Params`, `targets` and the four steps."""

    name: ClassVar[str]
    summary: ClassVar[str]
    Params: ClassVar[type[FaultParams]]
    targets: ClassVar[frozenset[str]] = frozenset({"sim"})  # target kinds it can act on
    signals_processes: ClassVar[bool] = False  # acts on the process group of `params.role`

    def __init__(self, params: FaultParams) -> None:
        self.params = params

    def undo_plan(self, ctx: FaultContext) -> list[UndoAction]:
        """What heal must undo if the driver dies right after inject. Journaled first."""
        return []

    def lingers_s(self) -> float:
        """How long after the heal what the fault held back can still land: a delaying proxy
        releases each chunk it holds on that chunk's own schedule. The window's provocation goes
        on at least that long, so a late write finds the request its freed pages went to."""
        return 0.0

    def freezes_sender(self) -> bool:
        """Whether the fault freezes the KV sender with writes in flight, which it makes when it
        resumes: the peer has given up on them meanwhile, and a decode that freed their pages has
        handed them to requests decoding right then. The window's provocation keeps one long
        reference decode running across it (`span`, faults/provoke.py)."""
        return False

    @abstractmethod
    def inject(self, ctx: FaultContext) -> None: ...

    @abstractmethod
    def confirm(self, ctx: FaultContext) -> Confirmation: ...

    def heal(self, ctx: FaultContext, plan: list[UndoAction]) -> None:
        """Undo the fault: by default perform the plan taken before inject (idempotent)."""
        for action in plan:
            perform(action, ctx.target)

    def audit(self, ctx: FaultContext, plan: list[UndoAction]) -> list[str]:
        """Anything the heal left behind, as sentences; empty when clean."""
        return leftovers(plan, ctx.target)
