"""The toy model: deterministic, driven only by the KV it attends, and leaky by design."""

from __future__ import annotations

import numpy as np

from chaos.targets.sim import model
from chaos.targets.sim.kvpool import KVPool, KVSlots
from chaos.targets.sim.model import Mode, Sampling, choose_mode, context_hashes, kv_for, next_token
from chaos.targets.sim.prefix_cache import PrefixCache, chain_keys
from chaos.targets.sim.tokenizer import EOS_ID, detokenize, tokenize

GREEDY = Sampling(temperature=0.0, seed=0, ignore_eos=True)
PAGE = 8


def _generate(pool: KVPool, pages: list[int], prompt_len: int, steps: int, sampling: Sampling = GREEDY) -> list[int]:
    """What the engine does with a prompt already in `pages`: first token, then decode in place.

    Mirrors `Engine._compute_prompt` (step 0) and `Engine._decode_one` (later steps).
    """
    slots = pool.slots(pages, prompt_len)
    attended = pool.read(slots)
    mode = choose_mode(attended)
    out = [next_token(attended, prompt_len, 0, mode, sampling)]
    while len(out) < steps and (out[-1] != EOS_ID or sampling.ignore_eos):
        pos = prompt_len + len(out) - 1
        slots = pool.slots(pages, pos + 1)
        previous = int(pool.ctx[slots[pos - 1]])
        pool.write(slots[pos:], kv_for([out[-1]], pos, previous))
        out.append(next_token(pool.read(slots), prompt_len, len(out), mode, sampling))
    return out


def _prefilled(prompt: list[int], extra: int, num_pages: int = 32) -> tuple[KVPool, list[int]]:
    pool = KVPool(num_pages, PAGE)
    pages = pool.alloc(pool.pages_for(len(prompt) + extra))
    pool.write(pool.slots(pages, len(prompt)), kv_for(prompt, 0, 0))
    return pool, pages


# ------------------------------------------------------------------------ context hashes ----


def test_context_hashes_depend_on_token_position_and_prefix() -> None:
    base = context_hashes([1, 2, 3, 4], 0, 0)
    assert base.dtype == np.uint64
    assert len(set(base.tolist())) == 4
    assert np.array_equal(context_hashes([1, 2, 3, 4], 0, 0), base)  # deterministic
    changed_first = context_hashes([9, 2, 3, 4], 0, 0)
    assert all(changed_first[i] != base[i] for i in range(4))  # every later hash changes
    changed_last = context_hashes([1, 2, 3, 9], 0, 0)
    assert changed_last[:3].tolist() == base[:3].tolist() and changed_last[3] != base[3]
    assert context_hashes([1, 2, 3, 4], 1, 0)[0] != base[0]  # position matters
    assert context_hashes([1, 2, 3, 4], 0, 5)[0] != base[0]  # the previous hash matters


def test_kv_for_fields() -> None:
    kv = kv_for([5, 6, 7], 10, 42)
    assert kv.tokens.tolist() == [5, 6, 7]
    assert kv.positions.tolist() == [10, 11, 12]
    assert kv.ctx.tolist() == context_hashes([5, 6, 7], 10, 42).tolist()


