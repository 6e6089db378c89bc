"""The embedded PD stack: a prefill worker, a decode worker and the real `sglang-router` in PD mode.

Each process starts in its own session on 127.0.0.1 with free ports; the router is the PyPI
`sglang-router` (`python -m sglang_router.launch_router --pd-disaggregation`) with `HF_ENDPOINT`
pointed at loopback so its tokenizer lookup never leaves the machine (docs/performance.md).
A stack can be stopped from another process through the state file it writes.

With `proxied_links`, three standalone fault proxies (`python -m faults.proxy`, each in its own
session, clean pass-through at start) sit on the links a network fault acts on: router->prefill
HTTP, router->decode HTTP, and the KV transfer channel (decode advertises the proxy's address, so
prefill's KV writes cross it; the proxy forwards to decode's fixed transfer port). They are
recorded in the state file, so `pdchaos sim down` and `pdchaos heal` stop them too. Workers keep
their real URLs in `endpoints` (for /abort_request, /v1/loads, /metrics); only the router and
prefill's KV writes go through proxies.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from chaos.process import PortTaken, says_port_taken, wait_http_ok
from chaos.targets.base import Endpoints, WorkerEndpoint
from chaos.targets.launched import LaunchedStack
from chaos.targets.launcher import Launcher, PlannedCommand, ProcessHandle, distinct_port
from chaos.targets.sglang.router import RouterOptions, router_command  # the same router as the real stack
from chaos.targets.sim.settings import Role, TransferTimeouts, WorkerSettings
from chaos.targets.sim.spec import SimSpec
from chaos.targets.sim.worker import command_for, env_for
from chaos.targets.state import clear_state

log = logging.getLogger("pdchaos.sim")

LOOPBACK = "127.0.0.1"
ROUTER_ENV = {"HF_ENDPOINT": "http://127.0.0.1:9", "RUST_LOG": "info"}
# The links a proxied stack puts a fault proxy on, by name.
PROXY_LINKS = ("router_prefill", "router_decode", "kv_transfer")
PROXY_PREFIX = "proxy_"  # a proxy's name in `procs` and in the state file
BIND_ATTEMPTS = 3  # a stack that lost a port to another run's server starts again on new ones


@dataclass(frozen=True)
class ProxyHandle:
    """One standalone fault proxy of the stack: where it listens, where it forwards, its control API."""

    link: str
    listen: str  # HOST:PORT the proxy accepts on (what the router or prefill connects to)
    upstream: str  # HOST:PORT it forwards to (the real worker or transfer port)
    control_url: str  # http://HOST:PORT of its control API (GET/PUT /faults, GET /stats)
    pid: int

    @property
    def listen_port(self) -> int:
        return int(self.listen.rpartition(":")[2])

    @property
    def url(self) -> str:
        return f"http://{self.listen}"


@dataclass(frozen=True)
class SimStackConfig:
    """Settings shared by both workers, with per-role overrides (the asymmetry faults create)."""

    worker: WorkerSettings = field(default_factory=WorkerSettings)
    prefill_overrides: dict[str, Any] = field(default_factory=dict)
    decode_overrides: dict[str, Any] = field(default_factory=dict)
    router: RouterOptions = field(default_factory=RouterOptions)
    startup_timeout_s: float = 30.0
    # Put a fault proxy on router->prefill, router->decode and the KV transfer link (faults/links/).
    proxied_links: bool = False

    def settings_for(self, role: str, port: int, bootstrap_port: int, host: str = LOOPBACK) -> WorkerSettings:
        overrides = self.prefill_overrides if role == "prefill" else self.decode_overrides
        worker_role = cast(Role, role)  # the stack asks only for its workers' roles: prefill, decode
        return replace(self.worker, role=worker_role, host=host, port=port, bootstrap_port=bootstrap_port, **overrides)


def sim_stack_config(spec: SimSpec) -> SimStackConfig:
    """The embedded stack a campaign's `target.sim` section describes."""
    worker = WorkerSettings(
        page_size=spec.page_size,
        context_length=spec.context_length,
        max_total_tokens=spec.max_total_tokens,
        mem_fraction_static=spec.mem_fraction_static,
        prefill_tokens_per_s=spec.prefill_tokens_per_s,
        decode_step_s=spec.decode_step_ms / 1000.0,
        transfer_tokens_per_s=spec.transfer_tokens_per_s,
        kv_checksum=spec.kv_checksum,
        defects=tuple(spec.defects),
        timeouts=TransferTimeouts(
            bootstrap_timeout_s=spec.bootstrap_timeout_s,
            waiting_timeout_s=spec.waiting_timeout_s,
            heartbeat_interval_s=spec.heartbeat_interval_s,
        ),
    )
    router = RouterOptions(
        retries=spec.router.retries,
        circuit_breaker=spec.router.circuit_breaker,
        health_check_interval_s=spec.router.health_check_interval_s,
    )
    return SimStackConfig(
        worker=worker,
        prefill_overrides=dict(spec.prefill),
        decode_overrides=dict(spec.decode),
        router=router,
        proxied_links=spec.proxied_links,
    )


