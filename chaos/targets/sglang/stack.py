"""A real SGLang PD deployment launched by pdchaos: prefill, decode and the SGLang router in front.

Each server is a `PlannedCommand` handed to the launcher (this machine, or the Ray node that
offers its role's resource), so it runs in its own session with its log captured, and a fault's
signal reaches every process of its group (SGLang's scheduler and detokenizer are children of
the API server). Readiness: each worker's `/health` (a 1-token generate through the fake
transfer, 503 while loading), then the router's `/readiness` (200 once it holds a healthy
prefill and decode). The stack writes `target.json`, so `pdchaos heal` can stop it from another
process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any

from chaos.errors import TargetError, UsageError
from chaos.process import PortTaken
from chaos.targets.base import Endpoints, WorkerEndpoint
from chaos.targets.dialect import SGLANG
from chaos.targets.launched import LaunchedStack
from chaos.targets.launcher import Launcher, PlannedCommand, ProcessHandle
from chaos.targets.sglang.commands import server_command, server_env, sglang_router_command
from chaos.targets.sglang.pool import pool_checks
from chaos.targets.sglang.readiness import await_health, await_router, router_ready_url
from chaos.targets.sglang.settings import Ports, WorkerSettings, as_restart_settings, with_overrides, worker_settings
from chaos.targets.sglang.spec import SGLangSpec
from chaos.targets.state import clear_state

ROLES = ("prefill", "decode")
POOL_CHECK_FILE = "pool-check.json"  # expected vs reported KV pool per role (chaos.gpu.PoolCheck)
log = logging.getLogger(__name__)
START_ATTEMPTS = 3  # a port taken between choosing and binding it: start again on fresh ones
ROUTER_READY_TIMEOUT_S = 120.0  # its workers are already healthy by then: seconds, not minutes


class SGLangStack(LaunchedStack):
    """Plan, launch, inspect, restart and stop a real SGLang PD deployment."""

    kind = "sglang"
    dialect = SGLANG

    def __init__(self, spec: SGLangSpec, run_dir: Path, launcher: Launcher | None = None) -> None:
        super().__init__(run_dir, launcher)
        self.spec = spec
        self._ports: Ports | None = None
        self.settings: dict[str, WorkerSettings] = {}
        # Process name -> its log's length when it was launched: each start of a role appends to
        # one log, and a start is judged by its own lines, not by a bind error of the one before.
        self._log_from: dict[str, int] = {}

    # ---------------------------------------------------------------------------- planning ----

    def _resolve(self) -> None:
        """Hosts and ports, once: `plan()` shows exactly what `up()` will start."""
        if self._ports is not None:
            return
        spec = self.spec
        self._hosts = {role: spec.host_of(role) or self.launcher.host(role) for role in (*ROLES, "router")}

        taken = {
            p
            for p in (
                spec.prefill.port,
                spec.decode.port,
                spec.prefill.nccl_port,
                spec.decode.nccl_port,
                spec.bootstrap_port,
                spec.router.port,
                spec.router.metrics_port,
            )
            if p is not None
        }

        def port(given: int | None, role: str) -> int:
            if given is not None:
                return given
            for _ in range(50):  # a port free now may be handed out twice: seven must differ
                chosen = self.launcher.free_port(role)
                if chosen not in taken:
                    taken.add(chosen)
                    return chosen
            raise UsageError(f"no free port for {role} that differs from the others ({sorted(taken)})")

        self._ports = Ports(
            prefill=port(spec.prefill.port, "prefill"),
            decode=port(spec.decode.port, "decode"),
            prefill_nccl=port(spec.prefill.nccl_port, "prefill"),
            decode_nccl=port(spec.decode.nccl_port, "decode"),
            bootstrap=port(spec.bootstrap_port, "prefill"),
            router=port(spec.router.port, "router"),
            router_metrics=port(spec.router.metrics_port, "router"),
        )
        self.settings = {role: worker_settings(spec, role, self._hosts[role], self._ports) for role in ROLES}

    @property
    def ports(self) -> Ports:
        self._resolve()
        assert self._ports is not None
        return self._ports

    def worker_command(self, role: str) -> PlannedCommand:
        self._resolve()
        s = self.settings[role]
        return PlannedCommand(
            role, role, server_command(s), self.log_dir / f"{role}.log", server_env(s), f"{s.url}/health"
        )

    def router_command(self) -> PlannedCommand:
        self._resolve()
        argv = sglang_router_command(
            self.spec.router,
            sys.executable,
            self._hosts["router"],
            self.ports,
            self.settings["prefill"],
            self.settings["decode"],
        )
        return PlannedCommand(
            "router",
            "router",
            argv,
            self.log_dir / "router.log",
            dict(self.spec.router.env),
            router_ready_url(self.router_url, self.spec.router.front),
        )

    def plan(self) -> list[PlannedCommand]:
        return [self.worker_command("prefill"), self.worker_command("decode"), self.router_command()]

    # ---------------------------------------------------------------------------- up/down ----

    def check_installed(self) -> None:
        """With device cpu, the tier's venv and model must be there (`make sglang-env`)."""
        if self.spec.device != "cpu":
            return
        for role, s in self.settings.items():
            if not Path(s.python).exists():
                raise TargetError(f"{role}: no SGLang CPU venv at {s.python}; run `make sglang-env`")
            if "/" in s.model_path and not (Path(s.model_path) / "config.json").exists():
                raise TargetError(f"{role}: no model at {s.model_path}; `make sglang-env` builds the tiny one")

    def up(self) -> Endpoints:
        """Start the deployment; one already up (every process alive) is returned as it is. Starting
        it again would launch a second server on each port: the new ones fail to bind, the old
        ones keep answering /health, and the stack loses its handles to the processes serving."""
        if self.procs and all(name in self.procs and self.procs[name].alive() for name in (*ROLES, "router")):
            return self.endpoints
        self._resolve()
        self.check_installed()
        self._check_shared_gpus()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        attempt = 1
        while True:
            try:
                self._start_all()
                return self.endpoints
            except PortTaken as exc:
                self._stop_processes()  # the launcher stays: the next start uses it
                if attempt == START_ATTEMPTS:
                    self.down()
                    raise TargetError(f"{exc} (after {attempt} starts)") from exc
                log.warning("%s; starting again on fresh ports", str(exc).splitlines()[0])
                self._ports = None  # chosen afresh; the ports the campaign gives are kept
                self._resolve()
                attempt += 1
            except BaseException:
                self.down()
                raise

    def _start_all(self) -> None:
        # Both load their weights at once; each is awaited after both have started.
        for role in ROLES:
            self._launch(self.worker_command(role))
        for role in ROLES:
            self._await_worker(role)
        self._start_router()
        self.write_state()
        self.pool_report = json.loads(json.dumps([check.to_json() for check in pool_checks(self)]))
        # target.json goes with the stack; the run directory keeps this for the report's reader.
        (self.run_dir / POOL_CHECK_FILE).write_text(json.dumps(self.pool_report, indent=2))
        self.write_state()

    def _check_shared_gpus(self) -> None:
        """Checked at launch, with the hosts the launcher gave: `pdchaos plan` places every role
        here, so only a run knows whether both roles really share a node's GPUs."""
        problem = self.spec.shared_gpu_problem() if self._hosts["prefill"] == self._hosts["decode"] else None
        if problem:
            raise UsageError(f"target.sglang: {problem}")

    def _launch(self, command: PlannedCommand) -> None:
        self._log_from[command.name] = len(self.logs(command.name))
        self.procs[command.name] = self.launcher.launch(command)
        self.write_state()  # at once: a run killed while the model loads must still be stoppable

    def _await_worker(self, role: str) -> None:
        await_health(
            self.worker_url(role) + "/health",
            self.spec.startup_timeout_s,
            self.procs[role],
            log_from=self._log_from.get(role, 0),
        )

    def _start_router(self) -> None:
        command = self.router_command()
        self._launch(command)
        self._await_router(self.procs["router"])

    def down(self) -> None:
        self._stop_processes()
        clear_state(self.run_dir)
        self.launcher.close()

    def _stop_processes(self) -> None:
        for name in ("router", "decode", "prefill"):
            proc = self.procs.get(name)
            if proc is not None:
                proc.stop(timeout_s=30.0)  # SGLang tears down its scheduler children on SIGTERM

    def restart(self, role: str, env: dict[str, str] | None = None, **overrides: Any) -> None:
        """Restart one role with changed settings, and wait until it serves again.

        `env` replaces the role's own environment (the campaign's env, e.g. plus
        SGLANG_TEST_DISAGG_FAILURE_PROB); None keeps it. Settings not named keep their values;
        one that cannot change (host, ports) is a TargetError.
        """
        if role == "router":
            return self._restart_router()
        self._resolve()
        settings = with_overrides(self.settings[role], env, overrides)
        self.procs[role].stop(timeout_s=30.0)
        self.settings[role] = settings
        self._launch(self.worker_command(role))
        self._await_worker(role)
        self._await_router_sees()
        self.write_state()

    def _await_router_sees(self) -> None:
        """The router marked the restarted worker unhealthy while it was down and takes it back
        only at its next health check: until then it answers 503 "No available prefill workers".
        Its /readiness (smg: its /workers) says so once it holds a healthy prefill and decode."""
        router = self.procs.get("router")
        if router is not None and router.alive():
            self._await_router(router)

    def _await_router(self, router: ProcessHandle) -> None:
        await_router(
            self.router_url, self.spec.router.front, ROUTER_READY_TIMEOUT_S, router, self._log_from.get("router", 0)
        )

    # -------------------------------------------------------------------------- inspection ----

    @property
    def router_url(self) -> str:
        self._resolve()
        return self._url("router", self.ports.router)

    def worker_url(self, role: str) -> str:
        self._resolve()
        return self.settings[role].url

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(
            router_url=self.router_url,
            workers=(
                WorkerEndpoint("prefill", self.worker_url("prefill"), self.ports.bootstrap),
                WorkerEndpoint("decode", self.worker_url("decode")),
            ),
            router_metrics_url=self._url("router", self.ports.router_metrics) + "/metrics",
        )

    def role_settings(self, role: str) -> dict[str, Any]:
        """The restartable settings of a role, env included, in the form `restart()` takes."""
        self._resolve()
        return as_restart_settings(self.settings[role]) if role in self.settings else {}

    # -------------------------------------------------------------------------- state file ----

    def _state_extra(self) -> dict[str, Any]:
        return {
            "commands": [
                {"name": c.name, "placement": self.launcher.placement(c.role), "shell": c.shell()} for c in self.plan()
            ],
            "settings": {role: dataclasses.asdict(s) for role, s in self.settings.items()},
            "pool": self.pool_report,
        }
