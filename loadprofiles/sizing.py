"""Over-length sizes: which prompt lengths cross a target's limits, and how many filler
repetitions make a prompt that long on the target's own tokenizer.

A prompt that must be rejected is aimed just over a limit the workers report (`plan_thresholds`):
the KV pool, the context, and inside the band [max_req_input_len, context) that only SGLang's
scheduler check (`validate_input_length`) rejects, the incident's band (SGLang #30233). It is sized
with the target's own token counts (`Sizer`): two short prompts `CALIBRATION_K` filler repetitions
apart give the tokens per repetition, chat template included, and one short prompt with the sized
prompt's own markers gives its fixed part (`Sizer.through`).

The over-length faults and provocations (faults/) and `pdchaos canary` (chaos/canary/) size their
prompts here. The load's over-length user aims at and a margin over each limit without measuring
(`PromptFactory.thresholds`, loadprofiles/prompts.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

FILLER = " the"  # one token per repetition in common tokenizers (BPE, SentencePiece) and the embedded engine's
CALIBRATION_K = (8, 72)  # filler repetitions of the two calibration prompts
COMPLETION_TOKENS = 8  # a rejected prompt's completion budget, when its caller does not choose one


@dataclass(frozen=True)
class Threshold:
    """One limit an over-length prompt is aimed at, and the length aimed at."""

    name: str  # pool, context, band, manual; joined with "=" where sizes coincide ("pool=context")
    tokens: int  # a prompt of at least this many tokens is over the limit (band: its lower edge)
    target: int  # the prompt length aimed at
    label: str  # e.g. "pool 4096", "band [4090,8192)"
    upper: int | None = None  # band: stay below this (the context)
    context: int | None = None  # the context length the prompt and its completion must fit in

    def max_new_tokens(self, most: int = COMPLETION_TOKENS) -> int:
        """Room under the context, so the tokenizer's `input + max_new_tokens > context` check
        does not reject the prompt before the check under test."""
        if self.context is not None and self.target < self.context:
            return max(1, min(most, self.context - self.target))
        return most


def plan_thresholds(
    limits: Iterable[tuple[int | None, int | None, int | None]], manual: int | None = None
) -> list[Threshold]:
    """Just over every limit any worker reports, as (pool, context, max input) each
    (`WorkerLimits.as_tuple`): asymmetric pools give one size per worker. `manual` N adds N+1 and
    2N, for a target that states no limit. Smallest first; sizes that coincide are one."""
    every = list(limits)
    contexts = [c for _, c, _ in every if c is not None]
    smallest_context = min(contexts) if contexts else None
    sizes: list[Threshold] = []
    for pool, context, max_input in every:
        if pool is not None:
            sizes.append(Threshold("pool", pool, pool + 1, f"pool {pool}", context=smallest_context))
        if context is not None:
            sizes.append(Threshold("context", context, context + 1, f"context {context}", context=context))
        if context is not None and max_input is not None and max_input < context:
            middle = max_input + (context - max_input) // 2
            sizes.append(
                Threshold("band", max_input, middle, f"band [{max_input},{context})", upper=context, context=context)
            )
    if manual is not None:
        sizes.append(Threshold("manual", manual, manual + 1, f"--max-tokens-probe {manual}", context=smallest_context))
        sizes.append(
            Threshold("manual", manual, 2 * manual, f"2 x --max-tokens-probe {manual}", context=smallest_context)
        )
    merged: dict[int, Threshold] = {}
    for size in sizes:
        seen = merged.get(size.target)
        if seen is None:
            merged[size.target] = size
        elif size.name not in seen.name.split("="):
            merged[size.target] = replace(seen, name=f"{seen.name}={size.name}", label=f"{seen.label} = {size.label}")
    return sorted(merged.values(), key=lambda t: t.target)


@dataclass(frozen=True)
class Sizer:
    """A prompt's length as a function of its filler repetitions: `fixed + slope * repetitions` tokens."""

    fixed: float
    slope: float
    exact: bool  # measured on the target (else estimated: one token per repetition)

    @classmethod
    def estimated(cls, fixed: float) -> Sizer:
        """At least one token per repetition, for a target that counts no tokens."""
        return cls(float(fixed), 1.0, exact=False)

    @classmethod
    def measured(cls, counts: tuple[int | None, int | None]) -> Sizer | None:
        """From the target's counts of two prompts `CALIBRATION_K` repetitions apart; None when
        one was not counted or they do not grow."""
        low, high = counts
        if low is None or high is None or high <= low:
            return None
        k0, k1 = CALIBRATION_K
        slope = (high - low) / (k1 - k0)
        return cls(low - slope * k0, slope, exact=True)

    def through(self, tokens_at_k0: int) -> Sizer:
        """The same slope through one prompt's own count at `CALIBRATION_K[0]` repetitions: its
        markers move the fixed part by a few tokens."""
        return Sizer(tokens_at_k0 - self.slope * CALIBRATION_K[0], self.slope, exact=True)

    def repetitions(self, tokens: int) -> int:
        return max(1, math.ceil((tokens - self.fixed) / self.slope))

    def tokens(self, repetitions: int) -> int:
        return round(self.fixed + self.slope * repetitions)
