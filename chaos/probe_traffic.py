"""The reference probes under load: replayed at their interval through the load (not in its
lulls), one with each reuse wave of a window's provocation, all at once after every heal (the
aftershock), and the span probe across each window that freezes the KV sender. Every reply is
journaled and counts as progress for the watchdog. Their isolated answers were recorded at the
baseline (`chaos/runner.py`); the reference oracle compares."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from chaos import transport
from chaos.campaign import ProbeSpec, WindowSpec
from chaos.journal import Journal, RequestRecord
from chaos.probes import Probe, reader_order, replay_order, send_probe
from chaos.watchdog import ProgressWatchdog

log = logging.getLogger("pdchaos.runner")

AFTERSHOCK_PARALLEL = 8


class ProbeTraffic:
    def __init__(
        self,
        probes: list[Probe],
        router_url: str,
        api: str,
        model: str,
        spec: ProbeSpec,
        journal: Journal,
        watchdog: ProgressWatchdog,
        stop: threading.Event,
        say: Callable[[str], None],
        span: Probe | None = None,
        span_timeout_s: float = 0.0,
    ) -> None:
        self.probes = probes
        self.span = span  # recorded at the baseline when a window holds a span (faults/provoke.py)
        self.span_timeout_s = span_timeout_s
        self.router_url = router_url
        self.api = api
        self.model = model
        self.spec = spec
        self.journal = journal
        self.watchdog = watchdog
        self.stop = stop
        self.say = say

    def send(self, client: httpx.Client, probe: Probe, phase: str) -> RequestRecord:
        return send_probe(
            client, self.router_url, probe, phase, self.api, timeout_s=self.spec.timeout_s, model=self.model
        )

    def record(self, record: RequestRecord) -> None:
        self.journal.append_request(record)
        self.watchdog.note(record)

    def replayer(self) -> Callable[[], None] | None:
        """Sends the next reference probe now and journals it: the provocation's reuse waves carry
        one each, so pages a fault freed also go to requests whose right answer is known (the
        longer probes: `reader_order`)."""
        if not self.probes:
            return None
        order, count = reader_order(self.probes), itertools.count()

        def replay() -> None:
            probe = order[next(count) % len(order)]
            try:
                with transport.client(trust_env=False) as client:
                    self.record(self.send(client, probe, "provocation"))
            except Exception:  # a probe the run can no longer journal (it is ending) proves nothing
                log.debug("reference probe of a provocation not journaled", exc_info=True)

        return replay

    def span_sender(self) -> Callable[[threading.Event], None] | None:
        """Sends the span probe, sets the event once it decodes, journals it when it ends. Its
        timeout is past the liveness deadline: a span that long is a hang, not a doubt."""
        span = self.span
        if span is None:
            return None

        def send_span(decoding: threading.Event) -> None:
            try:
                with transport.client(trust_env=False) as client:
                    record = send_probe(
                        client,
                        self.router_url,
                        span,
                        "span",
                        self.api,
                        timeout_s=self.span_timeout_s,
                        model=self.model,
                        first_token=decoding,
                    )
                self.record(record)
            except Exception:  # a probe the run can no longer journal (it is ending) proves nothing
                log.debug("span probe not journaled", exc_info=True)

        return send_span

    def aftershock(self, window: WindowSpec) -> None:
        """Replay every probe right after the heal, all at once: corruption can outlive its fault,
        and probes one after another would push the next window back by a round trip each."""
        if self.stop.is_set() or self.watchdog.wedged.is_set() or not self.probes:
            return
        with (
            transport.client(trust_env=False, limits=httpx.Limits(max_connections=len(self.probes))) as client,
            ThreadPoolExecutor(
                max_workers=min(len(self.probes), AFTERSHOCK_PARALLEL), thread_name_prefix="aftershock"
            ) as pool,
        ):
            records = list(pool.map(lambda probe: self.send(client, probe, "aftershock"), self.probes))
        for record in records:
            self.record(record)
        unanswered = sum(1 for r in records if r.status is None)
        if unanswered:
            self.say(
                f"aftershock probes after {window.fault}: {unanswered} of {len(records)} got no answer "
                f"in {self.spec.timeout_s:.0f} s"
            )

    def replay_through_load(
        self, load_started: threading.Event, load_done: threading.Event, in_lull: Callable[[], bool]
    ) -> None:
        """Probes at their interval through the load, except in its lulls: a lull is kept idle,
        as the liveness oracle's idle-moment check needs."""
        order = replay_order(self.probes)
        with transport.client(trust_env=False) as client:
            n = 0
            while (
                not load_done.wait(self.spec.interval_s)
                and not self.stop.is_set()
                and not self.watchdog.wedged.is_set()
            ):
                if load_started.is_set() and in_lull():
                    continue
                self.record(self.send(client, order[n % len(order)], "load"))
                n += 1
