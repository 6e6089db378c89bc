"""Reference probes: fixed prompts recorded alone first, then replayed under load and faults.

A probe keeps its request index (and so its markers) in every replay, so the reference oracle can
compare replays with the isolated baseline, and the canary oracle never mistakes a probe's own
markers for a leak. Probes go through `/generate` when the target speaks SGLang (streamed, so the
time to first token is measured), else through `/v1/completions`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import httpx

from chaos.journal import RequestRecord
from chaos.oracles.canary import MarkerCodec
from loadprofiles.exchange import ROUTES, perform, request_body
from loadprofiles.prompts import Message, Prompt
from loadprofiles.recorder import Observed, Sent, build_record, judge
from loadprofiles.sse import DEFAULT_BODY_CAP, Api

FILLER = ("The quarterly ledger lists revenue churn and the support backlog for each region with notes "
          "from the engineers on call about incidents and their follow ups ")


# Adapter probes share this opening across adapters: a prefix cache whose key forgets the adapter
# hands one adapter's KV to the other (bug class K6).
ADAPTER_PREFIX = ("System: you are the release assistant. Answer in short sentences, cite the ticket "
                  "numbers you are given and never invent figures that the note does not contain. ")
ADAPTERS = ("adapter-a", "adapter-b")


@dataclass(frozen=True)
class Probe:
    index: int
    prompt: str
    markers: tuple[str, str]
    max_tokens: int
    lora_path: str | None = None


def build_probes(codec: MarkerCodec, count: int, context_tokens: int | None, max_tokens: int) -> list[Probe]:
    """Lengths spread from short to about half the context (the timing oracle needs the spread);
    every other probe asks the model to repeat (its markers then come back out); every third runs
    under a LoRA adapter, behind an opening all adapter probes share."""
    longest_chars = max(400, min(16000, (context_tokens or 4096) * 2))
    probes = []
    for i in range(count):
        head, tail = codec.marker(i, 0), codec.marker(i, 1)
        chars = 200 + (longest_chars - 200) * (i % 6) // 5
        body = (FILLER * (chars // len(FILLER) + 1))[:chars]
        ask = "Please repeat this note exactly." if i % 2 == 0 else "Summarise this note for the weekly review."
        prompt = f"{head} {ask} {body} {tail}"
        adapter = ADAPTERS[(i // 3) % 2] if i % 3 == 2 else None
        if adapter is not None:
            prompt = ADAPTER_PREFIX + prompt
        probes.append(Probe(i, prompt, (head, tail), max_tokens, adapter))
    return probes


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


def send_probe(client: httpx.Client, base_url: str, probe: Probe, phase: str, api: str, timeout_s: float = 60.0) -> RequestRecord:
    """Send one probe, streamed, and return its record (never raises on HTTP trouble)."""
    route: Api = "generate" if api == "sglang" else "completions"
    prompt = Prompt(kind="probe", messages=(Message("user", probe.prompt),), markers=probe.markers,
                    repeat="repeat" in probe.prompt, est_tokens=len(probe.prompt) // 4)
    body = request_body(route, prompt, stream=True, max_tokens=probe.max_tokens, model="default", rid=None)
    if probe.lora_path:
        body["lora_path"] = probe.lora_path
    sent = Sent(id=f"probe-{probe.index}-{phase}-{uuid.uuid4().hex[:8]}", request_index=probe.index, phase=phase,
                user_kind="probe", actor="runner", endpoint=ROUTES[route], stream=True, markers=probe.markers,
                prompt=probe.prompt, max_tokens=probe.max_tokens, planned_send=None)
    obs = Observed()
    perform(client, base_url + ROUTES[route], body, api=route, timeout_s=timeout_s, obs=obs, cap=DEFAULT_BODY_CAP)
    return build_record(sent, obs, judge(obs))
