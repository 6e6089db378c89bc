"""Shared fixtures: the embedded PD stack behind the real router, and polling helpers."""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, TypeVar

import httpx
import pytest

from chaos import transport
from chaos.campaign import Campaign
from chaos.runner import Runner, RunOutcome
from chaos.targets.sim.stack import SimStack, SimStackConfig
from chaos.transport import Transport

# Ray and the router must stay on loopback (see chaos/cluster.py).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`pdchaos ARGS` from the repository root, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "chaos.cli", *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def selected_params(request: pytest.FixtureRequest, name: str) -> list[object]:
    """The values of parameter `name` among the tests of the requesting module that this session
    runs (all of them unless `-k` narrows them), each once, in collection order: what a module
    fixture that makes every run up front, several at a time, must make."""
    seen: dict[str, object] = {}
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if getattr(item, "module", None) is request.module and callspec is not None and name in callspec.params:
            seen.setdefault(str(callspec.params[name]), callspec.params[name])
    return list(seen.values())


def wait_until(probe: Callable[[], T], timeout_s: float = 15.0, interval_s: float = 0.1, what: str = "condition") -> T:
    """Poll `probe` until it returns something truthy; fail the test with `what` otherwise."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last value: {last!r})")


class _Startable(Protocol):
    def up(self) -> object: ...
    def down(self) -> None: ...


S = TypeVar("S", bound=_Startable)


@contextmanager
def running(stack: S) -> Iterator[S]:
    """A launched stack (sim, SGLang, vLLM) up for the block, stopped after it whatever happened."""
    stack.up()
    try:
        yield stack
    finally:
        stack.down()


def run_on(stack: object, campaign: Campaign, run_dir: Path) -> RunOutcome:
    """A campaign run on a stack a test module started (the campaign's target section must
    describe it): the runner is handed that stack instead of building one, and leaves it up. The
    runner calls its `up()`, which must return a stack already up as it is: the SGLang and vLLM
    stacks do; the sim's would start a second set of processes."""
    patch = pytest.MonkeyPatch()
    patch.setattr("chaos.runner.build_stack", lambda *_args, **_kwargs: stack)
    patch.setattr(stack, "down", lambda: None)  # the module's stack outlives the run
    try:
        return Runner(campaign, run_dir, progress=False).run()
    finally:
        patch.undo()


def start_stack(tmp_path: Path, config: SimStackConfig | None = None) -> SimStack:
    stack = SimStack(config or SimStackConfig(), tmp_path)
    stack.up()
    return stack


@pytest.fixture()
def fresh_transport(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The test starts with no transport (chaos/transport.py) and leaves none behind for the next."""
    monkeypatch.delenv(transport.ENV, raising=False)
    transport.configure(Transport())
    yield
    transport.configure(Transport())
    os.environ.pop(transport.ENV, None)


@pytest.fixture(scope="module")
def sim_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimStack]:
    stack = start_stack(tmp_path_factory.mktemp("sim"))
    try:
        yield stack
    finally:
        stack.down()


@pytest.fixture()
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60.0) as c:
        yield c


LEDGER_PROMPT = "Please repeat the ledger. " + "ledger line with amounts " * 120


class Traffic:
    """Client threads sending long prompts through the router until stopped (fault tests)."""

    def __init__(self, url: str, threads: int = 3, timeout_s: float = 30.0, prompt: str = LEDGER_PROMPT) -> None:
        self.url = url
        self.prompt = prompt
        self.timeout_s = timeout_s
        self.stop = threading.Event()
        self.statuses: list[int] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        body = {"text": self.prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self.stop.is_set():
                try:
                    self.statuses.append(client.post(f"{self.url}/generate", json=body).status_code)
                except httpx.HTTPError:
                    self.statuses.append(0)

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(self.timeout_s + 10)


class _AlwaysOk(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def another_runs_server() -> Iterator[int]:
    """A server of some other process's on loopback (here: a thread of the test's own process)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AlwaysOk)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
