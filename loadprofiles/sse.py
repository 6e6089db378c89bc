"""Reading one response body into what it says, incrementally, without ever raising.

A qualification run must record what a broken server sent, not crash on it. So the reader never
raises: malformed SSE lines, non-JSON payloads, a stream that stops without `[DONE]`, the
sglang-router's truncated error body (`data: {'error': {"message":{"error":{"message`, which it
sends when decode fails mid-stream; tests/test_sse_parsing.py), non-JSON bodies and bodies over the cap
(8 MiB of what we keep: stop reading, keep what arrived) all become `anomalies`, and the caller
decides the request's outcome from what was seen.

Two stream dialects: SGLang `/generate` chunks carry the *cumulative* text so far (its default,
`--incremental-streaming-output` off); OpenAI chat/completions chunks carry *deltas*. A reader
given no route reads each payload by its shape (`choices` or `usage`: OpenAI), for a caller that
judges whatever a server answered (`pdchaos canary`, chaos/canary/).

SSE is read line by line, one payload per `data:` line, rather than one per blank-line-terminated
event as the SSE spec says: LLM servers put one JSON object on each `data:` line, and some omit
the blank line, which would otherwise glue two objects into one unparseable payload.

The load users read every reply through here, so the common case is kept cheap: lines are split
as bytes, and a `data: {...}` line (or a whole body starting with `{`) goes to orjson as bytes,
with no decode and no line object in between. Anything else (a `[DONE]`, another field, a payload
orjson refuses: invalid UTF-8, NaN or infinity, a lone surrogate, nesting past 1024) takes the text
path and `json`, which decides every anomaly. A payload orjson reads, `json` reads to the same
value, but for an integer past 64 bits: orjson makes it a float, so such a "token count" is left
out, as any count that is not an integer is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

Api = Literal["generate", "chat", "completions"]

DEFAULT_BODY_CAP = 8 * 1024 * 1024  # bytes; past this we stop reading and keep what arrived
SAMPLE_CHARS = 120  # how much of an offending payload an anomaly quotes
MAX_ANOMALIES = 32  # distinct anomaly kinds kept per response (bounded even for garbage streams)
MAX_ERROR_CHARS = 2000
MAX_ERROR_PAYLOADS = 8  # payloads that said error, kept as sent (a garbage stream stays bounded)


@dataclass(frozen=True)
class Finish:
    """A finish reason in one shape for every route.

    `reason` is SGLang's `finish_reason.type` or the OpenAI string ("length", "stop", "abort").
    An in-band error object (`data: {"error": ...}`) is reported as reason "abort" with its code,
    which is what SGLang means by it.
    """

    reason: str
    message: str | None = None
    status_code: int | None = None

    @property
    def is_abort(self) -> bool:
        return self.reason in ("abort", "error")


@dataclass
class ParsedResponse:
    """Everything one response told us. Fields are None when the server did not say."""

    text: str = ""  # generated text (/generate: the latest cumulative text; OpenAI: deltas, joined at close)
    finish: Finish | None = None
    done: bool = False  # `data: [DONE]` seen
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each chunk with content
    body_bytes: int = 0
    over_cap: bool = False
    was_sse: bool = False  # read as an SSE stream (what the body turned out to be)
    payloads: int = 0  # JSON payloads (SSE) or bodies (non-stream) that parsed as objects
    shape_ok: bool = False  # a payload had the route's expected fields
    error_message: str | None = None  # the server's error message (error bodies, in-band errors)
    raw_text: str = ""  # the body as text when it could not be read as JSON (kept for scanning)
    # Output the text does not carry: reasoning, tool calls, token ids that decoded to nothing.
    output_without_text: bool = False
    # Each payload that said error (an error object, an abort finish, an unparseable payload that
    # mentions one), as sent, so a caller can judge what status it states (chaos/canary/reply.py).
    error_payloads: list[dict[str, Any] | str] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)

    @property
    def anomaly(self) -> str | None:
        return "; ".join(self.anomalies) if self.anomalies else None


def _sample(text: str) -> str:
    return text[:SAMPLE_CHARS].replace("\n", "\\n")


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _finish_from(value: Any) -> Finish | None:
    """SGLang's `{"type": ..., ...}` dict or an OpenAI string; None while not finished."""
    if isinstance(value, str) and value:
        return Finish(reason=value)
    if isinstance(value, dict) and isinstance(value.get("type"), str):
        message = value.get("message")
        return Finish(
            reason=value["type"],
            message=message if isinstance(message, str) else None,
            status_code=_int_or_none(value.get("status_code")),
        )
    return None


