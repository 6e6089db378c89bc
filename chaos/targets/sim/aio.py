"""Small asyncio helpers for the embedded engine's per-request paths."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout: float) -> T:
    """`asyncio.wait_for(awaitable, timeout)`: the same result, TimeoutError and cancellation.

    On Python 3.11+ it awaits in the caller's task under `asyncio.timeout`, which is what
    `wait_for` itself became in 3.12; 3.11's `wait_for` wraps each call in a task of its own,
    and the engine waits like this several times for every request.
    """
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout)
