"""A stand-in driver for the heal tests: start the embedded stack, hold one fault, get killed.

Usage: python -m tests.fault_driver RUN_DIR FAULT_NAME JSON_PARAMS
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from chaos.journal import Journal
from chaos.targets.sim.settings import TransferTimeouts, WorkerSettings
from chaos.targets.sim.stack import SimStack, SimStackConfig
from faults.base import FaultContext
from faults.registry import build_fault
from faults.window import run_window


def main() -> None:
    run_dir, name, params = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    config = SimStackConfig(worker=WorkerSettings(timeouts=replace(TransferTimeouts(), waiting_timeout_s=2.0)))
    stack = SimStack(config, run_dir)
    stack.up()
    journal = Journal.create(run_dir)
    fault = build_fault(name, params, "fault")
    print("ready", flush=True)
    run_window(fault, FaultContext(target=stack, journal=journal, window_id="w1"), duration_s=600.0)


if __name__ == "__main__":
    main()
