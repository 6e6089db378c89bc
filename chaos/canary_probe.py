"""The over-length canary: victim traffic with markers, then over-length probes that must be 4xx.

This is the behavioural check from the KV-leak incident (SGLang issue #30233): a prompt longer than
the KV pool (or the context) must come back as a 4xx, and nothing it returns may carry another
request's data. It works against any OpenAI-compatible endpoint (the router, an SGLang worker,
vLLM); `/generate` is probed too when the target is SGLang-shaped.

Flow (`run_canary`):

1. **Limits.** `discover_limits` reads ``/v1/models`` and ``/server_info`` (`discover_facts`); when the
   target states neither a context length nor a pool (an SGLang router does not), it reads the
   router's ``/workers`` list and asks each worker. ``--max-tokens-probe N`` stands in when nothing
   is reported.
2. **Plan.** One probe per size (`plan_sizes`): just over the pool (``max_total_num_tokens + 1``),
   just over the context (``context_length + 1``), inside the band ``[max_req_input_len,
   context_length)`` where only SGLang's scheduler check rejects (``validate_input_length``), and ``N+1``
   and ``2N`` for ``--max-tokens-probe N``; times each route, streaming and not. Every probe has its
   own marker index.
3. **Calibrate** (before any victim, so the probes' own calibration traffic is older than the
   victims' in the KV pool). A prompt is a head marker, ``k`` repetitions of `FILLER`, a tail marker
   and an instruction. Per route, two short requests with different ``k`` give the tokens per
   repetition from the server's own ``usage.prompt_tokens`` (``meta_info.prompt_tokens`` on
   ``/generate``), chat template included; per probe, one short request with that probe's exact
   markers gives its fixed part. So a probe is sized to the token. A route that answers 404/405 is
   skipped. Where a route reports no usage, sizes are estimates: `FILLER` is one token per
   repetition in common tokenizers and at least one in any we know, and over-length probes
   over-shoot by `ESTIMATE_MARGIN`; a narrow band cannot be hit without measuring, so that probe is
   SKIPPED.
4. **Victims.** `VICTIMS` concurrent requests over the routes, each with markers at the head, the tail
   and in between; half ask the model to repeat the prompt (which makes a leak visible).
5. **Probes**, one at a time, and the verdicts (`judge_probe`).

Verdicts. A probe PASSes when it was rejected with a 4xx and carries no foreign marker. Any marker
(or fragment) of another request of this run, or a verified marker of another run, in a probe's or
a victim's body is a FAIL. A 200, a 5xx, a 3xx or no answer at all is a FAIL. A 4xx that says
nothing about the prompt (401, 403, 404, 405, 408, 429) is INCONCLUSIVE, as is a 200 for a prompt
the server itself counted below the threshold (the probe undershot). Victims that do not get a 200
make the run INCONCLUSIVE (there is nothing to leak).

**Streaming rule** (`judge_stream`). A streamed probe is rejected when the HTTP status is 4xx, or when
the HTTP status is 200 and both hold:

* **no content was streamed**: no chunk carries a non-empty ``delta.content``,
  ``delta.reasoning_content``, ``delta.tool_calls``, ``choices[].text``, ``text`` or ``output_ids``
  (the empty ``role`` chunk chat streams open with is not content), and
* **the stream carries an error that says 4xx**: an ``error`` object whose ``code``,
  ``status_code`` or ``status`` is 400-499 (nested messages are searched too), an SGLang
  ``finish_reason`` ``{"type": "abort", "status_code": 4xx}``, or an error whose ``type`` is
  ``BadRequestError`` / ``invalid_request_error`` and has no numeric code. On ``/generate`` of an
  SGLang target, a code-less ``{"error": {"message": ...}}`` also counts: that is SGLang's
  ``ValueError`` path, which is its 400 mapping (``tokenizer_manager.py``, ``http_server.py``).

Anything else is a FAIL: content before or without the error, an in-stream 5xx, an abort without a
status (SGLang's plain abort, HTTP 200), or a stream that just ends.
"""

from __future__ import annotations

import asyncio
import enum
import json
import math
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx

from chaos.errors import UsageError
from chaos.http_status import rejects_the_prompt
from chaos.oracles.canary import MarkerCodec, MarkerHit, new_run_prefix
from chaos.targets.discovery import discover_facts

DEFAULT_TIMEOUT_S = 60.0
VICTIMS = 8
FILLER = " the"  # one token per repetition in every common tokenizer (BPE, SentencePiece, toy)
PROBE_MAX_TOKENS = 64  # room for a leaked marker to show up in the reply
VICTIM_MAX_TOKENS = 48
CALIBRATION_K = (8, 72)  # filler repetitions of the two per-route calibration requests
ESTIMATE_MARGIN = (0.05, 32)  # uncalibrated over-length probes: +5% + 32 tokens
MAX_BODY_BYTES = 4 * 1024 * 1024  # read at most this much of any reply
CALIBRATION_CONCURRENCY = 4

ROUTE_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "generate": "/generate",
}
CLIENT_ERROR_TYPES = frozenset({"badrequesterror", "invalid_request_error", "bad request"})

