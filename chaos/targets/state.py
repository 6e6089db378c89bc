"""`target.json`: what a launched target leaves in its run directory so any process can stop it.

Every launched stack (embedded, SGLang, vLLM) writes the same file: its endpoints, each process
group it started, and where the launcher put them (Ray agents on other nodes). `pdchaos heal`,
`pdchaos sim down` and the tests stop a stack from this file alone, whatever its kind.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from chaos.files import replace_file
from chaos.process import kill_group, pid_alive
from chaos.targets.base import Endpoints, ProcessRef, TargetState
from chaos.targets.launcher import Launcher, ProcessHandle
from chaos.targets.nodes import heal_agents

STATE_FILE = "target.json"


def state_path(run_dir: Path) -> Path:
    return run_dir / STATE_FILE


def write_state(
    run_dir: Path,
    kind: str,
    endpoints: Endpoints,
    procs: Mapping[str, ProcessHandle],
    launcher: Launcher,
    log_dir: Path,
    role_of: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Record the live processes (name -> handle); `role_of` names a process's role when it is not its name."""
    state = TargetState(
        kind=kind,
        endpoints=endpoints,
        processes=[
            ProcessRef(name, (role_of or {}).get(name, name), p.pid, p.pgid, str(log_dir / f"{name}.log"))
            for name, p in procs.items()
            if p.alive()
        ],
    )
    data = dataclasses.asdict(state)
    data["launcher"] = launcher.state()
    data.update(extra or {})
    replace_file(state_path(run_dir), json.dumps(data, indent=2))


def clear_state(run_dir: Path) -> None:
    path = state_path(run_dir)
    if path.exists():
        path.unlink()


def stop_from_state(run_dir: Path) -> list[str]:
    """Stop every process group a stack recorded in `run_dir` (from any process). What it did."""
    path = state_path(run_dir)
    if not path.exists():
        return []
    data = json.loads(path.read_text())
    done: list[str] = []
    launcher = data.get("launcher") or {}
    if launcher.get("agents"):  # on Ray nodes: the agents beside the processes stop them
        done.extend(heal_agents(launcher))
    else:
        for proc in data.get("processes", []):
            if pid_alive(proc["pgid"]):
                kill_group(proc["pgid"])
                done.append(f"stopped {proc['name']} (process group {proc['pgid']})")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(pid_alive(p["pgid"]) for p in data.get("processes", [])):
            time.sleep(0.1)
    path.unlink()
    return done
