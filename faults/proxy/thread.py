"""A fault proxy driven from sync code: `ProxyThread` runs a `FaultProxy` on its own event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from faults.proxy.spec import FaultSpec
from faults.proxy.stats import ProxyStats
from faults.proxy.tcp import FaultProxy

T = TypeVar("T")


class ProxyThread:
    """A FaultProxy on its own event loop in a daemon thread, driven from sync code."""

    def __init__(
        self,
        upstream: tuple[str, int],
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        *,
        faults: FaultSpec | Mapping[str, Any] | None = None,
        connect_timeout_s: float = 5.0,
    ) -> None:
        self.proxy = FaultProxy(
            listen_host, listen_port, upstream=upstream, faults=faults, connect_timeout_s=connect_timeout_s
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def address(self) -> tuple[str, int]:
        return self.proxy.address

    def start(self, timeout_s: float = 10.0) -> int:
        if self._loop is not None:
            raise RuntimeError("the proxy thread is already started")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"fault-proxy->{self.proxy.upstream[1]}", daemon=True
        )
        self._thread.start()
        try:
            return self._call(self.proxy.start(), timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the proxy (closing its connections) and its loop; safe to call twice."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            self._call(self.proxy.stop(), timeout_s)
        finally:
            self._loop = self._thread = None
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout_s)
            if not thread.is_alive():
                loop.close()

    def set_faults(self, faults: FaultSpec | Mapping[str, Any] | None) -> FaultSpec:
        return self._sync(lambda: self.proxy.set_faults(faults))

    def clear(self) -> None:
        self._sync(self.proxy.clear)

    def faults(self) -> FaultSpec:
        return self.proxy.faults

    def stats(self) -> ProxyStats:
        return self._sync(self.proxy.snapshot)

    def reset_stats(self) -> None:
        self._sync(self.proxy.reset_stats)

    def __enter__(self) -> ProxyThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        if self._loop is None:
            coro.close()
            raise RuntimeError("the proxy thread is not started")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def _sync(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the proxy's loop, so live changes never race a connection mid-chunk."""

        async def call() -> T:
            return fn()

        return self._call(call(), 10.0)
