"""Provocation: the traffic a fault window sends so that what its perturbation can break shows.

A fault perturbs the deployment; whether a KV-isolation bug then shows depends on the traffic in
flight at that moment. A campaign author should not have to know that an asymmetric pool only
matters to prompts between the two roles' limits, or that a freed page only leaks into the request
that is handed it next. So each fault family names the provocations that expose the bug classes it
opens (`PROVOCATIONS` below), and the runner runs them beside every window of a campaign, aimed
with the limits the target reports at that moment (after a restart, the new ones):

- `band` (the incident, SGLang #30233; K3, K7): prompts right under, at and over each role's
  admission limit, and spread through the band between the smallest and the largest limit. Over
  the smallest limit they are `over_length` requests: the pair must reject them (a 4xx), and the
  status oracle holds it to that; a pair that hands a rejected prompt over and decodes from pages
  it never received answers 200 instead, often with another request's text.
- `reuse` (K1, K2, K7, K8): waves of fresh "repeat" requests every `interval_s` while the fault
  holds and for `after_heal_s` after its heal (at least until the last write the fault held back
  is due, `Fault.lingers_s`), so pages a timeout or an abort freed are handed at
  once to a request that copies out whatever its KV holds; every wave also carries one prompt of
  several transfer chunks, so a dropped or late chunk lands where it matters (K3), and one of the
  campaign's longer reference probes: a repeat request reads each page once, early, so a late
  write after that goes unseen, while a probe attends all its pages at every step and its
  isolated output is known, so a late write at any moment of its decode changes what it says
  (and a long one asks for many pages, so it is likely handed the freed ones).
- `burst` (K4): simultaneous handoffs at inject and right after the heal, so transfer
  completions race for the same metadata slots.
- `prefix` (K5): prompts that share a long opening, sent before and after each eviction or flush,
  with long unshared prompts between them as eviction pressure, so a stale prefix-cache entry is
  hit by the next request that shares it.
- `span` (K1, for a fault that freezes the KV sender: `Fault.freezes_sender`): one reference probe
  that decodes for the whole window, started as the window opens and decoding (its first token
  came back) before the fault freezes the sender. While the sender is frozen the peer gives up on its
  transfers, and a decode that frees their pages at once hands them, page by page, to requests
  decoding right then (SGLang takes a decode request's pages as its output grows); when the
  sender resumes it writes the KV it held into them. A fresh request admitted after the free gets
  its own KV from the same frozen sender, written after the stale one, so only a request that was
  already decoding reads the stale KV: the span probe is one, and its isolated output is known.
  Its length is sized by the runner from the probes' isolated pace (`chaos/probes.py`).

Every request is journaled with canary markers of the run (user_kind `provocation`, or
`over_length` for a prompt over a limit) and a note that says which provocation sent it and into
which band; a `fault/<name>` event with step `provoke` records the plan: the limits read, every
band and the prompt lengths the target counted. A window's params take `provoke: false` to turn
it off, or a mapping (`ProvokeSettings`) to tune it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from chaos import transport
from chaos.errors import UsageError
from chaos.journal import EventKind, JournalEvent
from chaos.limits import WorkerLimits
from chaos.refusal import read_refusal
from faults.base import FaultContext
from faults.traffic.exchange import KIND_OVER_LENGTH, Exchange, send
from faults.traffic.source import FIXED_TOKENS_ESTIMATE, INDEX_SPAN, TrafficSource
from loadprofiles.sizing import Sizer

log = logging.getLogger("pdchaos.provoke")

KIND_PROVOCATION = "provocation"
KINDS = ("band", "reuse", "burst", "prefix", "span")
# Which provocations each fault family gets: the bug classes its perturbation opens (and `span`
# for every window whose fault freezes the KV sender).
PROVOCATIONS: dict[str, tuple[str, ...]] = {
    "memory_fraction": ("band", "reuse"),
    "transfer_stall": ("reuse", "burst"),
    "kv_transfer": ("reuse", "burst"),
    "engine_failure": ("reuse", "burst"),
    "client_abort": ("reuse",),
    "process_kill": ("reuse", "burst"),
    "router_link": ("reuse",),
    "netns_partition": ("reuse",),
    "cache_flush": ("prefix",),
    "over_length_burst": ("band",),
}
INSTRUCTION = "Please repeat this note exactly."
SHORT_TOKENS = (48, 96)  # fresh requests: a few pages, quick to hand over
# Fresh requests decode this long: a late write must land while they still read their pages.
REUSE_NEW_TOKENS = 96
MULTI_CHUNK_TOKENS = 640  # several transfer chunks on every engine we know (SGLang sends per page)
SHARED_OPENING_WORDS = 384
REQUEST_TIMEOUT_S = 30.0  # when no deadline is given (the runner gives the campaign's)
SIZING_TIMEOUT_S = 5.0  # two tiny requests; a target that cannot answer them gets estimated sizes
FINISH_GRACE_S = 3.0  # after the last wave: answers still due, bounded (a wedged engine answers none)
ANSWER_GRACE_S = 30.0  # ... but a band, burst or prefix shot, asked once, is waited for this much longer
MAX_IN_FLIGHT = 48
LANDED_MARGIN_S = 1.0  # reuse waves after the last held write is due: it lands, then is read
SPAN_COMMIT_WAIT_S = 30.0  # the fault waits at most this long for the span probe to be decoding


@dataclass(frozen=True)
class ProvokeSettings:
    """A window's `provoke:` mapping; `provoke: false` turns every provocation off."""

    enabled: bool = True
    kinds: tuple[str, ...] | None = None  # None: the fault family's own (PROVOCATIONS)
    interval_s: float = 0.5  # reuse: one wave this often
    wave_size: int = 3  # reuse: fresh short requests per wave (plus one multi-chunk prompt)
    after_heal_s: float = 4.0  # reuse: waves go on at least this long after the heal (and past the fault's
    # longest held delay, e.g. a kv_transfer latency plus jitter: late writes land then)
    band_count: int = 4  # band: prompts spread through each band
    burst: int = 12  # burst: simultaneous handoffs

    @classmethod
    def from_value(cls, value: Any, where: str) -> ProvokeSettings:
        if value is None or value is True:
            return cls()
        if value is False:
            return cls(enabled=False)
        if not isinstance(value, Mapping):
            raise UsageError(
                f"{where}: {value!r} must be true, false or a mapping of {', '.join(f.name for f in dataclasses.fields(cls))}"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise UsageError(
                f"{where}: unknown setting(s) {', '.join(unknown)}; provoke takes: {', '.join(sorted(names))}"
            )
        data = dict(value)
        if "kinds" in data:
            kinds = data["kinds"]
            if not isinstance(kinds, list) or not all(k in KINDS for k in kinds):
                raise UsageError(f"{where}.kinds: {kinds!r} must be a list of {', '.join(KINDS)}")
            data["kinds"] = tuple(kinds)
        for name, low, high in (("interval_s", 0.05, 60.0), ("after_heal_s", 0.0, 300.0)):
            if name in data and (
                isinstance(data[name], bool)
                or not isinstance(data[name], (int, float))
                or not low <= data[name] <= high
            ):
                raise UsageError(f"{where}.{name}: {data[name]!r} must be a number in {low}..{high}")
        for name, low, high in (("wave_size", 0, 64), ("band_count", 0, 32), ("burst", 0, 256)):
            if name in data and (
                isinstance(data[name], bool) or not isinstance(data[name], int) or not low <= data[name] <= high
            ):
                raise UsageError(f"{where}.{name}: {data[name]!r} must be an integer in {low}..{high}")
        if "enabled" in data and not isinstance(data["enabled"], bool):
            raise UsageError(f"{where}.enabled: {data['enabled']!r} must be true or false")
        return cls(**data)

    def kinds_for(self, fault: str, freezes_sender: bool = False) -> tuple[str, ...]:
        if not self.enabled:
            return ()
        if self.kinds is not None:
            return self.kinds
        return PROVOCATIONS.get(fault, ()) + (("span",) if freezes_sender else ())


def split_params(params: Mapping[str, Any], where: str) -> tuple[dict[str, Any], ProvokeSettings]:
    """A window's params without `provoke`, and its provocation settings (validated)."""
    rest = {k: v for k, v in params.items() if k != "provoke"}
    return rest, ProvokeSettings.from_value(params.get("provoke"), f"{where}.provoke")


# ------------------------------------------------------------------------------ planning ----


@dataclass(frozen=True)
class Shot:
    """One planned prompt: how long, why, and whether the pair must reject it."""

    kind: str  # band, reuse, burst, prefix
    label: str  # e.g. "band (prefill 2042, decode 4090)", "at prefill limit 2042"
    tokens: int  # the prompt length aimed at
    over_limit: bool  # some role must reject it: the status oracle wants a 4xx
    max_new_tokens: int
    limit: int | None = None  # over_limit: the smallest limit it is over


@dataclass(frozen=True)
class RoleLimits:
    role: str
    limits: WorkerLimits

    @property
    def first_rejected(self) -> int | None:
        """The shortest prompt this role rejects (SGLang: >= max_req_input_len, or >= context)."""
        bounds = [n for n in (self.limits.max_req_input_len, self.limits.context_length) if n is not None]
        return min(bounds) if bounds else None


def plan_band(roles: list[RoleLimits], count: int) -> list[Shot]:
    """Under, at and over each role's limit, and `count` prompts through the band between the
    smallest and the largest limit (empty when the roles agree)."""
    bounds = sorted({(r.first_rejected, r.role) for r in roles if r.first_rejected is not None})
    if not bounds:
        return []
    contexts = [r.limits.context_length for r in roles if r.limits.context_length is not None]
    context = min(contexts) if contexts else None
    low = bounds[0][0]
    high = bounds[-1][0]

    def room(tokens: int) -> int:
        """Generated tokens that keep prompt + output within the context (else the tokenizer's
        check rejects it before the check under test)."""
        return max(1, min(24, context - tokens)) if context is not None and tokens < context else 8

    shots: dict[int, Shot] = {}

    def add(kind_label: str, tokens: int) -> None:
        if tokens >= 8 and tokens not in shots:
            shots[tokens] = Shot("band", kind_label, tokens, tokens >= low, room(tokens), low)

    for limit, role in bounds:
        add(f"under the {role} limit {limit}", limit - 1)
        add(f"at the {role} limit {limit}", limit)
        add(f"over the {role} limit {limit}", limit + 1)
    if high - low > 2:
        names = ", ".join(f"{role} {limit}" for limit, role in bounds)
        for i in range(1, count + 1):
            add(f"band ({names})", low + (high - low) * i // (count + 1))
    for r in roles:  # the pool itself, where it is smaller than what the role admits on paper
        pool = r.limits.pool_tokens
        if pool is not None and (context is None or pool < context):
            add(f"at the {r.role} pool {pool}", pool)
    return sorted(shots.values(), key=lambda s: s.tokens)


def plan_wave(roles: list[RoleLimits], size: int, n: int) -> list[Shot]:
    """`size` fresh short requests and one multi-chunk prompt, all under every role's limit."""
    bounds = [r.first_rejected for r in roles if r.first_rejected is not None]
    ceiling = min(bounds) - 40 if bounds else MULTI_CHUNK_TOKENS + 40  # prompt + 32 generated stays admitted
    shots = [
        Shot("reuse", "fresh request for freed pages", SHORT_TOKENS[(n + i) % 2], False, REUSE_NEW_TOKENS)
        for i in range(size)
    ]
    multi = min(MULTI_CHUNK_TOKENS, ceiling)
    if multi > SHORT_TOKENS[1]:
        shots.append(Shot("reuse", "multi-chunk prompt", multi, False, 16))
    return shots


def plan_burst(size: int, label: str) -> list[Shot]:
    """`size` short handoffs sent at once: their completions race for decode's metadata slots."""
    return [Shot("burst", label, SHORT_TOKENS[i % 2], False, 24) for i in range(size)]


# ------------------------------------------------------------------------------- sending ----


@dataclass
class _Tally:
    sent: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    landed: dict[str, list[int]] = field(default_factory=dict)  # label -> prompt_tokens the target counted


class Provoker(TrafficSource):
    """Runs one window's provocations in a thread of its own, beside the fault."""

    def __init__(
        self,
        fault: str,
        settings: ProvokeSettings,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        lingers_s: float = 0.0,
        replay_probe: Callable[[], None] | None = None,
        freezes_sender: bool = False,
        span_probe: Callable[[threading.Event], None] | None = None,
    ) -> None:
        self.name = fault
        self.settings = settings
        # Sends one reference probe and journals it (the runner's); each reuse wave carries one.
        self.replay_probe = replay_probe
        # Sends the span probe, sets the event once it decodes, journals it when it ends (the runner's).
        self.span_probe = span_probe
        self._span_thread: threading.Thread | None = None
        # Waves go on past the heal until the last write the fault held back has landed.
        self.after_heal_s = max(settings.after_heal_s, lingers_s + LANDED_MARGIN_S if lingers_s else 0.0)
        # Past the liveness deadline, so a request the provoker gives up on is a hang, not a doubt.
        self.request_timeout_s = request_timeout_s
        self.kinds = settings.kinds_for(fault, freezes_sender)
        self._healed = threading.Event()
        self._healed_at: float | None = None
        self._thread: threading.Thread | None = None
        self._exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._plan: dict[str, Any] = {}
        self._tally = _Tally()

    @property
    def active(self) -> bool:
        return bool(self.kinds)

    def prepare(self, ctx: FaultContext) -> None:
        """Before inject, while the target is whole: measure how prompts size on it."""
        if not self.active:
            return
        self._setup(ctx, offset=INDEX_SPAN // 2)  # the upper half of the window's index range
        self._ctx = ctx
        self._sizer = Sizer.estimated(FIXED_TOKENS_ESTIMATE)
        self._roles_before = self._roles()
        try:
            self._sizer = asyncio.run(self._measure())
        except Exception as exc:  # sizing is best effort: estimated sizes still provoke
            log.warning("provocation sizing on %s failed: %s", ctx.target.endpoints.router_url, exc)

    def opened(self, ctx: FaultContext) -> None:
        """The window is open (its inject journaled) and the fault is about to act: what must be
        in flight when it acts starts now (the span probe)."""
        if "span" in self.kinds:
            self.start_span(ctx.window_id)

    def start_span(self, window_id: str) -> None:
        """Send the span probe and return once it decodes: the fault acts after (a target too
        slow to start it within SPAN_COMMIT_WAIT_S is injected anyway, and the plan says so)."""
        if self.span_probe is None:
            self._plan["span"] = {"sent": False, "why": "the campaign's baseline recorded no span probe"}
            return
        decoding, started = threading.Event(), time.monotonic()
        self._span_thread = threading.Thread(
            target=self.span_probe, args=(decoding,), name=f"span-{window_id}", daemon=True
        )
        self._span_thread.start()
        decoding.wait(min(SPAN_COMMIT_WAIT_S, self.request_timeout_s))
        waited = round(time.monotonic() - started, 3)
        self._plan["span"] = {"sent": True, "decoding": decoding.is_set(), "waited_s": waited}
        self._tally.sent["span"] += 1

    async def _measure(self) -> Sizer:
        calibration: list[Exchange] = []
        async with transport.async_client(timeout=httpx.Timeout(SIZING_TIMEOUT_S), trust_env=False) as client:
            try:
                return await self.measure_sizer(client, self._ctx.target.endpoints.router_url, INSTRUCTION, calibration)
            finally:
                self._keep(calibration)

    def start(self, ctx: FaultContext) -> None:
        """Right after inject: read the limits now (a restart changed them) and begin."""
        if not self.active:
            return
        if not hasattr(self, "_sizer"):
            self.prepare(ctx)
        self._thread = threading.Thread(target=self._run, name=f"provoke-{ctx.window_id}", daemon=True)
        self._thread.start()

    def healed(self) -> None:
        """The fault is healed: the after-heal waves run on in the background (`join` waits)."""
        self._healed_at = time.monotonic()
        self._healed.set()

    def join(self) -> None:
        """Wait until the after-heal waves ran out and the provocation is journaled (bounded)."""
        if not self._healed.is_set():
            self.healed()
        if self._span_thread is not None:  # its request timeout bounds it
            self._span_thread.join(self.request_timeout_s + FINISH_GRACE_S)
        if self._thread is None:
            return
        self._thread.join(self.after_heal_s + FINISH_GRACE_S + ANSWER_GRACE_S + self.request_timeout_s)

    def _journal_all(self) -> None:
        with self._lock:
            exchanges = list(self._exchanges)
        self.journal(self._ctx, exchanges)
        if self._ctx.journal is not None:
            self._ctx.journal.append_event(
                JournalEvent(
                    EventKind.FAULT,
                    self.name,
                    {
                        "window": self._ctx.window_id,
                        "step": "provoke",
                        "kinds": list(self.kinds),
                        **self._plan,
                        "sent": dict(self._tally.sent),
                        "statuses": dict(self._tally.statuses),
                        "landed": {k: sorted(v) for k, v in self._tally.landed.items()},
                    },
                )
            )

    # ------------------------------------------------------------------------ the thread ----

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception as exc:  # a provocation that breaks must not take the window with it
            log.exception("provocation of %s failed", self.name)
            self._plan["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            self._journal_all()

    def _roles(self) -> list[RoleLimits]:
        target = self._ctx.target
        dialect = target.dialect
        workers = target.endpoints.workers
        if not workers:
            return [RoleLimits("router", dialect.limits(target.endpoints.router_url))]
        return [RoleLimits(w.role, dialect.limits(w.url)) for w in workers]

    async def _main(self) -> None:
        url = self._ctx.target.endpoints.router_url
        # Limits as they are now only where the fault changes them (a restart): a stalled or
        # killed role answers nothing, and its limits are the ones read before the fault.
        roles = await asyncio.to_thread(self._roles) if "band" in self.kinds else self._roles_before
        self._plan["limits"] = {
            r.role: {
                "pool_tokens": r.limits.pool_tokens,
                "context_length": r.limits.context_length,
                "max_input_tokens": r.limits.max_req_input_len,
            }
            for r in roles
        }
        timeout = httpx.Timeout(self.request_timeout_s, connect=5.0)
        async with transport.async_client(
            timeout=timeout, trust_env=False, limits=httpx.Limits(max_connections=MAX_IN_FLIGHT)
        ) as client:
            sizer = self._sizer
            self._plan["sizing"] = "measured" if sizer.exact else "estimated (the target reports no token counts)"
            tasks: set[asyncio.Task[Any]] = set()
            asked_once: set[asyncio.Task[Any]] = set()  # band, burst and prefix shots: each answer is evidence

            def fire(shots: list[Shot], once: bool = True) -> None:
                for shot in shots:
                    task = asyncio.create_task(self._shoot(client, url, sizer, shot))
                    tasks.add(task)
                    if once:
                        asked_once.add(task)

            if "band" in self.kinds:
                band = plan_band(roles, self.settings.band_count)
                self._plan["band"] = [dataclasses.asdict(s) for s in band]
                fire(band)
            if "burst" in self.kinds and self.settings.burst:
                fire(plan_burst(self.settings.burst, "simultaneous handoff"))
            if "prefix" in self.kinds:
                fire(self._prefix_round(roles))
            wave, held, after_heal_sent = 0, 0, False
            while not (after_heal_sent and self._waves_over()):
                if "reuse" in self.kinds and self.settings.wave_size:
                    # A wave beyond the connection pool would only queue here and time out: a
                    # target that answers slower than the waves come gets as many as it holds.
                    if len(tasks) + self.settings.wave_size + 2 <= MAX_IN_FLIGHT:
                        fire(plan_wave(roles, self.settings.wave_size, wave), once=False)
                        if self.replay_probe is not None:
                            tasks.add(asyncio.create_task(asyncio.to_thread(self.replay_probe)))
                            self._tally.sent["reuse reference probe"] += 1
                        wave += 1
                    else:
                        held += 1
                if self._healed.is_set() and not after_heal_sent:
                    after_heal_sent = True  # the freed pages are handed out now: hit them at once
                    if "burst" in self.kinds and self.settings.burst:
                        fire(plan_burst(self.settings.burst, "simultaneous handoff after the heal"))
                    if "prefix" in self.kinds:
                        fire(self._prefix_round(roles))
                await asyncio.sleep(self.settings.interval_s)
                tasks = {t for t in tasks if not t.done()}
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=FINISH_GRACE_S)
                if late := pending & asked_once:  # a slow rejection (a decode waiting for KV) is still an answer
                    await asyncio.wait(late, timeout=min(ANSWER_GRACE_S, self.request_timeout_s))
                    pending = {t for t in pending if not t.done()}
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
            self._plan["waves"] = wave
            self._plan["after_heal_s"] = self.after_heal_s
            if held:
                self._plan["waves_held"] = held  # with MAX_IN_FLIGHT requests unanswered

    def _waves_over(self) -> bool:
        if not self._healed.is_set() or self._healed_at is None:
            return False
        reuse = "reuse" in self.kinds and self.settings.wave_size > 0
        return not reuse or time.monotonic() - self._healed_at >= self.after_heal_s

    def _prefix_round(self, roles: list[RoleLimits]) -> list[Shot]:
        bounds = [r.first_rejected for r in roles if r.first_rejected is not None]
        ceiling = min(bounds) - 40 if bounds else 2048
        long = max(SHORT_TOKENS[1], min(ceiling, 4 * SHARED_OPENING_WORDS))
        return [
            Shot("prefix", "shared opening", SHARED_OPENING_WORDS + SHORT_TOKENS[0], False, 32) for _ in range(3)
        ] + [Shot("prefix", "eviction pressure", long, False, 8) for _ in range(2)]

    def _keep(self, exchanges: list[Exchange]) -> None:
        with self._lock:
            self._exchanges.extend(exchanges)

    async def _shoot(self, client: httpx.AsyncClient, url: str, sizer: Sizer, shot: Shot) -> None:
        index = self.next_index()
        if shot.kind == "prefix" and shot.label == "shared opening":
            text, markers = self._shared_prompt(index, shot.tokens - SHARED_OPENING_WORDS)
        else:
            text, markers = self.prompt(index, sizer.repetitions(shot.tokens), INSTRUCTION)
        ex = self.exchange(
            index,
            (text, markers),
            KIND_OVER_LENGTH if shot.over_limit else KIND_PROVOCATION,
            shot.max_new_tokens,
            stream=shot.kind != "band",
        )
        ex.details.append(
            f"provoke {shot.kind}: {shot.label}, aimed at {shot.tokens} tokens"
            + ("" if sizer.exact else " (estimated)")
        )
        self._keep([ex])
        self._tally.sent[shot.kind] += 1
        try:
            await send(client, url, ex)
        except asyncio.CancelledError:
            ex.client_closed = "provocation ended"
            raise
        finally:
            status = str(ex.status) if ex.status is not None else (ex.transport[0] if ex.transport else "no answer")
            self._tally.statuses[f"{shot.kind} {status}"] += 1
            counted = ex.prompt_tokens if ex.prompt_tokens is not None else read_refusal(ex.error_message).prompt_tokens
            if shot.kind == "band" and counted is not None:
                self._tally.landed.setdefault(shot.label, []).append(counted)
            if shot.over_limit and ex.status == 200 and counted is not None and shot.limit and counted < shot.limit:
                ex.anomalies.append("over_length_missed")  # we undershot: not an over-length prompt

    def _shared_prompt(self, index: int, unique_tokens: int) -> tuple[str, list[str]]:
        """A long opening every `prefix` prompt shares (no marker in it, so the cache can share it),
        then this request's own markers, repeat instruction and filler."""
        head, tail = self.codec.marker(index, 0), self.codec.marker(index, 1)
        opening = "Shared notes of the provocation:" + " the" * SHARED_OPENING_WORDS
        return (
            f"{opening}\n{head} {INSTRUCTION}\n"
            + " and" * max(1, unique_tokens)
            + f"\n{tail} Repeat every code word you saw."
        ), [head, tail]
