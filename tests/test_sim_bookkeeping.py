"""Differential tests of the embedded engine's incremental bookkeeping.

The pool keeps the number of evictable pages (held by the prefix cache alone) as references come
and go, instead of scanning the cache. These tests run random request lifecycles against the
current `KVPool`/`PrefixCache` and against the old implementations (kept here verbatim: numpy
reference counts, a full scan for `evictable_pages`) and check after every operation that both
give the same answers and end in the same state, the defect's stale keys included. The engine
also appends each token's text instead of detokenizing the whole output again, tokenizes in one
pass and takes its digest as one dot product; each is checked against the old way on random
input. Last, decode's lean keep-alive client for the bootstrap POST.
"""

from __future__ import annotations

import asyncio
import json
import random
import string
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest

from chaos.targets.sim import model
from chaos.targets.sim.kvpool import KVPool, KVSlots, PoolExhausted
from chaos.targets.sim.prefix_cache import PageKey, PrefixCache, chain_keys
from chaos.targets.sim.tokenizer import ASCII_SPACE, EOS_ID, UNICODE_BASE, detokenize, token_text, tokenize

# ------------------------------------------------------- the old implementation, as it was ----


class OldPool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self._refs = np.zeros(num_pages, dtype=np.int32)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise PoolExhausted(f"need {num_pages} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(num_pages)]
        self._refs[pages] = 1
        return pages

    def take(self, page: int) -> None:
        self._free.remove(page)
        self._refs[page] = 1

    def incref(self, pages: Sequence[int]) -> None:
        for page in pages:
            if self._refs[page] <= 0:
                raise RuntimeError(f"incref of free page {page}")
            self._refs[page] += 1

    def release(self, pages: Sequence[int]) -> None:
        for page in pages:
            if self._refs[page] <= 0:
                raise RuntimeError(f"double free of page {page}")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)

    def refcount(self, page: int) -> int:
        return int(self._refs[page])


class OldCache:
    def __init__(self, pool: OldPool, keep_evicted_keys: bool = False) -> None:
        self.pool = pool
        self._pages: OrderedDict[PageKey, int] = OrderedDict()
        self.keep_evicted_keys = keep_evicted_keys
        self._stale: dict[PageKey, int] = {}
        self.hits_tokens = 0
        self.lookups_tokens = 0

    @property
    def evictable_pages(self) -> int:
        return sum(1 for page in self._pages.values() if self.pool.refcount(page) == 1)

    def match(self, keys: Sequence[PageKey]) -> list[int]:
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
                    self.pool.incref([page])
            else:
                break
            pages.append(page)
        self.hits_tokens += len(pages) * self.pool.page_size
        self.lookups_tokens += len(keys) * self.pool.page_size
        return pages

    def insert(self, keys: Sequence[PageKey], pages: Sequence[int]) -> None:
        for key, page in zip(keys, pages, strict=False):
            self._stale.pop(key, None)
            if key in self._pages:
                self._pages.move_to_end(key)
                continue
            self.pool.incref([page])
            self._pages[key] = page

    def evict(self, num_pages: int) -> int:
        freed = 0
        for key in list(self._pages):
            if freed >= num_pages:
                break
            page = self._pages[key]
            if self.pool.refcount(page) == 1:
                del self._pages[key]
                if self.keep_evicted_keys:
                    self._stale[key] = page
                self.pool.release([page])
                freed += 1
        return freed

    def flush(self) -> int:
        pages = list(self._pages.values())
        self._pages.clear()
        self._stale.clear()
        self.pool.release(pages)
        return len(pages)

    def alloc(self, num_pages: int) -> list[int]:
        shortfall = num_pages - self.pool.free_pages
        if shortfall > 0:
            self.evict(shortfall)
        return self.pool.alloc(num_pages)

    def can_alloc(self, num_pages: int) -> bool:
        return self.pool.free_pages >= num_pages or self.pool.free_pages + self.evictable_pages >= num_pages


