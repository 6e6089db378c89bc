"""Link faults against the embedded stack with proxied links: injected, confirmed, healed, audited.

Also the proxied stack itself (proxies in the state file, restarts keep them working) and
`pdchaos heal` after the driver was SIGKILLed mid-fault: no proxy, holder or rule is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from chaos.journal import Journal, JournalError
from chaos.process import group_members, pid_alive
from chaos.targets.base import Endpoints
from chaos.targets.sim.settings import TransferTimeouts, WorkerSettings
from chaos.targets.sim.stack import PROXY_LINKS, SimStack, SimStackConfig
from faults.base import FaultContext
from faults.links.iptables import netns_unavailable, partition_present
from faults.registry import FAULTS, build_fault
from faults.window import run_window
from tests.conftest import Traffic, start_stack, wait_until

pytestmark = pytest.mark.integration

# Short transfer timeouts, so a request cut off by a fault fails within a window of a few seconds.
LINK_STACK = SimStackConfig(
    worker=WorkerSettings(
        transfer_tokens_per_s=20000.0,
        timeouts=replace(TransferTimeouts(), waiting_timeout_s=1.5, bootstrap_timeout_s=2.0),
    ),
    proxied_links=True,
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimStack]:
    s = start_stack(tmp_path_factory.mktemp("links"), LINK_STACK)
    try:
        yield s
    finally:
        s.down()


def _ctx(stack: SimStack, journal: Journal | None, window: str) -> FaultContext:
    return FaultContext(target=stack, journal=journal, window_id=window)


def _serves(stack: SimStack) -> bool:
    try:
        body = {"text": "still there?", "sampling_params": {"max_new_tokens": 2}}
        return httpx.post(f"{stack.router_url}/generate", json=body, timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def _clean(stack: SimStack) -> bool:
    return all(httpx.get(f"{p.control_url}/faults", timeout=5).json() == {} for p in stack.proxies.values())


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


# --------------------------------------------------------------------------- the stack ----


def test_proxied_stack_routes_through_proxies_and_survives_a_restart(stack: SimStack) -> None:
    assert set(stack.proxies) == set(PROXY_LINKS)
    # Workers keep their real URLs (for /abort_request, /v1/loads); the router uses the proxies.
    assert [w.url for w in stack.endpoints.workers] == [stack.worker_url("prefill"), stack.worker_url("decode")]
    routed = {w["url"].rstrip("/") for w in httpx.get(f"{stack.router_url}/workers", timeout=5).json()["workers"]}
    assert routed == {stack.proxies["router_prefill"].url, stack.proxies["router_decode"].url}
    state = json.loads(SimStack.state_path(stack.run_dir).read_text())
    assert set(state["proxies"]) == set(PROXY_LINKS)
    recorded = {p["name"]: p for p in state["processes"]}
    assert all(recorded[f"proxy_{link}"]["pid"] == stack.proxies[link].pid for link in PROXY_LINKS)

    kv = stack.proxies["kv_transfer"]
    before = httpx.get(f"{kv.control_url}/stats", timeout=5).json()["accepted"]
    stack.restart("decode")
    assert _serves(stack)
    after = httpx.get(f"{kv.control_url}/stats", timeout=5).json()["accepted"]
    assert after > before, "after the restart, KV still crosses the proxy"
    assert stack.proxies["kv_transfer"] == kv and pid_alive(kv.pid)


# --------------------------------------------------------------------------- kv_transfer ----


@pytest.mark.parametrize("params", [{"mode": "reset"}, {"mode": "truncate", "truncate_after_bytes": 2048}])
def test_destructive_kv_transfer_faults_are_confirmed_by_failed_transfers(
    stack: SimStack, tmp_path: Path, params: dict
) -> None:
    fault = build_fault("kv_transfer", params, "faults[0]")
    with Journal.create(tmp_path / "run") as journal, Traffic(stack.router_url, timeout_s=15) as traffic:
        result = run_window(fault, _ctx(stack, journal, "w1"), duration_s=2.0)
    assert result.confirmation.confirmed, result.confirmation.evidence
    assert "failed-transfer counters +" in result.confirmation.evidence
    assert 500 in traffic.statuses
    assert result.healed and not result.leftovers and _clean(stack)
    assert _serves(stack)


def test_kv_transfer_latency_is_confirmed_by_the_proxy(stack: SimStack) -> None:
    fault = build_fault("kv_transfer", {"mode": "latency", "latency_ms": 50, "jitter_ms": 10}, "faults[0]")
    with Traffic(stack.router_url, timeout_s=15) as traffic:
        result = run_window(fault, _ctx(stack, None, "w1"), duration_s=1.5)
    assert result.confirmation.confirmed, result.confirmation.evidence
    assert set(traffic.statuses) == {200}  # slower, not broken
    assert result.healed and not result.leftovers and _clean(stack)


def test_kv_transfer_latency_with_no_traffic_cannot_be_confirmed(stack: SimStack) -> None:
    fault = build_fault("kv_transfer", {"mode": "latency"}, "faults[0]")
    result = run_window(fault, _ctx(stack, None, "w1"), duration_s=1.0)
    assert not result.confirmation.confirmed
    assert "touched no traffic" in result.confirmation.evidence
    assert result.healed and not result.leftovers and _clean(stack)


def test_a_proxy_fault_on_a_target_without_proxies_is_reported_not_available(tmp_path: Path) -> None:
    target = SimpleNamespace(kind="attach", run_dir=tmp_path, endpoints=Endpoints("http://127.0.0.1:9"))
    result = run_window(build_fault("router_link", {}, "faults[0]"), FaultContext(target=target), duration_s=0.1)  # type: ignore[arg-type]
    assert not result.confirmation.confirmed
    assert "not available here" in result.confirmation.evidence and "proxied_links" in result.confirmation.evidence
    assert result.healed and not result.leftovers


# --------------------------------------------------------------------------- router_link ----


@pytest.mark.parametrize("link, mode", [("decode", "partition"), ("prefill", "latency")])
def test_router_link_faults(stack: SimStack, link: str, mode: str) -> None:
    fault = build_fault("router_link", {"link": link, "mode": mode, "latency_ms": 50}, "faults[0]")
    with Traffic(stack.router_url, timeout_s=15) as traffic:
        result = run_window(fault, _ctx(stack, None, "w1"), duration_s=2.5)
    assert result.confirmation.confirmed, result.confirmation.evidence
    if mode == "partition":
        assert "router errors since inject" in result.confirmation.evidence
        assert any(s >= 500 or s == 0 for s in traffic.statuses)
    else:
        assert set(traffic.statuses) == {200}
    assert result.healed and not result.leftovers and _clean(stack)
    wait_until(lambda: _serves(stack), timeout_s=20, what="the router to serve again after the heal")


# ----------------------------------------------------------------------- netns_partition ----


def _iptables_usable() -> str | None:
    """Why iptables partitions cannot be tested here; installs iptables once where apt can."""
    if os.geteuid() == 0 and shutil.which("iptables") is None and shutil.which("apt-get"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(
                ["apt-get", "install", "-y", "-q", "iptables"],
                capture_output=True,
                timeout=180,
                check=False,
                env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            )
    return netns_unavailable()


@pytest.fixture(scope="module")
def iptables() -> None:
    reason = _iptables_usable()
    if reason:
        pytest.skip(f"netns_partition not available here: {reason}")


def test_netns_partition_of_the_transfer_port_is_confirmed_and_removed(
    stack: SimStack, iptables: None, tmp_path: Path
) -> None:
    fault = build_fault("netns_partition", {"link": "kv_transfer", "action": "reject"}, "faults[0]")
    ctx = _ctx(stack, None, "w1")
    with Traffic(stack.router_url, timeout_s=15):
        result = run_window(fault, ctx, duration_s=2.0)
    assert result.confirmation.confirmed, result.confirmation.evidence
    assert "matched" in result.confirmation.evidence and "failed-transfer counters +" in result.confirmation.evidence
    assert result.healed and not result.leftovers
    assert not partition_present("", ctx.baseline["chain"])
    assert not pid_alive(ctx.baseline["holder"].pid)
    assert _serves(stack)


def test_netns_partition_where_it_cannot_act_says_why() -> None:
    target = SimpleNamespace(kind="sim", run_dir=Path("."), endpoints=Endpoints("http://127.0.0.1:9"))
    fault = build_fault("netns_partition", {"netns": "pdchaos-no-such-namespace"}, "faults[0]")
    result = run_window(fault, FaultContext(target=target), duration_s=0.1)  # type: ignore[arg-type]
    assert not result.confirmation.confirmed
    assert "not available here" in result.confirmation.evidence
    assert result.healed and not result.leftovers


# ------------------------------------------------------------------- heal after SIGKILL ----

# Holds every window given as JSON [[fault, params], ...] at once, one thread each, until killed.
DRIVER = """
import json, sys, threading
from dataclasses import replace
from pathlib import Path
from chaos.journal import Journal
from chaos.targets.sim.settings import TransferTimeouts, WorkerSettings
from chaos.targets.sim.stack import SimStack, SimStackConfig
from faults.base import FaultContext
from faults.registry import build_fault
from faults.window import run_window

