"""Launching and stopping the servers the suite owns.

Every server starts in its own session (`setsid`), so a signal goes to its whole process group:
killing one PID of a real engine leaves its worker processes alive (vLLM: docs/vllm-tier.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

# Process states of a member that has exited (a zombie waits only to be reaped): it runs nothing
# and holds no port, so a group of them is gone.
EXITED = ("Z", "X")
PF_EXITING = 0x4  # include/linux/sched.h: the task is getting shut down


_HANDED_OUT: set[tuple[str, int]] = set()
_HANDED_OUT_LOCK = threading.Lock()
_CHOOSER = random.SystemRandom()  # not the global `random`: a campaign seed would give parallel runs one port

# Ports are picked below the kernel's ephemeral range: every outgoing connection, and every server
# that binds port 0 (Ray's raylets, agents and workers start many), takes its port from that range,
# so a port picked there can be taken in the seconds before our server binds it (a decode worker
# once failed to start that way beside a four-node Ray cluster). Above Ray's default worker ports
# (`ray start --min-worker-port 10002 --max-worker-port 19999`).
PORT_FLOOR = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _bindable(host: str, port: int) -> bool:
    """Whether `port` is free on `host`: bound without SO_REUSEADDR, so a port a connection or a
    TIME_WAIT still holds counts as taken too. Any error but "taken" (an address not on this node)
    is raised: no other port would do better."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _os_pick(host: str) -> int:
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody holds right now, outside the range the kernel hands out by itself, and
    never one this process has handed out before (a port is picked long before its server binds
    it). Another process can still pick the same one (two agents on one host: see the stacks'
    `distinct_port`), and one that binds it on purpose can take it in between. Where the
    ephemeral range leaves no room below it, the OS picks (port 0)."""
    ceiling = _ephemeral_low()
    with _HANDED_OUT_LOCK:
        for _ in range(256):
            port = _CHOOSER.randrange(PORT_FLOOR, ceiling) if ceiling - PORT_FLOOR >= 1024 else _os_pick(host)
            if (host, port) not in _HANDED_OUT and _bindable(host, port):
                _HANDED_OUT.add((host, port))
                return port
    raise OSError(f"no free port on {host} that this process has not handed out already")


@dataclass
class ManagedProcess:
    """A server started by the suite: its process group, its command and its log file."""

    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes]
    node: str = "local"  # where it runs: "local", or the Ray node its agent lives on

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def pgid(self) -> int:
        return self.popen.pid  # start_new_session makes the child its group's leader

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def read_log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def group_states(self) -> dict[int, str]:
        return group_states(self.pgid)

    def signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pgid, signum)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGCONT (a paused group cannot exit), SIGTERM, then SIGKILL after `timeout_s`."""
        if self.alive():
            self.signal_group(signal.SIGCONT)
            self.signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.popen.wait(timeout=timeout_s)
        # Children of the leader may outlive it; the group signal reaches them too. Stopped means
        # gone: a member still tearing down would race its successor for ports and locks.
        self.signal_group(signal.SIGKILL)
        await_group_exit(self.pgid, timeout_s)
        return self.popen.returncode


def launch(
    name: str,
    argv: Sequence[str],
    log_path: Path,
    env: Mapping[str, str] | None = None,
) -> ManagedProcess:
    """Start `argv` in a new session with stdout and stderr appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    full_env.update(env or {})
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,
        )
    return ManagedProcess(name=name, argv=list(argv), log_path=log_path, popen=popen)


# How servers say they lost their port: Python's and uvicorn's errno text, the Rust routers' words.
PORT_TAKEN_WORDS = ("address already in use", "error while attempting to bind on address")


class PortTaken(RuntimeError):
    """Another process listens on the port one of our servers was given: whatever answers there
    is not ours. (The message says "Address already in use", as the losing server would.)"""


def wait_http_ok(
    url: str,
    timeout_s: float,
    process: Any = None,
    interval_s: float = 0.1,
) -> None:
    """Poll `url` until it answers 200; fail early if `process` dies meanwhile, or if the answer
    comes from another process's socket (`PortTaken`): a port picked here can be taken by another
    run's server before ours binds it, and that server then answers for ours."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if process is not None and not process.alive():
                raise RuntimeError(
                    f"{process.name} exited with code {process.returncode} before {url} "
                    f"answered; its log ends:\n{process.read_log()[-2000:]}"
                )
            try:
                response = client.get(url)
                if response.status_code == 200:
                    if isinstance(process, ManagedProcess):
                        check_listener(url, process)
                    return
                last_error = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last_error = type(exc).__name__
            time.sleep(interval_s)
    raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f}s (last: {last_error})")


