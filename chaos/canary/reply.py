"""What came back for one canary request, read through the suite's one exchange
(loadprofiles/exchange.py) by shape, whatever the route, and what its in-stream errors state.

The stream's content and usage come from the reader; what status an in-stream error states is
the canary's own reading (the streaming rule, chaos/canary/__init__.py): proxies wrap errors in
errors and quote status codes in text, so nested messages and Python reprs are searched too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from chaos.refusal import read_refusal
from loadprofiles.exchange import ROUTES, perform_async, request_body
from loadprofiles.prompts import Prompt
from loadprofiles.recorder import Observed
from loadprofiles.sse import Api, ParsedResponse, parse_body

MAX_BODY_BYTES = 4 * 1024 * 1024  # read at most this much of any reply
ERROR_TEXT_CHARS = 300  # of an unparseable error payload, as the error's message
CLIENT_ERROR_TYPES = frozenset({"badrequesterror", "invalid_request_error", "bad request"})
_CODE_IN_TEXT = re.compile(r"""['"](?:code|status_code|status)['"]\s*:\s*['"]?(\d{3})\b""")


@dataclass(frozen=True)
class Reply:
    """What came back for one request, streamed or not."""

    http_status: int | None  # None: no HTTP answer
    body: str = ""
    content: str = ""  # the generated text (streams: the deltas joined)
    content_streamed: bool = False
    stream_error: bool = False
    stream_error_status: int | None = None  # the status the in-stream error states, if any
    stream_error_message: str = ""
    prompt_tokens: int | None = None  # as the server counted them
    transport_error: str | None = None
    elapsed_s: float = 0.0


def _to_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _error_status(error: Any, depth: int = 0) -> tuple[int | None, str, str | None]:
    """(numeric status, message, type) that an error object states.

    Proxies wrap errors in errors (a router's ``{"error": {"message": "<the worker's JSON>"}}``),
    so when the outer object gives no status, the message is read as an error object too.
    """
    if depth > 4:
        return None, "", None
    if isinstance(error, str):
        try:
            decoded = json.loads(error)
        except ValueError:
            decoded = None
        if isinstance(decoded, Mapping):
            status, decoded_message, kind = _error_status(decoded.get("error", decoded), depth + 1)
            return status, decoded_message or error, kind
        match = _CODE_IN_TEXT.search(error)
        return (int(match.group(1)) if match else None), error, None
    if not isinstance(error, Mapping):
        return None, "", None
    status = next(
        (s for key in ("code", "status_code", "status") if (s := _to_int(error.get(key))) is not None),
        None,
    )
    kind = error.get("type") if isinstance(error.get("type"), str) else None
    message = error.get("message")
    if status is None and isinstance(message, (Mapping, str)):
        inner = message.get("error", message) if isinstance(message, Mapping) else message
        inner_status, inner_message, inner_kind = _error_status(inner, depth + 1)
        return inner_status, inner_message, kind or inner_kind
    text = message if isinstance(message, str) else ("" if message is None else json.dumps(message))
    return status, text, kind


def _produced(parsed: ParsedResponse) -> bool:
    """Any content at all: text, reasoning, tool calls, token ids (not the empty role chunk)."""
    return bool(parsed.token_times) or parsed.output_without_text


def _stream_error(payloads: Sequence[Mapping[str, Any] | str]) -> tuple[bool, int | None, str]:
    """(an error was said, the status it states, its message) over the payloads that said error:
    error objects, SGLang's abort finish, and text that is not JSON (a proxy's Python repr)."""
    error = False
    status: int | None = None
    message = ""
    kind: str | None = None
    for payload in payloads:
        if isinstance(payload, str):  # not JSON: an error only as far as it says so
            error = True
            match = _CODE_IN_TEXT.search(payload)
            if match and status is None:
                status = int(match.group(1))
            message = message or payload[:ERROR_TEXT_CHARS]
            continue
        if "error" in payload:
            error = True
            stated, said, said_kind = _error_status(payload["error"])
            status = status if stated is None else stated
            message = message or said
            kind = kind or said_kind
        meta = payload.get("meta_info")
        finish = meta.get("finish_reason") if isinstance(meta, Mapping) else None
        if isinstance(finish, Mapping) and finish.get("type") == "abort":
            error = True
            stated = _to_int(finish.get("status_code"))
            status = status if stated is None else stated
            if isinstance(finish.get("message"), str):
                message = message or finish["message"]
            if isinstance(finish.get("err_type"), str):
                kind = kind or finish["err_type"]
    if error and status is None and kind and kind.lower() in CLIENT_ERROR_TYPES:
        status = 400
    return error, status, message


def _with_stream(reply: Reply, parsed: ParsedResponse) -> Reply:
    error, status, message = _stream_error(parsed.error_payloads)
    prompt_tokens = parsed.prompt_tokens if parsed.prompt_tokens is not None else reply.prompt_tokens
    return replace(
        reply,
        content=parsed.text,
        content_streamed=_produced(parsed),
        stream_error=error,
        stream_error_status=status,
        stream_error_message=message,
        prompt_tokens=prompt_tokens if prompt_tokens is not None else read_refusal(message).prompt_tokens,
    )


def parse_sse(body: str, reply: Reply) -> Reply:
    """Fold an SSE body into `reply`: content, in-stream errors, the server's prompt count."""
    return _with_stream(reply, parse_body(None, body.encode(), sse=True))


