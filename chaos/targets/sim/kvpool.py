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
        self._refs = np.zeros(num_pages, dtype=np.int32)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first

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

    def alloc(self, num_pages: int) -> list[int]:
        """Take `num_pages` pages off the free list (reference count 1). Contents are stale."""
        if num_pages > len(self._free):
            raise PoolExhausted(f"need {num_pages} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(num_pages)]
        self._refs[pages] = 1
        return pages

    def take(self, page: int) -> None:
        """Claim one specific page off the free list (only a defective index asks for that)."""
        self._free.remove(page)
        self._refs[page] = 1

    def incref(self, pages: Sequence[int]) -> None:
        for page in pages:
            if self._refs[page] <= 0:
                raise RuntimeError(f"incref of free page {page}")
            self._refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference per page; a page with none left goes back to the free list as is."""
        for page in pages:
            if self._refs[page] <= 0:
                raise RuntimeError(f"double free of page {page}")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

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

    def read(self, slots: np.ndarray) -> KVSlots:
        return KVSlots(self.tokens[slots], self.positions[slots], self.ctx[slots])