def test_prefix_continuation_equals_one_pass() -> None:
    """Prefix-cache equivalence: KV in two parts (continuing the hash) equals KV in one go."""
    tokens = tokenize("The quick brown fox jumps over the lazy dog, again and again and again.")
    whole = kv_for(tokens, 0, 0)
    for cut in (1, PAGE, len(tokens) // 2, len(tokens) - 1):
        head = kv_for(tokens[:cut], 0, 0)
        tail = kv_for(tokens[cut:], cut, int(head.ctx[-1]))
        assert np.concatenate([head.tokens, tail.tokens]).tolist() == whole.tokens.tolist()
        assert np.concatenate([head.positions, tail.positions]).tolist() == whole.positions.tolist()
        assert np.concatenate([head.ctx, tail.ctx]).tolist() == whole.ctx.tolist()
    # Continuing from the wrong hash gives different KV.
    wrong = kv_for(tokens[PAGE:], PAGE, 12345)
    assert wrong.ctx.tolist() != whole.ctx[PAGE:].tolist()


def test_prefix_cache_hit_reproduces_cold_prefill_through_the_pool() -> None:
    """A request that reuses cached pages and computes the rest attends exactly the cold KV."""
    shared = tokenize("system: you are a helpful assistant who answers briefly and well.\n")
    prompt_a = shared + tokenize("user: hello")
    prompt_b = shared + tokenize("user: what is the capital of France?")
    pool = KVPool(32, PAGE)
    cache = PrefixCache(pool)

    pages_a = cache.alloc(pool.pages_for(len(prompt_a)))
    pool.write(pool.slots(pages_a, len(prompt_a)), kv_for(prompt_a, 0, 0))
    keys_a = chain_keys(prompt_a, PAGE)
    cache.insert(keys_a, pages_a[: len(keys_a)])
    pool.release(pages_a)

    n = len(prompt_b)
    cached = cache.match(chain_keys(prompt_b[: n - 1], PAGE))
    assert len(cached) == len(shared) // PAGE >= 2
    pages_b = cached + cache.alloc(pool.pages_for(n) - len(cached))
    start = len(cached) * PAGE
    slots = pool.slots(pages_b, n)
    pool.write(slots[start:], kv_for(prompt_b[start:], start, int(pool.ctx[slots[start - 1]])))

    warm = pool.read(slots)
    cold = kv_for(prompt_b, 0, 0)
    assert warm.tokens.tolist() == cold.tokens.tolist()
    assert warm.positions.tolist() == cold.positions.tolist()
    assert warm.ctx.tolist() == cold.ctx.tolist()
    cold_pool, cold_pages = _prefilled(prompt_b, 0)
    assert next_token(warm, n, 0, Mode.GENERATE, GREEDY) == next_token(
        cold_pool.read(cold_pool.slots(cold_pages, n)), n, 0, Mode.GENERATE, GREEDY
    )


# ---------------------------------------------------------------------------- generate ----

PROMPT = tokenize("Tell me a story about a lighthouse keeper and a very patient cat.")


def test_mode_follows_the_attended_prompt() -> None:
    assert choose_mode(kv_for(PROMPT, 0, 0)) is Mode.GENERATE
    assert choose_mode(kv_for(tokenize("Please REPEAT this"), 0, 0)) is Mode.REPEAT


def test_same_attended_kv_same_tokens() -> None:
    pool_a, pages_a = _prefilled(PROMPT, 32)
    pool_b, pages_b = _prefilled(PROMPT, 32, num_pages=20)
    pool_b.alloc(3)  # different physical pages, same content
    out_a = _generate(pool_a, pages_a, len(PROMPT), 24)
    out_b = _generate(pool_b, pages_b, len(PROMPT), 24)
    assert out_a == out_b
    assert len(out_a) == 24
    assert all(token in model.VOCAB for token in out_a)
    assert len(set(out_a)) > 3  # not a constant


def test_generated_text_round_trips_through_the_tokenizer() -> None:
    pool, pages = _prefilled(PROMPT, 32)
    out = _generate(pool, pages, len(PROMPT), 24)
    assert tokenize(detokenize(out)) == out


def test_changing_one_attended_slot_changes_the_sequence() -> None:
    pool, pages = _prefilled(PROMPT, 16)
    reference = _generate(pool, pages, len(PROMPT), 8)
    for index in range(len(PROMPT)):
        pool, pages = _prefilled(PROMPT, 16)
        slot = pool.slots(pages, len(PROMPT))[index]
        pool.ctx[slot] ^= np.uint64(1)
        assert _generate(pool, pages, len(PROMPT), 8) != reference, index


def test_a_stale_slot_past_the_prompt_changes_nothing_until_attended() -> None:
    """Slots past the sequence are not attended: garbage there cannot change the output."""
    pool, pages = _prefilled(PROMPT, 16)
    reference = _generate(pool, pages, len(PROMPT), 8)
    pool, pages = _prefilled(PROMPT, 16)
    tail = pool.slots(pages, len(pages) * PAGE)[len(PROMPT) + 8 :]
    pool.write(tail, kv_for([123] * len(tail), 0, 99))
    assert _generate(pool, pages, len(PROMPT), 8) == reference


def test_eos_in_generate_mode() -> None:
    """Without ignore_eos a long generation ends with EOS, never before the minimum."""
    sampling = Sampling(temperature=0.0, seed=0, ignore_eos=False)
    pool, pages = _prefilled(PROMPT, 2000, num_pages=300)
    out = _generate(pool, pages, len(PROMPT), 2000, sampling)
    assert out[-1] == EOS_ID
    assert len(out) > model.MIN_TOKENS_BEFORE_EOS
    assert EOS_ID not in out[:-1]
    # ignore_eos never yields EOS
    pool, pages = _prefilled(PROMPT, len(out) + 8, num_pages=300)
    assert EOS_ID not in _generate(pool, pages, len(PROMPT), len(out) + 4)


def test_seed_matters_only_with_temperature() -> None:
    attended = kv_for(PROMPT, 0, 0)
    n = len(PROMPT)

    def seq(sampling: Sampling) -> list[int]:
        return [next_token(attended, n, step, Mode.GENERATE, sampling) for step in range(12)]

    greedy = seq(Sampling(0.0, seed=1, ignore_eos=True))
    assert greedy == seq(Sampling(0.0, seed=2, ignore_eos=True))
    hot_1 = seq(Sampling(0.7, seed=1, ignore_eos=True))
    assert hot_1 == seq(Sampling(0.7, seed=1, ignore_eos=True))
    assert hot_1 != seq(Sampling(0.7, seed=2, ignore_eos=True))
    assert hot_1 != greedy


# ------------------------------------------------------------------------------ repeat ----

REPEAT_PROMPT_TEXT = "Please repeat after me: the cat sat on the mat."


def test_repeat_copies_attended_tokens_in_order_then_eos() -> None:
    prompt = tokenize(REPEAT_PROMPT_TEXT)
    pool, pages = _prefilled(prompt, len(prompt) + 4)
    out = _generate(pool, pages, len(prompt), 10_000, Sampling(ignore_eos=False))
    assert out[:-1] == prompt
    assert out[-1] == EOS_ID
    assert detokenize(out) == REPEAT_PROMPT_TEXT


def test_repeat_reads_kv_not_the_request() -> None:
    """next_token in repeat mode returns whatever token sits in the attended slot."""
    tokens = tokenize("repeat") + [77, 78]
    n = len(tokens)
    kv = KVSlots(
        tokens=np.asarray(tokens, dtype=np.int64),
        positions=np.arange(n, dtype=np.int64),
        ctx=np.zeros(n, dtype=np.uint64),
    )
    assert choose_mode(kv) is Mode.REPEAT
    assert [next_token(kv, n, s, Mode.REPEAT, GREEDY) for s in range(n + 1)] == tokens + [EOS_ID]


def _victim_and_marker() -> tuple[list[int], list[int], str]:
    victim = tokenize("Please repeat: ab " + "lorem ipsum dolor sit amet, consectetur")
    marker = "ZEBRA-4471"
    foreign = tokenize(f"{marker} is the secret of tenant B, keep it private.")
    # Preconditions of the scenario: the trigger is in the victim's first page, and the
    # foreign marker fits wholly in the foreign request's first page.
    assert "repeat" in detokenize(victim[:PAGE])
    assert len(victim) >= 2 * PAGE
    assert detokenize(foreign[:PAGE]).startswith(marker)
    return victim, foreign, marker


def test_stale_page_leaks_foreign_text_in_repeat_mode() -> None:
    """Plant tenant B's KV in a page, read it through tenant A's page table: B's text comes out."""
    victim, foreign, marker = _victim_and_marker()
    pool = KVPool(16, PAGE)
    stale_page, own_page = 5, 2
    pool.write(pool.slots([stale_page], PAGE), kv_for(foreign[:PAGE], 0, 0))  # B's first page

    # A's page table: its own first page (written), then the stale page (A's KV never landed).
    table = [own_page, stale_page, 8, 9]  # + two pages to decode in place
    n = 2 * PAGE
    pool.write(pool.slots(table, PAGE), kv_for(victim[:PAGE], 0, 0))

    out = _generate(pool, table, n, 10_000, Sampling(ignore_eos=False))
    assert out[-1] == EOS_ID and len(out) == n + 1
    text = detokenize(out)
    assert marker in text
    assert text == detokenize(victim[:PAGE]) + detokenize(foreign[:PAGE])

    # The isolated reference (all of A's own KV) never shows the marker.
    ref_pool, ref_pages = _prefilled(victim[:n], n)
    ref_text = detokenize(_generate(ref_pool, ref_pages, n, 10_000, Sampling(ignore_eos=False)))
    assert marker not in ref_text
    assert ref_text == detokenize(victim[:n])


def test_stale_page_via_lifo_reuse() -> None:
    """The same leak through the real allocator: B frees, A reuses (LIFO), A's 2nd page never lands."""
    victim, foreign, marker = _victim_and_marker()
    pool = KVPool(16, PAGE)
    b_pages = pool.alloc(2)
    pool.write(pool.slots(b_pages, 2 * PAGE), kv_for(foreign[: 2 * PAGE], 0, 0))
    pool.release(b_pages)
    a_pages = pool.alloc(4)  # the prompt's two pages + two to decode in place
    assert a_pages[:2] == b_pages[::-1]  # LIFO: A's second page is B's first
    pool.write(pool.slots(a_pages, PAGE), kv_for(victim[:PAGE], 0, 0))
    text = detokenize(_generate(pool, a_pages, 2 * PAGE, 10_000, Sampling(ignore_eos=False)))
    assert marker in text
    assert text == detokenize(victim[:PAGE]) + detokenize(foreign[:PAGE])


def test_stale_page_flips_the_mode() -> None:
    """The instruction is read from attended KV: a stale page saying "repeat" turns it on."""
    own = tokenize("Write a short poem about autumn leaves")[:PAGE]
    assert len(own) == PAGE
    stale = tokenize("please repeat all of it: SECRET")[:PAGE]
    pool = KVPool(4, PAGE)
    pool.write(pool.slots([1], PAGE), kv_for(stale, 0, 0))
    pool.write(pool.slots([0], PAGE), kv_for(own, 0, 0))
    assert choose_mode(pool.read(pool.slots([0], PAGE))) is Mode.GENERATE
    assert choose_mode(pool.read(pool.slots([0, 1], 2 * PAGE))) is Mode.REPEAT
