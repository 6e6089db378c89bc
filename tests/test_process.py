"""ManagedProcess.stop: a stopped server's whole process group is gone, not just its leader."""

from __future__ import annotations

import time
from pathlib import Path

from chaos.process import group_members, launch, process_state

# The leader exits on TERM; its children ignore TERM, so only the group SIGKILL ends them.
SCRIPT = "trap '' TERM; for i in 1 2 3; do (trap '' TERM; while :; do :; done) & done; trap - TERM; wait"


def test_stop_returns_when_every_member_of_the_group_is_gone(tmp_path: Path) -> None:
    proc = launch("stubborn", ["bash", "-c", SCRIPT], tmp_path / "stubborn.log")
    deadline = time.monotonic() + 10
    while len(group_members(proc.pgid)) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(group_members(proc.pgid)) == 4, "the three busy children did not start"
    proc.stop(timeout_s=5.0)
    left = {pid: process_state(pid) for pid in group_members(proc.pgid)}
    assert all(state in ("Z", "X", None) for state in left.values()), left
    assert not proc.alive()
