"""Multi-node placement: each role's processes start, are signalled and are read on their own node.

With `--ray-address`, a target's roles go to the Ray nodes that offer their custom resource
(`pdchaos_prefill`, `pdchaos_decode`; `pdchaos_router` where a node offers it, else the driver's
node). On each such node a `NodeAgent` actor launches the role's processes in their own sessions
and does everything that must happen beside them: signal a process group (SIGSTOP for a stall,
SIGKILL for a kill), read /proc states, read logs, pick a free port and report the node's address.
Agents are named and detached, so `pdchaos heal` can find them by name after the driver died and
resume or stop what they hold; `down()` stops their processes and then the agents.

Load actors are placed the same way on nodes offering `pdchaos_load` (chaos/cluster.py).
"""

from __future__ import annotations

import os
import signal
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chaos.errors import TargetError
from chaos.gpu import GpuInventory, read_inventory
from chaos.process import ManagedProcess, free_port, group_members, launch, process_state
from chaos.ray_session import connect_ray, disconnect_ray
from chaos.targets.launcher import PlannedCommand

NAMESPACE = "pdchaos"
RESOURCE_PREFIX = "pdchaos_"
REQUIRED_ROLES = ("prefill", "decode")  # a multi-node run without their nodes is a setup error


def role_resource(role: str) -> str:
    return f"{RESOURCE_PREFIX}{role}"


class NodeAgent:
    """Runs on one node (as a Ray actor): owns the processes of one role placed there."""

    def __init__(self) -> None:
        self.procs: dict[str, ManagedProcess] = {}

    def where(self) -> dict[str, Any]:
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
        }

    def free_port(self, host: str) -> int:
        return free_port(host)

    def inventory(self) -> GpuInventory:
        return read_inventory()

    def launch(self, command: PlannedCommand) -> dict[str, int]:
        proc = launch(command.name, command.argv, Path(command.log_path), command.env)
        self.procs[command.name] = proc
        return {"pid": proc.pid, "pgid": proc.pgid}

    def returncode(self, name: str) -> int | None:
        return self.procs[name].returncode

    def signal_group(self, name: str, signum: int) -> None:
        self.procs[name].signal_group(signum)

    def signal_pgid(self, pgid: int, signum: int) -> bool:
        """For heal: a group this agent may no longer know by name. False if it is gone."""
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            return False
        return True

    def group_states(self, name: str) -> dict[int, str]:
        return self.procs[name].group_states()

    def pgid_states(self, pgid: int) -> dict[int, str]:
        return {pid: state for pid in group_members(pgid) if (state := process_state(pid)) is not None}

    def stop(self, name: str, timeout_s: float) -> int | None:
        return self.procs[name].stop(timeout_s)

    def read_log(self, name: str) -> str:
        return self.procs[name].read_log()

    def stop_all(self) -> list[str]:
        done = []
        for name, proc in self.procs.items():
            if proc.alive():
                proc.stop()
                done.append(f"stopped {name} (process group {proc.pgid})")
        return done


@dataclass
class RemoteProcess:
    """A process group an agent started on its node; every call runs beside it."""

    name: str
    node: str
    agent: Any
    pid: int
    pgid: int

    def _get(self, ref: Any) -> Any:
        import ray

        return ray.get(ref, timeout=60)

    @property
    def returncode(self) -> int | None:
        code: int | None = self._get(self.agent.returncode.remote(self.name))
        return code

    def alive(self) -> bool:
        return self.returncode is None

    def signal_group(self, signum: int) -> None:
        self._get(self.agent.signal_group.remote(self.name, int(signum)))

    def group_states(self) -> dict[int, str]:
        return {int(k): v for k, v in self._get(self.agent.group_states.remote(self.name)).items()}

    def stop(self, timeout_s: float = 10.0) -> int | None:
        code: int | None = self._get(self.agent.stop.remote(self.name, timeout_s))
        return code

    def read_log(self) -> str:
        text: str = self._get(self.agent.read_log.remote(self.name))
        return text


