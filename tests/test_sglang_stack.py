"""The SGLang stack's process management, with a stand-in for `sglang.launch_server` and the real router.

SGLang cannot run here, so `target.sglang.python` points at tests/fixtures/sglang/fake_launch_server.py,
which takes SGLang's flags and answers the endpoints the stack and the router poll. What is under
test is ours: launching each server in its own session, readiness (worker /health, router
/readiness), the state file, restarts with changed settings (the memory_fraction and
engine_failure faults drive them, as in a run), the pool check's readings, stopping every process
of every group.
"""

from __future__ import annotations

import json
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from chaos.gpu import Gpu, GpuInventory
from chaos.targets.sglang.pool import pool_checks
from chaos.targets.sglang.spec import SGLangSpec
from chaos.targets.sglang.stack import SGLangStack
from chaos.targets.state import stop_from_state
from faults.base import FaultContext
from faults.registry import build_fault
from tests.conftest import wait_until

pytestmark = pytest.mark.integration
FAKE_SERVER = Path(__file__).parent / "fixtures" / "sglang" / "fake_launch_server.py"


def fake_python(tmp_path: Path) -> str:
    """An executable standing where SGLang's Python would: it runs the stand-in server."""
    path = tmp_path / "fake-python"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE_SERVER}" "$@"\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def make_stack(tmp_path: Path, **changes: object) -> SGLangStack:
    data: dict[str, object] = {
        "model_path": "fake/model",
        "python": fake_python(tmp_path),
        "mem_fraction_static": 0.8,
        "context_length": 8192,
        "startup_timeout_s": 60,
        "router": {"env": {"HF_ENDPOINT": "http://127.0.0.1:9"}},
    }
    data.update(changes)
    return SGLangStack(SGLangSpec.model_validate(data), tmp_path / "run")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[SGLangStack]:
    s = make_stack(tmp_path)
    s.up()
    try:
        yield s
    finally:
        s.down()


def server_info(stack: SGLangStack, role: str) -> dict[str, object]:
    return httpx.get(f"{stack.worker_url(role)}/server_info", timeout=5, trust_env=False).json()  # type: ignore[no-any-return]


def group(stack: SGLangStack, role: str) -> set[int]:
    pid = stack.processes(role)[0].pid
    return {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}