def _error_from(obj: dict[str, Any]) -> tuple[str, int | None] | None:
    """The message and code of SGLang's/the router's error shapes, or None if `obj` is not one.

    Shapes: `{"error": {"message": ..., "code": ...}}` (SGLang /generate 400, router errors, in-band
    stream errors) and `{"object": "error", "message": ..., "code": ...}` (OpenAI routes, 5xx).
    """
    if obj.get("object") == "error":
        return str(obj.get("message", ""))[:MAX_ERROR_CHARS], _int_or_none(obj.get("code"))
    error = obj.get("error")
    if error is None:
        return None
    if isinstance(error, dict):
        code = _int_or_none(error.get("code"))
        return str(error.get("message", error))[:MAX_ERROR_CHARS], code
    return str(error)[:MAX_ERROR_CHARS], None


class ResponseReader:
    """Feed the body as it arrives; `close()` says what it was.

    `sse`: read as a Server-Sent-Events stream (the response's content type said so). A body that
    turns out to be the other kind is still read: an SSE reader that saw no `data:` line tries the
    whole body as JSON, and a JSON reader given a body starting with `data:` replays it as SSE.
    `api` None: each payload is read by its shape (module docstring).
    """

    def __init__(self, api: Api | None, *, sse: bool, cap: int = DEFAULT_BODY_CAP) -> None:
        self.api = api
        self.sse = sse
        self.cap = cap
        self.result = ParsedResponse()
        self._raw = bytearray()  # the body, up to the cap (SSE: only until a payload parses)
        self._line = bytearray()  # SSE: the current line, not yet terminated
        self._kinds: set[str] = set()
        self._pieces: list[str] = []  # OpenAI deltas so far
        self._delta_chars = 0
        self._closed = False

    # ---------------------------------------------------------------------------- input ----

    def feed(self, chunk: bytes, now: float) -> bool:
        """Take the next piece of the body. False: the cap is reached, stop reading.

        The cap bounds what is kept, not what crosses the wire: a non-stream body's bytes, a
        stream's generated text (and its longest line). A long /generate stream resends its whole
        text in every chunk, so its wire bytes grow with the square of its length.
        """
        r = self.result
        if self._closed or r.over_cap:
            return False
        r.body_bytes += len(chunk)
        if self.sse:
            if not (r.payloads or r.done):  # until it proves to be SSE, it may be a JSON body
                self._raw += chunk[: max(0, self.cap - len(self._raw))]
            self._feed_lines(chunk, now)
            if len(self._line) + len(r.text) + self._delta_chars > self.cap:
                r.over_cap = True
        else:
            room = self.cap - len(self._raw)
            if len(chunk) > room:
                chunk = chunk[:room]
                r.over_cap = True
            self._raw += chunk
        if r.over_cap:
            self.note("body_over_cap", f"stopped reading after {r.body_bytes} bytes (cap {self.cap})")
        return not r.over_cap

    def close(self, now: float, *, ended_by_server: bool = True) -> ParsedResponse:
        """The body ended; finish parsing. Safe to call twice.

        `ended_by_server=False`: the caller stopped reading (it gave up, hit a deadline, or the
        connection broke), so a stream without `[DONE]` is not the server's anomaly.
        """
        if self._closed:
            return self.result
        self._closed = True
        r = self.result
        if self.sse:
            if self._line and not r.over_cap and ended_by_server:
                # The last line had no newline: the router's truncated error body looks like this.
                self._line_done(bytes(self._line), now)
                self._line.clear()
            if r.payloads == 0 and not r.done and self._looks_like_json():
                self.sse = False  # JSON sent with an SSE content type: read it as JSON
                self._parse_body(now, complete=ended_by_server)
            elif not r.done and not r.over_cap and ended_by_server:
                if r.finish is None:
                    self.note("truncated_stream", f"no [DONE] after {r.body_bytes} bytes")
                elif not r.finish.is_abort:
                    self.note("missing_done", f"finished ({r.finish.reason}) but no [DONE]")
        elif bytes(self._raw[:5]) == b"data:":
            self.note("sse_body_without_sse_content_type", "")
            self.sse = True
            self._feed_lines(bytes(self._raw), now)
            self._closed = False
            return self.close(now, ended_by_server=ended_by_server)
        else:
            self._parse_body(now, complete=ended_by_server)
        r.was_sse = self.sse
        if self._pieces:
            r.text += "".join(self._pieces)
            self._pieces.clear()
        if r.over_cap and not r.raw_text and not r.text:
            r.raw_text = self._raw.decode("utf-8", errors="replace")
        return r

    def note(self, kind: str, detail: str) -> None:
        """Record an anomaly once per kind (a garbage stream must not grow the record forever)."""
        if kind in self._kinds or len(self._kinds) >= MAX_ANOMALIES:
            return
        self._kinds.add(kind)
        self.result.anomalies.append(f"{kind}: {detail}" if detail else kind)

    # ------------------------------------------------------------------------------ SSE ----

    def _feed_lines(self, chunk: bytes, now: float) -> None:
        buf = self._line
        if buf:  # a line is pending
            if b"\n" not in chunk:  # only the new bytes can end it: a long line stays linear
                buf += chunk
                return
            data = bytes(buf) + chunk
            buf.clear()
        else:
            data = chunk if type(chunk) is bytes else bytes(chunk)
        lines = data.split(b"\n")
        buf += lines.pop()  # what follows the last newline waits for the next chunk
        r = self.result
        for raw_line in lines:
            if raw_line[:7] == b"data: {" and not r.done:  # the common case, as bytes
                try:
                    obj = orjson.loads(raw_line[6:])  # a trailing \r is JSON whitespace
                except orjson.JSONDecodeError:
                    pass  # the text path says why
                else:
                    self._object(obj, now)
                    continue
            if raw_line:  # not the blank line after each event
                self._line_done(raw_line, now)

    def _line_done(self, raw_line: bytes, now: float) -> None:
        line = self._decode(raw_line.rstrip(b"\r"))
        if not line or line.startswith(":"):
            return  # event separator or comment
        field_name, sep, value = line.partition(":")
        if not sep or field_name not in ("data", "event", "id", "retry"):
            self.note("malformed_sse", f"not an SSE field: {_sample(line)!r}")
            return
        if field_name != "data":
            return
        self._payload(value[1:] if value.startswith(" ") else value, now)

    def _decode(self, raw: bytes) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.note("invalid_utf8", "")
            return raw.decode("utf-8", errors="replace")

    def _payload(self, payload: str, now: float) -> None:
        r = self.result
        if payload.strip() == "[DONE]":
            r.done = True
            return
        if r.done:
            self.note("data_after_done", _sample(payload))
        try:
            obj = json.loads(payload)
        except (ValueError, RecursionError):
            if "error" in payload.lower():
                self._said_error(payload[:MAX_ERROR_CHARS])
            if "error" in payload[:32]:
                # The router's truncated error body: an error we cannot read; the stream failed.
                self.note("malformed_sse", f"unparseable error payload {_sample(payload)!r}")
                if r.finish is None:
                    r.finish = Finish(reason="abort", message=_sample(payload))
                    r.error_message = payload[:MAX_ERROR_CHARS]
            else:
                self.note("malformed_sse", f"non-JSON payload {_sample(payload)!r}")
            return
        if not isinstance(obj, dict):
            self.note("malformed_sse", f"payload is not an object: {_sample(payload)!r}")
            return
        self._object(obj, now)

    def _object(self, obj: dict[str, Any], now: float) -> None:
        """One JSON object of a stream; a chunk that adds text is a token, timed `now`."""
        self.result.payloads += 1
        if self._apply(obj, streaming=True):
            self.result.token_times.append(now)

    # ------------------------------------------------------------------------- non-stream ----

    def _looks_like_json(self) -> bool:
        return bytes(self._raw).lstrip()[:1] in (b"{", b"[")

    def _parse_body(self, now: float, complete: bool = True) -> None:
        r = self.result
        raw = bytes(self._raw)
        if raw[:1] == b"{":  # the common case: one JSON object, read as bytes
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError:
                pass  # the text path says why
            else:
                r.payloads += 1
                if self._apply(obj, streaming=False):
                    r.token_times.append(now)
                return
        text = self._decode(raw)
        if not text.strip():
            return
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            r.raw_text = text
            if complete and not r.over_cap:  # a body we cut short cannot be JSON; not news
                self.note("non_json_body", _sample(text))
            return
        if not isinstance(obj, dict):
            r.raw_text = text
            self.note("unexpected_shape", f"body is a JSON {type(obj).__name__}")
            return
        r.payloads += 1
        if self._apply(obj, streaming=False):
            r.token_times.append(now)

    # ------------------------------------------------------------------- both: one object ----

    def _apply(self, obj: dict[str, Any], *, streaming: bool) -> bool:
        """Take one JSON object (a chunk or a whole body); True when it added generated text."""
        r = self.result
        error = _error_from(obj)
        if error is not None:
            message, code = error
            self._said_error(obj)
            r.error_message = message
            r.shape_ok = True
            if r.finish is None:
                r.finish = Finish(reason="abort", message=message, status_code=code)
            return False
        if self.api == "generate" or (self.api is None and "choices" not in obj and "usage" not in obj):
            return self._apply_generate(obj)
        return self._apply_openai(obj, streaming)

    def _said_error(self, payload: dict[str, Any] | str) -> None:
        if len(self.result.error_payloads) < MAX_ERROR_PAYLOADS:
            self.result.error_payloads.append(payload)

    def _apply_generate(self, obj: dict[str, Any]) -> bool:
        r = self.result
        text = obj.get("text")
        meta = obj.get("meta_info")
        grew = False
        if not isinstance(text, str) and not isinstance(meta, dict):
            self.note("unexpected_shape", f"no text or meta_info in {_sample(json.dumps(obj))!r}")
            return False
        r.shape_ok = True
        if isinstance(text, str):
            if text.startswith(r.text):
                grew = len(text) > len(r.text)
                r.text = text
            elif r.text.startswith(text):
                self.note("generate_text_shrank", f"{len(r.text)} -> {len(text)} chars")
            else:
                # Incremental streaming (or a server bug): keep everything we were given.
                self.note("generate_text_not_cumulative", "")
                grew = bool(text)
                r.text += text
        if not grew and not r.text and obj.get("output_ids"):
            r.output_without_text = True  # tokens that decoded to nothing (yet)
        if isinstance(meta, dict):
            reason = meta.get("finish_reason")
            finish = None if reason is None else _finish_from(reason)  # None: most chunks
            if finish is not None:
                r.finish = finish
                if finish.is_abort:
                    self._said_error(obj)
            self._usage(meta.get("prompt_tokens"), meta.get("completion_tokens"), meta.get("cached_tokens"))
        return grew

    def _apply_openai(self, obj: dict[str, Any], streaming: bool) -> bool:
        r = self.result
        choices = obj.get("choices")
        usage = obj.get("usage")
        grew = False
        if not isinstance(choices, list) and not isinstance(usage, dict):
            self.note("unexpected_shape", f"no choices or usage in {_sample(json.dumps(obj))!r}")
            return False
        r.shape_ok = True
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue  # n=1: only the first choice is ours
            piece: Any
            holder: Any = None
            if self.api == "completions":
                piece = choice.get("text")
            else:
                holder = choice.get("delta") if streaming else choice.get("message")
                piece = holder.get("content") if isinstance(holder, dict) else None
                if piece is None and self.api is None:
                    piece = choice.get("text")
            if isinstance(piece, str) and piece:
                self._pieces.append(piece)  # joined once, in close(): += would copy it all each time
                self._delta_chars += len(piece)
                grew = True
            elif isinstance(holder, dict) and (holder.get("reasoning_content") or holder.get("tool_calls")):
                r.output_without_text = True
            reason = choice.get("finish_reason")
            if reason is not None and (finish := _finish_from(reason)) is not None:
                r.finish = finish
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, dict) else usage.get("cached_tokens")
            self._usage(usage.get("prompt_tokens"), usage.get("completion_tokens"), cached)
        return grew

    def _usage(self, prompt: Any, completion: Any, cached: Any) -> None:
        """Later chunks may omit usage; keep the last value each field was given. (The values
        come from JSON, where `type(v) is int` is `_int_or_none`'s test: an int, not a bool.)"""
        r = self.result
        if type(prompt) is int:
            r.prompt_tokens = prompt
        if type(completion) is int:
            r.completion_tokens = completion
        if type(cached) is int:
            r.cached_tokens = cached


def parse_body(
    api: Api | None, body: bytes, *, sse: bool, now: float = 0.0, cap: int = DEFAULT_BODY_CAP
) -> ParsedResponse:
    """A whole body at once (tests, and callers that already hold the body)."""
    reader = ResponseReader(api, sse=sse, cap=cap)
    reader.feed(body, now)
    return reader.close(now)