class RayLauncher:
    """Places each role on the node offering its resource, through one named agent per role."""

    def __init__(self, ray_address: str, run_id: str | None = None) -> None:
        self.ray_address = ray_address
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self._owns_ray, self._ray = connect_ray(ray_address)
        self.agents: dict[str, Any] = {}
        self.where: dict[str, dict[str, Any]] = {}
        offered = self._offered_resources()
        missing = [r for r in REQUIRED_ROLES if role_resource(r) not in offered]
        if missing:
            raise TargetError(
                f"no Ray node offers {', '.join(role_resource(r) for r in missing)}: start the prefill and decode nodes with "
                f"`ray start --address {ray_address} --resources '{{\"{role_resource(missing[0])}\": 1}}'` "
                f"(offered now: {', '.join(sorted(offered)) or 'none'})"
            )
        self._offered = offered

    def _offered_resources(self) -> set[str]:
        return {
            k
            for node in self._ray.nodes()
            if node.get("Alive")
            for k in node.get("Resources", {})
            if k.startswith(RESOURCE_PREFIX)
        }

    def agent_name(self, role: str) -> str:
        return f"agent-{self.run_id}-{role}"

    def _agent(self, role: str) -> Any:
        if role in self.agents:
            return self.agents[role]
        ray = self._ray
        options: dict[str, Any] = {
            "num_cpus": 0,
            "name": self.agent_name(role),
            "namespace": NAMESPACE,
            "lifetime": "detached",
            "max_concurrency": 8,
        }
        if role_resource(role) in self._offered:
            options["resources"] = {role_resource(role): 0.001}
        else:  # the router (and its proxies) go beside the driver when no node is set aside for them
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False
            )
        agent = ray.remote(NodeAgent).options(**options).remote()
        self.where[role] = ray.get(agent.where.remote(), timeout=120)
        self.agents[role] = agent
        return agent

    def host(self, role: str) -> str:
        """The address a role's servers bind and advertise: its node's IP."""
        self._agent(role)
        return str(self.where[role]["ip"])

    def free_port(self, role: str) -> int:
        return int(self._ray.get(self._agent(role).free_port.remote(self.host(role)), timeout=60))

    def launch(self, command: PlannedCommand) -> RemoteProcess:
        agent = self._agent(command.role)
        ids = self._ray.get(agent.launch.remote(command), timeout=120)
        return RemoteProcess(command.name, self.placement(command.role), agent, ids["pid"], ids["pgid"])

    def inventory(self, role: str) -> GpuInventory:
        return self._ray.get(self._agent(role).inventory.remote(), timeout=60)  # type: ignore[no-any-return]

    def placement(self, role: str) -> str:
        where = self.where.get(role)
        if where is None:
            return (
                f"the Ray node offering {role_resource(role)}"
                if role_resource(role) in self._offered
                else "the driver's Ray node"
            )
        return f"Ray node {where['node_id'][:12]} ({where['hostname']}, {where['ip']})"

    def state(self) -> dict[str, Any]:
        """What `pdchaos heal` needs to find the agents again (written into target.json)."""
        return {
            "ray_address": self.ray_address,
            "namespace": NAMESPACE,
            "agents": {role: self.agent_name(role) for role in self.agents},
        }

    def close(self) -> None:
        """Stop every process the agents hold, then the agents (idempotent)."""
        for agent in self.agents.values():
            try:
                self._ray.get(agent.stop_all.remote(), timeout=120)
            finally:
                self._ray.kill(agent)
        self.agents.clear()
        if self._owns_ray:
            disconnect_ray(self._ray)
            self._owns_ray = False


def heal_agents(state: dict[str, Any]) -> list[str]:
    """From another process: resume and stop everything the named agents of a run hold."""
    owns, ray = connect_ray(state["ray_address"])
    done: list[str] = []
    try:
        for role, name in state.get("agents", {}).items():
            try:
                agent = ray.get_actor(name, namespace=state.get("namespace", NAMESPACE))
            except ValueError:
                continue  # already gone
            done.extend(f"{role} node: {line}" for line in ray.get(agent.stop_all.remote(), timeout=120))
            ray.kill(agent)
            done.append(f"stopped agent {name}")
    finally:
        if owns:
            disconnect_ray(ray)
    return done


def signal_remote(state: dict[str, Any], role: str, pgid: int, signum: int = signal.SIGCONT) -> bool:
    """Signal a process group on a role's node through its agent (heal of a stall after a crash)."""
    owns, ray = connect_ray(state["ray_address"])
    try:
        agent = ray.get_actor(state["agents"][role], namespace=state.get("namespace", NAMESPACE))
        return bool(ray.get(agent.signal_pgid.remote(pgid, int(signum)), timeout=60))
    except (KeyError, ValueError):
        return False
    finally:
        if owns:
            disconnect_ray(ray)
