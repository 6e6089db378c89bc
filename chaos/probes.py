"""Reference probes: fixed prompts recorded alone first, then replayed under load and faults.

A probe keeps its request index (and so its markers) in every replay, so the reference oracle can
compare replays with the isolated baseline, and the canary oracle never mistakes a probe's own
markers for a leak. Probes go through `/generate` when the target speaks SGLang (streamed, so the
time to first token is measured), else through `/v1/completions`.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import httpx

from chaos.journal import RequestRecord
from chaos.oracles.canary import MarkerCodec
from loadprofiles.recorder import Observed, Sent, build_record, judge
from loadprofiles.sse import ResponseReader

FILLER = ("The quarterly ledger lists revenue churn and the support backlog for each region with notes "
          "from the engineers on call about incidents and their follow ups ")


@dataclass(frozen=True)
class Probe:
    index: int
    prompt: str
    markers: tuple[str, str]
    max_tokens: int


def build_probes(codec: MarkerCodec, count: int, context_tokens: int | None, max_tokens: int) -> list[Probe]:
    """Lengths spread from short to about half the context (the timing oracle needs the spread);
    every other probe asks the model to repeat (its markers then come back out)."""
    longest_chars = max(400, min(16000, (context_tokens or 4096) * 2))
    probes = []
    for i in range(count):
        head, tail = codec.marker(i, 0), codec.marker(i, 1)
        chars = 200 + (longest_chars - 200) * (i % 6) // 5
        body = (FILLER * (chars // len(FILLER) + 1))[:chars]
        ask = "Please repeat this note exactly." if i % 2 == 0 else "Summarise this note for the weekly review."
        probes.append(Probe(i, f"{head} {ask} {body} {tail}", (head, tail), max_tokens))
    return probes


def send_probe(client: httpx.Client, base_url: str, probe: Probe, phase: str, api: str, timeout_s: float = 60.0) -> RequestRecord:
    route = "generate" if api == "sglang" else "completions"
    if route == "generate":
        url = f"{base_url}/generate"
        body = {"text": probe.prompt, "stream": True, "sampling_params": {"max_new_tokens": probe.max_tokens, "temperature": 0}}
    else:
        url = f"{base_url}/v1/completions"
        body = {"prompt": probe.prompt, "max_tokens": probe.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
    sent = Sent(id=f"probe-{probe.index}-{phase}-{uuid.uuid4().hex[:8]}", request_index=probe.index, phase=phase,
                user_kind="probe", actor="runner", endpoint=route, stream=True, markers=probe.markers,
                prompt=probe.prompt, max_tokens=probe.max_tokens, planned_send=None)
    obs = Observed()
    obs.t_send = time.time()
    reader: ResponseReader | None = None
    ended = False
    try:
        with client.stream("POST", url, json=body, timeout=timeout_s) as response:
            obs.t_first_byte = time.time()
            obs.status = response.status_code
            obs.sse = "text/event-stream" in response.headers.get("content-type", "")
            reader = ResponseReader(route, sse=obs.sse)  # type: ignore[arg-type]
            for chunk in response.iter_bytes():
                if not reader.feed(chunk, time.time()):
                    break
            else:
                ended = True
    except httpx.HTTPError as exc:
        obs.transport = ("disconnect" if isinstance(exc, httpx.NetworkError) else "timeout" if isinstance(exc, httpx.TimeoutException)
                         else "client_error", f"{type(exc).__name__}: {exc}"[:500])
    finally:
        obs.t_end = time.time()
        if reader is not None:
            obs.parsed = reader.close(obs.t_end, ended_by_server=ended)
    return build_record(sent, obs, judge(obs))