_TOKENS_IN_MESSAGE = (
    re.compile(r"[Ii]nput(?: length)? \((\d+) tokens\)"),  # SGLang tokenizer / scheduler checks
    re.compile(r"(\d+) tokens from the input"),  # SGLang, input + max_new_tokens > context
    re.compile(r"\((\d+) in the messages"),  # vLLM
    re.compile(r"request has (\d+) input tokens"),  # vLLM
    re.compile(r"prompt contains at least (\d+) input tokens"),  # vLLM
    re.compile(r"your prompt is (\d+) tokens"),
)
_CODE_IN_TEXT = re.compile(r"""['"](?:code|status_code|status)['"]\s*:\s*['"]?(\d{3})\b""")


class Verdict(str, enum.Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    INCONCLUSIVE = "INCONCLUSIVE"
    SKIPPED = "SKIPPED"


# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CanaryConfig:
    url: str
    model: str | None = None  # None: the first model /v1/models lists
    max_tokens_probe: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    victims: int = VICTIMS
    run_prefix: str | None = None  # None: a fresh one
    routes: tuple[str, ...] | None = None  # None: chat, completions (+ generate on SGLang)


@dataclass(frozen=True)
class TargetLimits:
    """What the target says about its limits; None where it says nothing."""

    url: str
    model: str
    api: str  # "sglang" (serves /generate) or "openai"
    context_length: int | None = None
    max_total_num_tokens: int | None = None
    max_req_input_len: int | None = None
    sources: tuple[str, ...] = ()

    @property
    def reports_anything(self) -> bool:
        return self.context_length is not None or self.max_total_num_tokens is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model": self.model,
            "api": self.api,
            "context_length": self.context_length,
            "max_total_num_tokens": self.max_total_num_tokens,
            "max_req_input_len": self.max_req_input_len,
            "sources": list(self.sources),
        }


@dataclass(frozen=True)
class ProbeSize:
    """One over-length size: the limit it crosses and the token count aimed at."""

    threshold: str  # "pool", "context", "band", "manual" (joined with "=" when sizes coincide)
    threshold_tokens: int  # a prompt of at least this many tokens is over-length
    target_tokens: int
    upper_tokens: int | None = None  # band: stay below this (the context length)
    label: str = ""

    def max_tokens(self, context_length: int | None) -> int:
        """Completion budget; below the context the prompt plus it must fit, or the tokenizer's
        ``input + max_new_tokens > context`` check would reject it before the check under test."""
        if context_length is not None and self.target_tokens < context_length:
            return max(1, min(PROBE_MAX_TOKENS, context_length - self.target_tokens))
        return PROBE_MAX_TOKENS


@dataclass(frozen=True)
class ProbeSpec:
    name: str  # "p1", ...
    index: int  # marker request index
    size: ProbeSize
    route: str
    stream: bool
    max_tokens: int


@dataclass(frozen=True)
class Leak:
    """A marker (or fragment) in a reply that belongs to some other request."""

    text: str
    offset: int
    kind: str  # "whole" or "fragment"
    owner: str  # "victim v3", "probe p5", "request 17 of this run", "run K7QX (another run)"
    verified: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "offset": self.offset,
            "kind": self.kind,
            "owner": self.owner,
            "verified": self.verified,
        }


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


@dataclass(frozen=True)
class ProbeResult:
    spec: ProbeSpec
    planned_tokens: int | None  # None: not sent
    exact: bool  # sized from the server's own token counts
    verdict: Verdict
    reason: str
    http_status: int | None = None
    stream_error_status: int | None = None
    rejected_status: int | None = None  # the 4xx that counts as the rejection
    measured_tokens: int | None = None
    content_chars: int = 0
    leaks: tuple[Leak, ...] = ()
    elapsed_s: float = 0.0
    excerpt: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "marker_index": self.spec.index,
            "threshold": self.spec.size.threshold,
            "threshold_label": self.spec.size.label,
            "threshold_tokens": self.spec.size.threshold_tokens,
            "upper_tokens": self.spec.size.upper_tokens,
            "target_tokens": self.spec.size.target_tokens,
            "planned_tokens": self.planned_tokens,
            "exact_size": self.exact,
            "measured_tokens": self.measured_tokens,
            "route": self.spec.route,
            "path": ROUTE_PATHS[self.spec.route],
            "stream": self.spec.stream,
            "max_tokens": self.spec.max_tokens,
            "http_status": self.http_status,
            "stream_error_status": self.stream_error_status,
            "rejected_status": self.rejected_status,
            "content_chars": self.content_chars,
            "verdict": self.verdict.value,
            "reason": self.reason,
            "leaks": [leak.to_dict() for leak in self.leaks],
            "elapsed_s": round(self.elapsed_s, 4),
            "excerpt": self.excerpt,
        }


@dataclass(frozen=True)
class VictimResult:
    name: str
    index: int
    route: str
    repeat: bool
    verdict: Verdict
    reason: str
    http_status: int | None = None
    markers: tuple[str, ...] = ()
    leaks: tuple[Leak, ...] = ()
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "marker_index": self.index,
            "route": self.route,
            "repeat": self.repeat,
            "http_status": self.http_status,
            "markers": list(self.markers),
            "verdict": self.verdict.value,
            "reason": self.reason,
            "leaks": [leak.to_dict() for leak in self.leaks],
            "elapsed_s": round(self.elapsed_s, 4),
        }


