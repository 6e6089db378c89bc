"""Build the *telltale* tiny Llama: weights constructed, not trained, so that greedy output names
every canary word in the KV the model attends. Built here, deterministically (no hub is reachable).

Run with any python that has torch, transformers and tokenizers (the vLLM venv has them):

    .venv-vllm/bin/python chaos/targets/models/telltale.py OUT_DIR          # build
    .venv-vllm/bin/python chaos/targets/models/telltale.py --prove OUT_DIR  # measure it (JSON)

Why: the tiny model of `chaos/targets/vllm/model.py` has random weights. A request that attends a
page another request wrote produces different gibberish, never the other request's marker, so on
a real engine the canary oracle cannot see a KV leak. This model's reply is a function of the
*set of marker words in the attended KV*, so a leaked page names its owner.

What the reply is
-----------------
A *marker word* w has two single-token forms in the tokenizer: its *prompt form*, the bare token
"w" (what "#w" tokenizes to: "#" or " #", then "w"), and its *reply form*, the spaced token " w".
The words are every lower-case word of 3+ letters that has both forms in the vocabulary, minus
any that is, or is a token of, one of STOPWORDS (the words of the suite's own prompt texts and
chat roles), sorted; at most MAX_WORDS. The list, with its token ids, is written to
`telltale.json` beside the weights; `expected_reply` computes a reply from attended token ids.

Greedy decoding emits the reply forms of the marker words found in the attended positions, most
frequent first (ties: lowest token id first), one emission per SUPPRESS occurrences, then EOS.
Everything that is not a marker word (filler, chat template, UUL canary markers) is invisible.
A clean request whose prompt carries "#w" replies " w" and stops; a request that attended a
page holding "#v" replies " w v" (or " v w" when the leaked positions hold more "#v" than its own
prompt holds "#w"). A prompt with no marker word gets an empty reply (EOS at once).

The construction (one layer; hidden 512 = 16 heads x 32, 8 KV heads; bf16)
---------------------------------------------------------------------------
The residual stream is split into named coordinates, so nothing ever adds into a coordinate
something else is using and bf16 rounding never mixes two quantities:

    A[0..M)    the current token's "value code": +1 on A[w] for the prompt form of word w,
               -SUPPRESS on A[w] for the reply form of w, 0 for every other token
    B[0..M)    where attention writes the mean of the attended value codes (B = A + MAX_WORDS)
    Y1, Y2     ballast, so that every token embedding has exactly the same norm (below)
    Z          a constant 1 in every token embedding: the source of EOS's logit

* Embedding. prompt form of w: A[w] = 1, Y2 = SUPPRESS, Z = 1. reply form of w: A[w] =
  -SUPPRESS, Y1 = 1, Z = 1. any other token: Y1 = 1, Y2 = SUPPRESS, Z = 1. Every row holds the
  same absolute values {1, SUPPRESS, 1}, so every row has the same norm, exactly, in bf16. That
  makes `input_layernorm` (RMSNorm) the same constant scale c = 1/rms for every token: it cannot
  favour or disfavour any token, and the ratio between a prompt form's +1 and a reply form's
  -SUPPRESS survives it exactly (SUPPRESS is a power of two).
* Attention. q_proj = 0 and k_proj = 0: every score is exactly 0, so the softmax is exactly
  uniform over every attended position (causal mask included) and RoPE, which rotates q and k,
  has nothing to rotate: the model is blind to positions, so KV moved from any position of any
  request counts the same. v_proj copies A[w] into value dimension w (KV head w // 32), so a KV
  page carries the identity of the marker words its tokens were. The attention output for word w
  is c * (n_w - SUPPRESS * r_w) / N: n_w prompt-form and r_w reply-form occurrences of w among the
  N attended positions. o_proj copies it to B[w] (from the first query head of each KV group).
* MLP off. gate/up/down = 0, so the MLP adds exactly 0 and `post_attention_layernorm` (which only
  feeds the MLP) has no effect.
* Head. The final RMSNorm divides the whole residual by one positive number, which rescales every
  logit alike and changes no argmax. lm_head's row for the reply form of w reads B[w] with weight
  LOGIT_SCALE; EOS's row reads Z; every other row is 0. So, at every step:
      logit(" w") = LOGIT_SCALE * c * (n_w - SUPPRESS * r_w) / (N * rms_final)
      logit(EOS)  = EOS_WEIGHT / rms_final,   logit(anything else) = 0
  The current token's own embedding sits in A, Y1, Y2 and Z, which no head row reads except Z, so
  the token being fed does not dominate the output (it only enters the attended mean like any other).
* Scale. rms_final is 11.31 for every token (B is tiny next to the ballast), so logit(" w") is
  2**24 * (n_w - 256 r_w) / (128 N): one occurrence among MAX_POSITIONS positions gives 32, EOS
  gives 16, so one marker occurrence wins over EOS up to 2 * MAX_POSITIONS attended positions,
  and EOS wins over the 0 of every non-marker token by 16 nats (temperature-1 sampling picks a
  non-marker token about once in 4000 steps; greedy never does).
* Suppression. Emitting " w" puts a -SUPPRESS value code for w into the KV, so w's count drops by
  SUPPRESS and the next most frequent marker word surfaces; with none left, EOS. That turns one
  argmax into a list of every marker word attended, not only the most frequent one.

Precision: every weight is 0, 1, a power of two or EOS_WEIGHT; A, B, Y and Z never share a
coordinate. The one rounding that matters is of the attention output (bf16, 2**-9 relative), so
counts are ordered exactly up to about 256; presence (count >= 1 versus EOS) has a factor 2 margin.

Prompt format (what a caller does): put "#w" (w = `word_for(request_index)`) in the prompt at
least once, better once every `page` tokens (`telltale_text` does it), so that every KV page of
the request carries its word; keep its count <= SUPPRESS; and keep the reply forms (" w" with a
space before, for any marker word w) out of prompts, since each occurrence there suppresses w.
For the same reason a page holding a request's reply token is no evidence of that request: pad
prompts to a multiple of the page size, so that the reply starts a fresh page.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import inspect
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, cast

HIDDEN = 512
HEAD_DIM = 32  # vLLM's CPU attention supports nothing smaller
HEADS = HIDDEN // HEAD_DIM
KV_HEADS = 8  # 256 value dimensions >= MAX_WORDS; 1 KiB of KV per token, as the random tiny model
INTERMEDIATE = 64  # the MLP is all zeros; its size only has to be legal
MAX_POSITIONS = 4096
MAX_WORDS = 254  # A and B take 2 * 254 coordinates, Y1, Y2 and Z three more: 511 <= HIDDEN
SUPPRESS = 256  # a reply form's value code, in prompt-form occurrences
LOGIT_SCALE = 2.0**24  # one occurrence among MAX_POSITIONS positions -> logit 32
MIN_LETTERS = 3
MARKER_PREFIX = "#"  # "#w" puts the bare token "w" in the prompt
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2  # the specials of the shared tokenizer builder, in its order

_B0 = MAX_WORDS
_Y1, _Y2, _Z = 2 * MAX_WORDS, 2 * MAX_WORDS + 1, 2 * MAX_WORDS + 2
# rms of every embedding row: sqrt((1 + SUPPRESS**2 + 1) / HIDDEN); EOS = half of one occurrence at
# MAX_POSITIONS, i.e. 16 after the final norm.
_RMS = ((2 + SUPPRESS**2) / HIDDEN) ** 0.5
EOS_WEIGHT = 16.0 * _RMS

# The words of the suite's own prompt texts and chat roles (the filler vocabulary, the instruction,
# system, probe and tenant-probe sentences), as they are written. No marker word's prompt or reply
# form may come out of the tokenizer for any of them, with or without a space before it: a word
# piece counts like the word ("infrastructure" is "in f ra struct ure", so "struct" is no marker
# word). tests/test_telltale_model.py checks this covers the current prompt texts.
STOPWORDS = frozenset(
    # chat roles and template words
    "user system assistant tool developer "
    # loadprofiles/prompts.py filler (three-letter words)
    "the and for are but not you all any can had her was one our out day get has him his how man "
    "new now old see two way who boy did its let put say she too use act add age ago air art ask "
    "bad bag bed big box bus buy car cat cup cut dog dry eat egg end eye far fat few fit fly fun "
    "gas god gun guy hat hit hot ice job key kid law lay leg lie lot low map mix net oil own pay "
    "pen pet pot red row run sea set sit six sky son sun tax tea ten tie top toy try war wet win "
    # instruction, system, probe and tenant-probe sentences
    "a about adapter and answer Answer are assistant b back Background backlog below call churn "
    "cite contain Copy does each engineers exactly figures follow for from given had in incidents "
    "infrastructure invent it largest ledger List lists main message never not note notes numbers "
    "of on Please please points quarter quarterly Question region release repeat Repeat revenue "
    "review sentences short Summarise summarise support System team text that the The their this "
    "ticket ups verbatim weekly what which with word Write wrote You you Confidential".split()
)

# Filler for telltale prompts: stop words, so never marker words; one token each after a space.
FILLER = tuple("the and for are but not you all can had was one out day get has new now old see two way".split())

_MODEL_PY = Path(__file__).resolve().parents[1] / "vllm" / "model.py"


def _tiny_model_module() -> ModuleType:
    """chaos/targets/vllm/model.py by path: its package imports pdchaos's deps, which the vLLM venv lacks."""
    # a .py path always has a spec (None is for a file no loader recognises)
    spec = cast(importlib.machinery.ModuleSpec, importlib.util.spec_from_file_location("pdchaos_tiny_model", _MODEL_PY))
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class Word:
    text: str
    prompt_id: int  # the bare token "w"
    reply_id: int  # the spaced token " w"


