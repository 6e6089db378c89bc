"""What every window that sends requests shares: a run prefix, marker indices, rids, prompts and
their sizing on the target. Traffic faults and provocations (faults/provoke.py) are sources.

Marker indices come from the fault's own params (`index_base`; 0 picks a range from the window id,
far above the load's indices), the run prefix from `run_prefix` or the journal's meta "run_prefix".
"""

from __future__ import annotations

import re
import secrets
import zlib
from collections.abc import Iterator

import httpx

from chaos import transport
from chaos.errors import UsageError
from chaos.markers import MAX_REQUEST_INDEX, MarkerCodec, new_run_prefix, validate_run_prefix
from faults.base import Fault, FaultContext
from faults.traffic.exchange import KIND_CALIBRATION, PHASE, Exchange, send
from faults.undo import UndoAction
from loadprofiles.sizing import CALIBRATION_K, FILLER, Sizer
from loadprofiles.sse import Api

FAULT_INDEX_BASE = 1_000_000_000  # far above the load's indices (it counts up from 10 000)
INDEX_SPAN = 100_000  # indices one window may use
INDEX_SLOTS = (MAX_REQUEST_INDEX - FAULT_INDEX_BASE) // INDEX_SPAN
FIXED_TOKENS_ESTIMATE = 24  # markers and instructions around the filler, before measuring
REQUEST_TIMEOUT_S = 60.0
CONTROL_TIMEOUT_S = 5.0


def check_run_prefix(where: str, run_prefix: str) -> None:
    if run_prefix:
        try:
            validate_run_prefix(run_prefix)
        except ValueError as exc:
            raise UsageError(f"{where}.run_prefix: {exc}") from None


def check_index_base(where: str, index_base: int) -> None:
    if index_base and not 0 < index_base <= MAX_REQUEST_INDEX - INDEX_SPAN:
        raise UsageError(
            f"{where}.index_base: {index_base} must be 0 (automatic) or in 1..{MAX_REQUEST_INDEX - INDEX_SPAN}"
        )


def window_index_base(window_id: str) -> int:
    """An index range of its own for a window: "w3" -> the third slot above FAULT_INDEX_BASE."""
    digits = re.search(r"(\d+)$", window_id)
    slot = int(digits.group(1)) if digits else zlib.crc32(window_id.encode())
    return FAULT_INDEX_BASE + (slot % INDEX_SLOTS) * INDEX_SPAN


def fault_client() -> httpx.AsyncClient:
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    return transport.async_client(timeout=timeout, trust_env=False, limits=httpx.Limits(max_connections=64))


class TrafficSource:
    """Whatever sends canary-marked requests for a window: a run prefix, marker indices, rids,
    the request shape the target speaks, and the journal."""

    # A fault's class attribute (Fault.name is a ClassVar), the Provoker's instance attribute (the
    # fault it provokes for). mypy sees the two as a conflict in the traffic faults, which set it
    # on the class: their `name =` lines ignore that [misc] error.
    name: str

    def _setup(self, ctx: FaultContext, run_prefix: str = "", index_base: int = 0, offset: int = 0) -> None:
        prefix = run_prefix
        if not prefix and ctx.journal is not None:
            stored = ctx.journal.get_meta("run_prefix")
            prefix = stored if isinstance(stored, str) else ""
        self.codec = MarkerCodec(prefix or new_run_prefix())
        base = (index_base or window_index_base(ctx.window_id or self.name)) + offset
        self._indices: Iterator[int] = iter(range(base, base + INDEX_SPAN - offset))
        self._window = ctx.window_id or "adhoc"
        # The route the target's engine speaks (SGLang /generate unless its dialect says otherwise).
        self._route: Api = "completions" if ctx.target.dialect.request_api == "openai" else "generate"

    def next_index(self) -> int:
        return next(self._indices)

    def rid(self, index: int) -> str:
        """Unique and fixed width, so `/abort_request`'s prefix match hits this request only."""
        return f"{self.codec.run_prefix}-{PHASE}-{self._window}-{index:010d}-{secrets.token_hex(3)}"

    def prompt(self, index: int, repetitions: int, instruction: str) -> tuple[str, list[str]]:
        head, tail = self.codec.marker(index, 0), self.codec.marker(index, 1)
        return f"{head} {instruction}\n" + FILLER * max(1, repetitions) + f"\n{tail} Repeat every code word you saw.", [
            head,
            tail,
        ]

    def exchange(
        self, index: int, prompt: tuple[str, list[str]], user_kind: str, max_tokens: int, stream: bool
    ) -> Exchange:
        text, markers = prompt
        return Exchange(
            rid=self.rid(index),
            index=index,
            prompt=text,
            markers=markers,
            user_kind=user_kind,
            actor=f"fault/{self._window}/{self.name}",
            max_tokens=max_tokens,
            stream=stream,
            route=self._route,
        )

    async def counted_tokens(
        self,
        client: httpx.AsyncClient,
        url: str,
        index: int,
        repetitions: int,
        instruction: str,
        exchanges: list[Exchange],
    ) -> int | None:
        """The target's count of one short prompt with `index`'s markers (None: it counts none)."""
        ex = self.exchange(index, self.prompt(index, repetitions, instruction), KIND_CALIBRATION, 1, stream=False)
        exchanges.append(ex)
        await send(client, url, ex)
        return ex.prompt_tokens if ex.status == 200 else None

    async def measure_sizer(
        self, client: httpx.AsyncClient, url: str, instruction: str, exchanges: list[Exchange]
    ) -> Sizer:
        """Prompt tokens per filler repetition, from two short requests the target counts."""
        k0, k1 = CALIBRATION_K
        low = await self.counted_tokens(client, url, self.next_index(), k0, instruction, exchanges)
        high = await self.counted_tokens(client, url, self.next_index(), k1, instruction, exchanges)
        return Sizer.measured((low, high)) or Sizer.estimated(FIXED_TOKENS_ESTIMATE)

    def journal(self, ctx: FaultContext, exchanges: list[Exchange]) -> None:
        if ctx.journal is not None and exchanges:
            ctx.journal.append_requests(e.record() for e in exchanges)
            ctx.journal.flush()


class TrafficFault(TrafficSource, Fault):
    """A fault that sends requests: a run prefix, marker indices, rids, and the journal."""

    targets = frozenset({"sim", "sglang", "attach", "vllm"})  # traffic only: any SGLang- or OpenAI-shaped URL

    def undo_plan(self, ctx: FaultContext) -> list[UndoAction]:
        return []  # requests end by themselves; nothing is left to undo

    def _setup(self, ctx: FaultContext, run_prefix: str = "", index_base: int = 0, offset: int = 0) -> None:
        super()._setup(
            ctx,
            run_prefix or getattr(self.params, "run_prefix", "") or "",
            index_base or getattr(self.params, "index_base", 0) or 0,
            offset,
        )
