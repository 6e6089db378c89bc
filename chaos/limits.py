"""What a worker admits: the limits prompts are sized against and over-length prompts aimed at.

One type for every reader of them: the dialects (what a worker reports, chaos/targets/dialect.py),
the load users (the target's limits in their config, loadprofiles/config.py), the faults and their
provocations, and `pdchaos canary`. The names are SGLang's, as its `/server_info` states them; an
engine that states fewer leaves the others None.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLimits:
    """A worker's limits as it reports them; None where it says nothing."""

    max_total_num_tokens: int | None = None  # the KV pool, in tokens
    context_length: int | None = None
    max_req_input_len: int | None = None  # the longest prompt SGLang's scheduler admits (`validate_input_length`)

    @property
    def pool_tokens(self) -> int | None:
        """The KV pool in tokens, by the engine-neutral name the faults' evidence uses."""
        return self.max_total_num_tokens

    @property
    def states_a_size(self) -> bool:
        """Whether a prompt can be sized against it: a context length or a pool is known."""
        return self.context_length is not None or self.max_total_num_tokens is not None

    def as_tuple(self) -> tuple[int | None, int | None, int | None]:
        """(pool, context, max input)."""
        return self.max_total_num_tokens, self.context_length, self.max_req_input_len


def _least(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def tightest(limits: Iterable[WorkerLimits]) -> WorkerLimits:
    """Each limit at its smallest over `limits` (the first size some worker must reject)."""
    every = list(limits)
    return WorkerLimits(
        max_total_num_tokens=_least(w.max_total_num_tokens for w in every),
        context_length=_least(w.context_length for w in every),
        max_req_input_len=_least(w.max_req_input_len for w in every),
    )