def marker_words(tokenizer: Any) -> list[Word]:
    """The marker words of a tokenizer (a `tokenizers.Tokenizer` or a HF fast tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    vocab = backend.get_vocab()
    excluded = {stop.lower() for stop in STOPWORDS}
    for stop in STOPWORDS:
        for variant in (stop, " " + stop, stop.lower(), " " + stop.lower()):
            excluded.update(backend.id_to_token(i) for i in backend.encode(variant).ids)
    words = []
    for token in sorted(vocab):
        spaced = "\u0120" + token  # byte-level BPE spells a leading space as U+0120
        if (
            not re.fullmatch(f"[a-z]{{{MIN_LETTERS},}}", token)
            or spaced not in vocab
            or token in excluded
            or spaced in excluded
        ):
            continue
        # Both forms must come out of the tokenizer as one token in the contexts prompts use.
        bare_ids = backend.encode(f"x {MARKER_PREFIX}{token} y").ids
        if vocab[token] not in bare_ids or backend.encode(f" {token}").ids != [vocab[spaced]]:
            continue
        words.append(Word(token, vocab[token], vocab[spaced]))
    return words[:MAX_WORDS]


def word_for(request_index: int, words: list[str]) -> str:
    """A request's marker word: index mod the number of words (requests M apart share a word)."""
    return words[request_index % len(words)]


