"""Prompts with canary markers, for every load kind; deterministic from the run's seed.

Every prompt carries its own request's markers: `codec.marker(i, 0)` first and `codec.marker(i, 1)`
last. Prompts that share a prefix (a system prompt common to the whole run, a conversation's
history) carry them at the start and end of their own, unique part instead: a marker in the shared
part would make it unique and defeat the prefix cache these prompts exist to exercise. History is
scrubbed of earlier requests' markers, so a prompt never carries a marker it does not own and a
reply that repeats its prompt is never mistaken for a leak.

Sizes are in *estimated* tokens: the filler is lower-case three-letter words after a space
(" the", " and"), one token each for a BPE tokenizer and exactly one for the embedded engine's toy
tokenizer; other text counts ceil(chars / 4) per segment. The estimate is exact on the embedded
engine; on a real one an over-length prompt's reply reports its true `prompt_tokens`, which is
how a miss is told apart from a server that accepted an over-length prompt.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace

from chaos.markers import MarkerCodec
from chaos.targets.discovery import TargetFacts
from loadprofiles.sizing import Threshold, plan_load_thresholds

CHARS_PER_TOKEN = 4
# Three-letter words: " xyz" is one token. None of them spells the embedded model's "repeat".
_WORDS = (
    "the and for are but not you all any can had her was one our out day get has him his how man "
    "new now old see two way who boy did its let put say she too use act add age ago air art ask "
    "bad bag bed big box bus buy car cat cup cut dog dry eat egg end eye far fat few fit fly fun "
    "gas god gun guy hat hit hot ice job key kid law lay leg lie lot low map mix net oil own pay "
    "pen pet pot red row run sea set sit six sky son sun tax tea ten tie top toy try war wet win"
).split()

REPEAT_INSTRUCTIONS = (
    "Please repeat this note exactly.",
    "Repeat the text below word for word.",
    "Copy this message back verbatim, please repeat it.",
)
OTHER_INSTRUCTIONS = (
    "Summarise this note for the weekly review.",
    "Write a short answer about the text below.",
    "List the main points of this message.",
)
SYSTEM_INTRO = "You are the support assistant of the infrastructure team. Background notes follow."

SHORT_WORDS = (16, 64)
MEDIUM_WORDS = (150, 400)
LONG_FRACTION = (0.70, 0.95)  # of the usable context, for long-context prompts
LONG_HEADROOM = 64  # tokens kept free under the limit for a chat template and estimate error
SHARED_PREFIX_TOKENS = 1024  # capped at a quarter of the context length when that is known
CONVERSATION_TURNS = 4  # a conversation restarts after this many turns
CONVERSATION_BUDGET = 0.5  # ... or when it would pass this fraction of the context length
FILLER_BLOCK_WORDS = 65536  # filler is cut from one pre-drawn block: a 1M-token prompt costs a copy


@dataclass(frozen=True)
class Message:
    role: str
    content: str


@dataclass(frozen=True)
class Prompt:
    """One prompt: chat messages (rendered as plain text for /generate and /v1/completions)."""

    kind: str  # canary_short, canary_medium, shared_prefix, conversation, long_context, over_length
    messages: tuple[Message, ...]
    markers: tuple[str, ...]  # head and tail (none for a sizing request)
    repeat: bool
    est_tokens: int
    max_tokens: int | None = None  # overrides the config's max_tokens
    threshold: Threshold | None = None
    chat_ok: bool = True  # False: only text routes (a chat template would move the size)

    @classmethod
    def user(cls, kind: str, text: str, markers: tuple[str, ...] = (), *, repeat: bool = False) -> Prompt:
        """One user message sent as it is (a probe's, a fault's, the canary's)."""
        return cls(
            kind=kind,
            messages=(Message("user", text),),
            markers=markers,
            repeat=repeat,
            est_tokens=estimate_tokens(text),
        )

    def as_text(self) -> str:
        """One user message is sent bare, so the head marker is the first thing in the prompt."""
        if len(self.messages) == 1 and self.messages[0].role == "user":
            return self.messages[0].content
        return render_messages(self.messages)


def render_messages(messages: tuple[Message, ...] | list[Message]) -> str:
    """A plain `role: content` template (the embedded engine's), so text and chat routes share
    prefix-cache pages for the same conversation."""
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def draw_words(rng: random.Random, words: int) -> str:
    """`words` tokens of filler, each " xyz"."""
    return "".join(" " + rng.choice(_WORDS) for _ in range(max(0, words)))


def scrub_markers(codec: MarkerCodec, text: str) -> str:
    """`text` without any marker or fragment of this run (history must not carry old markers)."""
    hits = codec.scan(text)
    if not hits:
        return text
    out: list[str] = []
    pos = 0
    for hit in hits:
        if hit.offset >= pos:
            out.append(text[pos : hit.offset])
            pos = hit.end
    out.append(text[pos:])
    return "".join(out)


class PromptFactory:
    """Builds every kind of prompt for one run; the same seed gives the same prompts."""

    def __init__(self, codec: MarkerCodec, seed: int, facts: TargetFacts) -> None:
        self.codec = codec
        self.seed = seed
        self.facts = facts
        # Drawing a word at a time costs ~0.4 us; a long-context prompt is 100k+ words and would
        # stall every user of this gevent process. A slice of a pre-drawn block is one copy.
        self._block = draw_words(random.Random(f"{seed}:filler-block"), FILLER_BLOCK_WORDS)
        self.shared_prefix = self._shared_prefix()

    def filler(self, rng: random.Random, words: int) -> str:
        """`words` filler tokens starting at a random word of the block (wrapping around)."""
        if words <= 0:
            return ""
        width = len(self._block) // FILLER_BLOCK_WORDS  # chars per word, the same for all
        start = rng.randrange(FILLER_BLOCK_WORDS) * width
        need = words * width
        text = self._block[start : start + need]
        while len(text) < need:
            text += self._block[: need - len(text)]
        return text

    def rng_for(self, request_index: int, purpose: str = "") -> random.Random:
        # A string seed hashes with SHA-512: the same in every process and Python run.
        return random.Random(f"{self.seed}:{request_index}:{purpose}")

    def markers(self, request_index: int) -> tuple[str, str]:
        return self.codec.marker(request_index, 0), self.codec.marker(request_index, 1)

    def _body(self, request_index: int, words: int, instruction: str) -> tuple[str, int, tuple[str, str]]:
        """`HEAD instruction filler TAIL`, its estimated size and its markers (HEAD, TAIL)."""
        head, tail = markers = self.markers(request_index)
        rng = self.rng_for(request_index, "filler")
        fixed = [head, f" {instruction}" if instruction else "", f" {tail}"]
        text = f"{fixed[0]}{fixed[1]}{self.filler(rng, words)}{fixed[2]}"
        return text, words + sum(estimate_tokens(part) for part in fixed), markers

    def _instruction(self, rng: random.Random, repeat: bool) -> str:
        return rng.choice(REPEAT_INSTRUCTIONS if repeat else OTHER_INSTRUCTIONS)

    # ------------------------------------------------------------------------ canary chat ----

    def canary(self, request_index: int, *, medium: bool, repeat: bool) -> Prompt:
        rng = self.rng_for(request_index, "canary")
        lo, hi = MEDIUM_WORDS if medium else SHORT_WORDS
        text, est, markers = self._body(request_index, rng.randint(lo, hi), self._instruction(rng, repeat))
        return Prompt(
            kind="canary_medium" if medium else "canary_short",
            messages=(Message("user", text),),
            markers=markers,
            repeat=repeat,
            est_tokens=est,
        )

    # --------------------------------------------------------------------- prefix sharing ----

    def _shared_prefix(self) -> str:
        size = SHARED_PREFIX_TOKENS
        if self.facts.context_length:
            size = min(size, self.facts.context_length // 4)
        rng = random.Random(f"{self.seed}:shared-prefix")
        return SYSTEM_INTRO + self.filler(rng, size - estimate_tokens(SYSTEM_INTRO))

    def shared_prefix_prompt(self, request_index: int, *, repeat: bool) -> Prompt:
        """The run's common system prompt, then a short unique question with the markers."""
        rng = self.rng_for(request_index, "shared")
        text, est, markers = self._body(request_index, rng.randint(*SHORT_WORDS), self._instruction(rng, repeat))
        messages = (Message("system", self.shared_prefix), Message("user", text))
        return Prompt(
            kind="shared_prefix",
            messages=messages,
            markers=markers,
            repeat=repeat,
            est_tokens=est + estimate_tokens(render_messages(messages[:1])),
        )

    def new_conversation(self) -> Conversation:
        return Conversation(self)

    # ----------------------------------------------------------------------- long context ----

    def long_context_limit(self, max_tokens: int) -> int | None:
        """The largest prompt the target should accept with room for the reply; None: unknown."""
        facts = self.facts
        if facts.context_length is None:
            return None
        limits = [facts.context_length - max_tokens]
        if facts.max_req_input_len is not None:
            limits.append(facts.max_req_input_len)
        if facts.max_total_num_tokens is not None:
            limits.append(facts.max_total_num_tokens - max_tokens)
        return min(limits) - LONG_HEADROOM

    def long_context(self, request_index: int, *, max_tokens: int, repeat: bool) -> Prompt | None:
        """70-95 % of the usable context; None when the context length is unknown (skip it)."""
        limit = self.long_context_limit(max_tokens)
        if limit is None or limit < 256:
            return None
        rng = self.rng_for(request_index, "long")
        target = int(limit * rng.uniform(*LONG_FRACTION))
        instruction = self._instruction(rng, repeat)
        fixed = estimate_tokens(instruction) + 2 * estimate_tokens(" " + self.markers(request_index)[0])
        text, est, markers = self._body(request_index, target - fixed, instruction)
        return Prompt(
            kind="long_context",
            messages=(Message("user", text),),
            markers=markers,
            repeat=repeat,
            est_tokens=est,
        )

    # ------------------------------------------------------------------------ over-length ----

    def thresholds(self) -> list[Threshold]:
        """At and a margin over every limit the target reports, and inside SGLang's scheduler band
        (`plan_load_thresholds`, loadprofiles/sizing.py)."""
        return plan_load_thresholds(self.facts.as_tuple())

    def over_length(self, request_index: int, threshold: Threshold) -> Prompt:
        head, _ = self.markers(request_index)
        fixed = 2 * estimate_tokens(" " + head)
        text, est, markers = self._body(request_index, threshold.target - fixed, "")
        return Prompt(
            kind="over_length",
            messages=(Message("user", text),),
            markers=markers,
            repeat=False,
            est_tokens=est,
            # The band needs input + max_tokens <= context_length; elsewhere the config's max_tokens.
            max_tokens=threshold.max_new_tokens() if threshold.in_band else None,
            threshold=threshold,
            # The band is a few tokens wide: a chat template's tokens would push it out.
            chat_ok=not threshold.in_band,
        )


@dataclass
class Conversation:
    """A multi-turn chat that grows: the shared system prompt, then turns of user and assistant.

    Each turn is one request with its own markers in its user message; earlier turns are kept
    without their markers (see the module docstring), so successive turns share a growing prefix.
    """

    factory: PromptFactory
    history: list[Message] = field(default_factory=list)
    turns: int = 0

    def next_turn(self, request_index: int, *, repeat: bool) -> Prompt:
        factory = self.factory
        budget = (factory.facts.context_length or 4 * SHARED_PREFIX_TOKENS) * CONVERSATION_BUDGET
        if self.turns >= CONVERSATION_TURNS or estimate_tokens(render_messages(self.history)) > budget:
            self.history, self.turns = [], 0
        if not self.history:
            self.history = [Message("system", factory.shared_prefix)]
        prompt = factory.shared_prefix_prompt(request_index, repeat=repeat)
        user = prompt.messages[-1]
        messages = (*self.history, user)
        self.history.append(Message("user", scrub_markers(factory.codec, user.content)))
        self.turns += 1
        return replace(
            prompt,
            kind="conversation",
            messages=messages,
            est_tokens=estimate_tokens(render_messages(messages)),
        )

    def add_reply(self, text: str) -> None:
        """The assistant's answer becomes history (scrubbed: a leaked marker must not spread)."""
        self.history.append(Message("assistant", scrub_markers(self.factory.codec, text)))
