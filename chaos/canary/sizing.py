"""The canary's plan and its sizes: one probe per over-length size, route and streaming mode,
each sized on the target's own token counts where the route gives them.

Calibration comes before any victim, so the probes' own calibration traffic is older than the
victims' in the KV pool. Per route, two short prompts `CALIBRATION_K` repetitions apart give the
tokens per repetition; per probe, one short prompt with that probe's exact markers gives its fixed
part (loadprofiles/sizing.py). A route that reports no usage gets estimated sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import httpx

from chaos.canary.prompts import probe_prompt
from chaos.canary.reply import send, short_message
from chaos.markers import MarkerCodec
from loadprofiles.exchange import ROUTES
from loadprofiles.sizing import CALIBRATION_K, Sizer, Threshold
from loadprofiles.sse import Api

ESTIMATE_MARGIN = (0.05, 32)  # uncalibrated over-length probes: +5% + 32 tokens


@dataclass(frozen=True)
class ProbeSpec:
    name: str  # "p1", ...
    index: int  # marker request index
    threshold: Threshold
    route: Api
    stream: bool
    max_tokens: int


@dataclass
class RouteCalibration:
    sizer: Sizer | None = None  # None: the route gives no counts, sizes there are estimates
    available: bool = True
    note: str = ""


@dataclass
class ProbePlan:
    spec: ProbeSpec
    repetitions: int | None = None
    planned_tokens: int | None = None
    exact: bool = False  # sized to the token on the server's own counts
    skip_reason: str | None = None


async def calibrate_route(
    client: httpx.AsyncClient, base: str, route: Api, model: str, codec: MarkerCodec, index: int
) -> RouteCalibration:
    replies = [
        await send(client, base, route, probe_prompt(codec, index, k), model=model, max_tokens=1, stream=False)
        for k in CALIBRATION_K
    ]
    first = replies[0]
    path = ROUTES[route]
    if first.http_status in (404, 405):
        return RouteCalibration(available=False, note=f"{path} answered {first.http_status}: route skipped")
    if first.http_status != 200:
        detail = first.transport_error or f"HTTP {first.http_status}: {short_message(first.body)}"
        return RouteCalibration(available=False, note=f"{path} refused a short request ({detail}): route skipped")
    low, high = (r.prompt_tokens for r in replies)
    if low is None or high is None or replies[1].http_status != 200:
        return RouteCalibration(note=f"{path} reports no prompt token count: sizes there are estimates")
    sizer = Sizer.measured((low, high))
    if sizer is None:
        return RouteCalibration(note=f"{path} token counts do not grow with the prompt: sizes there are estimates")
    return RouteCalibration(sizer=sizer)


def estimate(plan: ProbePlan) -> None:
    """Size `plan` without the server's counts: at least one token per repetition, so over-shoot
    by `ESTIMATE_MARGIN`; a narrow band cannot be hit that way, so it is skipped."""
    threshold = plan.spec.threshold
    if threshold.upper is not None:
        width = threshold.upper - threshold.tokens
        if width < max(64, threshold.tokens // 10):
            plan.skip_reason = f"the band is {width} tokens wide and this route reports no token counts to aim with"
            return
        plan.repetitions = threshold.target
        plan.planned_tokens = threshold.target
        return
    rate, extra = ESTIMATE_MARGIN
    plan.planned_tokens = math.ceil(threshold.target * (1 + rate)) + extra
    plan.repetitions = plan.planned_tokens  # >= 1 token per repetition, plus the fixed part


async def size_probe(
    client: httpx.AsyncClient, base: str, model: str, codec: MarkerCodec, plan: ProbePlan, calibration: RouteCalibration
) -> None:
    """Fix `plan.repetitions` from the server's count of this exact probe's fixed part."""
    if calibration.sizer is None:
        estimate(plan)
        return
    spec = plan.spec
    reply = await send(
        client,
        base,
        spec.route,
        probe_prompt(codec, spec.index, CALIBRATION_K[0]),
        model=model,
        max_tokens=1,
        stream=False,
    )
    if reply.http_status != 200 or reply.prompt_tokens is None:
        estimate(plan)
        return
    sizer = calibration.sizer.through(reply.prompt_tokens)
    plan.repetitions = sizer.repetitions(spec.threshold.target)
    plan.planned_tokens = sizer.tokens(plan.repetitions)
    plan.exact = float(sizer.slope).is_integer()