class SimStack(LaunchedStack):
    """Launch, inspect, restart and stop the embedded PD deployment."""

    kind = "sim"

    def __init__(self, config: SimStackConfig, run_dir: Path, launcher: Launcher | None = None) -> None:
        super().__init__(run_dir, launcher)
        self.config = config
        self.settings: dict[str, WorkerSettings] = {}
        self.extra_env: dict[str, dict[str, str]] = {}  # per role, over the settings' own env
        self._router_options = config.router
        self._ports: dict[str, int] = {}
        self.proxies: dict[str, ProxyHandle] = {}  # link name -> proxy (proxied_links only)

    # ---------------------------------------------------------------------------- up/down ----

    def plan(self) -> list[PlannedCommand]:
        """The processes up() starts, in order (proxies pick their ports when they start)."""
        self._choose_addresses()
        commands = [self._proxy_command(link) for link in PROXY_LINKS] if self.config.proxied_links else []
        commands += [self._worker_command(role, self._settings(role)) for role in ("prefill", "decode")]
        return [*commands, self._router_command()]

    def up(self) -> Endpoints:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            for attempt in range(BIND_ATTEMPTS):
                try:
                    self._start_all()
                    break
                except PortTaken as exc:  # another run's server took a port we picked: new ports, again
                    if attempt + 1 == BIND_ATTEMPTS:
                        raise
                    log.warning("sim stack: %s; starting again on new ports", exc)
                    self._stop_processes(forget=True)
            self.write_state()
        except BaseException:
            self.down()
            raise
        return self.endpoints

    def _start_all(self) -> None:
        self._choose_addresses()
        if self.config.proxied_links:
            self._start_proxies()
        for role in ("prefill", "decode"):
            self._start_worker(role, self._settings(role))
        for role in ("prefill", "decode"):
            wait_http_ok(self.worker_url(role) + "/health", self.config.startup_timeout_s, self.procs[role])
        self._start_router()

    def _choose_addresses(self) -> None:
        """Each port is picked on the node that will listen on it (all of them here, by default)."""
        taken: set[tuple[str, int]] = set()
        for name, role in (
            ("prefill", "prefill"),
            ("decode", "decode"),
            ("router", "router"),
            ("router_metrics", "router"),
            ("bootstrap", "prefill"),
        ):
            self._ports[name] = distinct_port(self.launcher, role, taken)
        # Decode's transfer port is fixed up front, so a proxy in front of it stays valid when
        # decode restarts; and no server of ours binds port 0 (chaos/process.py's free_port).
        self._ports["decode_transfer"] = distinct_port(self.launcher, "decode", taken)
        if self.config.proxied_links:
            for link in PROXY_LINKS:
                self._ports[f"{PROXY_PREFIX}{link}"] = distinct_port(self.launcher, "router", taken)
                self._ports[f"{PROXY_PREFIX}{link}_control"] = distinct_port(self.launcher, "router", taken)
        self._hosts = {role: self.launcher.host(role) for role in ("prefill", "decode", "router")}

    def _settings(self, role: str) -> WorkerSettings:
        settings = self.config.settings_for(role, self._ports[role], self._ports["bootstrap"], self._hosts[role])
        if role == "decode":
            settings = replace(settings, transfer_port=self._ports["decode_transfer"])
            if self.config.proxied_links:
                proxy = self.proxies.get("kv_transfer")
                settings = replace(settings, transfer_advertise=proxy.listen if proxy else "<kv_transfer proxy>")
        return settings

    def _worker_command(self, role: str, settings: WorkerSettings) -> PlannedCommand:
        env = {**env_for(settings.timeouts), **self.extra_env.get(role, {})}
        return PlannedCommand(
            role,
            role,
            command_for(settings),
            self.log_dir / f"{role}.log",
            env,
            ready_url=f"http://{settings.host}:{settings.port}/health",
        )

    def _start_worker(self, role: str, settings: WorkerSettings) -> None:
        self.settings[role] = settings
        self.procs[role] = self.launcher.launch(self._worker_command(role, settings))
        # Recorded before it is ready: a driver killed while it starts leaves `pdchaos heal` a pid.
        self.write_state()

    def _proxy_upstream(self, link: str) -> str:
        role, port = {
            "router_prefill": ("prefill", "prefill"),
            "router_decode": ("decode", "decode"),
            "kv_transfer": ("decode", "decode_transfer"),
        }[link]
        return f"{self._hosts[role]}:{self._ports[port]}"

    def _proxy_command(self, link: str) -> PlannedCommand:
        host = self._hosts["router"]  # the proxies sit beside the router
        name = PROXY_PREFIX + link
        argv = [
            sys.executable,
            "-m",
            "faults.proxy",
            "--listen",
            f"{host}:{self._ports[name]}",
            "--upstream",
            self._proxy_upstream(link),
            "--control",
            f"{host}:{self._ports[name + '_control']}",
        ]
        return PlannedCommand(name, "router", argv, self.log_dir / f"{name}.log")

    def _start_proxies(self) -> None:
        # Launch all three, then wait: each spends most of its start-up importing Python modules.
        for link in PROXY_LINKS:
            self.procs[PROXY_PREFIX + link] = self.launcher.launch(self._proxy_command(link))
        for link in PROXY_LINKS:
            proc = self.procs[PROXY_PREFIX + link]
            ready = _wait_proxy_ready(proc, self.config.startup_timeout_s)
            self.proxies[link] = ProxyHandle(
                link=link,
                listen=ready["listen"],
                upstream=self._proxy_upstream(link),
                control_url=f"http://{ready['control']}",
                pid=proc.pid,
            )

    def _router_worker_url(self, role: str) -> str:
        """Where the router reaches a worker: through its proxy when the links are proxied."""
        proxy = self.proxies.get(f"router_{role}")
        if proxy is not None:
            return proxy.url
        return f"<router_{role} proxy>" if self.config.proxied_links else self.worker_url(role)

    def _router_command(self) -> PlannedCommand:
        argv = router_command(
            self._router_options,
            self._ports["router"],
            self._ports["router_metrics"],
            self._router_worker_url("prefill"),
            self._ports["bootstrap"],
            self._router_worker_url("decode"),
            host=self._hosts["router"],
        )
        return PlannedCommand(
            "router", "router", argv, self.log_dir / "router.log", ROUTER_ENV, ready_url=self.router_url + "/readiness"
        )

    def _start_router(self) -> None:
        self.procs["router"] = self.launcher.launch(self._router_command())
        wait_http_ok(self.router_url + "/readiness", self.config.startup_timeout_s, self.procs["router"])

    def down(self) -> None:
        self._stop_processes()
        clear_state(self.run_dir)
        self.launcher.close()

    def _stop_processes(self, forget: bool = False) -> None:
        for name in ("router", "decode", "prefill", *(PROXY_PREFIX + link for link in PROXY_LINKS)):
            proc = self.procs.get(name)
            if proc is not None:
                proc.stop()
        if forget:  # a start again: nothing of the first attempt may be mistaken for the new
            self.procs.clear()
            self.proxies.clear()

    def restart(self, role: str, env: dict[str, str] | None = None, **overrides: Any) -> None:
        """Restart one role with changed settings (memory fraction, context length, ...).

        `env` replaces the role's extra environment (e.g. SGLANG_TEST_DISAGG_FAILURE_PROB);
        None keeps it. Settings not named keep their current values.
        """
        if role == "router":
            return self._restart_router()
        if env is not None:
            self.extra_env[role] = dict(env)
        self.procs[role].stop()
        if isinstance(overrides.get("timeouts"), dict):
            overrides["timeouts"] = TransferTimeouts(**overrides["timeouts"])
        settings = replace(self.settings[role], **overrides)
        self._start_worker(role, settings)
        wait_http_ok(self.worker_url(role) + "/health", self.config.startup_timeout_s, self.procs[role])

    # ------------------------------------------------------------------------- inspection ----

    @property
    def router_url(self) -> str:
        return self._url("router", self._ports["router"])

    def worker_url(self, role: str) -> str:
        return self._url(role, self._ports[role])

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(
            router_url=self.router_url,
            workers=(
                WorkerEndpoint("prefill", self.worker_url("prefill"), self._ports["bootstrap"]),
                WorkerEndpoint("decode", self.worker_url("decode")),
            ),
            router_metrics_url=self._url("router", self._ports["router_metrics"]) + "/metrics",
        )

    def role_settings(self, role: str) -> dict[str, Any]:
        """Current settings of a role plus its extra env, in the form restart() takes."""
        if role not in self.settings:
            return {}
        return {**dataclasses.asdict(self.settings[role]), "env": dict(self.extra_env.get(role, {}))}

    # ----------------------------------------------------------------------- state file ----

    def _state_roles(self) -> dict[str, str]:
        return {name: "proxy" for name in self.procs if name.startswith(PROXY_PREFIX)}

    def _state_extra(self) -> dict[str, Any]:
        return {"proxies": {link: dataclasses.asdict(handle) for link, handle in self.proxies.items()}}


def _wait_proxy_ready(proc: ProcessHandle, timeout_s: float) -> dict[str, Any]:
    """The JSON line a standalone proxy prints once it listens (it names its own pid)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = proc.read_log()
        for line in text.splitlines():
            if line.startswith("{"):
                try:
                    ready: dict[str, Any] = json.loads(line)  # a line that opens with { is an object
                except ValueError:
                    continue
                if ready.get("pid") == proc.pid and ready.get("listen") and ready.get("control"):
                    return ready
        if not proc.alive():
            error = PortTaken if says_port_taken(text) else RuntimeError  # its bind lost the race
            raise error(
                f"{proc.name} exited with code {proc.returncode} before it listened; see its log:\n{proc.read_log()[-2000:]}"
            )
        time.sleep(0.05)
    raise TimeoutError(
        f"{proc.name} did not report its ports within {timeout_s:.0f}s; its log ends:\n{proc.read_log()[-2000:]}"
    )
