"""The HTTP control API of a standalone fault proxy (`python -m faults.proxy --control ...`).

Toxiproxy-like and deliberately tiny:
- GET /faults: the current FaultSpec as sparse JSON; {} when the link is clean (heal's audit
  reads it so);
- PUT /faults: replace it (the whole spec; {} clears; 400 with {"error": ...} when invalid);
- GET /stats: ProxyStats, with "confirmed";
- POST /reset: remove every fault (counters stay, so a heal never erases the evidence);
- DELETE /stats: zero the counters (e.g. at the start of a fault window).

`ControlClient` is the sync client the fault runner and `pdchaos heal` use.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import httpx
from aiohttp import web

from faults.proxy.spec import FaultSpec, FaultSpecError
from faults.proxy.stats import ProxyStats
from faults.proxy.tcp import FaultProxy


def control_app(proxy: FaultProxy) -> web.Application:
    async def get_faults(_: web.Request) -> web.Response:
        return web.json_response(proxy.faults.to_dict())

    async def put_faults(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            spec = proxy.set_faults(FaultSpec.from_dict(body))
        except (ValueError, FaultSpecError) as exc:  # bad JSON is a ValueError too
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(spec.to_dict())

    async def get_stats(_: web.Request) -> web.Response:
        return web.json_response(proxy.snapshot().to_dict())

    async def reset(_: web.Request) -> web.Response:
        proxy.clear()
        return web.json_response(proxy.faults.to_dict())

    async def reset_stats(_: web.Request) -> web.Response:
        proxy.reset_stats()
        return web.json_response(proxy.snapshot().to_dict())

    app = web.Application()
    app.add_routes(
        [
            web.get("/faults", get_faults),
            web.put("/faults", put_faults),
            web.get("/stats", get_stats),
            web.post("/reset", reset),
            web.delete("/stats", reset_stats),
        ]
    )
    return app


class ControlServer:
    """The control API on (host, port), in the proxy's event loop."""

    def __init__(self, proxy: FaultProxy, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.port = port
        self._runner = web.AppRunner(control_app(proxy), access_log=None)

    async def start(self) -> int:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        # aiohttp exposes the bound port only here; a TCPSite's server is an asyncio.Server
        server = cast("asyncio.Server | None", site._server)
        assert server is not None and server.sockets
        self.port = int(server.sockets[0].getsockname()[1])
        return self.port

    async def stop(self) -> None:
        await self._runner.cleanup()


class ControlClient:
    """Sync client for a standalone proxy's control API."""

    def __init__(self, base_url: str, timeout_s: float = 5.0) -> None:
        # trust_env=False: an HTTP(S)_PROXY in the environment must not catch loopback control calls.
        self._http = httpx.Client(base_url=base_url, timeout=timeout_s, trust_env=False)

    def faults(self) -> FaultSpec:
        return FaultSpec.from_dict(self._json("GET", "/faults"))

    def set_faults(self, faults: FaultSpec | dict[str, Any]) -> FaultSpec:
        body = faults.to_dict() if isinstance(faults, FaultSpec) else faults
        return FaultSpec.from_dict(self._json("PUT", "/faults", body))

    def reset(self) -> None:
        self._json("POST", "/reset")

    def stats(self) -> ProxyStats:
        data = self._json("GET", "/stats")
        data.pop("confirmed", None)
        return ProxyStats(**data)

    def reset_stats(self) -> None:
        self._json("DELETE", "/stats")

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _json(self, method: str, path: str, body: Any = None) -> Any:
        response = self._http.request(method, path, json=body)
        if response.status_code == 400:
            raise FaultSpecError(response.json().get("error", response.text))
        response.raise_for_status()
        return response.json()
