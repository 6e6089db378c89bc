"""`python -m faults.links hold ...`: the process that holds a partition's iptables rules, so
they live exactly as long as it does (netns_partition's heal stops it by PID)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from faults.links.iptables import install_partition, remove_partition


def hold(argv: Sequence[str] | None = None) -> int:
    """`python -m faults.links hold ...`: arm, install on SIGUSR1, remove on SIGTERM/SIGINT/SIGHUP
    or after --max-hold-s. One JSON line per step on stdout (the fault reads them from the log)."""
    parser = argparse.ArgumentParser(prog="python -m faults.links hold")
    parser.add_argument("--chain", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--action", choices=("reject", "drop"), default="reject")
    parser.add_argument("--netns", default="")
    parser.add_argument("--max-hold-s", type=float, default=900.0)
    args = parser.parse_args(argv)
    state = {"install": False, "stop": False}

    def on_install(*_: object) -> None:
        state["install"] = True

    def on_stop(*_: object) -> None:
        state["stop"] = True

    signal.signal(signal.SIGUSR1, on_install)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_stop)

    def say(event: str, **data: object) -> None:
        print(json.dumps({"event": event, "pid": os.getpid(), **data}), flush=True)

    say("armed", chain=args.chain)
    deadline = time.monotonic() + args.max_hold_s
    installed = False
    try:
        while not state["stop"] and time.monotonic() < deadline:
            if state["install"] and not installed:
                try:
                    install_partition(args.netns, args.chain, args.host, args.port, args.action)
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                    say("error", error=str(exc))
                    return 1
                installed = True
                say("installed", chain=args.chain, host=args.host, port=args.port, action=args.action)
            time.sleep(0.05)
    finally:
        remove_partition(args.netns, args.chain)
        say("removed", chain=args.chain, expired=time.monotonic() >= deadline)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "hold":
        print(
            "usage: python -m faults.links hold --chain C --host H --port P [--action reject|drop] [--netns NS]",
            file=sys.stderr,
        )
        return 2
    return hold(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
