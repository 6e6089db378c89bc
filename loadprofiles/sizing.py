"""Over-length sizes: which prompt lengths cross a target's limits, and how many filler
repetitions make a prompt that long on the target's own tokenizer.

One `Threshold` type for every over-length prompt of the suite, planned here two ways from the
same limits, (pool, context, max input) each (`WorkerLimits.as_tuple`):

- `plan_thresholds`: just over every limit any worker reports, for the over-length faults and
  provocations (faults/) and `pdchaos canary` (chaos/canary/): the KV pool, the context, and
  inside the band [max_req_input_len, context) that only SGLang's scheduler check
  (`validate_input_length`) rejects, the incident's band (SGLang #30233).
- `plan_load_thresholds`: at and a margin over the context and the pool, the same band, and an
  assumed limit when the target states none, for the load's over-length user
  (loadprofiles/users.py, whose prompts `PromptFactory.over_length` builds to the estimated token).

The band's completion budget is one rule (`Threshold.max_new_tokens`). The faults and the canary
size their prompts with the target's own token counts (`Sizer`): two short prompts
`CALIBRATION_K` filler repetitions apart give the tokens per repetition, chat template included,
and one short prompt with the sized prompt's own markers gives its fixed part (`Sizer.through`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

FILLER = " the"  # one token per repetition in common tokenizers (BPE, SentencePiece) and the embedded engine's
CALIBRATION_K = (8, 72)  # filler repetitions of the two calibration prompts
COMPLETION_TOKENS = 8  # a rejected prompt's completion budget, when its caller does not choose one
OVER_MARGIN = (16, 50)  # the load's "over" size: a limit plus max(16, limit // 50) tokens
UNKNOWN_OVER_LENGTH = 131072  # the load's probe size when the target reports no limit at all


@dataclass(frozen=True)
class Threshold:
    """One limit an over-length prompt is aimed at, and the length aimed at."""

    # plan_thresholds: pool, context, band, manual; joined with "=" where sizes coincide ("pool=context").
    # plan_load_thresholds: at_context_length, over_max_total_num_tokens, band_max_req_input_len, assumed_limit, ...
    name: str
    tokens: int  # the limit: a prompt of at least this many tokens is over it (band: its lower edge)
    target: int  # the prompt length aimed at
    label: str  # e.g. "pool 4096", "band [4090,8192)"
    upper: int | None = None  # band: stay below this (the context)
    context: int | None = None  # the context length the prompt and its completion must fit in
    known: bool = True  # False: the target reported no limit, this one is assumed

    @property
    def in_band(self) -> bool:
        """Aimed inside [max_req_input_len, context): a few tokens wide, so the completion budget
        (`max_new_tokens`) and the exact prompt matter."""
        return self.upper is not None

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
            sizes.append(band(max_input, context, "band"))
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


def plan_load_thresholds(limits: tuple[int | None, int | None, int | None]) -> list[Threshold]:
    """At and a margin over the context, then the pool, of (pool, context, max input), then inside
    the band; one assumed limit (`known=False`) when none is stated. Sizes are not merged: the
    load's user takes them in turn and journals each name."""
    pool, context, max_input = limits
    sizes: list[Threshold] = []
    for name, limit in (("context_length", context), ("max_total_num_tokens", pool)):
        if limit is None:
            continue
        over = limit + max(OVER_MARGIN[0], limit // OVER_MARGIN[1])
        sizes.append(Threshold(f"at_{name}", limit, limit, f"at {name} {limit}", context=context))
        sizes.append(Threshold(f"over_{name}", limit, over, f"over {name} {limit} (+{over - limit})", context=context))
    if context is not None and max_input is not None and max_input < context:
        sizes.append(band(max_input, context, "band_max_req_input_len"))
    if not sizes:
        limit = UNKNOWN_OVER_LENGTH
        sizes.append(Threshold("assumed_limit", limit, limit, f"assumed limit {limit}", known=False))
    return sizes


def band(max_input: int, context: int, name: str) -> Threshold:
    """The middle of [max_input, context): over the scheduler's limit, under the tokenizer's."""
    middle = max_input + (context - max_input) // 2
    return Threshold(name, max_input, middle, f"band [{max_input},{context})", upper=context, context=context)


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
