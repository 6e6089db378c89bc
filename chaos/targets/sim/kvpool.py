"""The paged KV pool of one worker.

Like a real engine's pool: a fixed number of pages of `page_size` token slots, a LIFO free list
(SGLang #35049 notes LIFO reuse maximises the hazard), reference counts so the prefix cache and a
request can share a page, and **no zeroing on free**: a freed page keeps the KV of its last owner
until someone overwrites it. Whoever reads a page it did not write reads someone else's tokens.

A slot holds what the toy model needs from "KV": the token id at that position, its position,
and a rolling context hash that depends on every earlier token (as real K/V vectors do).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KVSlots:
    """A gathered view of some slots: what a reader attends."""

    tokens: np.ndarray  # int64
    positions: np.ndarray  # int64
    ctx: np.ndarray  # uint64 rolling context hash


class PoolExhausted(Exception):
    pass


class KVPool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("a pool needs at least one page of at least one slot")
        self.num_pages = num_pages
        self.page_size = page_size
        size = num_pages * page_size
        # A fresh pool is deterministic (token 0 at position -1) so outputs reproduce run to run.
        # Freed pages are never cleared again.
        self.tokens = np.zeros(size, dtype=np.int64)
        self.positions = np.full(size, -1, dtype=np.int64)
        self.ctx = np.zeros(size, dtype=np.uint64)
        # Reference counts live in Python lists, not numpy: they are read and bumped one page at a
        # time on every request, where a numpy scalar access costs several times a list's.
        self._refs: list[int] = [0] * num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        # The prefix cache's own references (`cache_hold`/`cache_drop`), so the pool can keep the
        # number of evictable pages (held by the cache alone) as it goes: counting them by a scan
        # of the cache cost a full pass on every allocation once the cache had filled the pool.
        self._cache_refs: list[int] = [0] * num_pages
        self._evictable = 0

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def evictable_pages(self) -> int:
        """Pages only the prefix cache holds: what eviction could free."""
        return self._evictable

    def alloc(self, num_pages: int) -> list[int]:
        """Take `num_pages` pages off the free list (reference count 1). Contents are stale."""
        free = self._free
        if num_pages > len(free):
            raise PoolExhausted(f"need {num_pages} pages, {len(free)} free")
        if num_pages <= 0:
            return []
        pages = free[-num_pages:]  # the same pages, in the same order, as num_pages pop()s
        pages.reverse()
        del free[-num_pages:]
        refs = self._refs
        for page in pages:
            refs[page] = 1
        return pages

    def take(self, page: int) -> None:
        """Claim one specific page off the free list (only a defective index asks for that)."""
        self._free.remove(page)
        self._refs[page] = 1

    def incref(self, pages: Sequence[int]) -> None:
        refs, cached = self._refs, self._cache_refs
        for page in pages:
            count = refs[page]
            if count <= 0:
                raise RuntimeError(f"incref of free page {page}")
            refs[page] = count + 1
            if count == 1 and cached[page]:
                self._evictable -= 1  # the cache's page is in use again

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference per page; a page with none left goes back to the free list as is."""
        refs, cached = self._refs, self._cache_refs
        for page in pages:
            count = refs[page]
            if count <= 0:
                raise RuntimeError(f"double free of page {page}")
            count -= 1
            refs[page] = count
            if count == 0:
                self._free.append(page)
            elif count == 1 and cached[page]:
                self._evictable += 1  # only the cache holds it now

    def cache_hold(self, page: int) -> None:
        """The prefix cache takes a reference on `page` (an incref the pool knows is the cache's)."""
        count = self._refs[page]
        if count <= 0:
            raise RuntimeError(f"incref of free page {page}")
        held = self._cache_refs[page]
        if held and count == 1:
            self._evictable -= 1
        self._refs[page] = count + 1
        self._cache_refs[page] = held + 1

    def cache_drop(self, page: int) -> None:
        """The prefix cache gives its reference on `page` back (evict, flush)."""
        count, held = self._refs[page], self._cache_refs[page]
        if count <= 0 or held <= 0:
            raise RuntimeError(f"double free of page {page}")
        was_evictable = count == 1
        count -= 1
        held -= 1
        self._refs[page] = count
        self._cache_refs[page] = held
        self._evictable += int(held > 0 and count == 1) - int(was_evictable)
        if count == 0:
            self._free.append(page)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def slots(self, pages: Sequence[int], num_tokens: int) -> np.ndarray:
        """Slot indices of the first `num_tokens` token positions of a page table."""
        if num_tokens > len(pages) * self.page_size:
            raise ValueError(f"{num_tokens} tokens do not fit in {len(pages)} pages")
        page_arr = np.asarray(pages, dtype=np.int64)
        positions = np.arange(num_tokens, dtype=np.int64)
        return page_arr[positions // self.page_size] * self.page_size + positions % self.page_size

    def write(self, slots: np.ndarray, kv: KVSlots) -> None:
        """Store KV at `slots`. No ownership check: the caller says where, the pool obeys."""
        self.tokens[slots] = kv.tokens
        self.positions[slots] = kv.positions
        self.ctx[slots] = kv.ctx

    def write_one(self, slot: int, token: int, position: int, ctx: int) -> None:
        """`write` of a single slot (a decode step), without building three one-element arrays."""
        self.tokens[slot] = token
        self.positions[slot] = position
        self.ctx[slot] = ctx

    def read(self, slots: np.ndarray) -> KVSlots:
        return KVSlots(self.tokens[slots], self.positions[slots], self.ctx[slots])
