"""One HTTP exchange with a target, read as it arrives: no Locust here.

Every request the suite sends goes through here and is read by one reader (loadprofiles/sse.py)
into one `Observed`: the load users (inside Locust) through `perform_fast` on their own lean
connection (loadprofiles/http_client.py), or through `perform` on an httpx client when their
config asks for it; the runner's probes (in the driver process, where Locust must never be
imported) through `perform`; the traffic faults, their provocations and `pdchaos canary`
(asyncio) through `perform_async`. The three read the body with the same loop and judge it the
same way: for the same reply they fill the same `Observed`, times aside.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
import traceback
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import httpx
import orjson

from chaos.journal import RequestRecord
from loadprofiles.prompts import Prompt
from loadprofiles.recorder import Observed, Sent, build_record, judge
from loadprofiles.sse import DEFAULT_BODY_CAP, Api, ResponseReader

if TYPE_CHECKING:
    from loadprofiles.http_client import Connection

ROUTES: dict[Api, str] = {"generate": "/generate", "chat": "/v1/chat/completions", "completions": "/v1/completions"}
CONNECT_TIMEOUT_S = 10.0

AbortPhase = Literal["before_first_byte", "after_first_token", "mid_stream", "abort_request"]


def request_body(
    route: Api, prompt: Prompt, *, stream: bool, max_tokens: int, model: str | None, rid: str | None
) -> dict[str, Any]:
    """`model` None: none is named, and the server answers with its own (a fault does not know
    the name; vLLM serves one model)."""
    if route == "generate":
        body: dict[str, Any] = {
            "text": prompt.as_text(),
            "stream": stream,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0},
        }
        if rid is not None:
            body["rid"] = rid
        return body
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if model is None:
        del body["model"]
    if route == "chat":
        body["messages"] = [{"role": m.role, "content": m.content} for m in prompt.messages]
    else:
        body["prompt"] = prompt.as_text()
    if stream:
        body["stream_options"] = {"include_usage": True}  # usage (cached tokens) in the last chunk
    return body


@dataclass(frozen=True)
class Interrupt:
    """Close the connection on purpose: before the headers, or after `after_chunks` content chunks."""

    phase: AbortPhase
    read_timeout_s: float | None = None  # before_first_byte
    after_chunks: int | None = None  # after_first_token (1), mid_stream (more)


_TRANSPORT_CLASSES: tuple[tuple[type[Exception], str], ...] = (
    (httpx.ConnectError, "connect_error"),
    (httpx.ConnectTimeout, "connect_error"),
    (httpx.PoolTimeout, "connect_error"),
    (httpx.TimeoutException, "timeout"),
    (httpx.RemoteProtocolError, "disconnect"),
    (httpx.NetworkError, "disconnect"),
)


def transport_class(exc: Exception) -> str:
    for kind, name in _TRANSPORT_CLASSES:
        if isinstance(exc, kind):
            return name
    return "client_error"


def _opened(status: int, content_type: str, obs: Observed, api: Api | None, cap: int) -> ResponseReader:
    """The headers are in: note them and start reading the body."""
    obs.t_first_byte = time.time()
    obs.status = status
    obs.sse = "text/event-stream" in content_type
    reader = ResponseReader(api, sse=obs.sse, cap=cap)
    obs.parsed = reader.result
    return reader


def _read_body(
    chunks: Iterable[bytes],
    reader: ResponseReader,
    obs: Observed,
    interrupt: Interrupt | None,
    timeout_s: float,
    first_token: threading.Event | None = None,
) -> bool:
    """Feed the body to `reader` as it arrives, each piece timed on arrival; True when the server
    ended it (not the cap, an interrupt or the deadline). `first_token` is set when the first
    content arrives."""
    result = reader.result
    after_chunks = interrupt.after_chunks if interrupt else None
    deadline = (obs.t_send or 0.0) + timeout_s
    for chunk in chunks:
        now = time.time()
        if not reader.feed(chunk, now):
            return False  # over the cap: closing the response drops the connection
        if first_token is not None and result.token_times:
            first_token.set()
        if after_chunks and len(result.token_times) >= after_chunks and result.finish is None:
            assert interrupt is not None
            obs.client_closed = f"at {interrupt.phase} (after {len(result.token_times)} content chunks)"
            return False
        if now > deadline:
            obs.transport = ("timeout", f"no end after {timeout_s:.1f}s")
            return False
    return True


def _failed(obs: Observed, exc: Exception, interrupt: Interrupt | None) -> None:
    error_class = transport_class(exc)
    if interrupt and interrupt.read_timeout_s and isinstance(exc, httpx.ReadTimeout):
        when = "before_first_byte" if obs.status is None else "before_first_byte (the headers had arrived)"
        obs.client_closed = f"at {when}, {interrupt.read_timeout_s * 1000:.0f} ms after sending"
    else:
        obs.transport = (error_class, f"{type(exc).__name__}: {exc}"[:500])
    if error_class == "client_error":
        traceback.print_exc(file=sys.stderr)  # our bug or a bad URL: make it visible


def _ended(obs: Observed, reader: ResponseReader | None, ended_by_server: bool) -> None:
    now = time.time()
    if reader is not None:
        obs.parsed = reader.close(now, ended_by_server=ended_by_server)
    obs.t_end = now


def perform(
    client: httpx.Client,
    url: str,
    body: dict[str, Any],
    *,
    api: Api,
    timeout_s: float,
    obs: Observed,
    cap: int,
    headers: dict[str, str] | None = None,
    interrupt: Interrupt | None = None,
    first_token: threading.Event | None = None,
) -> None:
    """Send one request and read its reply into `obs`, as it arrives. Never raises on HTTP
    trouble; a GreenletExit (Locust stopping the user) passes through with `obs` filled so far.
    `first_token` is set when the first content arrives."""
    read_timeout = interrupt.read_timeout_s if interrupt and interrupt.read_timeout_s else timeout_s
    timeout = httpx.Timeout(timeout_s, connect=min(CONNECT_TIMEOUT_S, timeout_s), read=read_timeout)
    reader: ResponseReader | None = None
    server_ended = False  # the body ended because the server ended it (not us, not an error)
    obs.t_send = time.time()
    try:
        with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as response:
            reader = _opened(response.status_code, response.headers.get("content-type", ""), obs, api, cap)
            server_ended = _read_body(response.iter_bytes(), reader, obs, interrupt, timeout_s, first_token)
    except Exception as exc:
        _failed(obs, exc, interrupt)
    finally:
        _ended(obs, reader, server_ended)


_JSON_CONTENT = {"Content-Type": "application/json"}


def json_bytes(body: dict[str, Any]) -> bytes:
    """The request body as httpx's `json=` sends it (compact, UTF-8), at orjson's speed."""
    try:
        return orjson.dumps(body)
    except TypeError:  # a lone surrogate (a reply carried one into a conversation): escape it
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def perform_fast(
    conn: Connection,
    url: str,
    body: dict[str, Any],
    *,
    api: Api,
    timeout_s: float,
    obs: Observed,
    cap: int,
    headers: dict[str, str] | None = None,
    interrupt: Interrupt | None = None,
) -> None:
    """`perform` on a load user's own connection (loadprofiles/http_client.py): the same request,
    the same timeouts, the same `obs` for the same reply. A reply not read to its server's end
    (cap, interrupt, deadline, error, GreenletExit) closes the connection."""
    read_timeout = interrupt.read_timeout_s if interrupt and interrupt.read_timeout_s else timeout_s
    payload = json_bytes(body)
    reader: ResponseReader | None = None
    server_ended = False
    obs.t_send = time.time()
    try:
        status, head = conn.request(
            "POST",
            url,
            payload,
            headers={**_JSON_CONTENT, **headers} if headers else _JSON_CONTENT,
            connect_timeout_s=min(CONNECT_TIMEOUT_S, timeout_s),
            write_timeout_s=timeout_s,
            read_timeout_s=read_timeout,
        )
        content_type = next((v for k, v in head if k == "content-type"), "")
        reader = _opened(status, content_type, obs, api, cap)
        server_ended = _read_body(conn.body(), reader, obs, interrupt, timeout_s)
    except Exception as exc:
        _failed(obs, exc, interrupt)
    finally:
        if not server_ended:
            conn.close()
        _ended(obs, reader, server_ended)


async def perform_async(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    api: Api | None,
    obs: Observed,
    cap: int,
    first_token: asyncio.Event | None = None,
    keep_body: bool = False,
) -> None:
    """`perform` for asyncio callers, under the client's own timeouts. `first_token` is set when
    the first content arrives; `keep_body` keeps the raw body, up to `cap`, in `obs.raw_body`. A cancel
    (the caller disconnecting on purpose) closes the connection and passes through with `obs`
    filled so far."""
    reader: ResponseReader | None = None
    server_ended = False
    obs.t_send = time.time()
    try:
        async with client.stream("POST", url, json=body) as response:
            reader = _opened(response.status_code, response.headers.get("content-type", ""), obs, api, cap)
            kept = obs.raw_body = bytearray() if keep_body else None
            async for chunk in response.aiter_bytes():
                if kept is not None:
                    kept += chunk
                if not reader.feed(chunk, time.time()) or (kept is not None and len(kept) >= cap):
                    break
                if first_token is not None and reader.result.token_times:
                    first_token.set()
            else:
                server_ended = True
    except Exception as exc:
        _failed(obs, exc, None)
    finally:
        _ended(obs, reader, server_ended)


def record_exchange(
    client: httpx.Client,
    base_url: str,
    route: Api,
    body: dict[str, Any],
    sent: Sent,
    *,
    timeout_s: float,
    first_token: threading.Event | None = None,
) -> RequestRecord:
    """Send one request from outside Locust (the runner's probes) and judge it into its record;
    never raises on HTTP trouble. `first_token` is set when the first content arrives."""
    obs = Observed()
    perform(
        client,
        base_url + ROUTES[route],
        body,
        api=route,
        timeout_s=timeout_s,
        obs=obs,
        cap=DEFAULT_BODY_CAP,
        first_token=first_token,
    )
    return build_record(sent, obs, judge(obs))


def post_aborts(client: httpx.Client, urls: tuple[str, ...], rid: str, obs: Observed) -> None:
    """POST /abort_request {"rid"} to every worker (SGLang's router has no such endpoint)."""
    obs.abort_sent_at = time.time()
    results = []
    for url in urls:
        try:
            response = client.post(url.rstrip("/") + "/abort_request", json={"rid": rid})
            results.append(f"{url} {response.status_code}")
        except httpx.HTTPError as exc:
            results.append(f"{url} {type(exc).__name__}")
    obs.abort_detail = f"/abort_request at {obs.abort_sent_at:.6f}: " + ", ".join(results)