@dataclass(frozen=True)
class CanaryReport:
    run_prefix: str
    limits: TargetLimits
    routes: tuple[str, ...]
    victims: tuple[VictimResult, ...]
    probes: tuple[ProbeResult, ...]
    notes: tuple[str, ...] = ()
    elapsed_s: float = 0.0

    def count(self, verdict: Verdict) -> int:
        return sum(1 for probe in self.probes if probe.verdict is verdict)

    @property
    def leaks(self) -> tuple[Leak, ...]:
        found = [leak for probe in self.probes for leak in probe.leaks]
        found += [leak for victim in self.victims for leak in victim.leaks]
        return tuple(found)

    @property
    def verdict(self) -> Verdict:
        if any(p.verdict is Verdict.FAIL for p in self.probes) or any(
            v.verdict is Verdict.FAIL for v in self.victims
        ):
            return Verdict.FAIL
        sent = [p for p in self.probes if p.verdict is not Verdict.SKIPPED]
        if (
            not sent
            or any(p.verdict is Verdict.INCONCLUSIVE for p in sent)
            or any(v.verdict is not Verdict.PASS for v in self.victims)
        ):
            return Verdict.INCONCLUSIVE
        return Verdict.PASS

    @property
    def exit_code(self) -> int:
        """0 PASS, 1 FAIL, 3 INCONCLUSIVE (the project's exit codes; 2 is a usage error)."""
        return {Verdict.PASS: 0, Verdict.FAIL: 1}.get(self.verdict, 3)

    def summary_line(self) -> str:
        sent = len(self.probes) - self.count(Verdict.SKIPPED)
        parts = [
            (
                f"{sent} over-length probes sent: {self.count(Verdict.PASS)} rejected (4xx, clean), "
                f"{self.count(Verdict.FAIL)} FAIL, {self.count(Verdict.INCONCLUSIVE)} INCONCLUSIVE"
            )
        ]
        if self.count(Verdict.SKIPPED):
            parts.append(f"{self.count(Verdict.SKIPPED)} skipped")
        clean = sum(1 for v in self.victims if v.verdict is Verdict.PASS)
        parts.append(f"victims {clean}/{len(self.victims)} clean")
        leaks = self.leaks
        parts.append(f"{len(leaks)} leaked marker{'s' if len(leaks) != 1 else ''}")
        return (
            f"canary {self.verdict.value}: " + "; ".join(parts)
            + f" (run {self.run_prefix}, exit {self.exit_code})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict.value,
            "exit_code": self.exit_code,
            "run_prefix": self.run_prefix,
            "target": self.limits.to_dict(),
            "routes": list(self.routes),
            "summary": {
                "probes": len(self.probes),
                "pass": self.count(Verdict.PASS),
                "fail": self.count(Verdict.FAIL),
                "inconclusive": self.count(Verdict.INCONCLUSIVE),
                "skipped": self.count(Verdict.SKIPPED),
                "victims": len(self.victims),
                "victims_clean": sum(1 for v in self.victims if v.verdict is Verdict.PASS),
                "leaks": len(self.leaks),
            },
            "probes": [probe.to_dict() for probe in self.probes],
            "victims": [victim.to_dict() for victim in self.victims],
            "notes": list(self.notes),
            "elapsed_s": round(self.elapsed_s, 3),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# --------------------------------------------------------------------------------------------------
# Limits
# --------------------------------------------------------------------------------------------------


def _check_reachable(url: str, timeout_s: float) -> None:
    try:
        with httpx.Client(timeout=min(timeout_s, 10.0), trust_env=False) as client:
            client.get(f"{url}/v1/models")
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        raise UsageError(f"--url {url}: not a usable URL ({exc}). Give the target's base URL, "
                         "e.g. --url http://127.0.0.1:30000.") from None
    except httpx.TransportError as exc:
        raise UsageError(
            f"--url {url}: cannot reach the target ({type(exc).__name__}: {exc or 'no detail'}). "
            "Check the host and port and that the server is up."
        ) from None


def _router_workers(url: str, timeout_s: float) -> list[tuple[str, str]]:
    """(worker URL, worker type) from an SGLang router's ``/workers``; [] when there is none."""
    try:
        with httpx.Client(timeout=min(timeout_s, 10.0), trust_env=False) as client:
            response = client.get(f"{url}/workers")
        if response.status_code != 200:
            return []
        payload = response.json()
    except (httpx.HTTPError, ValueError):
        return []
    workers = payload.get("workers") if isinstance(payload, Mapping) else None
    if not isinstance(workers, list):
        return []
    out = []
    for worker in workers:
        if isinstance(worker, Mapping) and isinstance(worker.get("url"), str):
            kind = worker.get("worker_type")
            out.append((worker["url"].rstrip("/"), kind if isinstance(kind, str) else "worker"))
    return out


def _min(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def discover_limits(url: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                    model: str | None = None) -> TargetLimits:
    """Model, API style and limits of the target at `url` (raises UsageError if unreachable).

    A router states no limits itself; then its workers are asked, and the smallest of each limit
    is kept (the first size some worker must reject).
    """
    _check_reachable(url, timeout_s)
    facts = discover_facts(url, timeout_s=min(timeout_s, 10.0))
    limits = TargetLimits(
        url=url,
        model=model or facts.model,
        api=facts.api,
        context_length=facts.context_length,
        max_total_num_tokens=facts.max_total_num_tokens,
        max_req_input_len=facts.max_req_input_len,
        sources=(f"{url} (/v1/models, /server_info)",),
    )
    if limits.reports_anything:
        return limits
    workers = _router_workers(url, timeout_s)
    if not workers:
        return limits
    worker_facts = [(w, kind, discover_facts(w, timeout_s=min(timeout_s, 10.0))) for w, kind in workers]
    return replace(
        limits,
        api="sglang" if any(f.api == "sglang" for _, _, f in worker_facts) else limits.api,
        context_length=_min(f.context_length for _, _, f in worker_facts),
        max_total_num_tokens=_min(f.max_total_num_tokens for _, _, f in worker_facts),
        max_req_input_len=_min(f.max_req_input_len for _, _, f in worker_facts),
        sources=limits.sources + tuple(
            f"{w} ({kind}, via the router's /workers)" for w, kind, _ in worker_facts
        ),
    )


def plan_sizes(limits: TargetLimits, max_tokens_probe: int | None) -> list[ProbeSize]:
    """The over-length sizes to probe, smallest first; sizes that coincide are merged."""
    sizes: list[ProbeSize] = []
    pool, ctx, max_input = limits.max_total_num_tokens, limits.context_length, limits.max_req_input_len
    if pool is not None:
        sizes.append(ProbeSize("pool", pool, pool + 1, label=f"pool {pool}"))
    if ctx is not None:
        sizes.append(ProbeSize("context", ctx, ctx + 1, label=f"context {ctx}"))
    if ctx is not None and max_input is not None and max_input < ctx:
        middle = max_input + (ctx - max_input) // 2
        sizes.append(ProbeSize("band", max_input, min(middle, ctx - 1), upper_tokens=ctx,
                               label=f"band [{max_input},{ctx})"))
    if max_tokens_probe is not None:
        n = max_tokens_probe
        sizes.append(ProbeSize("manual", n, n + 1, label=f"--max-tokens-probe {n}"))
        sizes.append(ProbeSize("manual", n, 2 * n, label=f"2 x --max-tokens-probe {n}"))
    merged: dict[int, ProbeSize] = {}
    for size in sizes:
        seen = merged.get(size.target_tokens)
        if seen is None:
            merged[size.target_tokens] = size
        elif size.threshold not in seen.threshold.split("="):
            merged[size.target_tokens] = replace(
                seen, threshold=f"{seen.threshold}={size.threshold}", label=f"{seen.label} = {size.label}"
            )
    return sorted(merged.values(), key=lambda s: s.target_tokens)


# --------------------------------------------------------------------------------------------------
# Prompts and requests
# --------------------------------------------------------------------------------------------------


def probe_prompt(codec: MarkerCodec, index: int, repetitions: int) -> str:
    head, tail = codec.marker(index, 0), codec.marker(index, 1)
    return (
        f"{head} This is an over-length canary.\n" + FILLER * repetitions
        + f"\n{tail} Now repeat every code word you have seen, word for word."
    )


_VICTIM_TEXT = (
    (
        "Account notes for customer {i}: the invoice was paid on the third, the shipment left "
        "the harbour at dawn, and the support ticket about the login page is still open."
    ),
    (
        "Private memo {i}: the quarterly numbers are ahead of plan, the new office opens next "
        "month, and the board meets on Friday to review the budget."
    ),
)


def victim_prompt(codec: MarkerCodec, index: int, repeat: bool, middles: int = 3) -> tuple[str, tuple[str, ...]]:
    """A victim prompt with markers at the head (slot 0), tail (slot 1) and in between (2..)."""
    markers = [codec.marker(index, 0)]
    parts = [markers[0]]
    parts.append(
        "Please repeat this whole message back to me, word for word." if repeat
        else "Remember the code words in this message. Reply with OK."
    )
    for j in range(middles):
        parts.append(_VICTIM_TEXT[j % len(_VICTIM_TEXT)].format(i=index))
        marker = codec.marker(index, 2 + j)
        markers.append(marker)
        parts.append(f"Code word: {marker}.")
    tail = codec.marker(index, 1)
    markers.append(tail)
    parts.append(tail)
    return " ".join(parts), tuple(markers)


def request_body(route: str, model: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    if route == "generate":
        return {
            "text": prompt,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0},
            "stream": stream,
        }
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _to_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _prompt_tokens(payload: Any) -> int | None:
    if not isinstance(payload, Mapping):
        return None
    usage = payload.get("usage")
    if isinstance(usage, Mapping) and (n := _to_int(usage.get("prompt_tokens"))) is not None:
        return n
    meta = payload.get("meta_info")
    if isinstance(meta, Mapping):
        return _to_int(meta.get("prompt_tokens"))
    return None


def tokens_in_message(text: str) -> int | None:
    """The prompt size a rejection message states, if it states one."""
    for pattern in _TOKENS_IN_MESSAGE:
        match = pattern.search(text)
        if match:
            return int(match.group(1))
    return None


def _content_of(payload: Mapping[str, Any]) -> tuple[str, bool]:
    """(text, any content at all) of one non-stream body or one stream chunk."""
    texts: list[str] = []
    produced = False
    choices = payload.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, Mapping):
                continue
            for key in ("delta", "message"):
                part = choice.get(key)
                if isinstance(part, Mapping):
                    for field_name in ("content", "reasoning_content"):
                        value = part.get(field_name)
                        if isinstance(value, str) and value:
                            texts.append(value)
                            produced = True
                    if part.get("tool_calls"):
                        texts.append(json.dumps(part["tool_calls"]))
                        produced = True
            value = choice.get("text")
            if isinstance(value, str) and value:
                texts.append(value)
                produced = True
    value = payload.get("text")
    if isinstance(value, str) and value:
        texts.append(value)
        produced = True
    if payload.get("output_ids"):
        produced = True
    return "".join(texts), produced


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
            status, message, kind = _error_status(decoded.get("error", decoded), depth + 1)
            return status, message or error, kind
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


def parse_sse(body: str, reply: Reply) -> Reply:
    """Fold an SSE body into `reply`: content, in-stream errors, the server's prompt count."""
    texts: list[str] = []
    produced = False
    error = False
    error_status: int | None = None
    error_message = ""
    error_type: str | None = None
    prompt_tokens = reply.prompt_tokens
    for raw_line in body.splitlines():
        line = raw_line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if not data or data == "[DONE]":
            continue
        try:
            chunk = json.loads(data)
        except ValueError:
            # Not JSON (a proxy's Python repr, say): an error only if it says so.
            if "error" in data.lower():
                error = True
                match = _CODE_IN_TEXT.search(data)
                if match and error_status is None:
                    error_status = int(match.group(1))
                error_message = error_message or data[:300]
            continue
        if not isinstance(chunk, Mapping):
            continue
        text, chunk_produced = _content_of(chunk)
        if chunk_produced:
            produced = True
            texts.append(text)
        if (n := _prompt_tokens(chunk)) is not None:
            prompt_tokens = n
        if "error" in chunk:
            error = True
            status, message, kind = _error_status(chunk["error"])
            error_status = error_status if status is None else status
            error_message = error_message or message
            error_type = error_type or kind
        meta = chunk.get("meta_info")
        finish = meta.get("finish_reason") if isinstance(meta, Mapping) else None
        if isinstance(finish, Mapping) and finish.get("type") == "abort":
            error = True
            status = _to_int(finish.get("status_code"))
            error_status = error_status if status is None else status
            if isinstance(finish.get("message"), str):
                error_message = error_message or finish["message"]
            if isinstance(finish.get("err_type"), str):
                error_type = error_type or finish["err_type"]
    if error and error_status is None and error_type and error_type.lower() in CLIENT_ERROR_TYPES:
        error_status = 400
    return replace(
        reply,
        content="".join(texts),
        content_streamed=produced,
        stream_error=error,
        stream_error_status=error_status,
        stream_error_message=error_message,
        prompt_tokens=prompt_tokens if prompt_tokens is not None else tokens_in_message(error_message),
    )


async def send(client: httpx.AsyncClient, base: str, route: str, body: dict[str, Any]) -> Reply:
    """POST one request; read at most MAX_BODY_BYTES; never raises for HTTP or transport trouble."""
    started = time.monotonic()
    try:
        async with client.stream("POST", base + ROUTE_PATHS[route], json=body) as response:
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                chunks.append(chunk)
                size += len(chunk)
                if size >= MAX_BODY_BYTES:
                    break
            status = response.status_code
            text = b"".join(chunks).decode("utf-8", errors="replace")
    except httpx.HTTPError as exc:
        return Reply(http_status=None, transport_error=f"{type(exc).__name__}: {exc or 'no detail'}",
                     elapsed_s=time.monotonic() - started)
    reply = Reply(http_status=status, body=text, elapsed_s=time.monotonic() - started)
    if body.get("stream") and status == 200:
        return parse_sse(text, reply)
    try:
        payload = json.loads(text)
    except ValueError:
        payload = None
    if status == 200 and isinstance(payload, Mapping):
        content, produced = _content_of(payload)
        return replace(reply, content=content, content_streamed=produced, prompt_tokens=_prompt_tokens(payload))
    return replace(reply, prompt_tokens=tokens_in_message(text))


# --------------------------------------------------------------------------------------------------
# Leaks and verdicts
# --------------------------------------------------------------------------------------------------


def find_leaks(codec: MarkerCodec, texts: Sequence[str], owner_index: int,
               names: Mapping[int, str]) -> tuple[Leak, ...]:
    """Markers and fragments in `texts` that are not `owner_index`'s own (deduplicated)."""
    found: dict[tuple[str, str], Leak] = {}
    for text in texts:
        if not text:
            continue
        for hit in codec.scan(text):
            owner = _foreign_owner(codec, hit, owner_index, names)
            if owner is not None:
                found.setdefault((hit.text, owner), Leak(
                    text=hit.text, offset=hit.offset, kind=hit.kind.value, owner=owner,
                    verified=hit.verified,
                ))
    return tuple(found.values())


def _foreign_owner(codec: MarkerCodec, hit: MarkerHit, owner_index: int,
                   names: Mapping[int, str]) -> str | None:
    if hit.run_prefix == codec.run_prefix:
        if hit.could_be_owned_by(codec.run_prefix, owner_index):
            return None
        if hit.request_index is None:
            return "another request of this run (fragment cut before its id)"
        return names.get(hit.request_index, f"request {hit.request_index} of this run")
    if hit.foreign_run and hit.verified:
        return f"run {hit.run_prefix} (another run)"
    return None  # an unverifiable fragment of some other run: too weak to call


def _leak_reason(leaks: Sequence[Leak]) -> str:
    owners = sorted({leak.owner for leak in leaks})
    shown = ", ".join(f"{leak.text} ({leak.kind})" for leak in leaks[:3])
    more = f" and {len(leaks) - 3} more" if len(leaks) > 3 else ""
    return f"LEAK: markers of {', '.join(owners)}: {shown}{more}"


def judge_stream(reply: Reply, route: str, api: str) -> tuple[int | None, str]:
    """The streaming rule (module docstring): (the 4xx that counts as rejection or None, why)."""
    if reply.content_streamed:
        what = f"in-stream error {reply.stream_error_status or '(no status)'}" if reply.stream_error else "no error"
        return None, f"streamed {len(reply.content)} chars of output ({what}): accepted"
    if not reply.stream_error:
        return None, "HTTP 200 stream ended with neither content nor an error"
    status = reply.stream_error_status
    if status is None and route == "generate" and api == "sglang":
        status = 400  # SGLang's /generate stream turns its 400 (ValueError) into a code-less error
    if status is None:
        return None, f"in-stream error with no status: {reply.stream_error_message[:120]!r}"
    if 400 <= status < 500:
        return status, f"rejected in-stream ({status}) before any content"
    return None, f"in-stream error {status} (must be a 4xx)"


def judge_probe(spec: ProbeSpec, reply: Reply, leaks: Sequence[Leak], api: str) -> tuple[Verdict, str, int | None]:
    """(verdict, reason, the 4xx that counted as rejection)."""
    size = spec.size
    if reply.http_status is None:
        base: tuple[Verdict, str, int | None] = (Verdict.FAIL, f"no HTTP answer ({reply.transport_error})", None)
    elif 400 <= reply.http_status < 500:
        if not rejects_the_prompt(reply.http_status):
            base = (Verdict.INCONCLUSIVE,
                    f"{reply.http_status} says nothing about the prompt's length", None)
        else:
            message = _short_message(reply.body)
            base = (Verdict.PASS, f"rejected {reply.http_status}" + (f": {message}" if message else ""),
                    reply.http_status)
    elif reply.http_status == 200 and spec.stream:
        rejected, why = judge_stream(reply, spec.route, api)
        base = (Verdict.PASS, why, rejected) if rejected is not None else (Verdict.FAIL, why, None)
    elif reply.http_status == 200:
        base = (Verdict.FAIL, f"accepted with 200 ({len(reply.content)} chars of output)", None)
    elif reply.http_status >= 500:
        base = (Verdict.FAIL, f"server error {reply.http_status} (an over-length prompt must get a 4xx)", None)
    else:
        base = (Verdict.FAIL, f"unexpected status {reply.http_status} (must be a 4xx)", None)
    if leaks:
        return Verdict.FAIL, _leak_reason(leaks) + f"; {base[1]}", base[2]
    verdict, reason, rejected = base
    if (verdict is Verdict.FAIL and reply.http_status == 200 and reply.prompt_tokens is not None
            and reply.prompt_tokens < size.threshold_tokens):
        undershot = (
            f"probe undershot: the server counted {reply.prompt_tokens} tokens, below "
            f"{size.threshold_tokens}; {reason}"
        )
        return Verdict.INCONCLUSIVE, undershot, None
    return verdict, reason, rejected


_MESSAGE_IN_TEXT = re.compile(r"['\"]message['\"]\s*:\s*\"((?:[^\"\\]|\\.)*)\"")


def _short_message(body: str, limit: int = 100) -> str:
    """The innermost error message of a reply body (JSON, SSE or a proxy's repr), shortened."""
    text = body.strip()
    if text.startswith("data:"):
        text = text.splitlines()[0][len("data:"):].strip()
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


# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------


@dataclass
class _Calibration:
    slope: float | None = None  # tokens per FILLER repetition; None: route gives no counts
    available: bool = True
    note: str = ""


@dataclass
class _Plan:
    spec: ProbeSpec
    repetitions: int | None = None
    planned_tokens: int | None = None
    exact: bool = False
    skip_reason: str | None = None


def _routes_for(limits: TargetLimits, requested: tuple[str, ...] | None) -> tuple[str, ...]:
    routes = ("chat", "completions") + (("generate",) if limits.api == "sglang" else ())
    if requested is not None:
        routes = tuple(r for r in requested if r in ROUTE_PATHS)
    return routes


async def _calibrate_route(client: httpx.AsyncClient, base: str, route: str, model: str,
                           codec: MarkerCodec, index: int) -> _Calibration:
    k0, k1 = CALIBRATION_K
    replies = [
        await send(client, base, route, request_body(route, model, probe_prompt(codec, index, k), 1, False))
        for k in (k0, k1)
    ]
    first = replies[0]
    if first.http_status in (404, 405):
        return _Calibration(available=False, note=f"{ROUTE_PATHS[route]} answered {first.http_status}: route skipped")
    if first.http_status != 200:
        detail = first.transport_error or f"HTTP {first.http_status}: {_short_message(first.body)}"
        return _Calibration(available=False, note=f"{ROUTE_PATHS[route]} refused a short request ({detail}): route skipped")
    counts = [r.prompt_tokens for r in replies]
    if None in counts or replies[1].http_status != 200:
        return _Calibration(note=f"{ROUTE_PATHS[route]} reports no prompt token count: sizes there are estimates")
    slope = (counts[1] - counts[0]) / (k1 - k0)  # type: ignore[operator]
    if slope <= 0:
        return _Calibration(note=f"{ROUTE_PATHS[route]} token counts do not grow with the prompt: sizes there are estimates")
    return _Calibration(slope=slope)


def _estimate(plan: _Plan) -> None:
    size = plan.spec.size
    if size.upper_tokens is not None:
        width = size.upper_tokens - size.threshold_tokens
        if width < max(64, size.threshold_tokens // 10):
            plan.skip_reason = (f"the band is {width} tokens wide and this route reports no token "
                                "counts to aim with")
            return
        plan.repetitions = size.target_tokens
        plan.planned_tokens = size.target_tokens
        return
    rate, extra = ESTIMATE_MARGIN
    plan.planned_tokens = math.ceil(size.target_tokens * (1 + rate)) + extra
    plan.repetitions = plan.planned_tokens  # >= 1 token per repetition, plus the fixed part


async def _size_probe(client: httpx.AsyncClient, base: str, model: str, codec: MarkerCodec,
                      plan: _Plan, calibration: _Calibration) -> None:
    """Fix `plan.repetitions` from the server's count of this exact probe's fixed part."""
    if calibration.slope is None:
        _estimate(plan)
        return
    k0 = CALIBRATION_K[0]
    spec = plan.spec
    reply = await send(client, base, spec.route,
                       request_body(spec.route, model, probe_prompt(codec, spec.index, k0), 1, False))
    if reply.http_status != 200 or reply.prompt_tokens is None:
        _estimate(plan)
        return
    base_tokens = reply.prompt_tokens - calibration.slope * k0
    repetitions = max(1, math.ceil((spec.size.target_tokens - base_tokens) / calibration.slope))
    plan.repetitions = repetitions
    plan.planned_tokens = round(base_tokens + calibration.slope * repetitions)
    plan.exact = float(calibration.slope).is_integer()


async def _run_victim(client: httpx.AsyncClient, base: str, model: str, codec: MarkerCodec,
                      index: int, route: str, names: Mapping[int, str]) -> VictimResult:
    repeat = index % 2 == 0
    prompt, markers = victim_prompt(codec, index, repeat)
    reply = await send(client, base, route, request_body(route, model, prompt, VICTIM_MAX_TOKENS, False))
    name = names[index]
    leaks = find_leaks(codec, [reply.body, reply.content], index, names)
    if leaks:
        verdict, reason = Verdict.FAIL, _leak_reason(leaks)
    elif reply.http_status == 200:
        verdict, reason = Verdict.PASS, "200, no foreign markers"
    elif reply.http_status is None:
        verdict, reason = Verdict.INCONCLUSIVE, f"no HTTP answer ({reply.transport_error})"
    else:
        verdict, reason = Verdict.INCONCLUSIVE, f"HTTP {reply.http_status}: {_short_message(reply.body)}"
    return VictimResult(name=name, index=index, route=route, repeat=repeat, verdict=verdict,
                        reason=reason, http_status=reply.http_status, markers=markers,
                        leaks=leaks, elapsed_s=reply.elapsed_s)


def _excerpt(reply: Reply) -> str:
    text = reply.body if reply.body else (reply.transport_error or "")
    return text[:300]


async def run_canary_async(config: CanaryConfig, limits: TargetLimits | None = None) -> CanaryReport:
    """The whole canary; `limits` skips discovery (the campaign runner may know them already)."""
    started = time.monotonic()
    url = config.url.rstrip("/")
    if limits is None:
        limits = await asyncio.to_thread(discover_limits, url, config.timeout_s, config.model)
    elif config.model:
        limits = replace(limits, model=config.model)
    if not limits.reports_anything and config.max_tokens_probe is None:
        raise UsageError(
            f"--url {url}: the target reports neither a context length (no max_model_len in "
            "/v1/models) nor a KV pool size (no /server_info), so there is no size to probe. "
            "Pass --max-tokens-probe N, with N the prompt length in tokens the target must reject "
            "(e.g. its context length)."
        )
    run_prefix = config.run_prefix or new_run_prefix()
    codec = MarkerCodec(run_prefix)
    notes: list[str] = []
    routes = _routes_for(limits, config.routes)
    sizes = plan_sizes(limits, config.max_tokens_probe)

    names: dict[int, str] = {i: f"victim v{i + 1}" for i in range(config.victims)}
    plans: list[_Plan] = []
    index = config.victims
    for size in sizes:
        for route in routes:
            for stream in (False, True):
                spec = ProbeSpec(name=f"p{len(plans) + 1}", index=index, size=size, route=route,
                                 stream=stream, max_tokens=size.max_tokens(limits.context_length))
                names[index] = f"probe {spec.name}"
                plans.append(_Plan(spec))
                index += 1
    calibration_index = index
    names[calibration_index] = "calibration request"

    timeout = httpx.Timeout(config.timeout_s, connect=min(config.timeout_s, 10.0))
    limits_http = httpx.Limits(max_connections=max(16, config.victims * 2))
    async with httpx.AsyncClient(timeout=timeout, limits=limits_http, trust_env=False) as client:
        # Calibrate first, so the probes' own calibration traffic is older than the victims'.
        calibrations = {}
        for route in routes:
            calibrations[route] = await _calibrate_route(client, url, route, limits.model, codec, calibration_index)
            if calibrations[route].note:
                notes.append(calibrations[route].note)
        usable = tuple(r for r in routes if calibrations[r].available)
        if not usable:
            raise UsageError(
                f"--url {url}: no route accepted a short request ({'; '.join(notes)}). Check --url "
                f"and --model (sent model {limits.model!r})."
            )
        gate = asyncio.Semaphore(CALIBRATION_CONCURRENCY)

        async def size_one(plan: _Plan) -> None:
            calibration = calibrations[plan.spec.route]
            if not calibration.available:
                plan.skip_reason = f"{ROUTE_PATHS[plan.spec.route]} is not served"
                return
            async with gate:
                await _size_probe(client, url, limits.model, codec, plan, calibration)

        await asyncio.gather(*(size_one(plan) for plan in plans))

        victims = await asyncio.gather(*(
            _run_victim(client, url, limits.model, codec, i, usable[i % len(usable)], names)
            for i in range(config.victims)
        ))

        results: list[ProbeResult] = []
        for plan in plans:
            results.append(await _run_probe(client, url, limits, codec, plan, names))

    return CanaryReport(
        run_prefix=run_prefix, limits=limits, routes=routes, victims=tuple(victims),
        probes=tuple(results), notes=tuple(notes), elapsed_s=time.monotonic() - started,
    )


async def _run_probe(client: httpx.AsyncClient, base: str, limits: TargetLimits, codec: MarkerCodec,
                     plan: _Plan, names: Mapping[int, str]) -> ProbeResult:
    spec = plan.spec
    if plan.skip_reason is not None or plan.repetitions is None:
        return ProbeResult(spec=spec, planned_tokens=None, exact=False, verdict=Verdict.SKIPPED,
                           reason=plan.skip_reason or "not sized")
    prompt = probe_prompt(codec, spec.index, plan.repetitions)
    reply = await send(client, base, spec.route,
                       request_body(spec.route, limits.model, prompt, spec.max_tokens, spec.stream))
    leaks = find_leaks(codec, [reply.body, reply.content, reply.stream_error_message], spec.index, names)
    verdict, reason, rejected = judge_probe(spec, reply, leaks, limits.api)
    if verdict is Verdict.PASS and not plan.exact:
        reason += " (size estimated)"
    return ProbeResult(
        spec=spec, planned_tokens=plan.planned_tokens, exact=plan.exact, verdict=verdict,
        reason=reason, http_status=reply.http_status, stream_error_status=reply.stream_error_status,
        rejected_status=rejected, measured_tokens=reply.prompt_tokens,
        content_chars=len(reply.content), leaks=tuple(leaks), elapsed_s=reply.elapsed_s,
        excerpt=_excerpt(reply) if verdict is not Verdict.PASS else "",
    )


def run_canary(config: CanaryConfig, limits: TargetLimits | None = None) -> CanaryReport:
    """Synchronous `run_canary_async` (for callers without an event loop)."""
    return asyncio.run(run_canary_async(config, limits))


# --------------------------------------------------------------------------------------------------
# Text output
# --------------------------------------------------------------------------------------------------


def _status_cell(probe: ProbeResult) -> str:
    if probe.verdict is Verdict.SKIPPED:
        return "-"
    if probe.http_status is None:
        return "no answer"
    if probe.spec.stream and probe.http_status == 200 and probe.stream_error_status is not None:
        return f"200/{probe.stream_error_status} in-stream"
    return str(probe.http_status)


def _tokens_cell(probe: ProbeResult) -> str:
    if probe.measured_tokens is not None:
        return str(probe.measured_tokens)
    if probe.planned_tokens is None:
        return "-"
    return str(probe.planned_tokens) if probe.exact else f"~{probe.planned_tokens}"


def format_report(report: CanaryReport) -> str:
    limits = report.limits
    lines = [
        (
            f"target {limits.url}  model {limits.model}  api {limits.api}  "
            f"context {limits.context_length or '?'}  pool {limits.max_total_num_tokens or '?'}  "
            f"max_req_input_len {limits.max_req_input_len or '?'}  run {report.run_prefix}"
        ),
    ]
    header = ["PROBE", "TOKENS", "THRESHOLD", "ROUTE", "STREAM", "STATUS", "VERDICT", "REASON"]
    rows = [header] + [
        [
            probe.spec.name,
            _tokens_cell(probe),
            probe.spec.size.label,
            ROUTE_PATHS[probe.spec.route],
            "yes" if probe.spec.stream else "no",
            _status_cell(probe),
            probe.verdict.value,
            probe.reason,
        ]
        for probe in report.probes
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        cells = [cell.rjust(widths[i]) if i == 1 else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    bad_victims = [v for v in report.victims if v.verdict is not Verdict.PASS]
    for victim in bad_victims:
        lines.append(f"{victim.name} ({ROUTE_PATHS[victim.route]}): {victim.verdict.value}: {victim.reason}")
    for note in report.notes:
        lines.append(f"note: {note}")
    lines.append(report.summary_line())
    return "\n".join(lines) + "\n"
