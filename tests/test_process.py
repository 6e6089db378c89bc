"""Stopping a server: its whole process group is gone, not just its leader."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from chaos.process import (
    ManagedProcess,
    PortTaken,
    free_port,
    group_members,
    kernel_wait,
    kill_group,
    launch,
    listener_pids,
    live_states,
    process_state,
    state_of_stat,
    wait_http_ok,
)
from tests.bystander import Bystander
from tests.conftest import another_runs_server

# The leader exits on TERM; its children ignore TERM, so only the group SIGKILL ends them.
SCRIPT = "trap '' TERM; for i in 1 2 3; do (trap '' TERM; while :; do :; done) & done; trap - TERM; wait"

STOPS: dict[str, Callable[[ManagedProcess], object]] = {
    "ManagedProcess.stop": lambda proc: proc.stop(timeout_s=2.0),
    "kill_group (from a state file)": lambda proc: kill_group(proc.pgid, timeout_s=2.0),
}


@pytest.mark.parametrize("stop", STOPS.values(), ids=STOPS.keys())
def test_stopping_returns_when_every_member_of_the_group_is_gone(
    tmp_path: Path, stop: Callable[[ManagedProcess], object]
) -> None:
    proc = launch("stubborn", ["bash", "-c", SCRIPT], tmp_path / "stubborn.log")
    deadline = time.monotonic() + 10
    while len(group_members(proc.pgid)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(group_members(proc.pgid)) == 4, "the three busy children did not start"
    stop(proc)
    left = {pid: process_state(pid) for pid in group_members(proc.pgid)}
    assert all(state in ("Z", "X", None) for state in left.values()), left
    proc.popen.wait(timeout=5)


def test_free_port_never_hands_out_a_port_twice_nor_one_that_is_held(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A second pick must not get a port handed out already (two of fourteen default runs once
    failed to start that way, a proxy on a worker's port), nor one another socket holds."""
    import socket

    from chaos import process

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        offered = iter([24001, 24001, taken, 24001, 24002])
        monkeypatch.setattr(process, "_HANDED_OUT", set())
        monkeypatch.setattr(process, "_ephemeral_low", lambda: 32768)  # whatever this host's range
        monkeypatch.setattr(process._CHOOSER, "randrange", lambda low, high: next(offered))
        assert [process.free_port(), process.free_port()] == [24001, 24002]


def test_free_port_picks_below_the_kernels_ephemeral_range(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Outgoing connections and servers that bind port 0 take ports from the ephemeral range, in
    the seconds between our pick and our server's bind: picks stay below it, above Ray's workers."""
    from chaos import process

    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    assert process._ephemeral_low() == int(ephemeral[0])
    monkeypatch.setattr(process, "_HANDED_OUT", set())
    monkeypatch.setattr(process, "_ephemeral_low", lambda: 32768)  # the default, whatever this host's
    picks = [process.free_port() for _ in range(50)]
    assert len(set(picks)) == 50
    assert all(process.PORT_FLOOR <= port < 32768 for port in picks), picks
    with pytest.raises(OSError) as not_here:  # named at once, not retried into "no free port"
        process.free_port("192.0.2.1")
    assert not_here.value.errno == errno.EADDRNOTAVAIL, not_here.value


def test_ports_of_one_stack_differ_though_two_agents_pick_them(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each node's agent remembers only its own picks; two agents on one host can pick alike."""
    from chaos.targets.launcher import LocalLauncher, distinct_port

    offered = iter([24001, 24001, 24002])
    launcher = LocalLauncher()
    monkeypatch.setattr(launcher, "free_port", lambda role: next(offered))
    taken: set[tuple[str, int]] = set()
    assert [distinct_port(launcher, "prefill", taken), distinct_port(launcher, "decode", taken)] == [24001, 24002]


def test_the_bystander_tells_a_stop_a_signal_and_a_lost_port(tmp_path: Path) -> None:
    """The bystander the campaign tests run beside the stack notices what a wrong fault would do."""
    bystander = Bystander.start(tmp_path)
    try:
        assert bystander.check() == []
        with open(f"/proc/{bystander.proc.pid}/cmdline", "rb") as f:
            assert f.read().split(b"\0")[0] == b"sglang::router"
        os.kill(bystander.proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert "it is stopped" in bystander.check()
        os.kill(bystander.proc.pid, signal.SIGCONT)
        time.sleep(0.2)
        assert bystander.check() == ["it received SIGCONT"]
        os.kill(bystander.proc.pid, signal.SIGKILL)
        bystander.proc.wait(5)
        assert bystander.check() == ["it exited (-9)"]
    finally:
        bystander.stop()


def test_readiness_answered_by_another_process_on_our_port_is_a_lost_port(tmp_path: Path) -> None:
    with another_runs_server() as port:
        ours = launch("never-binds", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "a.log")
        try:
            with pytest.raises(PortTaken, match=f"answered by pid {os.getpid()}.*Address already in use"):
                wait_http_ok(f"http://127.0.0.1:{port}/health", 10.0, ours)
        finally:
            ours.stop()
    port = free_port()
    server = launch("ours", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], tmp_path / "b.log")
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/", 20.0, server)  # its own socket: ready
        assert listener_pids(port) == {server.pid}
    finally:
        server.stop()


def test_a_member_the_kernel_is_tearing_down_counts_as_gone_whatever_state_it_shows() -> None:
    # /proc/PID/stat of a SIGKILLed vLLM worker still unmapping its memory: "R", flags with PF_EXITING
    exiting = "4242 (VLLM::Worker (x)) R 1 4242 4242 0 -1 4194884 120 0 0 0 9 3 0 0 20 0 8 0"
    running = "4243 (python) R 1 4242 4242 0 -1 4194560 120 0 0 0 9 3 0 0 20 0 8 0"
    stopped = "4244 (python) T 1 4242 4242 0 -1 4194560 120 0 0 0 9 3 0 0 20 0 8 0"
    assert state_of_stat(exiting) == "X"
    assert state_of_stat(running) == "R" and state_of_stat(stopped) == "T"
    assert live_states({4242: state_of_stat(exiting), 4243: state_of_stat(running)}) == {4243: "R"}


def test_our_own_process_reads_as_running_not_exiting() -> None:
    assert process_state(os.getpid()) in ("R", "S")


def test_where_a_process_waits_in_the_kernel_is_read_for_the_record() -> None:
    # What a lingering killed worker's evidence adds to its state: a sleeping child waits in the
    # kernel's sleep; a pid that does not exist reads as unknown.
    sleeper = subprocess.Popen(["sleep", "5"])
    try:
        deadline = time.monotonic() + 5
        while process_state(sleeper.pid) != "S" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "sleep" in (kernel_wait(sleeper.pid) or ""), kernel_wait(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert kernel_wait(sleeper.pid) is None
