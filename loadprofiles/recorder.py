"""From what a user observed to one judged `RequestRecord`, appended as a JSON line.

Outcomes follow Jepsen (chaos.journal.Outcome):

* **ok**: a 2xx whose reply finished normally (a finish reason other than abort, or a stream
  that ended with `[DONE]`).
* **fail**: the request definitely did not complete: a 4xx; a 500/501/503/505 (the server said
  it failed); an in-band abort that carries a status code the server chose; a connection that was
  never established (nothing was sent).
* **info**: anything indeterminate: a timeout, a disconnect (by the server or by us), an abort in
  flight (a finish reason `abort` without a status; after we POSTed /abort_request, any abort or
  5xx), a
  truncated or unreadable stream, a body over the cap, a 502/504 (the router lost its worker; the
  worker may still be running), a request cut off because the load stopped.

`error_class` names why it was not ok ("http_400", "abort", "timeout", "disconnect",
"truncated_stream", "malformed_sse", "malformed_body", "body_over_cap", "connect_error",
"load_stopped", "client_error"); `anomaly` lists what was odd about the bytes even when the
outcome is ok (malformed lines, a missing `[DONE]`, the router's truncated error body).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from chaos.journal import Outcome, RequestRecord
from loadprofiles.sse import ParsedResponse

PROMPT_KEEP_CHARS = 16384  # longer prompts are left out of the record (prompt_chars keeps the size)
DETAIL_CHARS = 2000
# Endings that say "not now" rather than "no": nothing listened (the router is down) or the router
# had no worker to send to (503). Users back off on them; the report counts them.
UNAVAILABLE_ENDINGS = frozenset({"connect_error", "http_503"})
ANOMALY_CHARS = 4000


@dataclass(frozen=True)
class Sent:
    """What was sent, as the record keeps it."""

    id: str
    request_index: int
    phase: str
    user_kind: str
    actor: str
    endpoint: str
    stream: bool
    markers: tuple[str, ...]
    prompt: str
    max_tokens: int
    planned_send: float | None


@dataclass
class Observed:
    """What came back, filled in as it happens (so a request cut off midway still has a record)."""

    t_send: float | None = None
    t_first_byte: float | None = None
    t_end: float | None = None
    status: int | None = None
    sse: bool = False  # the content type said SSE (the reader may find otherwise)
    parsed: ParsedResponse | None = None
    transport: tuple[str, str] | None = None  # (error_class, detail) of an exception
    client_closed: str | None = None  # we closed the connection on purpose, at this phase
    abort_sent_at: float | None = None  # we POSTed /abort_request at this time
    abort_detail: str | None = None
    load_stopped: bool = False  # Locust stopped this user while the request was in flight
    anomalies: list[str] = field(default_factory=list)  # what else the sender found odd about it
    details: list[str] = field(default_factory=list)  # what the sender noted (how it aimed or aborted it)
    raw_body: bytearray | None = None  # the body as it came, kept only when the sender asked (chaos/canary/)


@dataclass(frozen=True)
class Judgement:
    outcome: Outcome
    error_class: str | None = None
    error_detail: str | None = None
    anomalies: tuple[str, ...] = ()


def _http_judgement(status: int, parsed: ParsedResponse | None) -> Judgement:
    message = None
    if parsed is not None:
        message = parsed.error_message or (parsed.raw_text[:DETAIL_CHARS] if parsed.raw_text else None)
    detail = f"HTTP {status}" + (f": {message}" if message else "")
    if 400 <= status < 500 or status in (500, 501, 503, 505):
        return Judgement(Outcome.FAIL, f"http_{status}", detail)
    return Judgement(Outcome.INFO, f"http_{status}", detail)  # 502/504, 1xx/3xx: unknown


def judge(obs: Observed) -> Judgement:
    """Decide the outcome from what was seen; see the module docstring for the rules."""
    p = obs.parsed
    if obs.status is None:
        if obs.client_closed:
            return Judgement(Outcome.INFO, "disconnect", f"client closed {obs.client_closed}, before the first byte")
        if obs.transport:
            error_class, detail = obs.transport
            outcome = Outcome.FAIL if error_class == "connect_error" else Outcome.INFO
            return Judgement(outcome, error_class, detail)
        if obs.load_stopped:
            return Judgement(Outcome.INFO, "load_stopped", "the load stopped before the first byte")
        return Judgement(Outcome.INFO, "client_error", "no response and no error recorded")
    if not 200 <= obs.status < 300:
        verdict = _http_judgement(obs.status, p)
        if obs.abort_sent_at is not None and obs.status >= 500:
            # What an abort in flight may look like (SGLang's own abort tests accept it).
            return Judgement(Outcome.INFO, "abort", f"after /abort_request: {verdict.error_detail}")
        return verdict
    p = p or ParsedResponse()  # cut off between the headers and the first read
    finish = p.finish
    if finish is not None and not finish.is_abort:
        return Judgement(Outcome.OK)
    if finish is not None:
        detail = f"finish abort (status {finish.status_code}): {finish.message or ''}".strip()
        asked = obs.abort_sent_at is not None
        outcome = Outcome.INFO if asked or finish.status_code is None else Outcome.FAIL
        return Judgement(outcome, "abort", detail)
    if obs.client_closed:
        return Judgement(Outcome.INFO, "disconnect", f"client closed {obs.client_closed}")
    if obs.abort_sent_at is not None and obs.transport:
        return Judgement(Outcome.INFO, "abort", f"after /abort_request: {obs.transport[1]}")
    if obs.transport:
        return Judgement(Outcome.INFO, *obs.transport)
    if obs.load_stopped:
        return Judgement(Outcome.INFO, "load_stopped", "the load stopped while the reply was arriving")
    if p.over_cap:
        return Judgement(Outcome.INFO, "body_over_cap", f"{p.body_bytes} bytes, more than the cap")
    if p.shape_ok and (p.done or not p.was_sse):
        # The reply ended cleanly but never said why: count it, and flag it.
        return Judgement(Outcome.OK, anomalies=("no_finish_reason",))
    if p.was_sse:
        error_class = "truncated_stream" if p.payloads else "malformed_sse"
        return Judgement(Outcome.INFO, error_class, f"{p.body_bytes} bytes, {p.payloads} readable payloads, no finish")
    return Judgement(Outcome.INFO, "malformed_body", f"{p.body_bytes} bytes that are not a readable reply")


def _clip(text: str | None, limit: int) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + f"... [{len(text) - limit} more chars]"


def build_record(sent: Sent, obs: Observed, verdict: Judgement, *, detail_prefix: str | None = None) -> RequestRecord:
    p = obs.parsed
    anomalies = [*(p.anomalies if p else ()), *verdict.anomalies, *obs.anomalies]
    details = [d for d in (detail_prefix, verdict.error_detail, obs.abort_detail, *obs.details) if d]
    token_times = list(p.token_times) if p else []
    text = ""
    if p is not None:
        # A body we could not read as a reply is still scanned for markers: keep it as the text.
        text = p.text or (p.raw_text if 200 <= (obs.status or 0) < 300 else "")
    return RequestRecord(
        id=sent.id,
        request_index=sent.request_index,
        phase=sent.phase,
        user_kind=sent.user_kind,
        actor=sent.actor,
        endpoint=sent.endpoint,
        stream=sent.stream,
        markers=list(sent.markers),
        prompt=sent.prompt if len(sent.prompt) <= PROMPT_KEEP_CHARS else "",
        prompt_chars=len(sent.prompt),
        max_tokens=sent.max_tokens,
        planned_send=sent.planned_send,
        t_send=obs.t_send,
        t_first_byte=obs.t_first_byte,
        t_first_token=token_times[0] if token_times else None,
        t_end=obs.t_end,
        token_times=token_times,
        status=obs.status,
        finish_reason=p.finish.reason if p and p.finish else None,
        prompt_tokens=p.prompt_tokens if p else None,
        completion_tokens=p.completion_tokens if p else None,
        cached_tokens=p.cached_tokens if p else None,
        response_text=text,
        body_bytes=p.body_bytes if p else None,
        outcome=verdict.outcome,
        error_class=verdict.error_class,
        error_detail=_clip(" | ".join(details), DETAIL_CHARS) if details else None,
        anomaly=_clip("; ".join(anomalies), ANOMALY_CHARS) if anomalies else None,
    )


class RecordWriter:
    """Appends records as JSON lines; each line goes out in one write() on an O_APPEND file.

    One write per record means a reader tailing the file sees only whole lines (plus at most one
    partial line at the end, while it is being written), and several processes may share a file.
    """

    def __init__(self, path: str) -> None:
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: RequestRecord) -> None:
        try:  # orjson takes the dataclass as it is: no asdict copy (tens of µs a record with json)
            data = orjson.dumps(record, option=orjson.OPT_APPEND_NEWLINE)
        except TypeError:  # a lone surrogate (json.loads makes one of "\ud800"): escaped by json
            data = (json.dumps(dataclasses.asdict(record)) + "\n").encode()
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class RequestEvent(Protocol):
    """Locust's `environment.events.request` (only `fire` is used)."""

    def fire(self, *, reverse: bool = False, **kwargs: Any) -> None: ...


class LoadFailure(Exception):
    """What Locust's stats show for a request that did not behave as its user expected."""


def emit(writer: RecordWriter, record: RequestRecord, *, name: str, expected: bool, event: RequestEvent | None) -> None:
    """Write the record, then count it in Locust's stats: one record per request Locust counts."""
    try:
        writer.write(record)
    except OSError as exc:  # a full disk must not kill the user; the count shows the gap
        print(f"pdchaos: cannot write record {record.id}: {exc}", file=sys.stderr)
    if event is None:
        return
    elapsed_ms = 1000.0 * ((record.t_end or record.t_send or 0.0) - (record.t_send or 0.0))
    event.fire(
        request_type="POST",
        name=name,
        response_time=max(0.0, elapsed_ms),
        response_length=record.body_bytes or 0,
        response=None,
        context={"id": record.id, "outcome": record.outcome.value},
        exception=None if expected else LoadFailure(f"{record.outcome.value}/{record.error_class or 'unexpected_ok'}"),
        start_time=record.t_send,
        url=record.endpoint,
    )
