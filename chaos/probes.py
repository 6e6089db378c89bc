"""Reference probes: fixed prompts recorded alone first, then replayed under load and faults.

A probe keeps its request index (and so its markers) in every replay, so the reference oracle can
compare replays with the isolated baseline, and the canary oracle never mistakes a probe's own
markers for a leak. Probes go through `/generate` when the target speaks SGLang (streamed, so the
time to first token is measured), else through `/v1/completions`.
"""

from __future__ import annotations

import math
import statistics
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import httpx

from chaos.journal import RequestRecord
from chaos.markers import MarkerCodec
from loadprofiles.exchange import ROUTES, record_exchange, request_body
from loadprofiles.prompts import Prompt
from loadprofiles.recorder import Sent
from loadprofiles.sse import Api

FILLER = (
    "The quarterly ledger lists revenue churn and the support backlog for each region with notes "
    "from the engineers on call about incidents and their follow ups "
)


# Adapter probes share this opening across adapters: a prefix cache whose key forgets the adapter
# hands one adapter's KV to the other (bug class K6).
ADAPTER_PREFIX = (
    "System: you are the release assistant. Answer in short sentences, cite the ticket "
    "numbers you are given and never invent figures that the note does not contain. "
)
ADAPTERS = ("adapter-a", "adapter-b")  # names for a target that does not list its adapters
CHARS_PER_TOKEN = 4.0  # a common tokenizer on English text, when the target does not count tokens
SIZING_REPEATS = 8  # the filler this many times (~1,200 characters) sizes the probes
ASSUMED_CONTEXT_TOKENS = 4096  # probes are sized against this when the target states no context


def _route_for(api: str) -> Api:
    """SGLang's own route where the target serves it (streamed, it times the first token)."""
    return "generate" if api == "sglang" else "completions"


def chars_per_token(
    client: httpx.Client, base_url: str, api: str, index: int, timeout_s: float = 30.0, model: str = "default"
) -> tuple[float, RequestRecord]:
    """Characters of the probes' filler per prompt token on the target's own tokenizer, from one
    request with no markers (the target counts its tokens), and that request's record.
    CHARS_PER_TOKEN when the target does not count them."""
    route = _route_for(api)
    text = FILLER * SIZING_REPEATS
    body = request_body(route, Prompt.user("sizing", text), stream=False, max_tokens=1, model=model, rid=None)
    sent = Sent(
        id=f"sizing-{uuid.uuid4().hex[:8]}",
        request_index=index,
        phase="baseline",
        user_kind="sizing",
        actor="runner",
        endpoint=ROUTES[route],
        stream=False,
        markers=(),
        prompt=text,
        max_tokens=1,
        planned_send=None,
    )
    record = record_exchange(client, base_url, route, body, sent, timeout_s=timeout_s)
    counted = record.prompt_tokens
    return (len(text) / counted if record.status == 200 and counted and counted > 0 else CHARS_PER_TOKEN), record


@dataclass(frozen=True)
class Probe:
    index: int
    prompt: str
    markers: tuple[str, str]
    max_tokens: int
    lora_path: str | None = None
    ignore_eos: bool = False  # decode all `max_tokens` (the span probe)


