"""Multi-node placement on a real Ray cluster of three nodes (Ray's own test cluster, on loopback).

The head offers `pdchaos_load`, one node `pdchaos_prefill`, another `pdchaos_decode`. The embedded
stack is launched through `RayLauncher`: each role's processes must start from an agent on its own
node, faults must act through that agent, and `target.json` alone must let another caller stop
everything (what `pdchaos heal` does after the driver died).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from chaos.errors import TargetError
from chaos.process import pid_alive
from chaos.targets.state import state_path, stop_from_state

pytestmark = pytest.mark.integration

RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    os.environ.update(RAY_ENV)
    from ray.cluster_utils import Cluster

    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "resources": {"pdchaos_load": 1}, "include_dashboard": False},
    )
    c.prefill_node = c.add_node(num_cpus=0, resources={"pdchaos_prefill": 1})
    c.decode_node = c.add_node(num_cpus=0, resources={"pdchaos_decode": 1})
    c.wait_for_nodes()
    try:
        yield c
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def _ask(router_url: str) -> httpx.Response:
    return httpx.post(
        f"{router_url}/generate",
        json={"text": "hello there, repeat after me", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        timeout=30,
        trust_env=False,
    )


def test_each_role_starts_acts_and_stops_on_its_own_node(cluster: Any, tmp_path: Path) -> None:
    from chaos.targets.nodes import RayLauncher
    from chaos.targets.sim.stack import SimStack, SimStackConfig
    from faults.base import FaultContext
    from faults.registry import build_fault

    launcher = RayLauncher(cluster.address)
    stack = SimStack(SimStackConfig(startup_timeout_s=90), tmp_path, launcher)
    try:
        stack.up()
        assert launcher.where["prefill"]["node_id"] == cluster.prefill_node.node_id
        assert launcher.where["decode"]["node_id"] == cluster.decode_node.node_id
        assert launcher.where["router"]["node_id"] not in (cluster.prefill_node.node_id, cluster.decode_node.node_id)
        assert stack.processes("prefill")[0].node.startswith("Ray node")
        seen = launcher.inventory("decode")  # NVML read by the agent on decode's node
        assert not seen.available and seen.reason.startswith("no GPU")
        assert _ask(stack.router_url).status_code == 200

        # A stall goes through the prefill node's agent, and is undone the same way.
        fault = build_fault("transfer_stall", {"role": "prefill"}, "test")
        ctx = FaultContext(target=stack, window_id="w1")
        plan = fault.undo_plan(ctx)
        fault.inject(ctx)
        prefill = stack.processes("prefill")[0]
        states = prefill.group_states()
        assert states and set(states.values()) == {"T"}, states
        fault.heal(ctx, plan)
        assert "T" not in set(prefill.group_states().values())
        assert fault.audit(ctx, plan) == []
        assert _ask(stack.router_url).status_code == 200

        state = state_path(tmp_path).read_text()
        assert launcher.agent_name("prefill") in state and cluster.address in state
        pids = [p.pid for name in ("prefill", "decode", "router") for p in stack.processes(name)]
    except BaseException:
        stack.down()
        raise
    # The driver "dies" without stopping anything: the state file alone must be enough.
    done = stop_from_state(tmp_path)
    assert any("stopped agent" in line for line in done), done
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(pid_alive(pid) for pid in pids):
        time.sleep(0.2)
    assert not any(pid_alive(pid) for pid in pids)
    assert not state_path(tmp_path).exists()


def test_a_cluster_without_the_role_resources_is_a_clear_setup_error(tmp_path: Path) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from chaos.targets.nodes import RayLauncher

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        with pytest.raises(TargetError, match=r"pdchaos_prefill.*ray start"):
            RayLauncher(c.address)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()


def test_stall_heal_reaches_a_remote_group_after_the_driver_is_gone(cluster: Any, tmp_path: Path) -> None:
    """A SIGSTOPped role on another node is stopped by `pdchaos heal` from the journal, through the
    agent on its node: a process group number names nothing on the driver's host, so only the
    agent's stop, not a local signal, proves the heal reached it."""
    from chaos.heal import heal_run
    from chaos.journal import EventKind, Journal, JournalEvent
    from chaos.targets.nodes import RayLauncher
    from chaos.targets.sim.stack import SimStack, SimStackConfig

    launcher = RayLauncher(cluster.address)
    stack = SimStack(SimStackConfig(startup_timeout_s=90), tmp_path, launcher)
    stack.up()
    try:
        prefill = stack.processes("prefill")[0]
        journal = Journal.create(tmp_path)
        journal.append_event(
            JournalEvent(
                EventKind.FAULT,
                "transfer_stall",
                {
                    "window": "w1",
                    "step": "plan",
                    "undo": [{"kind": "sigcont", "role": "prefill", "pgid": prefill.pgid}],
                },
            )
        )
        journal.close()
        prefill.signal_group(signal.SIGSTOP)
        assert set(prefill.group_states().values()) == {"T"}
        pid = prefill.pid
    except BaseException:
        stack.down()
        raise
    report = heal_run(tmp_path)
    assert report.clean, report.left
    assert f"prefill node: stopped prefill (process group {prefill.pgid})" in report.done, report.done
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and pid_alive(pid):
        time.sleep(0.2)
    assert not pid_alive(pid)


def test_a_campaign_runs_across_the_cluster_and_records_where_each_role_ran(cluster: Any, tmp_path: Path) -> None:
    """`pdchaos run --ray-address`: roles on their nodes, load actors on the load node, and a PASS
    with the placement in the journal. (Faults acting through the agents are the first test's.)"""
    from chaos.campaign_validation import parse_campaign
    from chaos.journal import Journal
    from chaos.runner import Runner

    campaign = parse_campaign(
        {
            "name": "multinode",
            "seed": 3,
            "target": {
                "kind": "sim",
                "sim": {"waiting_timeout_s": 2, "bootstrap_timeout_s": 3, "transfer_tokens_per_s": 20000},
            },
            "load": {"profile": "mixed", "users": 6, "duration": "20s", "max_tokens": 16},
            "probes": {"count": 4, "interval": "2s"},
            "oracles": {"enabled": ["canary", "reference", "status", "liveness"]},
            "report": {"formats": ["json"]},
        }
    )
    outcome = Runner(campaign, tmp_path / "run", ray_address=cluster.address, progress=False).run()
    assert outcome.verdict.value == "PASS", outcome.reasons
    with Journal.open(tmp_path / "run") as journal:
        placement = journal.get_meta("target")["placement"]
    assert cluster.prefill_node.node_id[:12] in placement["prefill"], placement
    assert cluster.decode_node.node_id[:12] in placement["decode"], placement
    assert not state_path(tmp_path / "run").exists()  # stopped, agents included
