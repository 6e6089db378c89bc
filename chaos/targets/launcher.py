"""Where a target's processes start: here, or on the Ray node that offers their role's resource.

A stack describes each process as a `PlannedCommand` (what `pdchaos plan` prints) and hands it to
a `Launcher`. The local launcher starts it in its own session on this machine
(`chaos.process.launch`); the Ray launcher (`chaos.targets.nodes`) starts it through an agent
actor on the node that carries the role's custom resource, so signals, log reads and restarts
happen beside the process. Either way the stack gets back a `ProcessHandle`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from chaos.gpu import GpuInventory, read_inventory
from chaos.process import free_port, launch

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class PlannedCommand:
    """One process of a deployment, fully resolved: nothing is decided after this."""

    name: str  # unique in the stack: "prefill", "decode", "router", "proxy_kv_transfer", ...
    role: str  # placement: "prefill", "decode" or "router" (the router's node also hosts proxies)
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # set on top of the inherited environment
    ready_url: str | None = None  # answers 200 once the process serves

    def shell(self) -> str:
        """The command as one copy-pasteable shell line, environment first."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{env + ' ' if env else ''}{shlex.join(self.argv)}"


class ProcessHandle(Protocol):
    """A started process group, wherever it runs (chaos.process.ManagedProcess is the local one)."""

    name: str
    node: str

    @property
    def pid(self) -> int: ...

    @property
    def pgid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def alive(self) -> bool: ...

    def signal_group(self, signum: int) -> None: ...

    def group_states(self) -> dict[int, str]:
        """Each member of the process group and its /proc state letter."""
        ...

    def stop(self, timeout_s: float = 10.0) -> int | None: ...

    def read_log(self) -> str: ...


class Launcher(Protocol):
    def launch(self, command: PlannedCommand) -> ProcessHandle: ...

    def host(self, role: str) -> str:
        """The address a role's servers bind and advertise (loopback here, the node's IP on Ray)."""
        ...

    def free_port(self, role: str) -> int:
        """A port nobody listens on, on the role's node."""
        ...

    def placement(self, role: str) -> str:
        """Where a role's processes go, in words ("this machine", "Ray node abc (pdchaos_prefill)")."""
        ...

    def inventory(self, role: str) -> GpuInventory:
        """The GPUs as NVML sees them on the role's node."""
        ...

    def state(self) -> dict[str, Any]:
        """What `pdchaos heal` needs to reach the processes from another process (target.json)."""
        ...

    def close(self) -> None:
        """Release what the launcher holds (agents on other nodes); its processes are stopped first."""
        ...


def distinct_port(launcher: Launcher, role: str, taken: set[tuple[str, int]]) -> int:
    """A free port on `role`'s node that no other server of the stack was given: each node's agent
    remembers only its own picks, and several agents can share a host (Ray nodes on one machine)."""
    host = launcher.host(role)
    for _ in range(50):
        port = launcher.free_port(role)
        if (host, port) not in taken:
            taken.add((host, port))
            return port
    raise OSError(f"no free port on {host} for {role} that differs from the stack's others")


class LocalLauncher:
    """Every process on this machine, each in its own session."""

    def launch(self, command: PlannedCommand) -> ProcessHandle:
        return launch(command.name, command.argv, command.log_path, command.env)

    def host(self, role: str) -> str:
        return LOOPBACK

    def free_port(self, role: str) -> int:
        return free_port(LOOPBACK)

    def placement(self, role: str) -> str:
        return "this machine"

    def inventory(self, role: str) -> GpuInventory:
        return read_inventory()

    def state(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass
