"""The embedded engine's paged KV pool and its page-granular prefix cache."""

from __future__ import annotations

import numpy as np
import pytest

from chaos.targets.sim.kvpool import KVPool, KVSlots, PoolExhausted
from chaos.targets.sim.prefix_cache import PrefixCache, chain_keys


def _kv(tokens: list[int], start: int = 0, ctx_base: int = 1000) -> KVSlots:
    n = len(tokens)
    return KVSlots(
        tokens=np.asarray(tokens, dtype=np.int64),
        positions=np.arange(start, start + n, dtype=np.int64),
        ctx=np.arange(ctx_base, ctx_base + n, dtype=np.uint64),
    )


# ------------------------------------------------------------------------------- KVPool ----


def test_fresh_pool_is_deterministic_and_hands_out_page_zero_first() -> None:
    pool = KVPool(num_pages=4, page_size=3)
    assert pool.capacity_tokens == 12
    assert pool.free_pages == 4 and pool.used_pages == 0
    assert pool.tokens.tolist() == [0] * 12
    assert pool.positions.tolist() == [-1] * 12
    assert pool.ctx.tolist() == [0] * 12
    assert pool.alloc(2) == [0, 1]
    assert pool.alloc(1) == [2]
    assert pool.free_pages == 1 and pool.used_pages == 3


def test_invalid_pool_shapes_rejected() -> None:
    with pytest.raises(ValueError):
        KVPool(0, 4)
    with pytest.raises(ValueError):
        KVPool(4, 0)


def test_lifo_reuse_returns_the_page_just_freed() -> None:
    pool = KVPool(num_pages=8, page_size=4)
    pages = pool.alloc(5)
    assert pages == [0, 1, 2, 3, 4]
    pool.release([2])
    assert pool.alloc(1) == [2]
    pool.release([1, 3])  # freed in this order: 3 was freed last, so it comes back first
    assert pool.alloc(2) == [3, 1]
    pool.release([4])
    pool.release([0])
    assert pool.alloc(1) == [0]
    assert pool.alloc(1) == [4]
    assert pool.alloc(1) == [5]  # then the never-used pages, lowest first


def test_freed_pages_keep_their_contents() -> None:
    """Deliberate: no zeroing on free, like a real engine. The next owner reads stale KV."""
    pool = KVPool(num_pages=4, page_size=4)
    [page] = pool.alloc(1)
    slots = pool.slots([page], 4)
    pool.write(slots, _kv([11, 12, 13, 14], start=40, ctx_base=777))
    pool.release([page])
    assert pool.free_pages == 4
    [again] = pool.alloc(1)
    assert again == page
    stale = pool.read(pool.slots([again], 4))
    assert stale.tokens.tolist() == [11, 12, 13, 14]
    assert stale.positions.tolist() == [40, 41, 42, 43]
    assert stale.ctx.tolist() == [777, 778, 779, 780]


def test_refcounts_incref_release_and_double_free() -> None:
    pool = KVPool(num_pages=4, page_size=2)
    [page] = pool.alloc(1)
    assert pool.refcount(page) == 1
    pool.incref([page])
    assert pool.refcount(page) == 2
    pool.release([page])
    assert pool.refcount(page) == 1
    assert pool.free_pages == 3  # still held once: not free
    pool.release([page])
    assert pool.refcount(page) == 0
    assert pool.free_pages == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.release([page])
    assert pool.free_pages == 4  # the failed release did not put the page on the list twice
    with pytest.raises(RuntimeError, match="incref of free page"):
        pool.incref([page])


def test_pool_exhausted() -> None:
    pool = KVPool(num_pages=3, page_size=2)
    pool.alloc(2)
    with pytest.raises(PoolExhausted):
        pool.alloc(2)
    assert pool.free_pages == 1  # a failed alloc takes nothing
    assert pool.alloc(1) == [2]
    with pytest.raises(PoolExhausted):
        pool.alloc(1)
    assert pool.alloc(0) == []


def test_slots_map_token_positions_through_the_page_table() -> None:
    pool = KVPool(num_pages=10, page_size=4)
    assert pool.slots([7, 2, 5], 10).tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert pool.slots([3], 0).tolist() == []
    assert pool.slots([3], 4).tolist() == [12, 13, 14, 15]
    with pytest.raises(ValueError):
        pool.slots([7, 2], 9)


def test_pages_for_rounds_up() -> None:
    pool = KVPool(num_pages=10, page_size=4)
    assert [pool.pages_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_write_and_read_through_a_page_table() -> None:
    pool = KVPool(num_pages=6, page_size=4)
    slots = pool.slots([5, 1], 6)
    pool.write(slots, _kv([1, 2, 3, 4, 5, 6], start=0, ctx_base=50))
    assert pool.tokens[20:24].tolist() == [1, 2, 3, 4]
    assert pool.tokens[4:6].tolist() == [5, 6]
    assert pool.tokens[6:8].tolist() == [0, 0]  # the rest of page 1 is untouched
    back = pool.read(slots)
    assert back.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    assert back.positions.tolist() == [0, 1, 2, 3, 4, 5]
    assert back.ctx.dtype == np.uint64
    assert back.ctx.tolist() == [50, 51, 52, 53, 54, 55]


def test_write_has_no_ownership_check() -> None:
    """The pool writes wherever it is told, even into free pages (as RDMA would)."""
    pool = KVPool(num_pages=2, page_size=2)
    pool.write(pool.slots([1], 2), _kv([9, 9]))
    assert pool.free_pages == 2
    assert pool.tokens[2:4].tolist() == [9, 9]


# ------------------------------------------------------------------------- prefix cache ----


def test_chain_keys_cover_full_pages_and_chain_over_earlier_pages() -> None:
    a = chain_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], page_size=4)
    assert len(a) == 2  # the partial third page has no key
    assert all(isinstance(k, bytes) and len(k) == 16 for k in a)
    assert chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 4) == a
    # Same second page, different first page: the second key differs too.
    b = chain_keys([1, 2, 3, 0, 5, 6, 7, 8], 4)
    assert b[0] != a[0]
    assert b[1] != a[1]
    # Same first page, different second page: only the second key differs.
    c = chain_keys([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert c[0] == a[0] and c[1] != a[1]
    # A page's key is not just a hash of its own tokens.
    assert chain_keys([5, 6, 7, 8], 4)[0] != a[1]
    assert chain_keys([1, 2, 3], 4) == []
    assert chain_keys([1, 2, 3, 4], 4, salt=b"lora-a") != chain_keys([1, 2, 3, 4], 4)


def _cached_prompt(cache: PrefixCache, tokens: list[int]) -> tuple[list[bytes], list[int]]:
    """A request computes `tokens` into fresh pages, caches its full pages, then ends."""
    pool = cache.pool
    keys = chain_keys(tokens, pool.page_size)
    pages = cache.alloc(pool.pages_for(len(tokens)))
    cache.insert(keys, pages[: len(keys)])
    pool.release(pages)
    return keys, pages


def test_match_returns_longest_cached_prefix_and_takes_references() -> None:
    pool = KVPool(num_pages=16, page_size=2)
    cache = PrefixCache(pool)
    _keys, pages = _cached_prompt(cache, [1, 2, 3, 4, 5, 6])
    assert len(cache) == 3
    assert [pool.refcount(p) for p in pages] == [1, 1, 1]  # held by the cache alone

    longer = chain_keys([1, 2, 3, 4, 5, 6, 7, 8], 2)
    got = cache.match(longer)
    assert got == pages
    assert [pool.refcount(p) for p in pages] == [2, 2, 2]
    pool.release(got)

    diverging = chain_keys([1, 2, 3, 4, 0, 6], 2)
    got = cache.match(diverging)
    assert got == pages[:2]
    assert [pool.refcount(p) for p in pages] == [2, 2, 1]
    pool.release(got)

    # A hit on a later page alone is no hit: a key names the whole prefix.
    assert cache.match(chain_keys([9, 9, 3, 4], 2)) == []
    assert cache.match([]) == []
    assert cache.hits_tokens == (3 + 2) * 2
    assert cache.lookups_tokens == (4 + 3 + 2) * 2


def test_insert_takes_one_reference_and_ignores_duplicates() -> None:
    pool = KVPool(num_pages=8, page_size=2)
    cache = PrefixCache(pool)
    keys = chain_keys([1, 2, 3, 4], 2)
    first = pool.alloc(2)
    cache.insert(keys, first)
    assert [pool.refcount(p) for p in first] == [2, 2]
    second = pool.alloc(2)
    cache.insert(keys, second)  # same prefix computed again: the cache keeps the first copy
    assert [pool.refcount(p) for p in second] == [1, 1]
    assert cache.cached_pages == 2
    pool.release(first)
    pool.release(second)
    assert pool.used_pages == 2
    assert cache.evictable_pages == 2


def test_evict_only_pages_held_by_the_cache_alone_lru_first() -> None:
    pool = KVPool(num_pages=16, page_size=2)
    cache = PrefixCache(pool)
    _, a_pages = _cached_prompt(cache, [1, 1])
    _, b_pages = _cached_prompt(cache, [2, 2])
    c_keys, c_pages = _cached_prompt(cache, [3, 3])
    _, d_pages = _cached_prompt(cache, [4, 4])
    # Touch A: it becomes the most recently used. Hold C: not evictable.
    held_a = cache.match(chain_keys([1, 1], 2))
    pool.release(held_a)
    held_c = cache.match(c_keys)
    assert cache.evictable_pages == 3

    assert cache.evict(1) == 1
    assert pool.refcount(b_pages[0]) == 0  # B was the least recently used
    assert cache.match(chain_keys([2, 2], 2)) == []
    assert cache.evict(10) == 2  # D, then A; C is still in use
    assert pool.refcount(d_pages[0]) == 0 and pool.refcount(a_pages[0]) == 0
    assert pool.refcount(c_pages[0]) == 2
    assert len(cache) == 1
    pool.release(held_c)
    assert cache.evict(10) == 1
    assert len(cache) == 0 and pool.used_pages == 0


def test_evict_order_is_lru_not_insertion() -> None:
    pool = KVPool(num_pages=8, page_size=1)
    cache = PrefixCache(pool)
    _cached_prompt(cache, [1])
    _cached_prompt(cache, [2])
    pool.release(cache.match(chain_keys([1], 1)))  # 1 is now newer than 2
    cache.evict(1)
    assert cache.match(chain_keys([2], 1)) == []
    got = cache.match(chain_keys([1], 1))
    assert len(got) == 1
    pool.release(got)


def test_flush_drops_every_page_but_in_use_pages_keep_their_owner() -> None:
    pool = KVPool(num_pages=8, page_size=2)
    cache = PrefixCache(pool)
    keys, pages = _cached_prompt(cache, [1, 2, 3, 4])
    held = cache.match(keys[:1])
    assert cache.flush() == 2
    assert len(cache) == 0
    assert pool.refcount(pages[0]) == 1  # the request still has it
    assert pool.refcount(pages[1]) == 0
    assert cache.match(keys) == []
    pool.release(held)
    assert pool.used_pages == 0


def test_alloc_evicts_cold_pages_when_the_free_list_is_short() -> None:
    pool = KVPool(num_pages=4, page_size=2)
    cache = PrefixCache(pool)
    _cached_prompt(cache, [1, 2, 3, 4])  # 2 cached pages
    _cached_prompt(cache, [7, 7])  # 1 more (newest)
    assert pool.free_pages == 1
    assert cache.can_alloc(4)
    assert not cache.can_alloc(5)
    got = cache.alloc(3)  # needs 2 evictions: the two LRU pages (prefix [1,2,3,4])
    assert len(got) == 3
    assert cache.match(chain_keys([1, 2, 3, 4], 2)) == []
    kept = cache.match(chain_keys([7, 7], 2))
    assert len(kept) == 1
    pool.release(kept)
    with pytest.raises(PoolExhausted):
        cache.alloc(2)  # 1 evictable + 0 free


def test_alloc_does_not_evict_pages_still_in_use() -> None:
    pool = KVPool(num_pages=2, page_size=2)
    cache = PrefixCache(pool)
    keys, _ = _cached_prompt(cache, [1, 2, 3, 4])
    held = cache.match(keys)
    assert not cache.can_alloc(1)
    with pytest.raises(PoolExhausted):
        cache.alloc(1)
    assert len(cache) == 2
    pool.release(held)
    assert len(cache.alloc(1)) == 1