def gone(pids: set[int]) -> bool:
    def dead(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    return all(dead(p) for p in pids)


@pytest.mark.timeout(180)
def test_up_serves_through_the_router_and_records_its_state(stack: SGLangStack) -> None:
    endpoints = stack.endpoints
    assert httpx.get(f"{endpoints.router_url}/readiness", timeout=5, trust_env=False).status_code == 200
    workers = httpx.get(f"{endpoints.router_url}/workers", timeout=5, trust_env=False).json()["workers"]
    assert sorted((w["worker_type"], w["url"]) for w in workers) == [
        ("decode", stack.worker_url("decode")),
        ("prefill", stack.worker_url("prefill")),
    ]
    state = json.loads(stack.state_path(stack.run_dir).read_text())
    assert state["kind"] == "sglang" and {p["name"] for p in state["processes"]} == {"prefill", "decode", "router"}
    assert [c["name"] for c in state["commands"]] == ["prefill", "decode", "router"]
    # each server in its own session, with its own GPU and the shortened timeouts in its environment
    pids = {role: stack.processes(role)[0].pid for role in ("prefill", "decode", "router")}
    assert all(psutil.pid_exists(pid) for pid in pids.values())
    import os

    assert len({os.getsid(pid) for pid in pids.values()}) == 3 and all(os.getsid(p) == p for p in pids.values())
    assert "CUDA_VISIBLE_DEVICES=0" in stack.logs("prefill") and "CUDA_VISIBLE_DEVICES=1" in stack.logs("decode")
    assert "SGLANG_DISAGGREGATION_WAITING_TIMEOUT=30" in stack.logs("decode")
    assert server_info(stack, "prefill")["disaggregation_bootstrap_port"] == stack.ports.bootstrap
    # A stack already up is returned as it is (the runner calls up() on a stack it is handed).
    assert stack.up() == endpoints and {r: stack.processes(r)[0].pid for r in pids} == pids
    # no GPU here: the pool check says so rather than failing
    assert [(c["role"], c["status"]) for c in stack.pool_report] == [("prefill", "unknown"), ("decode", "unknown")]
    assert json.loads((stack.run_dir / "pool-check.json").read_text()) == stack.pool_report  # outlives target.json


@pytest.mark.timeout(180)
def test_pool_check_reads_metrics_and_server_info(stack: SGLangStack) -> None:
    # The stand-in holds 0.8 x 100000 tokens at 128 KiB each (9.77 GiB) beside 16 GiB of weights.
    def inventory(total_gib: float) -> GpuInventory:
        return GpuInventory(True, gpus=tuple(Gpu(i, "H100", f"GPU-{i}", total_gib * 1024, 0.0) for i in (0, 1)))

    fits = pool_checks(stack, inventory(32.2))
    assert [(c.role, c.status, c.reported_pool_tokens) for c in fits] == [
        ("prefill", "ok", 80000),
        ("decode", "ok", 80000),
    ]
    assert fits[0].weights_gib == 16.0 and fits[0].mem_fraction_static == 0.8
    assert [c.status for c in pool_checks(stack, inventory(80.0))] == ["low", "low"]


@pytest.mark.timeout(240)
def test_memory_fraction_fault_restarts_one_role_and_heals(stack: SGLangStack) -> None:
    fault = build_fault("memory_fraction", {"role": "prefill", "mem_fraction_static": 0.5}, "test")
    ctx = FaultContext(stack)
    plan = fault.undo_plan(ctx)
    old_group = group(stack, "prefill")
    fault.inject(ctx)
    confirmation = fault.confirm(ctx)
    assert confirmation.confirmed, confirmation.evidence
    assert "pool_tokens: 80000 -> 50000" in confirmation.evidence
    assert gone(old_group)  # the whole old group, its child included
    assert (
        server_info(stack, "prefill")["mem_fraction_static"] == 0.5
        and server_info(stack, "decode")["mem_fraction_static"] == 0.8
    )
    assert stack.role_settings("prefill")["mem_fraction_static"] == 0.5
    fault.heal(ctx, plan)
    assert fault.audit(ctx, plan) == []
    assert server_info(stack, "prefill")["max_total_num_tokens"] == 80000
    state = json.loads(stack.state_path(stack.run_dir).read_text())
    assert next(p["pid"] for p in state["processes"] if p["name"] == "prefill") == stack.processes("prefill")[0].pid


@pytest.mark.timeout(240)
def test_engine_failure_env_is_set_on_restart_and_removed_on_heal(stack: SGLangStack) -> None:
    fault = build_fault("engine_failure", {"role": "decode", "probability": 0.25}, "test")
    ctx = FaultContext(stack)
    plan = fault.undo_plan(ctx)
    fault.inject(ctx)
    last_env = [line for line in stack.logs("decode").splitlines() if "fake env:" in line][-1]
    assert "SGLANG_TEST_DISAGG_FAILURE_PROB=0.25" in last_env and "SGLANG_DISAGGREGATION_WAITING_TIMEOUT=30" in last_env
    fault.heal(ctx, plan)
    assert fault.audit(ctx, plan) == []
    last_env = [line for line in stack.logs("decode").splitlines() if "fake env:" in line][-1]
    assert "SGLANG_TEST_DISAGG_FAILURE_PROB" not in last_env


@pytest.mark.timeout(180)
def test_router_restart_and_a_stop_from_the_state_file_alone(tmp_path: Path) -> None:
    s = make_stack(tmp_path)
    s.up()
    try:
        old = s.processes("router")[0].pid
        s.restart("router")
        assert s.processes("router")[0].pid != old
        assert httpx.get(f"{s.router_url}/readiness", timeout=5, trust_env=False).status_code == 200
        pids = group(s, "prefill") | group(s, "decode") | {s.processes("router")[0].pid}
        # What `pdchaos heal` does from another process. Here this process is still their parent:
        # reap them meanwhile, as init would, or each would wait out its timeout as a zombie.
        reaping = threading.Event()

        def reap() -> None:
            while not reaping.wait(0.05):
                for proc in s.procs.values():
                    proc.alive()  # Popen.poll() reaps an exited child

        reaper = threading.Thread(target=reap, daemon=True)
        reaper.start()
        try:
            done = stop_from_state(s.run_dir)
        finally:
            reaping.set()
            reaper.join()
        assert len(done) == 3
        wait_until(lambda: gone(pids), 10, what="every process of every group stopped")
        assert not s.state_path(s.run_dir).exists()
    finally:
        s.down()


@pytest.mark.timeout(120)
def test_a_server_that_dies_while_loading_fails_up_with_its_log_and_leaves_nothing(tmp_path: Path) -> None:
    s = make_stack(tmp_path, extra_args=["--no-such-flag"])  # the stand-in exits on a flag it does not know
    with pytest.raises(RuntimeError, match="exited with code"):
        s.up()
    assert not s.state_path(s.run_dir).exists()
    assert all(not p.alive() for p in s.procs.values())
