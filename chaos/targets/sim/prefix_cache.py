"""A page-granular prefix cache (SGLang's radix cache, reduced to full pages).

A full page of prompt tokens is keyed by a hash chained over every earlier page, so a key names a
whole prefix. The cache holds one reference on each cached page; a page only the cache holds is
evictable, least recently used first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from chaos.targets.sim.kvpool import KVPool

PageKey = bytes


def chain_keys(tokens: Sequence[int], page_size: int, salt: bytes = b"") -> list[PageKey]:
    """One key per full page: blake2b(previous key + this page's token ids)."""
    keys: list[PageKey] = []
    previous = hashlib.blake2b(salt, digest_size=16).digest()
    full = len(tokens) // page_size * page_size
    arr = np.asarray(tokens[:full], dtype=np.int64)
    for start in range(0, full, page_size):
        previous = hashlib.blake2b(previous + arr[start : start + page_size].tobytes(), digest_size=16).digest()
        keys.append(previous)
    return keys


class PrefixCache:
    def __init__(self, pool: KVPool, keep_evicted_keys: bool = False) -> None:
        self.pool = pool
        self._pages: OrderedDict[PageKey, int] = OrderedDict()
        # Defect "prefix_cache_keeps_evicted_pages": eviction frees the page but the key stays
        # here, pointing at whatever the page holds after it is reused. The cache holds no
        # reference on these pages.
        self.keep_evicted_keys = keep_evicted_keys
        self._stale: dict[PageKey, int] = {}
        self.hits_tokens = 0
        self.lookups_tokens = 0

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def cached_pages(self) -> int:
        return len(self._pages)

    @property
    def evictable_pages(self) -> int:
        # Kept by the pool as references come and go (KVPool.cache_hold/cache_drop): a scan of
        # every cached page here made each allocation cost grow with the size of the cache.
        return self.pool.evictable_pages

    def match(self, keys: Sequence[PageKey]) -> list[int]:
        """The cached pages of the longest cached prefix; the caller gets a reference on each."""
        pages: list[int] = []
        for key in keys:
            page = self._pages.get(key)
            if page is not None:
                self._pages.move_to_end(key)
                self.pool.incref([page])
            elif key in self._stale:
                page = self._stale[key]
                if self.pool.refcount(page) == 0:
                    self.pool.take(page)
                else:
                    self.pool.incref([page])  # shared with whoever owns it now
            else:
                break
            pages.append(page)
        self.hits_tokens += len(pages) * self.pool.page_size
        self.lookups_tokens += len(keys) * self.pool.page_size
        return pages

    def insert(self, keys: Sequence[PageKey], pages: Sequence[int]) -> None:
        """Cache full prompt pages a request has just computed (takes its own reference)."""
        for key, page in zip(keys, pages, strict=False):
            self._stale.pop(key, None)
            if key in self._pages:
                self._pages.move_to_end(key)
                continue
            self.pool.cache_hold(page)
            self._pages[key] = page

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages that only the cache holds, least recently used first."""
        # Pick the victims first, then drop them: the cache is not copied to be iterated, and the
        # walk stops at the last victim (in-use pages sit at the recent end, so that is early).
        # Dropping one victim cannot make another page evictable or not: a page cached under two
        # keys (only with the stale-key defect) has two cache references, so it is never a victim.
        victims: list[tuple[PageKey, int]] = []
        if num_pages > 0:
            refs = self.pool.refcount
            for key, page in self._pages.items():
                if refs(page) == 1:
                    victims.append((key, page))
                    if len(victims) >= num_pages:
                        break
        for key, page in victims:
            del self._pages[key]
            if self.keep_evicted_keys:
                self._stale[key] = page
            self.pool.cache_drop(page)
        return len(victims)

    def flush(self) -> int:
        """Drop every cached page (`/flush_cache`); pages still in use keep their other owners."""
        pages = list(self._pages.values())
        self._pages.clear()
        self._stale.clear()
        for page in pages:
            self.pool.cache_drop(page)
        return len(pages)

    def alloc(self, num_pages: int) -> list[int]:
        """Allocate from the pool, evicting cold cache pages when the free list runs short."""
        shortfall = num_pages - self.pool.free_pages
        if shortfall > 0:
            self.evict(shortfall)
        return self.pool.alloc(num_pages)

    def can_alloc(self, num_pages: int) -> bool:
        return self.pool.free_pages >= num_pages or self.pool.free_pages + self.evictable_pages >= num_pages