def telltale_text(word: str, filler: list[str], page: int = 16) -> str:
    """Filler words (one token each after a space) with " #word" (two tokens) often enough that
    every run of `page` consecutive tokens holds one occurrence of the bare token `word`."""
    if page < 3:
        raise ValueError("page must be at least 3 tokens")
    every = page - 2
    parts = [f" {MARKER_PREFIX}{word}"]
    for i, filler_word in enumerate(filler, start=1):
        parts.append(" " + filler_word)
        if i % every == 0:
            parts.append(f" {MARKER_PREFIX}{word}")
    return "".join(parts)


def read_reply(text: str, words: list[str]) -> list[str]:
    """The marker words of a reply, in order (the reply is " w1 w2 ...")."""
    known = set(words)
    return [token for token in text.split() if token in known]


def expected_reply(token_ids: list[int], table: dict[str, Any]) -> list[str]:
    """The marker words greedy decoding names for these attended tokens, in order: what the model
    computes, without the model. `table` is telltale.json. For a prompt, this is the clean reply
    (a word piece of ordinary text can be a marker token: tokenize the prompt, do not guess)."""
    index = {tid: u for u, tid in enumerate(table["prompt_token_ids"])}
    reply_index = {tid: u for u, tid in enumerate(table["reply_token_ids"])}
    counts = [0] * len(table["words"])
    for tid in token_ids:
        if tid in index:
            counts[index[tid]] += 1
        elif tid in reply_index:
            counts[reply_index[tid]] -= table["suppress"]
    reply: list[str] = []
    while True:
        live = [(-count, table["reply_token_ids"][u], u) for u, count in enumerate(counts) if count > 0]
        if not live:
            return reply
        _, _, u = min(live)
        reply.append(table["words"][u])
        counts[u] -= table["suppress"]


# --------------------------------------------------------------------------------------- build


