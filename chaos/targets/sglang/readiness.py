"""Waiting until an SGLang server serves: poll until 200, give up early if its process dies.

SGLang's `/health` runs a 1-token generate and answers within SGLANG_HEALTH_CHECK_TIMEOUT (20 s):
on a server busy with load, or still warming up, one answer can take seconds. Each poll therefore
waits longer than that, where a plain 2 s poll would time out on every try and never see the 200.
"""

from __future__ import annotations

import time

import httpx

from chaos.targets.launcher import ProcessHandle

REQUEST_TIMEOUT_S = 25.0  # over SGLang's 20 s health-check timeout
INTERVAL_S = 1.0
# uvicorn's line when the port it was given was taken between choosing it and binding it (a minute
# of imports on a busy machine): whatever took it may answer /health in its place.
BIND_FAILED = ("error while attempting to bind on address", "address already in use")


class PortTaken(RuntimeError):
    """The server could not bind its port: start again on fresh ones."""


def await_health(url: str, timeout_s: float, process: ProcessHandle) -> None:
    """Return once `url` answers 200; RuntimeError with its log tail if `process` exits first,
    PortTaken if its log says it could not bind (checked first: another process may answer)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        while True:
            tail = process.read_log()[-4000:]
            if any(line in tail for line in BIND_FAILED):
                raise PortTaken(f"{process.name} could not bind its port; its log ends:\n{tail[-1500:]}")
            if not process.alive():
                raise RuntimeError(f"{process.name} exited with code {process.returncode} before {url} answered; "
                                   f"its log ends:\n{process.read_log()[-3000:]}")
            try:
                response = client.get(url, timeout=min(REQUEST_TIMEOUT_S, max(1.0, deadline - time.monotonic())))
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{url} did not answer 200 within {timeout_s:.0f}s (last: {last}); "
                                   f"{process.name}'s log ends:\n{process.read_log()[-2000:]}")
            time.sleep(INTERVAL_S)
