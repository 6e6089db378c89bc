"""The vLLM CPU PD pair launched by pdchaos: a prefill and a decode engine and vllm-router in front.

Prefill is a `kv_producer`, decode a `kv_consumer` (NixlConnector, KV buffers in CPU memory, UCX
over loopback); decode pulls each prompt's KV from prefill. The front is the real `vllm-router`
(`--vllm-pd-disaggregation`): it sends a request to prefill with max_tokens 1 and
`do_remote_decode`, then to decode with the `kv_transfer_params` prefill returned, and streams
decode's answer back. Every process runs in its own session (killing one vLLM PID leaves its
EngineCore and Worker alive, docs/vllm-tier.md), with the vLLM venv's python, through `engine.py`
(the NIXL idle-CPU fix). Readiness: each engine's `/health`, then the router's `/health` and `/readiness`
(200 once it holds a healthy prefill and decode).
Ports come from below the kernel's ephemeral range (chaos/process.py's `free_port`): vLLM's own
sockets bind ephemeral ports and could take one between our choice and the engine's bind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from chaos.errors import TargetError
from chaos.process import PortTaken, says_port_taken, wait_http_ok
from chaos.targets.base import Endpoints, WorkerEndpoint
from chaos.targets.launched import LaunchedStack
from chaos.targets.launcher import Launcher, PlannedCommand, distinct_port
from chaos.targets.state import clear_state
from chaos.targets.vllm.dialect import VllmDialect
from chaos.targets.vllm.spec import VllmSpec

ROLES = ("prefill", "decode")
REPO = Path(__file__).resolve().parents[3]
ENGINE_SCRIPT = Path(__file__).resolve().parent / "engine.py"
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
ROUTER_READY_TIMEOUT_S = 60.0
ROUTER_HEALTH_INTERVAL_S = 2
# The suite's probes name no model and send "default" (SGLang serves any name; vLLM answers 404 to
# an unknown one), so the engines answer to that alias too; /v1/models lists the real name first.
DEFAULT_MODEL_ALIAS = "default"
BIND_RETRIES = 3  # an engine that lost its port to another socket is started again on new ones


@dataclass
class RoleSettings:
    """What a role runs with; restart() changes these (memory_fraction's keys map onto them)."""

    max_model_len: int
    kv_cache_bytes: int
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Ports:
    router: int
    router_metrics: int
    http: dict[str, int]
    side_channel: dict[str, int]


class VllmStack(LaunchedStack):
    """Plan, launch, inspect, restart and stop the vLLM CPU PD pair."""

    kind = "vllm"

    def __init__(self, spec: VllmSpec, run_dir: Path, launcher: Launcher | None = None) -> None:
        super().__init__(run_dir, launcher)
        self.spec = spec
        self.dialect = VllmDialect(dev_mode=spec.server_dev_mode)
        self.settings: dict[str, RoleSettings] = {
            role: RoleSettings(
                getattr(spec, role).max_model_len or spec.max_model_len,
                getattr(spec, role).kv_cache_bytes or spec.kv_cache_bytes,
            )
            for role in ROLES
        }
        self._hosts = {role: self.launcher.host(role) for role in (*ROLES, "router")}
        self._ports: Ports | None = None
        self.bytes_per_token: dict[str, float] = {}  # KV bytes per token, read from each engine
        self.startup_s: dict[str, float] = {}  # measured: launch to ready, per process
        self.restarts: list[dict[str, Any]] = []  # role, stopped_at, launched_at, ready_at (epoch s)

    # ---------------------------------------------------------------------------- planning ----

    @property
    def venv_python(self) -> Path:
        venv = Path(self.spec.venv)
        return (venv if venv.is_absolute() else REPO / venv) / "bin" / "python"

    @property
    def model_dir(self) -> Path:
        if self.spec.model:
            return Path(self.spec.model)
        return self.venv_python.parent.parent / "models" / "tiny-llama"

    def check_installed(self) -> None:
        if not self.venv_python.exists():
            raise TargetError(f"the vLLM venv is missing ({self.venv_python}); run `make vllm-env`")
        if not (self.model_dir / "config.json").exists():
            raise TargetError(f"no model at {self.model_dir}; `make vllm-env` builds the tiny one")

    @property
    def ports(self) -> Ports:
        if self._ports is None:
            self._ports = self._pick_ports()
        return self._ports

    def _pick_ports(self) -> Ports:
        taken: set[tuple[str, int]] = set()

        def pick(role: str, count: int) -> list[int]:
            return [distinct_port(self.launcher, role, taken) for _ in range(count)]

        router = pick("router", 2)
        prefill, decode = pick("prefill", 2), pick("decode", 2)
        return Ports(
            router=router[0],
            router_metrics=router[1],
            http={"prefill": prefill[0], "decode": decode[0]},
            side_channel={"prefill": prefill[1], "decode": decode[1]},
        )

    def engine_command(self, role: str) -> PlannedCommand:
        s, spec, host = self.settings[role], self.spec, self._hosts[role]
        kv_config: dict[str, Any] = {
            "kv_connector": "NixlConnector",
            "kv_role": KV_ROLE[role],
            "kv_buffer_device": "cpu",
        }
        if spec.kv_lease_s is not None:
            kv_config["kv_connector_extra_config"] = {"kv_lease_duration": spec.kv_lease_s}
        argv = [
            str(self.venv_python),
            str(ENGINE_SCRIPT),
            "--model",
            str(self.model_dir),
            "--served-model-name",
            *dict.fromkeys((spec.served_model_name, DEFAULT_MODEL_ALIAS)),
            "--host",
            host,
            "--port",
            str(self.ports.http[role]),
            "--max-model-len",
            str(s.max_model_len),
            "--dtype",
            "bfloat16",
            "--kv-cache-memory-bytes",
            str(s.kv_cache_bytes),
            "--kv-transfer-config",
            json.dumps(kv_config),
            "--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching",
            "--enable-log-requests",  # at INFO: ids and params, no prompts; and "Request X aborted."
            "--enable-prompt-tokens-details",
        ]  # usage.prompt_tokens_details.cached_tokens: prefix-cache reuse
        if spec.enforce_eager:
            argv.append("--enforce-eager")
        env = {
            "HF_HUB_OFFLINE": "1",
            "HF_ENDPOINT": "http://127.0.0.1:9",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": host,
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(self.ports.side_channel[role]),
            "PDCHAOS_NIXL_PTHR_DELAY_US": str(spec.nixl_progress_delay_us),
        }
        if spec.server_dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if (os.cpu_count() or 1) >= 2:  # one core each: two engines spinning OpenMP on both cores fight
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(ROLES.index(role))
        env.update(spec.env)
        env.update(s.env)
        return PlannedCommand(role, role, argv, self.log_dir / f"{role}.log", env, f"{self.worker_url(role)}/health")

    def router_command(self) -> PlannedCommand:
        host, ports = self._hosts["router"], self.ports
        # Retries and the circuit breaker would hide faults from the suite: off.
        argv = [
            str(self.venv_python),
            "-m",
            "vllm_router.launch_router",
            "--host",
            host,
            "--port",
            str(ports.router),
            "--vllm-pd-disaggregation",
            "--kv-connector",
            "nixl",
            "--prefill",
            self.worker_url("prefill"),
            "--decode",
            self.worker_url("decode"),
            "--prometheus-host",
            host,
            "--prometheus-port",
            str(ports.router_metrics),
            "--disable-retries",
            "--disable-circuit-breaker",
            "--worker-startup-check-interval",
            "1",
            "--health-check-interval-secs",
            str(ROUTER_HEALTH_INTERVAL_S),
            "--health-failure-threshold",
            "2",
            "--health-success-threshold",
            "1",
            "--request-timeout-secs",
            "300",
        ]
        env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1"}
        return PlannedCommand("router", "router", argv, self.log_dir / "router.log", env, f"{self.router_url}/health")

    def plan(self) -> list[PlannedCommand]:
        return [self.engine_command("prefill"), self.engine_command("decode"), self.router_command()]

    # ---------------------------------------------------------------------------- up/down ----

    def up(self) -> Endpoints:
        """Start the pair; a stack already up (every process alive) is returned as it is."""
        if self.procs and all(name in self.procs and self.procs[name].alive() for name in (*ROLES, "router")):
            return self.endpoints
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.check_installed()
        try:
            for attempt in range(BIND_RETRIES):
                started = time.monotonic()
                for role in ROLES:  # both load at once; each is awaited after both started
                    self._launch(self.engine_command(role))
                try:
                    for role in ROLES:
                        self._await_engine(role, started)
                    break
                except RuntimeError as exc:
                    if attempt + 1 == BIND_RETRIES or not _lost_port(exc):
                        raise
                    for role in ROLES:  # another socket took a port first: new ports, again
                        self.procs[role].stop(timeout_s=30.0)
                    self._ports = None
            self._start_router()
            self._read_bytes_per_token()
            self.write_state()
        except BaseException:
            self.down()
            raise
        return self.endpoints

    def _launch(self, command: PlannedCommand) -> None:
        self.procs[command.name] = self.launcher.launch(command)
        self.write_state()  # at once: a run killed while the engines load must still be stoppable

    def _await_engine(self, role: str, started: float) -> None:
        wait_http_ok(self.worker_url(role) + "/health", self.spec.startup_timeout_s, self.procs[role], interval_s=1.0)
        self.startup_s[role] = time.monotonic() - started

    def _start_router(self) -> None:
        started = time.monotonic()
        for attempt in range(BIND_RETRIES):
            self._launch(self.router_command())
            try:
                wait_http_ok(self.router_url + "/health", ROUTER_READY_TIMEOUT_S, self.procs["router"], interval_s=0.5)
                break
            except RuntimeError as exc:  # the engines' own sockets may take a port after it was picked
                if attempt + 1 == BIND_RETRIES or not _lost_port(exc):
                    raise
                router, metrics = (self.launcher.free_port("router") for _ in range(2))
                self._ports = dataclasses.replace(self.ports, router=router, router_metrics=metrics)
        self._await_router_sees("router")
        self.startup_s["router"] = time.monotonic() - started

    def _read_bytes_per_token(self) -> None:
        for role in ROLES:
            pool = self.dialect.limits(self.worker_url(role)).pool_tokens
            if pool:
                self.bytes_per_token[role] = self.settings[role].kv_cache_bytes / pool

    def down(self) -> None:
        for name in ("router", "decode", "prefill"):
            proc = self.procs.get(name)
            if proc is not None:
                proc.stop(timeout_s=30.0)  # SIGTERM lets the API server take its engine children down
        clear_state(self.run_dir)
        self.launcher.close()

    def restart(self, role: str, env: dict[str, str] | None = None, **overrides: Any) -> None:
        """Restart one role (router included) with changed settings and wait until it serves.

        `context_length` sets --max-model-len; `max_total_tokens` sets --kv-cache-memory-bytes to
        that many tokens of KV. vLLM on CPU sizes its cache in bytes, so `mem_fraction_static`
        has no meaning here. `env` replaces the role's own environment; None keeps it.
        """
        if role == "router":
            return self._restart_router()
        if role not in ROLES:
            raise TargetError(f"the vLLM pair has no role {role!r}; roles: prefill, decode, router")
        settings = self._with_overrides(role, env, overrides)
        stopped_at = time.time()
        self.procs[role].stop(timeout_s=30.0)
        self.settings[role] = settings
        for attempt in range(BIND_RETRIES):
            started, launched_at = time.monotonic(), time.time()
            self._launch(self.engine_command(role))
            try:
                self._await_engine(role, started)
                break
            except RuntimeError as exc:  # the same ports are kept: the router knows them
                if attempt + 1 == BIND_RETRIES or not _lost_port(exc):
                    raise
                time.sleep(2.0)
        # Down for sure from stopped_at until launched_at; serving by ready_at (its health poll
        # may find it serving a second or more after it first did).
        self.restarts.append(
            {"role": role, "stopped_at": stopped_at, "launched_at": launched_at, "ready_at": time.time()}
        )
        self._await_router_sees(role)
        self.write_state()

    def _with_overrides(self, role: str, env: dict[str, str] | None, overrides: dict[str, Any]) -> RoleSettings:
        current = self.settings[role]
        changed = dataclasses.replace(current, env=dict(env) if env is not None else dict(current.env))
        for key, value in overrides.items():
            if value is None:
                continue
            if key == "context_length":
                changed.max_model_len = int(value)
            elif key == "max_total_tokens":
                per_token = self.bytes_per_token.get(role)
                if per_token is None:
                    raise TargetError(
                        f"{role}: its KV bytes per token are unknown (no vllm:cache_config_info), "
                        "so max_total_tokens cannot be turned into --kv-cache-memory-bytes"
                    )
                changed.kv_cache_bytes = round(int(value) * per_token)
            elif key == "mem_fraction_static":
                raise TargetError(
                    "mem_fraction_static: vLLM on CPU sizes its KV cache in bytes "
                    "(--kv-cache-memory-bytes); change max_total_tokens instead"
                )
            else:
                raise TargetError(
                    f"{role}: cannot change {key!r} on the vLLM pair; it takes context_length, max_total_tokens and env"
                )
        return changed

    def _await_router_sees(self, role: str) -> None:
        """The router marks a revived worker healthy on its next health check: wait for that
        (its /readiness is 200 only while it holds a healthy prefill and decode)."""
        wait_http_ok(self.router_url + "/readiness", ROUTER_READY_TIMEOUT_S, self.procs["router"], interval_s=0.5)

    # -------------------------------------------------------------------------- inspection ----

    @property
    def router_url(self) -> str:
        return self._url("router", self.ports.router)

    def worker_url(self, role: str) -> str:
        return self._url(role, self.ports.http[role])

    @property
    def endpoints(self) -> Endpoints:
        return Endpoints(
            router_url=self.router_url,
            workers=(
                WorkerEndpoint("prefill", self.worker_url("prefill"), self.ports.side_channel["prefill"]),
                WorkerEndpoint("decode", self.worker_url("decode")),
            ),
            router_metrics_url=self._url("router", self.ports.router_metrics) + "/metrics",
        )

    def role_settings(self, role: str) -> dict[str, Any]:
        """The restartable settings of a role, in the form `restart()` takes."""
        if role not in self.settings:
            return {}
        s = self.settings[role]
        per_token = self.bytes_per_token.get(role)
        pool = round(s.kv_cache_bytes / per_token) if per_token else None
        return {"context_length": s.max_model_len, "max_total_tokens": pool, "env": dict(s.env)}

    def router_workers(self) -> Any:
        """The router's own view of its workers (health included), for diagnostics."""
        try:
            return httpx.get(f"{self.router_url}/workers", timeout=3.0, trust_env=False).json()
        except (httpx.HTTPError, ValueError):
            return None

    # -------------------------------------------------------------------------- state file ----

    def _state_extra(self) -> dict[str, Any]:
        return {
            "commands": [
                {"name": c.name, "placement": self.launcher.placement(c.role), "shell": c.shell()} for c in self.plan()
            ],
            "settings": {role: dataclasses.asdict(s) for role, s in self.settings.items()},
            "startup_s": self.startup_s,
            "restarts": self.restarts,
        }


def _lost_port(error: Exception) -> bool:
    """Another socket has the port: an engine that exited on its failed bind (the log tail in the
    error says so), or another run's server answering for ours (PortTaken)."""
    return isinstance(error, PortTaken) or says_port_taken(str(error))
