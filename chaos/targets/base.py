"""The Target contract: a PD deployment the suite can talk to and act on (docs/architecture.md, "Target")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from chaos.targets.launcher import Launcher, PlannedCommand, ProcessHandle

if TYPE_CHECKING:
    from chaos.targets.dialect import EngineDialect

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
    dialect: EngineDialect  # how its engine states limits, failed transfers, aborts (SGLang's unless it says)

    @property
    def endpoints(self) -> Endpoints: ...

    def processes(self, role: str) -> list[ProcessHandle]:
        """The process groups of a role the suite may signal (empty when attached by URL)."""
        ...

    def restart(self, role: str, **overrides: Any) -> Any:
        """Restart one role with changed settings; raises TargetError where impossible."""
        ...

    def role_settings(self, role: str) -> dict[str, Any]:
        """The settings a role runs with now, as restart() takes them."""
        ...

    def logs(self, role: str) -> str: ...


class LinkProxy(Protocol):
    """A fault proxy on one link of a target: where it forwards to, and its control API."""

    @property
    def upstream(self) -> str: ...

    @property
    def control_url(self) -> str: ...


@runtime_checkable
class ProxiedLinks(Protocol):
    """A target with a fault proxy on its links, by link name (the embedded stack with
    `proxied_links`). The link faults act through these; on a target that is not one, or has no
    proxy on the link, they are not available."""

    @property
    def proxies(self) -> Mapping[str, LinkProxy]: ...


class Stack(Target, Protocol):
    """A target the suite launches itself, and so can also plan, start and stop."""

    launcher: Launcher  # where each role's processes run: this machine or a Ray node
    pool_report: list[dict[str, Any]]  # each role's expected vs reported KV pool after up(); empty where none is set

    def plan(self) -> list[PlannedCommand]:
        """Every process it would start, fully resolved (`pdchaos plan` prints these)."""
        ...

    def up(self) -> Endpoints: ...

    def down(self) -> None: ...