def check_listener(url: str, process: ManagedProcess) -> None:
    """PortTaken when the socket listening on `url`'s port belongs to no member of `process`'s group.
    Only the group's descriptors are read when it does (the common case); all of /proc only to
    name the owner when it does not."""
    port = httpx.URL(url).port
    sockets = _listening_sockets(port) if port is not None else set()
    if not sockets or any(_holds(pid, sockets) for pid in group_members(process.pgid)):
        return
    owners = _owners(sockets)
    raise PortTaken(
        f"{url} is answered by pid {', '.join(map(str, sorted(owners))) or '(unknown)'}, not by "
        f"{process.name} (process group {process.pgid}): Address already in use"
    )


def says_port_taken(text: str) -> bool:
    """Whether a server's error or log says it lost its port to another socket."""
    lowered = text.lower()
    return any(words in lowered for words in PORT_TAKEN_WORDS)


def listener_pids(port: int) -> set[int] | None:
    """The pids holding a listening TCP socket on `port` in this network namespace; None when
    /proc shows no such socket (another namespace, another OS): then nothing can be told."""
    sockets = _listening_sockets(port)
    return (_owners(sockets) or None) if sockets else None


def _listening_sockets(port: int) -> set[str]:
    """`socket:[inode]` names of the TCP sockets listening on `port`, as /proc/PID/fd links read."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    return {f"socket:[{inode}]" for inode in inodes}


def _holds(pid: int, sockets: set[str]) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in sockets:
                return True
        except OSError:
            continue
    return False


def _owners(sockets: set[str]) -> set[int]:
    return {int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _holds(int(entry), sockets)}


def process_state(pid: int) -> str | None:
    """The one-letter state of a process from /proc (T = stopped), None if it is gone; "X" for
    one the kernel is tearing down."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return state_of_stat(f.read())
    except (OSError, IndexError, ValueError):
        return None


def state_of_stat(stat: str) -> str:
    """The state in a /proc/PID/stat line, "X" (dead) once the process is exiting.

    A SIGKILLed process with a large address space can show "R" for tens of seconds on a loaded
    machine while the kernel unmaps its memory; it never runs its own code again, so it counts as
    gone (PF_EXITING in the flags field). Not every lingering pid is that: a killed vLLM worker was
    once seen in "R" without PF_EXITING, cause unknown, and counts as alive.
    """
    fields = stat.rsplit(")", 1)[1].split()
    state, flags = fields[0], int(fields[6])
    return "X" if flags & PF_EXITING and state not in EXITED else state


def kernel_wait(pid: int) -> str | None:
    """Where in the kernel a process is (/proc/PID/wchan, else the top of /proc/PID/stack), None
    when it runs in user space or this cannot be read: what tells a killed process that is still
    unmapping its memory from one stuck in a driver."""
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
        if wchan and wchan != "0":
            return wchan
        top = Path(f"/proc/{pid}/stack").read_text().split("\n", 1)[0].strip()
    except OSError:
        return None
    return top.split("] ", 1)[-1].split("+", 1)[0] or None


def started_at(pid: int) -> float | None:
    """When a process started (epoch seconds, as `ps -o lstart` gives it), None if it is gone: with
    the pid, what tells a process from a later one that reuses its pid."""
    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def command_line(pid: int) -> str | None:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return None


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                members.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return members


def group_states(pgid: int) -> dict[int, str]:
    """pid -> one-letter state (T = stopped, Z = zombie) of every member of a process group."""
    return {pid: state for pid in group_members(pgid) if (state := process_state(pid)) is not None}


def live_states(states: Mapping[int, str]) -> dict[int, str]:
    """The members that still run: a zombie has exited and only waits to be reaped."""
    return {pid: state for pid, state in states.items() if state not in EXITED}


def await_group_exit(pgid: int, timeout_s: float) -> dict[int, str]:
    """Wait until no member of the group runs; returns what still ran at the deadline."""
    deadline = time.monotonic() + timeout_s
    while (live := live_states(group_states(pgid))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return live


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_group(pgid: int, timeout_s: float = 10.0) -> None:
    """Stop a process group we only know by id (e.g. from a state file): CONT, TERM, then KILL
    whatever still runs; returns when the whole group is gone (or `timeout_s` after the KILL)."""
    for signum in (signal.SIGCONT, signal.SIGTERM):
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            return
    if not await_group_exit(pgid, timeout_s):
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    await_group_exit(pgid, timeout_s)
