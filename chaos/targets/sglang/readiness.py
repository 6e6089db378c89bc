"""Waiting until an SGLang server serves: poll until 200, give up early if its process dies.

SGLang's `/health` runs a 1-token generate and answers within SGLANG_HEALTH_CHECK_TIMEOUT (20 s):
on a server busy with load, or still warming up, one answer can take seconds. Each poll therefore
waits longer than that, where a plain 2 s poll would time out on every try and never see the 200.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from chaos.process import ManagedProcess, PortTaken, check_listener, says_port_taken
from chaos.targets.launcher import ProcessHandle

REQUEST_TIMEOUT_S = 25.0  # over SGLang's 20 s health-check timeout
INTERVAL_S = 1.0


def answered_200(response: httpx.Response) -> bool:
    return response.status_code == 200


def await_health(
    url: str,
    timeout_s: float,
    process: ProcessHandle,
    ready: Callable[[httpx.Response], bool] = answered_200,
    log_from: int = 0,
) -> None:
    """Return once `url`'s answer is `ready` (by default: 200); RuntimeError with its log tail if
    `process` exits first, PortTaken if its log says it could not bind (checked first: another
    process may answer).

    `log_from`: the log's length when `process` was launched. A role's log is appended to by each
    of its starts, and an earlier start's "address already in use" must not fail this one."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"

    def own_log() -> str:
        return process.read_log()[log_from:]

    with httpx.Client(timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        while True:
            tail = own_log()[-4000:]
            # uvicorn says so when the port it was given was taken between choosing it and binding
            # it (a minute of imports on a busy machine): whatever took it may answer in its place.
            if says_port_taken(tail):
                raise PortTaken(f"{process.name} could not bind its port; its log ends:\n{tail[-1500:]}")
            if not process.alive():
                raise RuntimeError(
                    f"{process.name} exited with code {process.returncode} before {url} answered; "
                    f"its log ends:\n{own_log()[-3000:]}"
                )
            try:
                response = client.get(url, timeout=min(REQUEST_TIMEOUT_S, max(1.0, deadline - time.monotonic())))
                if ready(response):
                    if isinstance(process, ManagedProcess):
                        check_listener(url, process)  # PortTaken: another run's server answered for ours
                    return
                last = f"HTTP {response.status_code}: {response.text[:200]}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            if time.monotonic() >= deadline:
                wanted = "200" if ready is answered_200 else "ready"
                raise TimeoutError(
                    f"{url} did not answer {wanted} within {timeout_s:.0f}s (last: {last}); "
                    f"{process.name}'s log ends:\n{own_log()[-2000:]}"
                )
            time.sleep(INTERVAL_S)


def router_ready_url(router_url: str, front: str) -> str:
    """What says the router serves. sglang-router's /readiness is 200 once it holds a healthy prefill
    and decode; smg 1.13's is 200 (and requests get 503 `no_available_workers`) while it is still
    registering them, so for smg the answer is its /workers list (`workers_ready`)."""
    return f"{router_url}/workers" if front == "smg" else f"{router_url}/readiness"


def workers_ready(answer: object, roles: tuple[str, ...] = ("prefill", "decode")) -> bool:
    """An smg `/workers` answer that lists a healthy, ready worker of every role."""
    workers = answer.get("workers") if isinstance(answer, dict) else None
    if not isinstance(workers, list):
        return False
    healthy = {
        w.get("worker_type")
        for w in workers
        if isinstance(w, dict) and w.get("is_healthy") is True and w.get("status", "ready") == "ready"
    }
    return all(role in healthy for role in roles)


def _smg_ready(response: httpx.Response) -> bool:
    try:
        return response.status_code == 200 and workers_ready(response.json())
    except ValueError:
        return False


def await_router(router_url: str, front: str, timeout_s: float, process: ProcessHandle, log_from: int = 0) -> None:
    """Return once the router serves both roles (see `router_ready_url`)."""
    await_health(
        router_ready_url(router_url, front),
        timeout_s,
        process,
        ready=_smg_ready if front == "smg" else answered_200,
        log_from=log_from,
    )