run_dir = Path(sys.argv[1])
config = SimStackConfig(worker=WorkerSettings(timeouts=replace(TransferTimeouts(), waiting_timeout_s=2.0)), proxied_links=True)
stack = SimStack(config, run_dir)
stack.up()
journal = Journal.create(run_dir)
for n, (name, params) in enumerate(json.loads(sys.argv[2])):
    fault = build_fault(name, params, "fault")
    ctx = FaultContext(target=stack, journal=journal, window_id=f"w{n + 1}")
    threading.Thread(target=run_window, args=(fault, ctx, 600.0)).start()
"""


def _plans(run_dir: Path) -> dict[str, list[dict]]:
    try:
        with Journal.open(run_dir, readonly=True) as journal:
            return {e.name: e.data["undo"] for e in journal.iter_events(kind="fault") if e.data.get("step") == "plan"}
    except (FileNotFoundError, JournalError):
        return {}


def _holder_events(run_dir: Path) -> list[dict]:
    logs = list((run_dir / "logs").glob("netns_partition-*.log"))
    return [json.loads(line) for log in logs for line in log.read_text().splitlines() if line.startswith("{")]


@pytest.mark.parametrize("partition", [False, True], ids=["proxy", "proxy and partition"])
def test_heal_after_the_driver_was_killed_leaves_no_proxy_or_rule(
    partition: bool, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A proxy fault, and in the second case a partition too, held when the driver is SIGKILLed
    (the second is skipped, saying why, where iptables partitions cannot be made)."""
    windows: list[list] = [["kv_transfer", {"mode": "blackhole"}]]
    if partition:
        request.getfixturevalue("iptables")
        windows.append(["netns_partition", {"link": "router_decode"}])
    run_dir = tmp_path / "run"
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(run_dir), json.dumps(windows)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until(lambda: len(_plans(run_dir)) == len(windows), timeout_s=60, what="every window to be planned")
        state = json.loads(SimStack.state_path(run_dir).read_text())
        control = state["proxies"]["kv_transfer"]["control_url"]
        # The journal says "inject" as injection starts; wait for the faults themselves.
        wait_until(lambda: httpx.get(f"{control}/faults", timeout=5).json() != {}, timeout_s=15, what="the proxy fault")
        if partition:
            wait_until(
                lambda: any(e["event"] == "installed" for e in _holder_events(run_dir)),
                timeout_s=15,
                what="the partition rules",
            )
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver dies; its stack, proxies and holder live on
        driver.wait(10)
    try:
        _check_heal(run_dir, state, control, partition)
    finally:  # whatever failed above, leave nothing running (a second heal is harmless)
        subprocess.run(
            [sys.executable, "-m", "chaos.cli", "heal", str(run_dir)], capture_output=True, timeout=120, check=False
        )


