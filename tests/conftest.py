"""Shared fixtures: the embedded PD stack behind the real router, and polling helpers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from chaos.targets.sim.stack import SimStack, SimStackConfig

# Ray and the router must stay on loopback (components.md).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")

T = TypeVar("T")


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


def start_stack(tmp_path: Path, config: SimStackConfig | None = None) -> SimStack:
    stack = SimStack(config or SimStackConfig(), tmp_path)
    stack.up()
    return stack


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