def build_weights(words: list[Word], vocab_size: int) -> dict[str, Any]:
    """The state dict (fp32) of the construction above."""
    import torch

    if len(words) > MAX_WORDS:
        raise ValueError(f"{len(words)} marker words, at most {MAX_WORDS} fit")
    embed = torch.zeros(vocab_size, HIDDEN)
    embed[:, _Y1] = 1.0
    embed[:, _Y2] = float(SUPPRESS)
    embed[:, _Z] = 1.0
    head = torch.zeros(vocab_size, HIDDEN)
    v_proj = torch.zeros(KV_HEADS * HEAD_DIM, HIDDEN)
    o_proj = torch.zeros(HIDDEN, HEADS * HEAD_DIM)
    group = HEADS // KV_HEADS
    for u, word in enumerate(words):
        embed[word.prompt_id, u] = 1.0
        embed[word.prompt_id, _Y2] = float(SUPPRESS)
        embed[word.prompt_id, _Y1] = 0.0
        embed[word.reply_id, u] = -float(SUPPRESS)
        embed[word.reply_id, _Y1] = 1.0
        embed[word.reply_id, _Y2] = 0.0
        v_proj[u, u] = 1.0
        kv_head, r = divmod(u, HEAD_DIM)
        o_proj[_B0 + u, kv_head * group * HEAD_DIM + r] = 1.0
        head[word.reply_id, _B0 + u] = LOGIT_SCALE
    head[EOS_ID, _Z] = EOS_WEIGHT

    ones = torch.ones(HIDDEN)
    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": embed,
        p + "input_layernorm.weight": ones.clone(),
        p + "self_attn.q_proj.weight": torch.zeros(HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.k_proj.weight": torch.zeros(KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.weight": v_proj,
        p + "self_attn.o_proj.weight": o_proj,
        p + "post_attention_layernorm.weight": ones.clone(),
        p + "mlp.gate_proj.weight": torch.zeros(INTERMEDIATE, HIDDEN),
        p + "mlp.up_proj.weight": torch.zeros(INTERMEDIATE, HIDDEN),
        p + "mlp.down_proj.weight": torch.zeros(HIDDEN, INTERMEDIATE),
        "model.norm.weight": ones.clone(),
        "lm_head.weight": head,
    }


