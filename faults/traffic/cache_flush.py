"""cache_flush: `POST /flush_cache` to the workers every interval while the window lasts.

SGLang answers 400 while requests are running or waiting, so under constant load no flush may take
effect: then the window is unconfirmed, with the counts of 200 and 400 answers.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import httpx

from chaos import transport
from chaos.errors import UsageError
from chaos.journal import EventKind, JournalEvent
from faults.base import Confirmation, Fault, FaultContext, FaultNotAvailable, FaultParams
from faults.traffic.source import CONTROL_TIMEOUT_S
from faults.undo import UndoAction


@dataclass(frozen=True)
class CacheFlushParams(FaultParams):
    interval_s: float = 1.0
    role: Literal["both", "prefill", "decode"] = "both"

    def validate(self, where: str) -> None:
        if not 0.05 <= self.interval_s <= 3600:
            raise UsageError(f"{where}.interval_s: {self.interval_s} must be in 0.05..3600 seconds")


class CacheFlush(Fault):
    """POST /flush_cache to the workers every interval_s while the window lasts.

    SGLang answers 400 while requests are running or waiting, so under constant load no flush
    may take effect: then the window is unconfirmed, with the counts of 200 and 400 answers."""

    name = "cache_flush"
    summary = "POST /flush_cache to the workers every interval during the window (400 while requests run)"
    Params = CacheFlushParams
    targets = frozenset({"sim", "sglang", "attach"})

    @property
    def p(self) -> CacheFlushParams:
        return self.params  # type: ignore[return-value]

    def undo_plan(self, ctx: FaultContext) -> list[UndoAction]:
        return []  # a flushed cache refills by itself

    def _urls(self, ctx: FaultContext) -> list[str]:
        roles = ("prefill", "decode") if self.p.role == "both" else (self.p.role,)
        return [w.url for w in ctx.target.endpoints.workers if w.role in roles]

    def inject(self, ctx: FaultContext) -> None:
        urls = self._urls(ctx)
        if not urls:
            raise FaultNotAvailable(f"the target lists no {self.p.role} worker to flush")
        self._answers: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._flush_all(urls)  # the first round now, so even a short window flushes once
        self._thread = threading.Thread(
            target=self._loop, args=(urls,), name=f"cache-flush-{ctx.window_id}", daemon=True
        )
        self._thread.start()

    def _flush_all(self, urls: list[str]) -> None:
        for url in urls:
            try:
                answer = str(
                    transport.post(f"{url}/flush_cache", timeout=CONTROL_TIMEOUT_S, trust_env=False).status_code
                )
            except httpx.HTTPError as exc:
                answer = type(exc).__name__
            with self._lock:
                self._answers[answer] += 1

    def _loop(self, urls: list[str]) -> None:
        while not self._stop.wait(self.p.interval_s):
            self._flush_all(urls)

    def _counts(self) -> Counter[str]:
        with self._lock:
            return Counter(getattr(self, "_answers", Counter()))

    def confirm(self, ctx: FaultContext) -> Confirmation:
        answers = self._counts()
        summary = ", ".join(f"{k} x{v}" for k, v in sorted(answers.items())) or "none sent"
        if answers.get("200"):
            return Confirmation(True, f"/flush_cache answers: {summary}")
        why = (
            " (SGLang refuses to flush while requests run or wait: under constant load no flush takes effect)"
            if answers.get("400")
            else ""
        )
        return Confirmation(False, f"no flush answered 200: {summary}{why}")

    def heal(self, ctx: FaultContext, plan: list[UndoAction]) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()
            self._thread.join(CONTROL_TIMEOUT_S * 2 + self.p.interval_s)
            if ctx.journal is not None:
                ctx.journal.append_event(
                    JournalEvent(
                        EventKind.NOTE, self.name, {"window": ctx.window_id, "flush_answers": dict(self._counts())}
                    )
                )
        super().heal(ctx, plan)

    def audit(self, ctx: FaultContext, plan: list[UndoAction]) -> list[str]:
        thread = getattr(self, "_thread", None)
        return [f"the {self.name} thread is still running"] if thread is not None and thread.is_alive() else []
