"""What every stack pdchaos launches shares: its processes, their logs, where they run, target.json.

A stack (embedded engine, SGLang, vLLM) plans its processes as `PlannedCommand`s and starts them
through its launcher; this base holds the handles it gets back and answers the Target questions
that do not depend on the engine: a role's process groups, its log, the state file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chaos.targets.dialect import SGLANG, EngineDialect
from chaos.targets.launcher import Launcher, LocalLauncher, ProcessHandle
from chaos.targets.state import state_path, write_state


class LaunchedStack:
    kind: str
    dialect: EngineDialect = SGLANG  # the embedded engine speaks SGLang's formats

    def __init__(self, run_dir: Path, launcher: Launcher | None = None) -> None:
        self.run_dir = run_dir
        self.log_dir = run_dir / "logs"
        self.launcher: Launcher = launcher or LocalLauncher()
        self.pool_report: list[dict[str, Any]] = []  # a stack that sets a role's KV pool checks it after up()
        self.procs: dict[str, ProcessHandle] = {}  # process name -> handle; a role's server is named after it
        self._hosts: dict[str, str] = {}  # role -> the address its servers bind and advertise

    def _url(self, role: str, port: int) -> str:
        return f"http://{self._hosts[role]}:{port}"

    def processes(self, role: str) -> list[ProcessHandle]:
        return [p for name, p in self.procs.items() if name == role]

    def logs(self, role: str) -> str:
        proc = self.procs.get(role)
        if proc is not None:
            return proc.read_log()  # on its node, wherever that is
        path = self.log_dir / f"{role}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _start_router(self) -> None:
        raise NotImplementedError

    def _restart_router(self) -> None:
        """The router holds no settings of its own to change: stop it, start it, record it."""
        self.procs["router"].stop()
        self._start_router()
        self.write_state()

    state_path = staticmethod(state_path)

    def write_state(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_state(
            self.run_dir,
            self.kind,
            self.endpoints,
            self.procs,
            self.launcher,
            self.log_dir,
            role_of=self._state_roles(),
            extra=self._state_extra(),
        )

    @property
    def endpoints(self) -> Any:
        raise NotImplementedError

    def _state_roles(self) -> dict[str, str]:
        """Process name -> role, where they differ (e.g. fault proxies)."""
        return {}

    def _state_extra(self) -> dict[str, Any]:
        """What else this kind records in target.json."""
        return {}
