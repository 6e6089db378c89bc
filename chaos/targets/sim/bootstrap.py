"""The bootstrap handshake between decode and prefill, keyed by `bootstrap_room`.

Prefill hosts a small HTTP server on its bootstrap port (as SGLang's aiohttp bootstrap server).
Decode, once it has preallocated pages for a request, posts where prefill must write them; the
waiting timeout starts then. Decode also polls `/health` as its heartbeat, and on abort or timeout
posts `/abort` and learns whether prefill may still write into those pages (SGLang's
ABORT / ABORT_ACK). Decode only reuses such pages once no write can land there any more.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from chaos.targets.sim.http1 import HttpError, KeepAliveClient
from chaos.targets.sim.transfer import Destination, KVSender, SendState

log = logging.getLogger("sglang.disaggregation")

TOMBSTONE_TTL_S = 120.0  # SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL


@dataclass
class Room:
    """Prefill's view of one room: who asked for it and where its KV must go."""

    room: int
    sender: KVSender
    destination: asyncio.Future[Destination] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    created: float = field(default_factory=time.monotonic)


class BootstrapServer:
    """Prefill side: rooms by id, destinations that arrive before or after the request."""

    def __init__(self) -> None:
        self.rooms: dict[int, Room] = {}
        self._early: dict[int, Destination] = {}
        self._aborted_early: dict[int, float] = {}
        self._rejected: dict[int, tuple[str, float]] = {}  # room -> prefill's rejection, when

    def reject(self, room: int, message: str) -> Destination | None:
        """Prefill rejected the room's request: a later /bootstrap for it is answered so. Returns
        the destination decode already posted, if it came first (it must then be told directly)."""
        cutoff = time.monotonic() - TOMBSTONE_TTL_S
        self._rejected = {r: v for r, v in self._rejected.items() if v[1] > cutoff}
        self._rejected[room] = (message, time.monotonic())
        return self._early.pop(room, None)

    def open_room(self, room: int) -> Room:
        if room in self.rooms:
            raise ValueError(f"bootstrap_room {room} is already in use")
        entry = Room(room=room, sender=KVSender(room))
        if self._aborted_early.pop(room, None) is not None:
            entry.sender.abort_requested = True
        if room in self._early:
            entry.destination.set_result(self._early.pop(room))
        self.rooms[room] = entry
        return entry

    def close_room(self, room: int) -> None:
        self.rooms.pop(room, None)

    def _expire(self) -> None:
        cutoff = time.monotonic() - TOMBSTONE_TTL_S
        self._aborted_early = {r: t for r, t in self._aborted_early.items() if t > cutoff}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_post("/bootstrap", self._bootstrap)
        app.router.add_post("/abort", self._abort)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _bootstrap(self, request: web.Request) -> web.Response:
        body = await request.json()
        room = int(body["room"])
        dest = Destination(host=str(body["host"]), port=int(body["port"]), pages=[int(p) for p in body["pages"]])
        rejected = self._rejected.get(room)
        if rejected is not None:
            return web.json_response({"room": room, "status": "rejected", "message": rejected[0]})
        entry = self.rooms.get(room)
        if entry is None:
            self._early[room] = dest
        elif not entry.destination.done():
            entry.destination.set_result(dest)
        return web.json_response({"room": room, "status": "ok"})

    async def _abort(self, request: web.Request) -> web.Response:
        """Stop the room's sender; answer whether it may still write (`state`)."""
        body = await request.json()
        room = int(body["room"])
        entry = self.rooms.get(room)
        if entry is None:
            self._expire()
            self._aborted_early[room] = time.monotonic()
            return web.json_response({"room": room, "state": "unknown"})
        entry.sender.abort_requested = True
        if entry.sender.may_still_write:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(entry.sender.finished.wait(), timeout=5.0)
        state = entry.sender.state
        name = (
            "in_flight"
            if state in (SendState.CONNECTING, SendState.SENDING)
            else ("finished" if state is SendState.FINISHED else "never_started")
        )
        log.info("Received ABORT for bootstrap_room=%d, sender state %s", room, name)
        return web.json_response({"room": room, "state": name})


class BootstrapClient:
    """Decode side: talk to prefill bootstrap servers."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        # The per-request POST goes through a lean keep-alive client (http1.py); the rare calls
        # (abort, heartbeat) keep aiohttp.
        self._posts = KeepAliveClient()

    async def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        return self._session

    async def close(self) -> None:
        self._posts.close()
        if self._session is not None:
            await self._session.close()

    async def send_destination(
        self, addr: str, room: int, rid: str, dest: Destination, attempts: int = 3
    ) -> str | None:
        """Post where prefill must write; returns prefill's rejection message if it rejected the request."""
        host, _, port = addr.rpartition(":")
        payload = {"room": room, "rid": rid, "host": dest.host, "port": dest.port, "pages": dest.pages}
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                resp = await self._posts.post_json(host, int(port), "/bootstrap", payload, timeout=2)
                if resp.status == 200:
                    try:
                        if resp.content_type.split(";")[0].strip() != "application/json":
                            return None  # as aiohttp's resp.json() refused it
                        answer = json.loads(resp.body)
                    except ValueError:
                        return None
                    rejected = isinstance(answer, dict) and answer.get("status") == "rejected"
                    return str(answer.get("message", "rejected by prefill")) if rejected else None
                last = RuntimeError(f"HTTP {resp.status}")
            except (
                OSError,  # refused, reset (and, from 3.11, asyncio.TimeoutError)
                asyncio.TimeoutError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
                HttpError,
                ValueError,
            ) as exc:  # what aiohttp's ClientError and timeout covered before
                last = exc
            await asyncio.sleep(0.2 * (attempt + 1))
        raise ConnectionError(f"Could not fetch prefill parallel info from {addr} after {attempts} attempts ({last!r})")

    async def notify_abort(self, addr: str, room: int) -> str | None:
        """Prefill's answer about the room's sender, or None when prefill does not answer."""
        session = await self._client()
        try:
            async with session.post(
                f"http://{addr}/abort", json={"room": room}, timeout=aiohttp.ClientTimeout(total=8)
            ) as resp:
                if resp.status != 200:
                    return None
                return str((await resp.json())["state"])
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError):
            return None

    async def healthy(self, addr: str, timeout_s: float) -> bool:
        session = await self._client()
        try:
            async with session.get(f"http://{addr}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False