def _check_heal(run_dir: Path, state: dict, control: str, partition: bool) -> None:
    assert httpx.get(f"{control}/faults", timeout=5).json() != {}
    holder = next((a["pid"] for a in _plans(run_dir).get("netns_partition", []) if a["kind"] == "stop_pid"), None)
    if partition:
        assert holder is not None and pid_alive(holder)
    groups = [p["pgid"] for p in state["processes"]]

    healed = subprocess.run(
        [sys.executable, "-m", "chaos.cli", "heal", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert healed.returncode == 0, healed.stdout + healed.stderr
    assert "clear the faults of proxy" in healed.stdout
    for pgid in groups:
        wait_until(lambda pgid=pgid: not group_members(pgid), timeout_s=15, what=f"group {pgid} to be gone")
    for handle in state["proxies"].values():
        assert not pid_alive(handle["pid"])
        assert not _listening(int(handle["listen"].rpartition(":")[2])), f"{handle['link']} proxy still listening"
    if partition:
        assert holder is not None and not pid_alive(holder)
        events = _holder_events(run_dir)
        assert [e["event"] for e in events] == ["armed", "installed", "removed"]
        assert not partition_present("", events[0]["chain"])


def test_link_families_are_registered() -> None:
    assert {"kv_transfer", "router_link", "netns_partition"} <= set(FAULTS)
