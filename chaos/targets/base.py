"""The Target contract: a PD deployment the suite can talk to and act on (docs/architecture.md, "Target")."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from chaos.process import ManagedProcess
from chaos.targets.launcher import PlannedCommand

WorkerRole = Literal["prefill", "decode"]


@dataclass(frozen=True)
class WorkerEndpoint:
    role: WorkerRole
    url: str
    bootstrap_port: int | None = None


@dataclass(frozen=True)
class Endpoints:
    """Where a deployment answers: the router, each worker, the router's Prometheus port."""

    router_url: str
    workers: tuple[WorkerEndpoint, ...] = ()
    router_metrics_url: str | None = None

    def of(self, role: WorkerRole) -> list[WorkerEndpoint]:
        return [w for w in self.workers if w.role == role]

    @property
    def prefill_urls(self) -> list[str]:
        return [w.url for w in self.of("prefill")]

    @property
    def decode_urls(self) -> list[str]:
        return [w.url for w in self.of("decode")]


@dataclass(frozen=True)
class ProcessRef:
    """A process group the suite launched (or was given) and may signal."""

    name: str
    role: str
    pid: int
    pgid: int
    log_path: str


@dataclass
class TargetState:
    """What a launched target writes to disk, so another process can stop or heal it."""

    kind: str
    endpoints: Endpoints
    processes: list[ProcessRef] = field(default_factory=list)


class Target(Protocol):
    """What the runner and the faults need of a deployment (launched or attached)."""

    kind: str
    run_dir: Path

    @property
    def endpoints(self) -> Endpoints: ...

    def processes(self, role: str) -> list[ManagedProcess]:
        """The process groups of a role the suite may signal (empty when attached by URL)."""
        ...

    def restart(self, role: str, **overrides: Any) -> Any:
        """Restart one role with changed settings; raises TargetError where impossible."""
        ...

    def role_settings(self, role: str) -> dict[str, Any]:
        """The settings a role runs with now, as restart() takes them."""
        ...

    def logs(self, role: str) -> str: ...


class Stack(Target, Protocol):
    """A target the suite launches itself, and so can also plan, start and stop."""

    def plan(self) -> list[PlannedCommand]:
        """Every process it would start, fully resolved (`pdchaos plan` prints these)."""
        ...

    def up(self) -> Endpoints: ...

    def down(self) -> None: ...
