"""over_length_burst: prompts just over each limit the workers report, sent at once.

The limits are the KV pool, the context, and the band [max_req_input_len, context) only SGLang's
scheduler check rejects (loadprofiles/sizing.py); each prompt is sized with the target's own token
counts. Confirmed when every prompt was answered by the server's admission (a 4xx about the
prompt, or a 200 the status oracle then judges).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from chaos.errors import UsageError
from chaos.http_status import NOT_ABOUT_THE_PROMPT_4XX
from chaos.refusal import read_refusal
from faults.base import Confirmation, FaultContext, FaultNotAvailable, FaultParams
from faults.traffic.exchange import KIND_OVER_LENGTH, Exchange, send
from faults.traffic.source import TrafficFault, check_index_base, check_run_prefix, fault_client
from loadprofiles.sizing import CALIBRATION_K, Threshold, plan_thresholds


@dataclass(frozen=True)
class OverLengthParams(FaultParams):
    count: int = 1  # prompts per threshold
    stream: bool = False
    run_prefix: str = ""
    index_base: int = 0

    def validate(self, where: str) -> None:
        if not 1 <= self.count <= 100:
            raise UsageError(f"{where}.count: {self.count} must be in 1..100")
        check_run_prefix(where, self.run_prefix)
        check_index_base(where, self.index_base)


def undershot(thresholds: list[Threshold], counted: int) -> bool:
    """A prompt the target counted at `counted` tokens is under every limit. Over the deployment's
    smallest limit is over-length whichever limit it was aimed at: a prompt aimed past decode's
    limit that lands past only prefill's must still be rejected."""
    return counted < min(t.tokens for t in thresholds)


class OverLengthBurst(TrafficFault):
    name = "over_length_burst"  # type: ignore[misc]  # see TrafficSource.name
    summary = "prompts just over each limit the workers report (pool, context, the [max_req_input_len, context) band), at once"
    Params = OverLengthParams

    INSTRUCTION = "This is an over-length canary."

    @property
    def p(self) -> OverLengthParams:
        return self.params  # type: ignore[return-value]

    def inject(self, ctx: FaultContext) -> None:
        self._setup(ctx)
        workers = ctx.target.endpoints.workers
        urls = [w.url for w in workers] or [ctx.target.endpoints.router_url]
        dialect = ctx.target.dialect
        thresholds = plan_thresholds([dialect.limits(u).as_tuple() for u in urls])
        if not thresholds:
            raise FaultNotAvailable("the target reports no pool size or context length (/server_info, /v1/models)")
        ctx.baseline["thresholds"] = thresholds
        self._probe_thresholds: dict[str, Threshold] = {}
        self._notes: list[str] = []
        exchanges: list[Exchange] = []
        try:
            asyncio.run(self._run(ctx, thresholds, exchanges))
        finally:
            self.journal(ctx, exchanges)
        ctx.baseline["probes"] = [e for e in exchanges if e.user_kind == KIND_OVER_LENGTH]

    async def _run(self, ctx: FaultContext, thresholds: list[Threshold], exchanges: list[Exchange]) -> None:
        url = ctx.target.endpoints.router_url
        notes: list[str] = self._notes
        async with fault_client() as client:
            sizer = await self.measure_sizer(client, url, self.INSTRUCTION, exchanges)
            planned: list[tuple[Threshold, int, int, bool]] = []  # threshold, index, repetitions, exact
            for threshold in thresholds:
                for _ in range(self.p.count):
                    index = self.next_index()
                    # This index's own count: its marker's tokens shift the fixed part by a few.
                    base = (
                        await self.counted_tokens(client, url, index, CALIBRATION_K[0], self.INSTRUCTION, exchanges)
                        if sizer.exact
                        else None
                    )
                    if base is not None:
                        planned.append((threshold, index, sizer.through(base).repetitions(threshold.target), True))
                    elif threshold.upper is not None:
                        notes.append(
                            f"{threshold.label}: skipped, the target reports no token counts to aim into the band"
                        )
                    else:  # at least one token per repetition: aim a little over
                        planned.append((threshold, index, threshold.target + 32, False))
            probes: list[tuple[Threshold, Exchange]] = []
            for threshold, index, reps, exact in planned:
                ex = self.exchange(
                    index,
                    self.prompt(index, reps, self.INSTRUCTION),
                    KIND_OVER_LENGTH,
                    threshold.max_new_tokens(),
                    stream=self.p.stream,
                )
                ex.details.append(
                    f"{threshold.label}, aimed at {threshold.target} tokens" + ("" if exact else " (estimated)")
                )
                probes.append((threshold, ex))
                self._probe_thresholds[ex.rid] = threshold
                exchanges.append(ex)
            await asyncio.gather(*(send(client, url, ex) for _, ex in probes))
            for _, ex in probes:
                if ex.status == 200 and ex.prompt_tokens is not None and undershot(thresholds, ex.prompt_tokens):
                    ex.anomalies.append("over_length_missed")  # we undershot: not an over-length prompt

    def confirm(self, ctx: FaultContext) -> Confirmation:
        probes: list[Exchange] = ctx.baseline.get("probes", [])
        if not probes:
            why = "; ".join(getattr(self, "_notes", [])) or "none planned"
            return Confirmation(False, f"no over-length prompt was sent ({why})")
        # Answered by the server's admission: a 404 or 401 never reached it (chaos/http_status.py).
        answered = [e for e in probes if e.status is not None and e.status not in NOT_ABOUT_THE_PROMPT_4XX]
        parts = []
        for ex in probes:
            threshold = getattr(self, "_probe_thresholds", {}).get(ex.rid)
            label = threshold.label if threshold else "?"
            counted = ex.prompt_tokens if ex.prompt_tokens is not None else read_refusal(ex.error_message).prompt_tokens
            got = f"{counted} tokens" if counted is not None else "tokens not reported"
            status = str(ex.status) if ex.status is not None else (ex.transport[0] if ex.transport else "no answer")
            parts.append(f"{label}: {status} ({got})")
        notes = getattr(self, "_notes", [])
        evidence = (
            f"{len(probes)} over-length prompt(s) sent, {len(answered)} answered by the server's "
            "admission: " + "; ".join(parts + notes)
        )
        return Confirmation(len(answered) == len(probes), evidence)
