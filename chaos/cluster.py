"""Load placement on Ray: actors that each run Locust as a subprocess and stream records back.

Locust must not be imported inside a Ray worker (the gevent patching Locust does on import
deadlocks there), so an actor only starts `python -m locust` in its own session and tails the
JSON-lines file the users write. One machine: a local Ray bound to loopback. Many machines:
`--ray-address`, with load actors placed on nodes that offer the `pdchaos_load` resource when any
node does.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from chaos import transport
from chaos.ray_session import connect_ray, disconnect_ray
from loadprofiles.clock import ClockState, write_state
from loadprofiles.config import CONFIG_ENV, LoadConfig

LOCUSTFILE = Path(__file__).resolve().parent.parent / "loadprofiles" / "locustfile.py"
LOAD_RESOURCE = "pdchaos_load"
ACTOR_CPUS = 0.25  # several actors fit on a 2-core machine
POLL_MAX_LINES = 5000


def _die_with_parent() -> None:
    """In the Locust child: get SIGTERM when the actor process dies, so no Locust is orphaned."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def locust_command(locustfile: Path, host: str) -> list[str]:
    # The shape class in the locustfile sets users and duration; --json prints the stats at exit.
    return [
        sys.executable,
        "-m",
        "locust",
        "--headless",
        "-f",
        str(locustfile),
        "--host",
        host,
        "--json",
        "--only-summary",
        "--skip-log",
        "--stop-timeout",
        "5",
    ]


@dataclass
class HealthSample:
    """One reading of a load generator's own health."""

    actor: str
    t: float
    cpu_percent: float
    rss_mb: float
    running: bool


@dataclass
class PollResult:
    records: list[dict[str, Any]] = field(default_factory=list)
    health: HealthSample | None = None
    running: bool = False
    anomalies: list[str] = field(default_factory=list)


class LoadGenerator:
    """Runs one Locust process and tails its records. Used inside a Ray actor (or directly)."""

    def __init__(
        self,
        name: str,
        config: LoadConfig,
        workdir: str,
        locustfile: str = str(LOCUSTFILE),
        transport_settings: str | None = None,
    ) -> None:
        self.name = name
        self.config = config
        # The driver's headers and TLS settings (no secret: the key is read from this node's environment)
        self.transport_settings = transport_settings if transport_settings is not None else transport.current().to_env()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.locustfile = Path(locustfile)
        self.proc: subprocess.Popen[bytes] | None = None
        self._offset = 0
        self._partial = b""
        self._ps: psutil.Process | None = None
        self._clock: ClockState | None = None

    def start(self) -> int:
        env = dict(os.environ)
        env[CONFIG_ENV] = self.config.to_json()
        env[transport.ENV] = self.transport_settings
        self.stdout_path = self.workdir / f"{self.name}.summary.json"
        self.stderr_path = self.workdir / f"{self.name}.locust.log"
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                locust_command(self.locustfile, self.config.target_url),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                cwd=str(self.workdir),
            )
        self._ps = psutil.Process(self.proc.pid)
        self._ps.cpu_percent(None)  # prime the CPU counter
        return self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def poll(self, clock: ClockState | None = None) -> PollResult:
        """New records and a health sample; `clock`, when it changed, goes to the shape's file."""
        if clock is not None and clock != self._clock and self.config.clock_path:
            write_state(self.config.clock_path, clock)
            self._clock = clock
        result = PollResult(running=self.running())
        result.records, result.anomalies = self._read_new_records()
        result.health = self._health(result.running)
        return result

    def _read_new_records(self) -> tuple[list[dict[str, Any]], list[str]]:
        path = Path(self.config.records_path)
        if not path.exists():
            return [], []
        with open(path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read()
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an incomplete last line waits for the next poll
        records, anomalies = [], []
        for line in lines:
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                anomalies.append(f"{self.name}: unreadable record line ({len(line)} bytes)")
        return records, anomalies

    def _health(self, running: bool) -> HealthSample | None:
        if self._ps is None:
            return None
        try:
            cpu = self._ps.cpu_percent(None)
            rss = self._ps.memory_info().rss / 1e6
        except psutil.Error:
            cpu, rss = 0.0, 0.0
        return HealthSample(self.name, time.time(), cpu, rss, running)

    def stop(self, timeout_s: float = 10.0) -> tuple[list[dict[str, Any]], PollResult]:
        """Stop Locust (SIGINT lets it print its stats); its JSON stats and the last records."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=timeout_s)
        return self.locust_stats(), self.poll()

    def wait(self, timeout_s: float) -> bool:
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False

    def locust_stats(self) -> list[dict[str, Any]]:
        try:
            text = self.stdout_path.read_text()
            start = text.find("[")
            return json.loads(text[start:]) if start >= 0 else []
        except (OSError, ValueError):
            return []


def locust_request_count(stats: list[dict[str, Any]]) -> int:
    return sum(int(entry.get("num_requests", 0)) for entry in stats)


class LoadCluster:
    """A Ray session (local on loopback, or joined by address) holding the load actors."""

    def __init__(self, ray_address: str | None = None) -> None:
        self.ray_address = ray_address
        self.actors: list[Any] = []
        self.names: list[str] = []

    def __enter__(self) -> LoadCluster:
        self._owns_ray, self._ray = connect_ray(self.ray_address)
        return self

    def __exit__(self, *_: object) -> None:
        self.stop_all()
        if self._owns_ray:  # a Ray session the target's launcher opened outlives the load
            disconnect_ray(self._ray)

    def start(self, configs: list[LoadConfig], workdir: str | None = None) -> None:
        ray = self._ray
        remote_cls = ray.remote(LoadGenerator)
        options: dict[str, Any] = {"num_cpus": ACTOR_CPUS, "max_concurrency": 4}
        if any(LOAD_RESOURCE in node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")):
            options["resources"] = {LOAD_RESOURCE: 0.01}
        base = workdir or tempfile.mkdtemp(prefix="pdchaos-load-")
        for config in configs:
            name = f"actor-{config.actor_index}"
            actor = remote_cls.options(name=None, **options).remote(
                name, config, os.path.join(base, name), str(LOCUSTFILE), transport.current().to_env()
            )
            self.actors.append(actor)
            self.names.append(name)
        ray.get([a.start.remote() for a in self.actors])

    def poll(self, clock: ClockState | None = None) -> list[PollResult]:
        results: list[PollResult] = self._ray.get([a.poll.remote(clock) for a in self.actors])
        return results

    def stop_all(self, timeout_s: float = 15.0) -> list[tuple[list[dict[str, Any]], PollResult]]:
        """Stop every Locust; per actor its Locust stats and the records not yet polled."""
        if not self.actors:
            return []
        try:
            results: list[tuple[list[dict[str, Any]], PollResult]] = self._ray.get(
                [a.stop.remote() for a in self.actors], timeout=timeout_s + 5
            )
        except Exception:  # an actor that died cannot report; its Locust got SIGTERM with it
            results = []
        for actor in self.actors:
            self._ray.kill(actor)
        self.actors, self.names = [], []
        return results