# ------------------------------------------------------------------ the random lifecycles ----


@dataclass
class Live:
    tokens: list[int]
    salt: bytes
    pages: list[int]


class Twin:
    """The same operations on the new and the old implementation; every answer must agree."""

    def __init__(self, num_pages: int, page_size: int, keep_evicted_keys: bool) -> None:
        self.new_pool = KVPool(num_pages, page_size)
        self.new = PrefixCache(self.new_pool, keep_evicted_keys=keep_evicted_keys)
        self.old_pool = OldPool(num_pages, page_size)
        self.old = OldCache(self.old_pool, keep_evicted_keys=keep_evicted_keys)
        self.live: list[Live] = []
        self.extra_holds: list[int] = []  # pages someone else (a transfer, a twin request) holds too

    def both(self, op: str, *args: object) -> object:
        results = []
        for cache in (self.new, self.old):
            try:
                results.append(("ok", getattr(cache, op)(*args)))
            except (PoolExhausted, RuntimeError) as exc:
                results.append((type(exc).__name__, str(exc)))
        assert results[0] == results[1], f"{op}{args}: new {results[0]} != old {results[1]}"
        kind, value = results[0]
        if kind != "ok":
            raise AssertionError(f"{op}{args} failed in both: {value}")
        return value

    def pool_both(self, op: str, pages: list[int]) -> None:
        getattr(self.new_pool, op)(pages)
        getattr(self.old_pool, op)(pages)

    def check(self) -> None:
        new, old = self.new, self.old
        scan = sum(1 for page in new._pages.values() if self.new_pool.refcount(page) == 1)
        assert new.evictable_pages == scan == old.evictable_pages
        assert list(new._pages.items()) == list(old._pages.items())
        assert new._stale == old._stale
        assert self.new_pool._free == old.pool._free
        assert self.new_pool._refs == old.pool._refs.tolist()
        assert self.new_pool.free_pages == old.pool.free_pages
        assert self.new_pool.used_pages == old.pool.used_pages
        assert (new.hits_tokens, new.lookups_tokens) == (old.hits_tokens, old.lookups_tokens)

    def step(self, rng: random.Random) -> None:
        ps = self.new_pool.page_size
        roll = rng.random()
        if roll < 0.45 or not self.live:
            # A request arrives: prefix hits first, then fresh pages if they fit (Engine._reserve).
            shared = rng.choice(([1, 2, 3, 4] * 4, [5, 6] * 6, [7] * 9, []))
            tokens = shared[: rng.randint(0, len(shared))] + [rng.randint(1, 9) for _ in range(rng.randint(1, 12))]
            salt = rng.choice((b"", b"", b"tenant-b"))
            keys = chain_keys(tokens[: len(tokens) - 1], ps, salt)
            cached = self.both("match", keys)
            assert isinstance(cached, list)
            needed = -(-(len(tokens) + rng.randint(0, 6)) // ps) - len(cached)
            if self.both("can_alloc", needed):
                fresh = self.both("alloc", needed)
                assert isinstance(fresh, list)
                self.live.append(Live(tokens, salt, cached + fresh))
            else:
                self.pool_both("release", cached)
        elif roll < 0.8:
            # A request ends: usually its full prompt pages go into the cache (Engine.release).
            req = self.live.pop(rng.randrange(len(self.live)))
            if rng.random() < 0.85:
                keys = chain_keys(req.tokens, ps, req.salt)
                self.both("insert", keys, req.pages[: len(keys)])
            self.pool_both("release", req.pages)
        elif roll < 0.88:
            self.both("evict", rng.randint(0, 4))
        elif roll < 0.95 and self.live:
            # Someone else takes, or gives back, a reference on a live request's page.
            if self.extra_holds and rng.random() < 0.5:
                self.pool_both("release", [self.extra_holds.pop()])
            else:
                page = rng.choice(rng.choice(self.live).pages or [None])  # type: ignore[list-item]
                if page is not None:
                    self.pool_both("incref", [page])
                    self.extra_holds.append(page)
        elif roll < 0.96:
            self.both("flush")
        else:
            for page in self.extra_holds:
                self.pool_both("release", [page])
            self.extra_holds.clear()


@pytest.mark.parametrize("keep_evicted_keys", [False, True], ids=["clean", "stale-key-defect"])
@pytest.mark.parametrize("seed", range(12))
def test_incremental_evictable_count_equals_the_full_scan(seed: int, keep_evicted_keys: bool) -> None:
    rng = random.Random(seed)
    twin = Twin(num_pages=rng.choice((6, 12, 24)), page_size=rng.choice((1, 2, 4)), keep_evicted_keys=keep_evicted_keys)
    for _ in range(600):
        twin.step(rng)
        twin.check()
    # Drain: every request ends, the cache is flushed, the pool is whole again.
    for req in twin.live:
        twin.pool_both("release", req.pages)
    for page in twin.extra_holds:
        twin.pool_both("release", [page])
    twin.both("flush")
    twin.check()
    assert twin.new_pool.free_pages == twin.new_pool.num_pages and twin.new_pool.evictable_pages == 0


def test_cache_reference_errors_match_plain_references() -> None:
    pool = KVPool(4, 2)
    with pytest.raises(RuntimeError, match="incref of free page"):
        pool.cache_hold(0)
    [page] = pool.alloc(1)
    pool.cache_hold(page)
    pool.release([page])
    assert pool.evictable_pages == 1
    pool.cache_drop(page)
    assert pool.evictable_pages == 0 and pool.free_pages == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.cache_drop(page)


# ---------------------------------------------------------------- incremental detokenizing ----


@pytest.mark.parametrize("seed", range(5))
def test_text_appended_token_by_token_equals_detokenizing_the_whole(seed: int) -> None:
    """The engine appends each new token's text instead of detokenizing every output again."""
    rng = random.Random(seed)
    ids: list[int] = []
    text = ""
    for _ in range(300):
        # ASCII pieces, any code point (lone surrogates included), EOS, ids past the vocabulary.
        token = rng.choice(
            (
                rng.randrange(ASCII_SPACE),
                rng.randrange(UNICODE_BASE, EOS_ID),
                UNICODE_BASE + rng.randint(0xD800, 0xDFFF),
                EOS_ID,
                EOS_ID + rng.randint(1, 99),
            )
        )
        ids.append(token)
        text += token_text(token)
        assert text == detokenize(ids)


# ----------------------------------------------------------------- the one-pass tokenizer ----


def _old_tokenize(text: str) -> list[int]:
    """`tokenize` as it was: a generator of pieces, then one of glued punctuation."""
    from chaos.targets.sim import tokenizer as tk

    def pieces() -> Iterator[str]:
        for match in tk._PIECE_RE.finditer(text):
            run = match.group()
            for start in range(0, len(run), tk.PIECE_CHARS):
                yield run[start : start + tk.PIECE_CHARS]

    def merged() -> Iterator[str]:
        pending = ""
        for piece in pieces():
            single_ascii = len(piece) == 1 and 0x20 <= ord(piece) <= 0x7E and not piece.isalnum()
            if single_ascii and len(pending) < tk.PIECE_CHARS:
                pending += piece
                continue
            if pending:
                yield pending
                pending = ""
            if single_ascii:
                pending = piece
            else:
                yield piece
        if pending:
            yield pending

    ids: list[int] = []
    for piece in merged():
        if 0x20 <= ord(piece[0]) <= 0x7E:
            ids.append(tk._ascii_piece_id(piece))
        else:
            ids.append(UNICODE_BASE + ord(piece))
    return ids


@pytest.mark.parametrize("seed", range(4))
def test_one_pass_tokenizer_gives_the_old_ids(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = string.printable + " " * 10 + "....,,!!" + "\u00e9\u65e5\U0001f600\x00\x7f\u200b"
    words = ["the", " the", "repeat", "MARKER-77", "a", "ab", "abcde", "x" * 9, "!?", "  "]
    for _ in range(2000):
        parts = [rng.choice(alphabet) if rng.random() < 0.6 else rng.choice(words) for _ in range(rng.randint(0, 40))]
        text = "".join(parts)
        assert tokenize(text) == _old_tokenize(text), text


# ------------------------------------------------------------------------ the model digest ----


@pytest.mark.parametrize("n", [0, 1, 7, 24, 300, 5000])
def test_digest_by_dot_product_equals_the_wrapping_elementwise_sum(n: int) -> None:
    """`model._digest` uses one uint64 dot product; it must equal the old product-and-sum mod 2**64."""
    rng = np.random.default_rng(n)
    ctx = rng.integers(0, 2**64, size=n, dtype=np.uint64, endpoint=False)
    weights = (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) | np.uint64(1)
    with np.errstate(over="ignore"):
        old = int(np.sum(ctx * weights, dtype=np.uint64))
    kv = KVSlots(np.zeros(n, dtype=np.int64), np.arange(n, dtype=np.int64), ctx)
    assert model._digest(kv) == old


# ------------------------------------------------------------ the bootstrap's keep-alive POST ----


def test_keep_alive_client_reuses_connections_and_reads_errors() -> None:
    from aiohttp import web

    from chaos.targets.sim.http1 import KeepAliveClient

    async def scenario() -> None:
        seen_peers: list[object] = []

        async def echo(request: web.Request) -> web.StreamResponse:
            seen_peers.append(request.transport.get_extra_info("peername") if request.transport else None)
            body = await request.json()
            if body.get("close"):
                return web.json_response({"got": body}, headers={"Connection": "close"})
            if body.get("fail"):
                return web.json_response({"error": "no"}, status=503)
            return web.json_response({"got": body})

        app = web.Application()
        app.router.add_post("/x", echo)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        client = KeepAliveClient()
        try:
            for i in range(3):
                resp = await client.post_json("127.0.0.1", port, "/x", {"i": i, "pages": [1, 2]}, timeout=5)
                assert resp.status == 200 and resp.content_type.startswith("application/json")
                assert json.loads(resp.body) == {"got": {"i": i, "pages": [1, 2]}}
            assert len(set(seen_peers)) == 1  # one connection, kept alive
            resp = await client.post_json("127.0.0.1", port, "/x", {"fail": True}, timeout=5)
            assert resp.status == 503
            resp = await client.post_json("127.0.0.1", port, "/x", {"close": True}, timeout=5)
            assert resp.status == 200
            resp = await client.post_json("127.0.0.1", port, "/x", {"i": 9}, timeout=5)
            assert resp.status == 200
            assert len(set(seen_peers)) == 2  # the server closed the first; a new one was opened
        finally:
            client.close()
            await runner.cleanup()
        with pytest.raises(OSError):  # nobody listens any more: refused, as aiohttp's client error was
            await client.post_json("127.0.0.1", port, "/x", {}, timeout=5)

    asyncio.run(scenario())


def test_keep_alive_client_times_out_on_a_server_that_never_answers() -> None:
    from chaos.targets.sim.http1 import KeepAliveClient

    async def scenario() -> None:
        async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1 << 16)
            await asyncio.sleep(10)

        server = await asyncio.start_server(mute, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = KeepAliveClient()
        try:
            with pytest.raises(asyncio.TimeoutError):
                await client.post_json("127.0.0.1", port, "/x", {}, timeout=0.2)
            assert not client._idle.get(("127.0.0.1", port))  # the half-done connection is not reused
        finally:
            client.close()
            server.close()

    asyncio.run(scenario())
