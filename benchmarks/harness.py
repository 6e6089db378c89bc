"""What a benchmark that starts its own servers needs around its measurement, in one place.

benchmarks/ttft_overhead.py and benchmarks/router_throughput.py start the embedded stack (and
router_throughput stub workers too) as subprocesses and measure it. Around that they need the
same things, which were copied between them: a run directory for the processes' logs, the
guarantee that every process started is stopped however the run ends (Ctrl-C, SIGTERM, an
error), the machine and the command line a figure was measured with, and the `--json` output.
Starting the processes stays with each benchmark (SimStack, or its own launches): only what
surrounds it is here.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import signal
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from types import TracebackType
from typing import Any

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- run directory ----


def utc_stamp() -> str:
    """The run's start time as it names things (`20250101T120000Z`): UTC, so runs sort by it."""
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def make_run_dir(given: Path | None, name: str, stamp: str) -> Path:
    """`given` (`--run-dir`), else `runs/<name>-<stamp>` in the repository, created and absolute:
    the started processes' logs go there and the report quotes it, so it must not depend on the
    working directory. The caller passes `stamp` because it may name other things of the run."""
    run_dir = (given or REPO / "runs" / f"{name}-{stamp}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


# ---------------------------------------------------------------- stopping what was started ----


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


class StopOnExit:
    """`with StopOnExit(stack.down) as run: ...`: `stop` runs however the block ends.

    Inside the block SIGTERM raises KeyboardInterrupt as Ctrl-C does, so `kill` stops the servers
    too instead of orphaning them. `stop` runs with SIGINT and SIGTERM ignored, because a second
    Ctrl-C while stopping must not leave servers behind; the handlers are the defaults after it.
    An interrupt is said on stderr before stopping, then swallowed: `run.interrupted` tells the
    caller to return 130. Other exceptions propagate after the stop.
    """

    def __init__(self, stop: Callable[[], None]) -> None:
        self.stop = stop
        self.interrupted = False

    def __enter__(self) -> StopOnExit:
        signal.signal(signal.SIGTERM, _raise_interrupt)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        self.interrupted = exc_type is not None and issubclass(exc_type, KeyboardInterrupt)
        if self.interrupted:
            print("interrupted; stopping everything", file=sys.stderr)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            self.stop()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        return self.interrupted


# ------------------------------------------------------------------------------- the report ----


def package_version(pkg: str) -> str:
    """The installed version, or "?": a report must not fail over a missing package."""
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "?"


def machine_info(*, cpu_count: bool = False, versions: Sequence[str] = ()) -> dict[str, Any]:
    """The machine a figure was measured on, in the report's key order: `nproc` (the CPUs this
    process may use, what the figures depend on), `cpu_count` (the box's, if asked), CPU model,
    kernel, Python, the versions of the `versions` packages (keyed with `_` for `-`), and the load
    average at the start (other tenants; the caller adds `loadavg_end`)."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 0
    info: dict[str, Any] = {"nproc": usable}
    if cpu_count:
        info["cpu_count"] = os.cpu_count()
    info |= {"cpu_model": model, "kernel": platform.release(), "python": platform.python_version()}
    info |= {pkg.replace("-", "_"): package_version(pkg) for pkg in versions}
    info["loadavg_start"] = list(os.getloadavg())
    return info


def command_line(script: str, argv: list[str] | None) -> str:
    """The command that reruns this benchmark from the repository root: `main`'s `argv` when it
    was called with one (tests), else the process's own arguments."""
    return " ".join(
        shlex.quote(a) for a in [".venv/bin/python", f"benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)]
    )


def write_json(report: dict[str, Any], path: str | None) -> None:
    """`--json PATH`: nothing without it, the report on stdout for '-', else into the file."""
    if not path:
        return
    text = json.dumps(report, indent=2)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")
