"""Run an aiohttp `web.Application` on a free 127.0.0.1 port, its event loop in a daemon thread.

The tests' fake servers (tests/openai_server.py, tests/oracle_servers.py, the fakes in
test_canary_command, test_preflight and test_fault_proxy) are real HTTP servers that synchronous
test code talks to; this is the one copy of the thread, loop and runner bookkeeping they share.
The port is bound when the object is made, so `url` is known before the server starts.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.log import access_logger

WAIT_S = 10.0  # for the server to start, and to stop

T = TypeVar("T")


class ThreadedServer:
    """`with ThreadedServer(app) as server:` serves `app` at `server.url` until the block ends, then
    cleans up the runner (in-flight handlers get `shutdown_timeout`), stops the loop, joins the
    thread and closes the loop. `loop` is the server's loop, for work that must run on it."""

    def __init__(
        self,
        app: web.Application,
        *,
        tls: ssl.SSLContext | None = None,
        shutdown_timeout: float = 60.0,  # aiohttp's default
        access_log: logging.Logger | None = access_logger,
    ) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port: int = self._sock.getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self._tls = tls
        self._runner = web.AppRunner(app, shutdown_timeout=shutdown_timeout, access_log=access_log)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="aiohttp-thread", daemon=True)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT_S)

    async def _start(self) -> None:
        await self._runner.setup()
        await web.SockSite(self._runner, self._sock, ssl_context=self._tls).start()

    def __enter__(self) -> ThreadedServer:
        self._thread.start()
        try:
            self._call(self._start())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._call(self._runner.cleanup())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(WAIT_S)
            self.loop.close()
            self._sock.close()  # closed by the cleanup already, unless the start failed
