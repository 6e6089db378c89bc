"""Fault families against the embedded engine: injected, confirmed (or not), healed, audited."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from chaos.journal import Journal
from chaos.process import group_members, process_state
from chaos.targets.sim.settings import TransferTimeouts, WorkerSettings
from chaos.targets.sim.stack import SimStack, SimStackConfig
from chaos.windows import windows_from_events
from faults.base import FaultContext
from faults.registry import FAULTS, build_fault
from faults.window import run_window
from tests.conftest import Traffic, start_stack, wait_until

pytestmark = pytest.mark.integration

# A stall outlasts decode's waiting timeout (2 s) and its bootstrap timeout (3 s) by 3 s: on a busy
# machine a request caught by the stall may reach decode a moment after it began.
STALL_S = 6.0
FAULT_STACK = SimStackConfig(
    worker=WorkerSettings(
        transfer_tokens_per_s=20000.0,
        timeouts=replace(TransferTimeouts(), waiting_timeout_s=2.0, bootstrap_timeout_s=3.0),
    ),
)


@pytest.fixture()
def stack(tmp_path: Path) -> Iterator[SimStack]:
    s = start_stack(tmp_path, FAULT_STACK)
    try:
        yield s
    finally:
        s.down()


def _ctx(stack: SimStack, journal: Journal, window: str) -> FaultContext:
    return FaultContext(target=stack, journal=journal, window_id=window)


def _pools_idle(stack: SimStack) -> bool:
    for role in ("prefill", "decode"):
        data = httpx.get(f"{stack.worker_url(role)}/v1/loads", timeout=5).json()
        if data["num_used_tokens"] or data["quarantined_tokens"] or data["num_running_reqs"]:
            return False
    return True


def test_transfer_stall_is_confirmed_healed_and_journaled(stack: SimStack, tmp_path: Path) -> None:
    fault = build_fault("transfer_stall", {"role": "prefill"}, "faults[0]")
    with Journal.create(tmp_path / "run") as journal, Traffic(stack.router_url) as traffic:
        wait_until(
            lambda: traffic.statuses, timeout_s=30, what="traffic flowing before the stall"
        )  # else nothing waits on it
        result = run_window(fault, _ctx(stack, journal, "w1"), duration_s=STALL_S)
        assert result.confirmation.confirmed, result.confirmation.evidence
        assert result.healed and not result.leftovers
        assert all(process_state(pid) != "T" for pid in group_members(stack.procs["prefill"].pgid))
        windows = windows_from_events(journal.iter_events())
    assert [(w.fault, w.confirmed, w.healed) for w in windows] == [("transfer_stall", True, True)]
    assert windows[0].start is not None and windows[0].end is not None and windows[0].end > windows[0].start
    wait_until(lambda: _pools_idle(stack), timeout_s=30, what="pools back at baseline after the stall")


def test_an_attached_deployment_is_stalled_through_the_pid_and_log_its_campaign_gives(
    stack: SimStack, tmp_path: Path
) -> None:
    """Attach mode with `processes:`: the suite did not launch it, yet it can pause, read and resume it."""
    from chaos.targets.attach import AttachTarget
    from chaos.targets.spec import AttachedProcess

    given = [
        AttachedProcess(role=role, pid=stack.procs[role].pid, log=str(stack.log_dir / f"{role}.log"))
        for role in ("prefill", "decode")
    ]
    target = AttachTarget(
        stack.router_url,
        [("prefill", stack.worker_url("prefill")), ("decode", stack.worker_url("decode"))],
        tmp_path,
        processes_given=given,
    )
    assert "decode" in target.logs("decode").lower()
    fault = build_fault("transfer_stall", {"role": "prefill"}, "faults[0]")
    with Journal.create(tmp_path / "run") as journal, Traffic(stack.router_url) as traffic:
        wait_until(lambda: traffic.statuses, timeout_s=30, what="traffic flowing before the stall")
        result = run_window(fault, FaultContext(target=target, journal=journal, window_id="w1"), duration_s=STALL_S)
    assert result.confirmation.confirmed, result.confirmation.evidence
    assert result.healed and not result.leftovers
    assert all(process_state(pid) != "T" for pid in group_members(stack.procs["prefill"].pgid))
    assert stack.procs["prefill"].alive() and stack.procs["decode"].alive()  # attached: paused, never killed


def test_a_stall_nobody_waits_on_is_reported_unconfirmed(stack: SimStack, tmp_path: Path) -> None:
    """No traffic and a stall shorter than the waiting timeout: nothing times out, so no proof."""
    fault = build_fault("transfer_stall", {"role": "prefill"}, "faults[0]")
    with Journal.create(tmp_path / "run") as journal:
        result = run_window(fault, _ctx(stack, journal, "w1"), duration_s=1.0)
    assert not result.confirmation.confirmed
    assert result.healed and not result.leftovers


def test_process_kill_confirms_down_and_heal_restarts(stack: SimStack, tmp_path: Path) -> None:
    fault = build_fault("process_kill", {"role": "prefill", "signal": "KILL"}, "faults[0]")
    old_pid = stack.procs["prefill"].pid
    with Journal.create(tmp_path / "run") as journal:
        result = run_window(fault, _ctx(stack, journal, "w1"), duration_s=1.0)
    assert result.confirmation.confirmed, result.confirmation.evidence
    assert result.healed and not result.leftovers
    assert stack.procs["prefill"].pid != old_pid and stack.procs["prefill"].alive()
    r = httpx.post(
        f"{stack.router_url}/generate", json={"text": "back?", "sampling_params": {"max_new_tokens": 4}}, timeout=30
    )
    assert r.status_code == 200


def test_memory_fraction_makes_pools_asymmetric_and_heal_restores(stack: SimStack, tmp_path: Path) -> None:
    before = httpx.get(f"{stack.worker_url('prefill')}/server_info").json()
    fault = build_fault("memory_fraction", {"role": "prefill", "max_total_tokens": 4096}, "faults[0]")
    with Journal.create(tmp_path / "run") as journal:
        seen: dict = {}

        def peek() -> bool:
            seen.update(httpx.get(f"{stack.worker_url('prefill')}/server_info").json())
            return True

        result = run_window(fault, _ctx(stack, journal, "w1"), duration_s=0.5, keep_going=peek)
    assert result.confirmation.confirmed, result.confirmation.evidence
    assert seen["max_total_num_tokens"] == 4096 != before["max_total_num_tokens"]
    after = httpx.get(f"{stack.worker_url('prefill')}/server_info").json()
    assert after["max_total_num_tokens"] == before["max_total_num_tokens"]
    assert result.healed and not result.leftovers


def test_engine_failure_probability_is_confirmed_by_the_engine_logs(stack: SimStack, tmp_path: Path) -> None:
    fault = build_fault("engine_failure", {"role": "decode", "probability": 0.5}, "faults[0]")
    with Journal.create(tmp_path / "run") as journal, Traffic(stack.router_url) as traffic:
        result = run_window(fault, _ctx(stack, journal, "w1"), duration_s=3.0)
    assert result.confirmation.confirmed, result.confirmation.evidence
    assert 500 in traffic.statuses
    assert result.healed and not result.leftovers
    assert stack.role_settings("decode")["env"] == {}


@pytest.mark.parametrize(
    "params, message",
    [
        ({"role": "nowhere"}, "is not one of"),
        ({"rol": "prefill"}, "unknown parameter"),
        ({"probability": 2.0}, "must be in (0, 1]"),
    ],
)
def test_bad_fault_parameters_name_the_field(params: dict, message: str) -> None:
    from chaos.errors import UsageError

    name = "engine_failure" if "probability" in params else "transfer_stall"
    with pytest.raises(
        UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")
    ):
        build_fault(name, params, "faults[3]")


def test_every_fault_is_registered() -> None:
    # Every fault family in one list: a new fault is added here and in faults/registry.py.
    assert set(FAULTS) == {
        "transfer_stall",
        "process_kill",
        "memory_fraction",
        "engine_failure",
        "kv_transfer",
        "router_link",
        "netns_partition",
        "client_abort",
        "over_length_burst",
        "cache_flush",
    }


def test_the_abort_timing_reads_the_transfer_latency_of_real_sglang_loads() -> None:
    """SGLang 0.5.23 nests `/v1/loads` under `loads: [{dp_rank ...}]`; the latency is per rank."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from types import SimpleNamespace

    from chaos.targets.base import Endpoints, WorkerEndpoint
    from faults.traffic.client_abort import transfer_latency_s

    loads = json.loads((Path(__file__).parent / "fixtures/sglang/cpu-0.5.23/loads_prefill_idle.json").read_text())
    loads["loads"][0]["disaggregation"]["kv_transfer_latency_ms"] = 42.0

    class Loads(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(loads).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Loads)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        target = SimpleNamespace(endpoints=Endpoints(router_url=url, workers=(WorkerEndpoint("prefill", url),)))
        assert transfer_latency_s(FaultContext(target=target)) == pytest.approx(0.042)  # type: ignore[arg-type]
    finally:
        server.shutdown()