def build_probes(
    codec: MarkerCodec,
    count: int,
    context_tokens: int | None,
    max_tokens: int,
    *,
    adapters: tuple[str, ...] = ADAPTERS,
    chars_per_token: float = CHARS_PER_TOKEN,
) -> list[Probe]:
    """Lengths spread from short to about half the context (the timing oracle needs the spread),
    in characters of the filler at `chars_per_token` (measured on the target: `chars_per_token`);
    every other probe asks the model to repeat (its markers then come back out); with two or more
    `adapters`, every third runs under one of the first two, behind an opening they all share."""
    half = (context_tokens or ASSUMED_CONTEXT_TOKENS) / 2
    longest_chars = max(400, min(16000, int(half * chars_per_token)))
    adapters = adapters[:2] if len(adapters) >= 2 else ()
    probes = []
    for i in range(count):
        head, tail = codec.marker(i, 0), codec.marker(i, 1)
        chars = 200 + (longest_chars - 200) * (i % 6) // 5
        body = (FILLER * (chars // len(FILLER) + 1))[:chars]
        ask = "Please repeat this note exactly." if i % 2 == 0 else "Summarise this note for the weekly review."
        prompt = f"{head} {ask} {body} {tail}"
        adapter = adapters[(i // 3) % 2] if adapters and i % 3 == 2 else None
        if adapter is not None:
            prompt = ADAPTER_PREFIX + prompt
        probes.append(Probe(i, prompt, (head, tail), max_tokens, adapter))
    return probes


def build_span_probe(codec: MarkerCodec, index: int, max_tokens: int) -> Probe:
    """The probe a `span` provocation keeps decoding across a frozen sender (faults/provoke.py):
    a short prompt that asks for new text, decoded to `max_tokens` whatever it says (ignore_eos),
    so it asks for a new page every page of output, and attends every one at every step."""
    head, tail = codec.marker(index, 0), codec.marker(index, 1)
    prompt = f"{head} Write the weekly review of this note, at length. {FILLER} {tail}"
    return Probe(index, prompt, (head, tail), max_tokens, ignore_eos=True)


def span_tokens(span_s: float, itl_s: float, room_tokens: int) -> int:
    """Tokens that keep a decode running `span_s` at `itl_s` per token (the isolated pace: under
    load a token comes slower, so it runs longer), within `room_tokens`."""
    return max(1, min(room_tokens, math.ceil(span_s / itl_s)))


def isolated_itl(records: Iterable[RequestRecord]) -> float | None:
    """The median time per generated token of the answered (200) streamed replies with more than
    one token (the baselines)."""
    paces = [
        (r.t_end - r.t_first_token) / (r.completion_tokens - 1)
        for r in records
        if r.status == 200
        and r.t_end is not None
        and r.t_first_token is not None
        and r.completion_tokens is not None
        and r.completion_tokens > 1
    ]
    return statistics.median(paces) if paces else None


def replay_order(probes: list[Probe]) -> list[Probe]:
    """The order probes are replayed in under load: the adapter probes back to back, so each
    finds the shared opening still cached under the other adapter (a cache key that forgets the
    adapter shows at once, before eviction churn can hide it); the others keep their order."""
    adapters = [p for p in probes if p.lora_path]
    others = [p for p in probes if not p.lora_path]
    if not adapters:
        return list(probes)
    at = min(probes.index(adapters[0]), len(others))
    return others[:at] + adapters + others[at:]


def reader_order(probes: list[Probe]) -> list[Probe]:
    """The probes a provocation's reuse waves replay: the longer half, longest first. Pages a
    fault freed go to whichever request asks for pages next, so the more pages a reader asks for,
    the likelier it is handed them; and a probe attends every page it holds at every step, so a
    write that lands in one late changes what it says."""
    ranked = sorted(probes, key=lambda p: len(p.prompt), reverse=True)
    return ranked[: (len(ranked) + 1) // 2]


def send_probe(
    client: httpx.Client,
    base_url: str,
    probe: Probe,
    phase: str,
    api: str,
    timeout_s: float = 60.0,
    model: str = "default",
    first_token: threading.Event | None = None,
) -> RequestRecord:
    """Send one probe, streamed, and return its record (never raises on HTTP trouble). `model` is
    the name the target's /v1/models gave (an OpenAI server may refuse any other); `first_token`
    is set when the first token arrives (the request is decoding)."""
    route = _route_for(api)
    prompt = Prompt.user("probe", probe.prompt, probe.markers, repeat="repeat" in probe.prompt)
    body = request_body(route, prompt, stream=True, max_tokens=probe.max_tokens, model=model, rid=None)
    if probe.lora_path:
        body["lora_path"] = probe.lora_path
    if probe.ignore_eos:  # SGLang's and vLLM's sampling parameter, in both of their APIs
        (body["sampling_params"] if route == "generate" else body)["ignore_eos"] = True
    sent = Sent(
        id=f"probe-{probe.index}-{phase}-{uuid.uuid4().hex[:8]}",
        request_index=probe.index,
        phase=phase,
        user_kind="probe",
        actor="runner",
        endpoint=ROUTES[route],
        stream=True,
        markers=probe.markers,
        prompt=probe.prompt,
        max_tokens=probe.max_tokens,
        planned_send=None,
    )
    return record_exchange(client, base_url, route, body, sent, timeout_s=timeout_s, first_token=first_token)
