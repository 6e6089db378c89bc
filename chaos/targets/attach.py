"""A deployment someone else runs, reached by URL; with process ids and log paths where given.

Only faults that need no process access apply to a URL alone. Given a role's pid (its process
group is what gets signalled: start each server with `setsid`) a stall can pause and resume it;
given a log path, confirmations and the integrity oracle read it. The suite never kills or
restarts what it did not launch, and never signals a pid that now names another process: each
pid's start time is taken when the run attaches (and checked against the campaign's `command` and
`started_at` where given), and a pid that started at another time since is refused.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from chaos.errors import TargetError, UsageError
from chaos.process import command_line, group_states, pid_alive, started_at
from chaos.targets.base import Endpoints, WorkerEndpoint, WorkerRole
from chaos.targets.dialect import SGLANG, EngineDialect
from chaos.targets.launcher import ProcessHandle
from chaos.targets.spec import AttachedProcess as AttachedProcessSpec

START_TOLERANCE_S = 1.0  # `ps -o lstart` gives whole seconds; the kernel's start time drifts under that


@dataclass
class AttachedProcess:
    """A process group of the deployment, known by one member's pid."""

    name: str
    pid: int
    log_path: Path | None = None
    node: str = "this machine"
    started: float | None = None  # the pid's start time when the run attached: a later process may reuse the pid

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
        return pid_alive(self.pid) and not self._reused()

    def _reused(self) -> bool:
        """The pid names a process that started after the one attached (its own is gone)."""
        now = started_at(self.pid)
        return self.started is not None and now is not None and abs(now - self.started) > START_TOLERANCE_S

    def signal_group(self, signum: int) -> None:
        if self._reused():
            raise TargetError(
                f"{self.name}: pid {self.pid} now names a process started at {started_at(self.pid):.0f}, not the one "
                f"attached (started at {self.started:.0f}): it is not signalled"
            )
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signum)

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
    worker_urls: list[tuple[WorkerRole, str]] = field(default_factory=list)  # (role, url)
    run_dir: Path = Path(".")
    processes_given: list[Any] = field(default_factory=list)  # campaign AttachedProcess entries (role, pid, log)
    kind: str = "attach"
    dialect: EngineDialect = SGLANG  # attach() reads OPENAI where the URLs speak no SGLang endpoint

    def __post_init__(self) -> None:
        self._started = {p.pid: started_at(p.pid) for p in self.processes_given if p.pid is not None}

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(
            router_url=self.router_url, workers=tuple(WorkerEndpoint(role, url) for role, url in self.worker_urls)
        )

    def processes(self, role: str) -> list[ProcessHandle]:
        return [
            AttachedProcess(p.role, p.pid, Path(p.log) if p.log else None, started=self._started.get(p.pid))
            for p in self.processes_given
            if p.role == role and p.pid is not None
        ]

    def restart(self, role: str, **overrides: Any) -> None:
        raise TargetError(f"cannot restart {role}: the target is attached (launch it with pdchaos to allow restarts)")

    def role_settings(self, role: str) -> dict[str, Any]:
        return {}

    def logs(self, role: str) -> str:
        return "".join(
            AttachedProcess(p.role, p.pid or 0, Path(p.log)).read_log()
            for p in self.processes_given
            if p.role == role and p.log
        )


def check_attached(processes: Sequence[AttachedProcessSpec]) -> None:
    """Refuse, naming the field, a given pid that is not the process the campaign means: none
    there, or one whose command line or start time differs (the pid was reused)."""
    for i, p in enumerate(processes):
        if p.pid is None:
            continue
        where = f"target.processes[{i}]"
        start = started_at(p.pid)
        if start is None:
            raise UsageError(f"{where}.pid: no process {p.pid} on this machine; give the {p.role}'s pid")
        command = command_line(p.pid) or ""
        if p.command is not None and p.command not in command:
            raise UsageError(
                f"{where}.command: pid {p.pid} runs `{command[:160]}`, which does not hold {p.command!r}; "
                f"a later process reuses the pid? give the {p.role}'s current pid"
            )
        if p.started_at is not None and abs(start - p.started_at) > START_TOLERANCE_S:
            raise UsageError(
                f"{where}.started_at: pid {p.pid} started at {start:.0f}, not {p.started_at:.0f}: a later process "
                f"reuses the pid; give the {p.role}'s current pid and start time"
            )
