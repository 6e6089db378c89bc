"""`python -m faults.proxy`: one fault proxy as its own process, with its HTTP control API.

It prints one JSON line when it listens (pid, listen and control addresses) and runs until SIGTERM
or SIGINT. The embedded stack starts one per proxied link (chaos/targets/sim/stack.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence

from faults.proxy.spec import FaultSpecError, as_spec
from faults.proxy.tcp import FaultProxy


def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m faults.proxy", description="TCP fault proxy with an HTTP control API")
    p.add_argument(
        "--listen", type=parse_hostport, default=("127.0.0.1", 0), help="HOST:PORT to listen on (default 127.0.0.1:0)"
    )
    p.add_argument("--upstream", type=parse_hostport, required=True, help="HOST:PORT to forward to")
    p.add_argument(
        "--control",
        type=parse_hostport,
        help="HOST:PORT for the control API (GET/PUT /faults, GET /stats, POST /reset)",
    )
    p.add_argument("--faults", type=json.loads, help="initial fault spec as JSON")
    return p


async def _serve_cli(args: argparse.Namespace) -> int:
    proxy = FaultProxy(*args.listen, upstream=args.upstream, faults=args.faults)
    await proxy.start()
    control = None
    if args.control:
        from faults.proxy.control import ControlServer  # aiohttp only where the API is wanted

        control = ControlServer(proxy, *args.control)
    try:
        control_port = await control.start() if control else None
        stopping = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopping.set)
        ready = {
            "pid": os.getpid(),
            "listen": f"{proxy.listen_host}:{proxy.port}",
            "listen_port": proxy.port,
            "upstream": f"{proxy.upstream[0]}:{proxy.upstream[1]}",
            "control": f"{args.control[0]}:{control_port}" if control else None,
            "control_port": control_port,
        }
        print(json.dumps(ready), flush=True)
        await stopping.wait()
    finally:
        if control:
            await control.stop()
        await proxy.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        as_spec(args.faults)
    except FaultSpecError as exc:
        print(f"error: --faults: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(_serve_cli(args))


if __name__ == "__main__":
    sys.exit(main())