def reply_of(obs: Observed, *, stream: bool) -> Reply:
    """A reply as the canary judges it, from what the exchange observed."""
    elapsed = (obs.t_end or 0.0) - (obs.t_send or 0.0)
    if obs.status is None or obs.transport is not None:
        return Reply(
            http_status=None, transport_error=obs.transport[1] if obs.transport else "no response", elapsed_s=elapsed
        )
    body = obs.raw_body.decode("utf-8", errors="replace") if obs.raw_body else ""
    reply = Reply(http_status=obs.status, body=body, elapsed_s=elapsed)
    parsed = obs.parsed or ParsedResponse()
    if stream and obs.status == 200:
        return _with_stream(reply, parsed)
    if obs.status == 200 and parsed.payloads and not parsed.was_sse:  # one JSON object
        return replace(
            reply, content=parsed.text, content_streamed=_produced(parsed), prompt_tokens=parsed.prompt_tokens
        )
    return replace(reply, prompt_tokens=read_refusal(body).prompt_tokens)


async def send(
    client: httpx.AsyncClient, base: str, route: Api, prompt: str, *, model: str, max_tokens: int, stream: bool
) -> Reply:
    """POST one prompt on `route`; read at most MAX_BODY_BYTES; never raises for HTTP or
    transport trouble."""
    body = request_body(
        route, Prompt.user("canary", prompt), stream=stream, max_tokens=max_tokens, model=model, rid=None
    )
    obs = Observed()
    await perform_async(client, base + ROUTES[route], body, api=None, obs=obs, cap=MAX_BODY_BYTES, keep_body=True)
    return reply_of(obs, stream=stream)


_MESSAGE_IN_TEXT = re.compile(r"['\"]message['\"]\s*:\s*\"((?:[^\"\\]|\\.)*)\"")


def short_message(body: str, limit: int = 100) -> str:
    """The innermost error message of a reply body (JSON, SSE or a proxy's repr), shortened."""
    text = body.strip()
    if text.startswith("data:"):
        text = text.splitlines()[0][len("data:") :].strip()
    message = ""
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    if isinstance(payload, Mapping):
        _, message, _ = _error_status(payload.get("error", payload))
    if not message or message.lstrip().startswith(("{", "data:")) or _MESSAGE_IN_TEXT.search(message):
        found = _MESSAGE_IN_TEXT.findall(message or text)
        if found:
            message = found[-1].encode().decode("unicode_escape", errors="replace")
    return (message or text).replace("\n", " ")[:limit]
