"""A process the suite does not own, made to look like one it does.

Started beside a campaign (`Bystander.start`), it carries a command line like a serving process
(`sglang::router ... --port ...`, the embedded worker's module name), listens on a loopback port
and writes down every catchable signal it receives. A fault that picked processes by name, or a
heal that signalled a wrong group, would reach it: SIGSTOP cannot be caught, but the SIGCONT that
ends it can, and the process state shows a stop still in force. Its port must stay reachable.

    python -m tests.bystander SIGNAL_LOG PORT_FILE    (what `Bystander.start` runs)
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

CAUGHT = (signal.SIGCONT, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT)


def serve(signal_log: Path, port_file: Path) -> None:
    def note(signum: int, _: object) -> None:
        with signal_log.open("a") as f:
            f.write(f"{signal.Signals(signum).name}\n")

    for signum in CAUGHT:
        signal.signal(signum, note)
    listener = socket.create_server(("127.0.0.1", 0))
    port_file.write_text(str(listener.getsockname()[1]))
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(conn.recv(64))  # echo: the port answers as it did before the campaign


class Bystander:
    """The running bystander: `check()` lists what was done to it (empty when nothing was)."""

    def __init__(self, proc: subprocess.Popen[bytes], signal_log: Path, port: int) -> None:
        self.proc, self.signal_log, self.port = proc, signal_log, port

    @classmethod
    def start(cls, workdir: Path, title: str = "sglang::router") -> Bystander:
        workdir.mkdir(parents=True, exist_ok=True)
        signal_log, port_file = workdir / "signals.log", workdir / "port"
        signal_log.write_text("")
        # argv[0] is the title; `--port` and the sim worker's module name make the command line
        # look like the processes faults act on. (With argv[0] not a path, Python does not find
        # the venv: the bystander needs the standard library only.)
        argv = [
            title,
            "-m",
            "tests.bystander",
            str(signal_log),
            str(port_file),
            "--host",
            "127.0.0.1",
            "--port",
            "30000",
            "chaos.targets.sim.worker",
        ]
        proc = subprocess.Popen(
            argv, executable=sys.executable, start_new_session=True, cwd=Path(__file__).resolve().parent.parent
        )
        deadline = time.monotonic() + 15
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("the bystander did not start")
            time.sleep(0.05)
        return cls(proc, signal_log, int(port_file.read_text()))

    def check(self) -> list[str]:
        from faults.undo import process_state  # here: the bystander itself runs on the stdlib alone

        problems = []
        if self.proc.poll() is not None:
            problems.append(f"it exited ({self.proc.returncode})")
            return problems
        if received := self.signal_log.read_text().split():
            problems.append(f"it received {', '.join(received)}")
        if process_state(self.proc.pid) == "T":
            return problems + ["it is stopped"]  # its port cannot answer now
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=5) as conn:
                conn.sendall(b"ping")
                conn.settimeout(5)
                if conn.recv(64) != b"ping":
                    problems.append(f"its port {self.port} answered wrongly")
        except OSError as exc:
            problems.append(f"its port {self.port} is unreachable: {exc}")
        return problems

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


if __name__ == "__main__":
    serve(Path(sys.argv[1]), Path(sys.argv[2]))
