"""The timing tell: a response faster than the engine can prefill its prompt skipped the work.

The incident's tell (bug class K3, SGLang #30233): a prompt the prefill side rejected was
handed off as a one-token stub, so the client got a 200 about as fast as a one-token prefill,
though its prompt was thousands of tokens long. Load only slows a request down (queueing,
batching), so a response well below the *isolated* prefill time is a tell under any load.

Calibration. From the baseline (records with `phase == "baseline"`, sent one at a time with no
load, status 200) fit by least squares

    latency = a + b * uncached  [+ c * completion_tokens, for non-streamed records]

where `uncached = prompt_tokens - cached_tokens` and latency is the TTFT (`t_first_token -
t_send`) of a streamed record, or the whole time (`t_end - t_send`) of a non-streamed one; the
completion term absorbs the decode time such a total contains. The predicted TTFT floor of a
prompt is then `a + b * uncached`. The fit is refused (INCONCLUSIVE, with a note) unless there are
at least `min_points` baseline records, the largest uncached length is at least `min_spread`
times the smallest (and `min_span_tokens` more), and the fitted slope `b` is positive.

Judgement. For each 200 response (any phase) with a known uncached length whose prefill term is
long enough to dominate, i.e. `b * uncached >= max(a, 0)` (prefill at least half the predicted
TTFT) and `b * uncached >= noise_sigmas * sigma` (sigma: the fit's residual standard deviation),
the observed TTFT must not be below `settings.timing_tell_factor * (a + b * uncached)`. A record
with no first-token time is judged by `t_end - t_send`, an upper bound of its TTFT: a fast total
is a fast TTFT. Below the threshold is FAIL, with the numbers.

A 200 that ended early (an abort, a cut connection) with no first token has no TTFT and no
bound: not judged. A record without `prompt_tokens` borrows the baseline's count for the same probe.

A record without `cached_tokens` (an engine that does not report it) counts as cached the
longest prefix its prompt shares with any other prompt of the run, in proportion of characters
(`shared_prefix_chars`): a shared system prompt or an earlier conversation turn may be served from
a prefix cache, and judging such a prompt as uncached would call a legitimate hit a tell. A prompt
sent before, or not journaled (longer than the journal keeps), is not judged; the notes count them.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from chaos.journal import Outcome, RequestRecord
from chaos.oracles.base import PROBE_KIND, OracleContext
from chaos.verdict import Finding, OracleResult, Verdict

BASELINE_PHASE = "baseline"
MAX_FINDINGS = 100


@dataclass(frozen=True)
class PrefillModel:
    """latency = a + b * uncached (+ c * completion tokens for non-streamed totals)."""

    a: float
    b: float
    c: float | None
    sigma: float
    points: int
    span: tuple[int, int]

    def predict_ttft(self, uncached: int) -> float:
        return self.a + self.b * uncached

    def describe(self) -> str:
        decode = f", c={self.c * 1000:.3f} ms/completion token" if self.c is not None else ""
        return (
            f"TTFT = {self.a * 1000:.2f} ms + {self.b * 1e6:.2f} us/uncached token{decode} "
            f"(residual sigma {self.sigma * 1000:.2f} ms, {self.points} baseline points, "
            f"uncached {self.span[0]}..{self.span[1]} tokens)"
        )


def _first(labels: list[str]) -> str | None:
    return labels[0] if labels else None


def shared_prefix_chars(records: Sequence[RequestRecord]) -> dict[str, int]:
    """For each record with a journaled prompt, by id: how many of its leading characters a prefix
    cache may already hold from another request of the run. The longest prefix the prompt shares
    with any other distinct prompt (sorted, that is a neighbour's), or all of it for every send of
    the same prompt but one sent strictly before all the others."""
    sends: dict[str, list[RequestRecord]] = {}
    for record in records:
        if record.prompt:
            sends.setdefault(record.prompt, []).append(record)
    distinct = sorted(sends)
    longest: dict[str, int] = {}
    for i, text in enumerate(distinct):
        neighbours = distinct[max(0, i - 1) : i] + distinct[i + 1 : i + 2]
        longest[text] = max((_common_prefix_length(text, n) for n in neighbours), default=0)
    shared = {}
    for text, group in sends.items():
        first = _strictly_first(group)
        for record in group:
            shared[record.id] = longest[text] if record is first else len(text)
    return shared


def _common_prefix_length(a: str, b: str) -> int:
    """By bisection on slices: each comparison runs in C, for prompts of thousands of characters."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def _strictly_first(group: list[RequestRecord]) -> RequestRecord | None:
    """The record sent before every other of `group`, or None (a tie, or a send time unknown)."""
    if len(group) == 1:
        return group[0]
    if any(r.t_send is None for r in group):
        return None
    ordered = sorted(group, key=lambda r: r.t_send or 0.0)
    return ordered[0] if ordered[0].t_send != ordered[1].t_send else None


def observed_ttft(record: RequestRecord) -> tuple[float | None, bool]:
    """(seconds, exact): the TTFT when a first token was seen, else the total as an upper bound.

    The total bounds the TTFT only for a response that finished normally: an abort or a cut-off
    connection ends the request early, whether or not a first token was ever produced.
    """
    if record.t_send is None:
        return None, False
    if record.t_first_token is not None:
        return record.t_first_token - record.t_send, True
    finished = record.outcome is Outcome.OK and record.finish_reason != "abort"
    if record.t_end is not None and finished:
        return record.t_end - record.t_send, False
    return None, False


class TimingTellOracle:
    name = "timing"

    def __init__(
        self, *, min_points: int = 5, min_spread: float = 4.0, min_span_tokens: int = 256, noise_sigmas: float = 4.0
    ) -> None:
        self.min_points = min_points
        self.min_spread = min_spread
        self.min_span_tokens = min_span_tokens
        self.noise_sigmas = noise_sigmas

    def evaluate(self, ctx: OracleContext) -> OracleResult:
        records = ctx.requests
        baseline_tokens = {
            r.request_index: r.prompt_tokens
            for r in records
            if r.user_kind == PROBE_KIND and r.phase == BASELINE_PHASE and r.prompt_tokens is not None
        }
        untold = any(r.cached_tokens is None and r.status == 200 for r in records)
        shared = shared_prefix_chars(records) if untold else {}
        model, why = self.calibrate([r for r in records if r.phase == BASELINE_PHASE], baseline_tokens, shared)
        if model is None:
            return OracleResult(self.name, Verdict.INCONCLUSIVE, 0, [], [f"no calibration: {why}"])
        factor = ctx.settings.timing_tell_factor
        notes = [
            f"calibration: {model.describe()}",
            (
                f"threshold: a response is a tell when its TTFT < {factor:g} x predicted, judged only where "
                f"b*uncached >= max(a, 0) and >= {self.noise_sigmas:g} sigma, i.e. uncached >= "
                f"{self.min_judged_tokens(model)} tokens"
            ),
        ]
        findings: list[Finding] = []
        checked = 0
        skipped: Counter[str] = Counter()
        for record in records:
            if record.status != 200:
                continue
            uncached, why = self.uncached(record, baseline_tokens, shared)
            if uncached is None:
                skipped[why] += 1
                continue
            prefill = model.b * uncached
            if prefill < max(model.a, 0.0) or prefill < self.noise_sigmas * model.sigma:
                continue  # short prompt: overhead and noise dominate, a fast answer proves nothing
            seen, exact = observed_ttft(record)
            if seen is None:
                skipped["no first token and no normal end (aborted or cut off)"] += 1
                continue
            checked += 1
            predicted = model.predict_ttft(uncached)
            threshold = factor * predicted
            if seen >= threshold:
                continue
            if len(findings) >= MAX_FINDINGS:
                skipped["tells beyond the listing cap"] += 1
                continue
            faults = ctx.windows_at(record.t_send)
            measure = "TTFT" if exact else "whole response (an upper bound of its TTFT)"
            findings.append(
                Finding(
                    self.name,
                    Verdict.FAIL,
                    f"{record.id} answered 200 in {seen * 1000:.1f} ms ({measure}); prefilling its {uncached} uncached "
                    f"token(s) takes about {predicted * 1000:.1f} ms (threshold {threshold * 1000:.1f} ms): work was skipped",
                    request_id=record.id,
                    window=_first(faults),
                    evidence={
                        "observed_s": round(seen, 6),
                        "exact_ttft": exact,
                        "predicted_ttft_s": round(predicted, 6),
                        "threshold_s": round(threshold, 6),
                        "uncached_tokens": uncached,
                        "prompt_tokens": record.prompt_tokens,
                        "cached_tokens": record.cached_tokens,
                        "user_kind": record.user_kind,
                        "phase": record.phase,
                        "finish_reason": record.finish_reason,
                        "completion_tokens": record.completion_tokens,
                        "faults_active": faults,
                    },
                )
            )
        for why, count in sorted(skipped.items()):
            notes.append(f"{count} 200 response(s) not judged: {why}")
        return OracleResult.from_findings(self.name, checked, findings, notes)

    def min_judged_tokens(self, model: PrefillModel) -> int:
        need = max(model.a, 0.0, self.noise_sigmas * model.sigma)
        return max(1, math.ceil(need / model.b))

    def uncached(
        self, record: RequestRecord, baseline_tokens: dict[int, int], shared: dict[str, int]
    ) -> tuple[int | None, str]:
        prompt = record.prompt_tokens
        if prompt is None and record.user_kind == PROBE_KIND:
            prompt = baseline_tokens.get(record.request_index)
        if prompt is None:
            return None, "no prompt_tokens"
        if record.cached_tokens is not None:
            return max(0, prompt - record.cached_tokens), ""
        if not record.prompt:
            return None, "no cached_tokens and the prompt is not journaled"
        cacheable = shared.get(record.id, len(record.prompt))
        if cacheable >= len(record.prompt):
            return None, "no cached_tokens and the same prompt was sent before (may be a cache hit)"
        return prompt - math.ceil(prompt * cacheable / len(record.prompt)), ""

    def calibrate(
        self, baseline: list[RequestRecord], baseline_tokens: dict[int, int], shared: dict[str, int]
    ) -> tuple[PrefillModel | None, str]:
        rows: list[tuple[float, float, float]] = []  # (uncached, completion term, latency)
        for record in baseline:
            if record.status != 200:
                continue
            uncached, _ = self.uncached(record, baseline_tokens, shared)
            seen, exact = observed_ttft(record)
            if uncached is None or seen is None:
                continue
            if exact:
                rows.append((uncached, 0.0, seen))
            elif record.completion_tokens is not None:
                rows.append((uncached, float(record.completion_tokens), seen))
        if len(rows) < self.min_points:
            return None, f"{len(rows)} usable baseline record(s), fewer than {self.min_points}"
        data = np.array(rows, dtype=float)
        lengths = data[:, 0]
        low, high = int(lengths.min()), int(lengths.max())
        if high < self.min_spread * max(low, 1) or high - low < self.min_span_tokens:
            return None, (
                f"baseline prompt lengths {low}..{high} uncached tokens do not spread enough "
                f"(need max >= {self.min_spread:g} x min and a span of {self.min_span_tokens} tokens)"
            )
        has_totals = bool(np.any(data[:, 1] > 0))
        design = np.column_stack([np.ones(len(data)), lengths] + ([data[:, 1]] if has_totals else []))
        coef, _, rank, _ = np.linalg.lstsq(design, data[:, 2], rcond=None)
        if rank < design.shape[1] and has_totals:
            # Output lengths do not vary apart from the other columns: fold decode time into `a`.
            # Still sound: a judged prompt has b*uncached >= a, so its real TTFT (>= b*uncached)
            # stays above factor*(a + b*uncached) for any factor <= 0.5.
            has_totals = False
            design = design[:, :2]
            coef, _, rank, _ = np.linalg.lstsq(design, data[:, 2], rcond=None)
        if rank < design.shape[1]:
            return None, "baseline prompt lengths are all equal: cannot fit a prefill cost per token"
        a, b = float(coef[0]), float(coef[1])
        c = float(coef[2]) if has_totals else None
        if not b > 0:
            return None, f"fitted prefill cost per token is not positive (b={b:.3g} s/token)"
        residuals = data[:, 2] - design @ coef
        dof = max(1, len(data) - design.shape[1])
        sigma = float(math.sqrt(float(residuals @ residuals) / dof))
        return PrefillModel(a=a, b=b, c=c, sigma=sigma, points=len(data), span=(low, high)), ""
