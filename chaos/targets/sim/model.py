"""The toy model: deterministic, and it reads the KV pages it attends.

Two behaviours, both driven only by attended KV content:
- **repeat**: when the attended prompt asks to repeat, the model copies the attended tokens in
  order, from the first position, then stops. A stale page therefore comes out verbatim, with
  whatever markers its last owner wrote into it.
- **generate**: otherwise the next token is a hash of every attended slot's context hash,
  weighted by position, mixed with the step. Any stale slot changes the digest, so the output
  differs from the isolated reference.

The context hash of position p is `mix(ctx[p-1], token[p], p)`: like a real K/V vector it
depends on the whole prefix, so a prefix-cache hit reproduces exactly what a cold prefill
computes, and anything else does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import numpy as np

from chaos.targets.sim.kvpool import KVSlots
from chaos.targets.sim.tokenizer import EOS_ID, detokenize, tokenize

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15

REPEAT_TRIGGER = "repeat"
# Short pieces so generated text looks like words and tokenizes back to the same ids.
_WORDS = (
    " the",
    " of",
    " and",
    " to",
    " in",
    " is",
    " it",
    " that",
    " was",
    " for",
    " on",
    " are",
    " with",
    " as",
    " be",
    " at",
    " one",
    " have",
    " this",
    " from",
    " by",
    " hot",
    " word",
    " but",
    " what",
    " some",
    " we",
    " can",
    " out",
    " other",
    " were",
    " all",
    " there",
    " when",
    " up",
    " use",
    " your",
    " how",
    " said",
    " an",
    " each",
    " she",
    " which",
    " do",
    " their",
    " time",
    " if",
    " will",
    " way",
    " about",
    " many",
    " then",
    " them",
    " write",
    " would",
    " like",
    " so",
    " these",
    " her",
    " long",
    " make",
    " thing",
    " see",
    " him",
    " two",
    " has",
    " look",
    " more",
    " day",
    " could",
    " go",
    " come",
    " did",
    " my",
    " sound",
    " no",
    " most",
    " who",
    " over",
    " know",
    " water",
    " than",
    " call",
    " first",
    " may",
    " down",
    " side",
    " been",
    " now",
    " find",
    " any",
    " new",
    " work",
    " part",
    " take",
    " get",
    " place",
    " made",
    " live",
    " where",
    " after",
    " back",
    " little",
    " only",
    " round",
    " man",
    " year",
    " came",
    " show",
    " every",
    " good",
    " me",
    " give",
    " our",
    " under",
    " name",
    " very",
    " through",
    " just",
    " form",
    " much",
    " great",
    " think",
    " say",
    " help",
    " low",
    " line",
    " before",
    " turn",
    " cause",
    " same",
    " mean",
    " move",
    " right",
    " boy",
    " old",
    " too",
    " does",
    " tell",
    " set",
    " three",
    ".",
    ",",
)
VOCAB: tuple[int, ...] = tuple(dict.fromkeys(tokenize(w)[0] for w in _WORDS if len(tokenize(w)) == 1))
MIN_TOKENS_BEFORE_EOS = 4
EOS_ODDS = 64  # in generate mode, EOS comes with probability 1/EOS_ODDS per step after the minimum


def _mix64(value: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread 64-bit hash."""
    value = (value + _GOLDEN) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


def context_hash(previous_ctx: int, token: int, position: int) -> int:
    """The context hash at `position`, from the one before it."""
    return _mix64(previous_ctx ^ _mix64((token << 20) ^ position))


def context_hashes(tokens: list[int], start_position: int, previous_ctx: int) -> np.ndarray:
    """The context hash of each token, continuing from the hash at `start_position - 1`."""
    out = np.empty(len(tokens), dtype=np.uint64)
    ctx = previous_ctx
    for i, token in enumerate(tokens):
        ctx = context_hash(ctx, token, start_position + i)
        out[i] = ctx
    return out


def adapter_seed(lora_path: str | None) -> int:
    """The context hash before position 0: an adapter changes every position's KV."""
    if not lora_path:
        return 0
    value = 0
    for byte in lora_path.encode():
        value = _mix64(value ^ byte)
    return value


def kv_for(tokens: list[int], start_position: int, previous_ctx: int) -> KVSlots:
    return KVSlots(
        tokens=np.asarray(tokens, dtype=np.int64),
        positions=np.arange(start_position, start_position + len(tokens), dtype=np.int64),
        ctx=context_hashes(tokens, start_position, previous_ctx),
    )


class Mode(Enum):
    REPEAT = "repeat"
    GENERATE = "generate"


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    seed: int = 0  # mixed into the digest when temperature > 0
    ignore_eos: bool = False


def choose_mode(prompt: KVSlots) -> Mode:
    """Read the instruction from the attended prompt KV, not from the request text."""
    text = detokenize(prompt.tokens.tolist()).lower()
    return Mode.REPEAT if REPEAT_TRIGGER in text else Mode.GENERATE


def _position_weights(n: int) -> np.ndarray:
    weights: np.ndarray = (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(_GOLDEN)) | np.uint64(1)
    return weights


_WEIGHTS = _position_weights(4096)  # grown on demand; computed once instead of on every token


def _digest(attended: KVSlots) -> int:
    global _WEIGHTS
    n = len(attended.ctx)
    if n > len(_WEIGHTS):
        _WEIGHTS = _position_weights(max(n, 2 * len(_WEIGHTS)))
    # The weighted sum modulo 2**64. A uint64 dot product wraps exactly as the elementwise
    # product and sum did (integer dot products never go through floating point), in one call.
    return int(np.dot(attended.ctx, _WEIGHTS[:n]))


def next_token(attended: KVSlots, prompt_len: int, step: int, mode: Mode, sampling: Sampling) -> int:
    """Token number `step` (0 = the first token) after a prompt of `prompt_len` tokens.

    `attended` holds every slot the request attends: the prompt and the tokens generated so far.
    """
    if mode is Mode.REPEAT:
        return int(attended.tokens[step]) if step < prompt_len else EOS_ID
    state = _digest(attended) ^ ((step + 1) * _GOLDEN & _MASK)
    if sampling.temperature > 0:
        state ^= _mix64(sampling.seed & _MASK)
    value = _mix64(state)
    if not sampling.ignore_eos and step >= MIN_TOKENS_BEFORE_EOS and value % EOS_ODDS == 0:
        return EOS_ID
    return VOCAB[(value >> 8) % len(VOCAB)]
