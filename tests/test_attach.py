"""Attach mode acts only on the processes the campaign means: a pid that names another process (none
there, another command, a later start) is refused before the run, and never signalled during it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from chaos.errors import TargetError, UsageError
from chaos.process import process_state, started_at
from chaos.targets.attach import AttachedProcess, AttachTarget, check_attached
from chaos.targets.spec import AttachedProcess as Given


@pytest.fixture
def server() -> Iterator[subprocess.Popen[bytes]]:
    """A stand-in for an engine someone else runs, in its own session as the docs ask."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)  # sglang.launch_server stand-in"],
        start_new_session=True,
    )
    yield proc
    proc.kill()
    proc.wait()


def test_the_pid_the_campaign_means_is_accepted(server: subprocess.Popen[bytes]) -> None:
    start = started_at(server.pid)
    assert start is not None and abs(start - time.time()) < 60
    check_attached([Given(role="prefill", pid=server.pid, command="launch_server", started_at=round(start))])


@pytest.mark.parametrize(
    ("given", "field", "says"),
    [
        ({"pid": 4_000_000}, "target.processes[0].pid", "no process 4000000"),
        ({"command": "sglang_router"}, "target.processes[0].command", "does not hold 'sglang_router'"),
        ({"started_at": 1_000_000_000.0}, "target.processes[0].started_at", "a later process reuses the pid"),
    ],
    ids=["gone", "another-command", "started-at-another-time"],
)
def test_a_pid_that_names_another_process_is_refused_naming_the_field(
    server: subprocess.Popen[bytes], given: dict, field: str, says: str
) -> None:
    spec = Given(role="decode", **{"pid": server.pid, **given})
    with pytest.raises(UsageError) as refused:
        check_attached([spec])
    assert str(refused.value).startswith(field) and says in str(refused.value)


def test_a_pid_reused_during_the_run_is_never_signalled(server: subprocess.Popen[bytes]) -> None:
    target = AttachTarget("http://127.0.0.1:9", processes_given=[Given(role="prefill", pid=server.pid)])
    [attached] = target.processes("prefill")
    assert isinstance(attached, AttachedProcess) and attached.alive()
    attached.started = (attached.started or 0.0) - 3600  # as if the attached one had exited and its pid been reused
    assert not attached.alive()
    with pytest.raises(TargetError, match="not the one attached"):
        attached.signal_group(signal.SIGSTOP)
    assert process_state(server.pid) not in ("T", None)  # running, not stopped


def test_the_attached_process_is_signalled_while_its_pid_is_its_own(server: subprocess.Popen[bytes]) -> None:
    target = AttachTarget("http://127.0.0.1:9", processes_given=[Given(role="prefill", pid=server.pid)])
    [attached] = target.processes("prefill")
    attached.signal_group(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 5
        while process_state(server.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_state(server.pid) == "T"
    finally:
        attached.signal_group(signal.SIGCONT)
