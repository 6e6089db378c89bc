"""A short qualification of the embedded engine: isolated references, then concurrent load.

Until the campaign runner exists this is what `make run` does: start the embedded PD stack, record
each probe prompt's greedy output alone, replay every probe concurrently (streaming and not, two
routes) and check each reply against its reference and for other requests' canary markers.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from chaos.oracles.canary import MarkerCodec, new_run_prefix
from chaos.targets.sim.stack import SimStack, SimStackConfig

FILLER = (
    "The quarterly report lists revenue, churn and the support backlog for each region, "
    "with notes from the on-call engineers about incidents and their follow-ups. "
)


@dataclass(frozen=True)
class Probe:
    index: int
    prompt: str
    max_new_tokens: int


@dataclass
class Reply:
    probe: Probe
    route: str
    stream: bool
    status: int
    text: str
    ttft_s: float | None
    latency_s: float
    error: str | None = None


@dataclass
class SmokeResult:
    requests: int = 0
    ok: int = 0
    mismatches: int = 0
    leaks: int = 0
    errors: int = 0
    requests_per_s: float = 0.0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    findings: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.requests > 0 and self.ok == self.requests

    def to_json(self) -> str:
        data = asdict(self)
        data["findings"] = self.findings[:20]
        data["verdict"] = "PASS" if self.passed else "FAIL"
        return json.dumps(data)


def build_probes(codec: MarkerCodec, count: int) -> list[Probe]:
    """Half ask the model to repeat (their markers come back out), half to generate."""
    probes = []
    for i in range(count):
        head, tail = codec.marker(i, 0), codec.marker(i, 1)
        body = FILLER * (1 + (i * 7) % 12)
        if i % 2 == 0:
            prompt = f"{head} Please repeat this note exactly. {body}{tail}"
        else:
            prompt = f"{head} Summarise this note for the weekly review. {body}{tail}"
        probes.append(Probe(index=i, prompt=prompt, max_new_tokens=24 + (i % 3) * 8))
    return probes


async def send(client: httpx.AsyncClient, base: str, probe: Probe, route: str, stream: bool) -> Reply:
    if route == "generate":
        url = f"{base}/generate"
        body = {"text": probe.prompt, "stream": stream, "sampling_params": {"max_new_tokens": probe.max_new_tokens, "temperature": 0}}
    else:
        url = f"{base}/v1/completions"
        body = {"model": "pdchaos/toy-1", "prompt": probe.prompt, "max_tokens": probe.max_new_tokens, "temperature": 0, "stream": stream}
    started = time.monotonic()
    first: float | None = None
    text = ""
    try:
        if not stream:
            response = await client.post(url, json=body)
            latency = time.monotonic() - started
            if response.status_code != 200:
                return Reply(probe, route, stream, response.status_code, "", None, latency, response.text[:200])
            data = response.json()
            text = data["text"] if route == "generate" else data["choices"][0]["text"]
            return Reply(probe, route, stream, 200, text, None, latency)
        async with client.stream("POST", url, json=body) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Reply(probe, route, stream, response.status_code, text, first, time.monotonic() - started, str(chunk["error"])[:200])
                piece = chunk["text"] if route == "generate" else chunk["choices"][0]["text"]
                if piece and first is None:
                    first = time.monotonic() - started
                text = piece if route == "generate" else text + piece  # /generate streams cumulative text
            return Reply(probe, route, stream, response.status_code, text, first, time.monotonic() - started)
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        return Reply(probe, route, stream, 0, text, first, time.monotonic() - started, f"{type(exc).__name__}: {exc}")


async def run_load(base: str, codec: MarkerCodec, probes: list[Probe], rounds: int, concurrency: int) -> SmokeResult:
    result = SmokeResult()
    async with httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=concurrency)) as client:
        references = {p.index: await send(client, base, p, "generate", False) for p in probes}
        for ref in references.values():
            if ref.status != 200:
                result.findings.append(f"reference for probe {ref.probe.index} failed: {ref.status} {ref.error}")
        gate = asyncio.Semaphore(concurrency)

        async def one(probe: Probe, k: int) -> Reply:
            async with gate:
                return await send(client, base, probe, ("generate", "completions")[k % 2], stream=(k // 2) % 2 == 1)

        jobs = [one(p, k) for k in range(rounds) for p in probes]
        started = time.monotonic()
        replies = await asyncio.gather(*jobs)
        elapsed = time.monotonic() - started

    for reply in replies:
        result.requests += 1
        where = f"probe {reply.probe.index} via {reply.route}{' (stream)' if reply.stream else ''}"
        leaked = codec.scan_others(reply.text, reply.probe.index)
        if leaked:
            result.leaks += 1
            owners = sorted({h.request_index for h in leaked if h.request_index is not None})
            result.findings.append(f"LEAK: {where} contains markers of requests {owners}")
        if reply.error or reply.status != 200:
            result.errors += 1
            result.findings.append(f"error: {where}: {reply.status} {reply.error}")
        elif reply.text != references[reply.probe.index].text:
            result.mismatches += 1
            result.findings.append(f"mismatch: {where} differs from its isolated reference")
        elif not leaked:
            result.ok += 1
    ttfts = sorted(r.ttft_s for r in replies if r.ttft_s is not None)
    result.requests_per_s = round(result.requests / elapsed, 1) if elapsed > 0 else 0.0
    if ttfts:
        result.ttft_p50_ms = round(1000 * statistics.median(ttfts), 1)
        result.ttft_p99_ms = round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1)
    return result


def run_smoke(run_dir: Path, probes: int = 48, rounds: int = 4, concurrency: int = 32, config: SimStackConfig | None = None) -> SmokeResult:
    codec = MarkerCodec(new_run_prefix())
    stack = SimStack(config or SimStackConfig(), run_dir)
    try:
        endpoints = stack.up()
        return asyncio.run(run_load(endpoints.router_url, codec, build_probes(codec, probes), rounds, concurrency))
    finally:
        stack.down()
