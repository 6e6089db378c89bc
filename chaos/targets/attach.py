"""A deployment reached by URL only: no process access, so only faults that need none apply."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.errors import TargetError
from chaos.process import ManagedProcess
from chaos.targets.base import Endpoints, WorkerEndpoint


@dataclass
class AttachTarget:
    router_url: str
    worker_urls: list[tuple[str, str]] = field(default_factory=list)  # (role, url)
    run_dir: Path = Path(".")
    processes_given: list[Any] = field(default_factory=list)  # campaign AttachedProcess entries
    kind: str = "attach"

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(router_url=self.router_url,
                         workers=tuple(WorkerEndpoint(role, url) for role, url in self.worker_urls))  # type: ignore[arg-type]

    def processes(self, role: str) -> list[ManagedProcess]:
        return []

    def restart(self, role: str, **overrides: Any) -> None:
        raise TargetError(f"cannot restart {role}: the target is attached by URL (launch it with pdchaos to allow restarts)")

    def role_settings(self, role: str) -> dict[str, Any]:
        return {}

    def logs(self, role: str) -> str:
        return ""
