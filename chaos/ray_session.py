"""The Ray session every placement shares: load actors (chaos/cluster.py) and node agents
(chaos/targets/nodes.py) join the same one, bound to loopback unless an address is given."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

# Ray binds every socket to loopback only with this (by default it listens on *:PORT).
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}


def connect_ray(address: str | None) -> tuple[bool, Any]:
    """Join (or, without an address, start) Ray on loopback; (whether this call connected, ray)."""
    os.environ.update(RAY_ENV)
    import ray

    if ray.is_initialized():
        return False, ray
    # ray.init() sets SIGTERM to sys.exit in the main thread: a handler the caller installed (a
    # run's heal and report, chaos/stop_signals.py) must stay; a default one gives way to Ray's.
    main = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main else None
    ray.init(
        address=address,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": dict(RAY_ENV)},
    )
    if callable(sigterm):
        signal.signal(signal.SIGTERM, sigterm)
    return True, ray


def disconnect_ray(ray: Any) -> None:
    """Shut down the Ray session this process opened, keeping its signal handlers: Ray's shutdown
    resets SIGTERM to the default at the C level while Python still lists the caller's handler, so
    a SIGTERM after it would kill the driver outright, its heal and report undone."""
    ray.shutdown()
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            handler = signal.getsignal(signum)
            if handler is not None:
                signal.signal(signum, handler)  # the same handler, installed again with the OS
