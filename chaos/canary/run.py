"""The canary's run (chaos/canary/__init__.py, "Flow"): limits, plan, calibration, victims, probes."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from chaos import transport
from chaos.canary.judging import find_leaks, judge_probe, leak_reason
from chaos.canary.prompts import probe_prompt, victim_prompt
from chaos.canary.reply import Reply, send, short_message
from chaos.canary.report import CanaryReport, ProbeResult, VictimResult
from chaos.canary.sizing import ProbePlan, ProbeSpec, RouteCalibration, calibrate_route, size_probe
from chaos.canary.target import DEFAULT_TIMEOUT_S, CanaryTarget, discover_target
from chaos.errors import UsageError
from chaos.markers import MarkerCodec, new_run_prefix
from chaos.verdict import Verdict
from loadprofiles.exchange import ROUTES
from loadprofiles.sizing import plan_thresholds
from loadprofiles.sse import Api

VICTIMS = 8
PROBE_MAX_TOKENS = 64  # room for a leaked marker to show up in the reply
VICTIM_MAX_TOKENS = 48
CALIBRATION_CONCURRENCY = 4


@dataclass(frozen=True)
class CanaryConfig:
    url: str
    model: str | None = None  # None: the first model /v1/models lists
    max_tokens_probe: int | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    victims: int = VICTIMS
    run_prefix: str | None = None  # None: a fresh one
    routes: tuple[Api, ...] | None = None  # None: chat, completions (+ generate on SGLang)


def _routes_for(api: str, requested: tuple[Api, ...] | None) -> tuple[Api, ...]:
    routes: tuple[Api, ...] = ("chat", "completions") + (("generate",) if api == "sglang" else ())
    if requested is not None:
        routes = tuple(r for r in requested if r in ROUTES)
    return routes


async def _run_victim(
    client: httpx.AsyncClient,
    base: str,
    model: str,
    codec: MarkerCodec,
    index: int,
    route: Api,
    names: Mapping[int, str],
) -> VictimResult:
    repeat = index % 2 == 0
    prompt, markers = victim_prompt(codec, index, repeat)
    reply = await send(client, base, route, prompt, model=model, max_tokens=VICTIM_MAX_TOKENS, stream=False)
    name = names[index]
    leaks = find_leaks(codec, [reply.body, reply.content], index, names)
    if leaks:
        verdict, reason = Verdict.FAIL, leak_reason(leaks)
    elif reply.http_status == 200:
        verdict, reason = Verdict.PASS, "200, no foreign markers"
    elif reply.http_status is None:
        verdict, reason = Verdict.INCONCLUSIVE, f"no HTTP answer ({reply.transport_error})"
    else:
        verdict, reason = Verdict.INCONCLUSIVE, f"HTTP {reply.http_status}: {short_message(reply.body)}"
    return VictimResult(
        name=name,
        index=index,
        route=route,
        repeat=repeat,
        verdict=verdict,
        reason=reason,
        http_status=reply.http_status,
        markers=markers,
        leaks=leaks,
        elapsed_s=reply.elapsed_s,
    )


def _excerpt(reply: Reply) -> str:
    text = reply.body if reply.body else (reply.transport_error or "")
    return text[:300]


async def run_canary_async(config: CanaryConfig, target: CanaryTarget | None = None) -> CanaryReport:
    """The whole canary; `target` skips discovery (a caller may know the target already)."""
    started = time.monotonic()
    url = config.url.rstrip("/")
    if target is None:
        target = await asyncio.to_thread(discover_target, url, config.timeout_s, config.model)
    elif config.model:
        target = dataclasses.replace(target, facts=dataclasses.replace(target.facts, model=config.model))
    facts = target.facts
    if not facts.states_a_size and config.max_tokens_probe is None:
        raise UsageError(
            f"--url {url}: the target reports neither a context length (no max_model_len in "
            "/v1/models) nor a KV pool size (no /server_info), so there is no size to probe. "
            "Pass --max-tokens-probe N, with N the prompt length in tokens the target must reject "
            "(e.g. its context length)."
        )
    run_prefix = config.run_prefix or new_run_prefix()
    codec = MarkerCodec(run_prefix)
    notes: list[str] = []
    routes = _routes_for(facts.api, config.routes)
    thresholds = plan_thresholds([facts.as_tuple()], manual=config.max_tokens_probe)

    names: dict[int, str] = {i: f"victim v{i + 1}" for i in range(config.victims)}
    plans: list[ProbePlan] = []
    index = config.victims
    for threshold in thresholds:
        for route in routes:
            for stream in (False, True):
                spec = ProbeSpec(
                    name=f"p{len(plans) + 1}",
                    index=index,
                    threshold=threshold,
                    route=route,
                    stream=stream,
                    max_tokens=threshold.max_new_tokens(PROBE_MAX_TOKENS),
                )
                names[index] = f"probe {spec.name}"
                plans.append(ProbePlan(spec))
                index += 1
    calibration_index = index
    names[calibration_index] = "calibration request"

    timeout = httpx.Timeout(config.timeout_s, connect=min(config.timeout_s, 10.0))
    limits_http = httpx.Limits(max_connections=max(16, config.victims * 2))
    async with transport.async_client(timeout=timeout, limits=limits_http, trust_env=False) as client:
        # Calibrate first, so the probes' own calibration traffic is older than the victims'.
        calibrations: dict[Api, RouteCalibration] = {}
        for route in routes:
            calibrations[route] = await calibrate_route(client, url, route, facts.model, codec, calibration_index)
            if calibrations[route].note:
                notes.append(calibrations[route].note)
        usable = tuple(r for r in routes if calibrations[r].available)
        if not usable:
            raise UsageError(
                f"--url {url}: no route accepted a short request ({'; '.join(notes)}). Check --url "
                f"and --model (sent model {facts.model!r})."
            )
        gate = asyncio.Semaphore(CALIBRATION_CONCURRENCY)

        async def size_one(plan: ProbePlan) -> None:
            calibration = calibrations[plan.spec.route]
            if not calibration.available:
                plan.skip_reason = f"{ROUTES[plan.spec.route]} is not served"
                return
            async with gate:
                await size_probe(client, url, facts.model, codec, plan, calibration)

        await asyncio.gather(*(size_one(plan) for plan in plans))

        victims = await asyncio.gather(
            *(
                _run_victim(client, url, facts.model, codec, i, usable[i % len(usable)], names)
                for i in range(config.victims)
            )
        )

        results: list[ProbeResult] = []
        for plan in plans:
            results.append(await _run_probe(client, url, facts.model, facts.api, codec, plan, names))

    return CanaryReport(
        run_prefix=run_prefix,
        target=target,
        routes=routes,
        victims=tuple(victims),
        probes=tuple(results),
        notes=tuple(notes),
        elapsed_s=time.monotonic() - started,
    )


async def _run_probe(
    client: httpx.AsyncClient,
    base: str,
    model: str,
    api: str,
    codec: MarkerCodec,
    plan: ProbePlan,
    names: Mapping[int, str],
) -> ProbeResult:
    spec = plan.spec
    if plan.skip_reason is not None or plan.repetitions is None:
        return ProbeResult(
            spec=spec, planned_tokens=None, exact=False, verdict=None, reason=plan.skip_reason or "not sized"
        )
    prompt = probe_prompt(codec, spec.index, plan.repetitions)
    reply = await send(client, base, spec.route, prompt, model=model, max_tokens=spec.max_tokens, stream=spec.stream)
    leaks = find_leaks(codec, [reply.body, reply.content, reply.stream_error_message], spec.index, names)
    verdict, reason, rejected = judge_probe(spec, reply, leaks, api)
    if verdict is Verdict.PASS and not plan.exact:
        reason += " (size estimated)"
    return ProbeResult(
        spec=spec,
        planned_tokens=plan.planned_tokens,
        exact=plan.exact,
        verdict=verdict,
        reason=reason,
        http_status=reply.http_status,
        stream_error_status=reply.stream_error_status,
        rejected_status=rejected,
        measured_tokens=reply.prompt_tokens,
        content_chars=len(reply.content),
        leaks=tuple(leaks),
        elapsed_s=reply.elapsed_s,
        excerpt=_excerpt(reply) if verdict is not Verdict.PASS else "",
    )


def run_canary(config: CanaryConfig, target: CanaryTarget | None = None) -> CanaryReport:
    """Synchronous `run_canary_async` (for callers without an event loop)."""
    return asyncio.run(run_canary_async(config, target))
