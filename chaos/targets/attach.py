"""A deployment someone else runs, reached by URL; with process ids and log paths where given.

Only faults that need no process access apply to a URL alone. Given a role's pid (its process
group is what gets signalled: start each server with `setsid`) a stall can pause and resume it;
given a log path, confirmations and the integrity oracle read it. The suite never kills or
restarts what it did not launch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.errors import TargetError
from chaos.process import group_states, pid_alive
from chaos.targets.base import Endpoints, WorkerEndpoint


@dataclass
class AttachedProcess:
    """A process group of the deployment, known by one member's pid."""

    name: str
    pid: int
    log_path: Path | None = None
    node: str = "this machine"

    @property
    def pgid(self) -> int:
        try:
            return os.getpgid(self.pid)
        except ProcessLookupError:
            return self.pid

    @property
    def returncode(self) -> int | None:
        return None  # not our child: only "alive or not" is known

    def alive(self) -> bool:
        return pid_alive(self.pid)

    def signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.pgid, signum)
        except ProcessLookupError:
            pass

    def group_states(self) -> dict[int, str]:
        return group_states(self.pgid)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        raise TargetError(f"{self.name} was attached, not launched: pdchaos does not stop it")

    def read_log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")


@dataclass
class AttachTarget:
    router_url: str
    worker_urls: list[tuple[str, str]] = field(default_factory=list)  # (role, url)
    run_dir: Path = Path(".")
    processes_given: list[Any] = field(default_factory=list)  # campaign AttachedProcess entries (role, pid, log)
    kind: str = "attach"

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(router_url=self.router_url,
                         workers=tuple(WorkerEndpoint(role, url) for role, url in self.worker_urls))  # type: ignore[arg-type]

    def processes(self, role: str) -> list[AttachedProcess]:
        return [AttachedProcess(p.role, p.pid, Path(p.log) if p.log else None)
                for p in self.processes_given if p.role == role and p.pid is not None]

    def restart(self, role: str, **overrides: Any) -> None:
        raise TargetError(f"cannot restart {role}: the target is attached (launch it with pdchaos to allow restarts)")

    def role_settings(self, role: str) -> dict[str, Any]:
        return {}

    def logs(self, role: str) -> str:
        return "".join(AttachedProcess(p.role, p.pid or 0, Path(p.log)).read_log()
                       for p in self.processes_given if p.role == role and p.log)