def build_model(out: Path, words: list[Word], vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=vocab_size,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)  # nothing is random, but the module's init is discarded deterministically
    model = LlamaForCausalLM(config)
    state = {name: tensor.to(torch.bfloat16) for name, tensor in build_weights(words, vocab_size).items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise RuntimeError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model = model.to(torch.bfloat16)
    model.generation_config.do_sample = False
    model.save_pretrained(out)


def build(out: Path) -> list[Word]:
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    _tiny_model_module().build_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    words = marker_words(tokenizer)
    if not words:
        raise RuntimeError("the tokenizer has no marker words")
    if tokenizer.eos_token_id != EOS_ID:
        raise RuntimeError(f"EOS is token {tokenizer.eos_token_id}, the construction expects {EOS_ID}")
    build_model(out, words, len(tokenizer))
    (out / "telltale.json").write_text(
        json.dumps(
            {
                "format": 1,
                "words": [w.text for w in words],
                "prompt_token_ids": [w.prompt_id for w in words],
                "reply_token_ids": [w.reply_id for w in words],
                "marker_prefix": MARKER_PREFIX,
                "suppress": SUPPRESS,
                "max_positions": MAX_POSITIONS,
                "eos_token_id": EOS_ID,
                "dtype": "bfloat16",
            },
            indent=1,
        )
        + "\n"
    )
    return words


def load_words(model_dir: Path | str) -> list[str]:
    """The marker words of a built telltale model, in index order."""
    words: list[str] = json.loads((Path(model_dir) / "telltale.json").read_text())["words"]
    return words


# --------------------------------------------------------------------------------------- proof


class Telltale:
    """The built model under Hugging Face transformers on CPU, with the KV cache in reach."""

    def __init__(self, model_dir: Path | str, dtype: str = "bfloat16") -> None:
        import torch
        from transformers import AutoTokenizer, LlamaForCausalLM

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
        if self.model.dtype != getattr(torch, dtype):  # transformers before 4.56 calls it torch_dtype
            self.model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=getattr(torch, dtype)).eval()
        forward_args = inspect.signature(self.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        self.words = load_words(model_dir)
        self.by_reply_id = {self.tokenizer.convert_tokens_to_ids("\u0120" + w): w for w in self.words}
        self.by_reply_id_rev = {w: i for i, w in self.by_reply_id.items()}
        self.prompt_id = {w: self.tokenizer.convert_tokens_to_ids(w) for w in self.words}
        marked = set(self.by_reply_id) | set(self.prompt_id.values()) | {BOS_ID, EOS_ID, PAD_ID}
        self.plain_ids = [i for i in range(len(self.tokenizer)) if i not in marked]

    # KV caches as (keys, values) of layer 0, each [1, KV_HEADS, positions, HEAD_DIM]
    def prefill(self, ids: list[int]) -> tuple[int, Any]:
        """Run `ids`; return the next greedy token and the KV of `ids`."""
        from transformers import DynamicCache

        with self.torch.no_grad():
            logits, cache = self._forward(ids, DynamicCache())
        return int(logits.argmax()), _layer0(cache)

    def _forward(self, ids: list[int], cache: Any) -> tuple[Any, Any]:
        """One forward pass; the cache argument is `cache` from transformers 5.2x, `past_key_values` before."""
        out = self.model(input_ids=self.torch.tensor([ids]), use_cache=True, **{self._cache_arg: cache})
        cache = getattr(out, "cache", None)
        return out.logits[0, -1], out.past_key_values if cache is None else cache

    def decode(self, kv: Any, token: int, max_new: int = 8) -> list[int]:
        """Greedy from `token` on, attending `kv` (possibly tampered with); stops after EOS."""
        from transformers import DynamicCache

        cache = DynamicCache()
        cache.update(kv[0].clone(), kv[1].clone(), 0)
        emitted = [token]
        with self.torch.no_grad():
            while token != EOS_ID and len(emitted) < max_new:
                logits, cache = self._forward([token], cache)
                token = int(logits.argmax())
                emitted.append(token)
        return emitted

    def generate(self, ids: list[int], max_new: int = 8) -> list[int]:
        first, kv = self.prefill(ids)
        return self.decode(kv, first, max_new)

    def reply_words(self, emitted: list[int]) -> list[str]:
        return [self.by_reply_id[t] for t in emitted if t in self.by_reply_id]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids

    def marked_ids(self, word: str, length: int, rng: random.Random, page: int = 16) -> list[int]:
        """`length` random non-marker tokens with the bare token `word` once in every `page`."""
        ids = [rng.choice(self.plain_ids) for _ in range(length)]
        for pos in range(rng.randrange(page), length, page):
            ids[pos] = self.prompt_id[word]
        return ids


def _layer0(cache: Any) -> Any:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return cache.layers[0].keys, cache.layers[0].values
    if hasattr(cache, "key_cache"):
        return cache.key_cache[0], cache.value_cache[0]
    return cache[0]  # legacy tuple


def _splice(kv: Any, start: int, donor: Any, donor_start: int, length: int) -> tuple[Any, Any]:
    keys, values = kv[0].clone(), kv[1].clone()
    keys[:, :, start : start + length] = donor[0][:, :, donor_start : donor_start + length]
    values[:, :, start : start + length] = donor[1][:, :, donor_start : donor_start + length]
    return keys, values


def prove(
    model_dir: Path | str, pairs: int = 50, seed: int = 0, dtype: str = "bfloat16", page: int = 16
) -> dict[str, Any]:
    """The figures: clean replies, text and chat prompts, page leaks, and how much foreign KV it takes."""
    import statistics

    tt = Telltale(model_dir, dtype)
    rng = random.Random(seed)
    fig: dict[str, Any] = {"dtype": dtype, "pairs": pairs, "page": page, "words": len(tt.words)}

    # (a) text prompts, plain and (c) under the chat template, several marker densities
    text_ok = chat_ok = 0
    for _ in range(pairs):
        word = rng.choice(tt.words)
        filler = [rng.choice(FILLER) for _ in range(rng.randrange(8, 400))]
        body = telltale_text(word, filler, page=rng.choice([page, 64, 10_000]))
        if tt.reply_words(tt.generate(tt.encode(body))) == [word]:
            text_ok += 1
        chat = tt.tokenizer.apply_chat_template(
            [
                {"role": "system", "content": "You are the support assistant of the infrastructure team."},
                {"role": "user", "content": "Please repeat this note exactly." + body},
            ],
            add_generation_prompt=True,
            tokenize=False,
        )
        if tt.reply_words(tt.generate(tt.encode(chat))) == [word]:
            chat_ok += 1
    fig["text_prompt_names_own_word_only"] = text_ok
    fig["chat_prompt_names_own_word_only"] = chat_ok

    # one occurrence in a prompt filling the whole context
    word = tt.words[0]
    ids = [rng.choice(tt.plain_ids) for _ in range(MAX_POSITIONS - 1)]
    ids[rng.randrange(len(ids))] = tt.prompt_id[word]
    fig["one_occurrence_in_full_context_named"] = tt.reply_words(tt.generate(ids + [tt.plain_ids[0]])) == [word]

    # (b) KV leaks between random pairs of requests (random content, marker once per page)
    clean = page_named = page_exact = concat_named = 0
    false_words = 0
    flip_first: list[float] = []
    one_position_names = flip_matches_counts = 0
    for _ in range(pairs):
        own, victim = rng.sample(tt.words, 2)
        a = tt.marked_ids(own, rng.randrange(4, 33) * page, rng, page)
        b = tt.marked_ids(victim, rng.randrange(4, 33) * page, rng, page)
        first_a, kv_a = tt.prefill(a)
        _, kv_b = tt.prefill(b)
        if tt.reply_words(tt.decode(kv_a, first_a)) == [own]:
            clean += 1
        # decode attends one page of the victim in place of one of its own (prefill was clean)
        pa, pb = rng.randrange(len(a) // page) * page, rng.randrange(len(b) // page) * page
        words = tt.reply_words(tt.decode(_splice(kv_a, pa, kv_b, pb, page), first_a))
        page_named += victim in words
        page_exact += words == [own, victim] or words == [victim, own]
        false_words += sum(w not in (own, victim) for w in words)
        # decode attends the victim's whole KV after its own (a wrong page table)
        joined = tuple(tt.torch.cat([x, y], dim=2) for x, y in zip(kv_a, kv_b, strict=True))
        concat_named += victim in tt.reply_words(tt.decode(joined, first_a))
        # foreign positions replacing the head of the prompt (prefill of the last token attends
        # them): the reply should name the victim from the first one holding its marker on, and
        # its first token should be the victim once the victim's count passes the own count
        _, kv_head = tt.prefill(a[:-1])
        b = tt.marked_ids(victim, len(a), rng, page)  # as long and as dense as the own prompt
        _, kv_b = tt.prefill(b)
        length = len(a) - 1

        def reply_after(n: int) -> list[str]:
            # B023: called only within this iteration, so the loop variables it reads are the current ones
            return tt.reply_words(tt.decode(_splice(kv_head, 0, kv_b, 0, n), a[-1], max_new=6)[1:])  # noqa: B023

        first_marker = b.index(tt.prompt_id[victim]) + 1
        one_position_names += victim in reply_after(first_marker) and victim not in reply_after(first_marker - 1)
        lo, hi = 0, length  # bisect the smallest n whose first reply word is the victim
        if reply_after(hi)[:1] == [victim]:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if reply_after(mid)[:1] == [victim] else (mid, hi)
            flip_first.append(hi / len(a))
            own_id, victim_id = tt.prompt_id[own], tt.prompt_id[victim]
            predicted = next(
                (
                    n
                    for n in range(1, length + 1)
                    if (b[:n].count(victim_id), -tt.by_reply_id_rev[victim])
                    > (a[n:].count(own_id), -tt.by_reply_id_rev[own])
                ),
                None,
            )
            flip_matches_counts += predicted == hi
    fig["clean_reply_is_own_word_only"] = clean
    fig["one_leaked_page_names_victim"] = page_named
    fig["one_leaked_page_reply_is_exactly_own_and_victim"] = page_exact
    fig["words_named_that_are_neither_own_nor_victim"] = false_words
    fig["victim_kv_appended_names_victim"] = concat_named
    fig["one_foreign_marker_position_names_victim"] = one_position_names
    fig["first_token_becomes_victim"] = {
        "found": len(flip_first),
        "matches_count_rule": flip_matches_counts,
        "median_fraction_of_prompt_replaced": round(statistics.median(flip_first), 3) if flip_first else None,
    }
    return fig


def main(argv: list[str]) -> int:
    """`OUT_DIR`: build. `--prove MODEL_DIR [PAIRS]`: build there if empty, then print the figures."""
    if argv[:1] == ["--prove"] and len(argv) in (2, 3):
        model_dir = Path(argv[1])
        if not (model_dir / "telltale.json").exists():
            build(model_dir)
        pairs = int(argv[2]) if len(argv) == 3 else 50
        print(json.dumps(prove(model_dir, pairs=pairs), indent=1))
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: telltale.py OUT_DIR | telltale.py --prove MODEL_DIR [PAIRS]", file=sys.stderr)
        return 2
    out = Path(argv[0])
    words = build(out)
    print(f"telltale model written to {out} ({len(words)} marker words)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
