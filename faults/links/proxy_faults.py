"""The link faults put on the target's fault proxies: kv_transfer and router_link."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from chaos.errors import UsageError
from chaos.targets.base import LinkProxy, ProxiedLinks
from faults.base import Confirmation, Fault, FaultContext, FaultNotAvailable, FaultParams
from faults.proxy.control import ControlClient
from faults.proxy.spec import FaultSpec, StreamFaults
from faults.proxy.stats import ProxyStats
from faults.signals import RouterReading, transfer_failures
from faults.undo import UndoAction


def link_proxies(ctx: FaultContext) -> Mapping[str, LinkProxy]:
    """The target's fault proxies by link; none for a target without them."""
    return ctx.target.proxies if isinstance(ctx.target, ProxiedLinks) else {}


def proxy_of(ctx: FaultContext, link: str) -> LinkProxy:
    """The target's fault proxy on `link`, or FaultNotAvailable."""
    handle = link_proxies(ctx).get(link)
    if handle is None:
        raise FaultNotAvailable(
            f"the target has no fault proxy on its {link} link (run the embedded stack with proxied_links: true)"
        )
    return handle


Direction = Literal["upstream", "downstream", "both"]


def _spec(direction: Direction, faults: StreamFaults, probability: float, seed: int, refuse: bool = False) -> FaultSpec:
    up = faults if direction in ("upstream", "both") else StreamFaults()
    down = faults if direction in ("downstream", "both") else StreamFaults()
    return FaultSpec(up, down, probability, seed, refuse)


def _check_probability(where: str, probability: float) -> None:
    if not 0 < probability <= 1:
        raise UsageError(f"{where}.probability: {probability} must be in (0, 1]")


class ProxyFault(Fault):
    """A fault put on one of the target's proxies; subclasses say which link, what spec, and
    whether the mode is destructive (then a downstream consequence must be seen too)."""

    def link(self) -> str:
        raise NotImplementedError

    def spec(self) -> FaultSpec:
        raise NotImplementedError

    def destructive(self) -> bool:
        raise NotImplementedError

    def lingers_s(self) -> float:
        spec = self.spec()
        return max((f.latency_ms + f.jitter_ms) / 1000 for f in (spec.upstream, spec.downstream))

    def consequence_now(self, ctx: FaultContext) -> Any:
        """A reading taken at inject, compared in `consequence`."""
        return None

    def consequence(self, ctx: FaultContext, before: Any) -> tuple[bool, str]:
        return True, ""

    def undo_plan(self, ctx: FaultContext) -> list[UndoAction]:
        try:
            handle = proxy_of(ctx, self.link())
        except FaultNotAvailable:
            return []  # inject says why; nothing to undo
        return [UndoAction("clear_proxy", url=handle.control_url)]

    def inject(self, ctx: FaultContext) -> None:
        handle = proxy_of(ctx, self.link())
        with ControlClient(handle.control_url) as client:
            ctx.baseline["proxy_before"] = client.stats()
            ctx.baseline["consequence_before"] = self.consequence_now(ctx)
            client.set_faults(self.spec())
        ctx.baseline["control_url"] = handle.control_url

    def confirm(self, ctx: FaultContext) -> Confirmation:
        url = ctx.baseline.get("control_url")
        if url is None:
            return Confirmation(False, "not injected")
        try:
            with ControlClient(url) as client:
                stats: ProxyStats = client.stats().since(ctx.baseline["proxy_before"])
        except httpx.HTTPError as exc:
            return Confirmation(False, f"proxy {url} unreadable: {type(exc).__name__}")
        touched = (
            f"proxy {self.link()}: {stats.affected} connection(s) affected since inject "
            f"(accepted {stats.accepted}, refused {stats.refused}, resets {stats.resets}, "
            f"truncations {stats.truncations}, blackholed {stats.blackholed}, delayed chunks {stats.delayed_chunks}, "
            f"throttled bytes {stats.throttled_bytes})"
        )
        if stats.affected <= 0:
            return Confirmation(False, touched + "; the fault touched no traffic")
        if not self.destructive():
            return Confirmation(True, touched)
        seen, what = self.consequence(ctx, ctx.baseline.get("consequence_before"))
        return Confirmation(seen, f"{touched}; {what}")


# ---------------------------------------------------------------------------- kv_transfer ----


@dataclass(frozen=True)
class KvTransferParams(FaultParams):
    mode: Literal["latency", "bandwidth", "reset", "truncate", "blackhole"] = "latency"
    latency_ms: float = 200.0  # latency mode: each chunk held this long (+- jitter_ms)
    jitter_ms: float = 0.0
    bandwidth_bytes_per_s: float = 262144.0  # bandwidth mode
    truncate_after_bytes: int = 4096  # truncate mode: forward this much of each connection, then FIN
    # upstream: prefill->decode (the KV writes); downstream: decode->prefill (the ACKs)
    direction: Literal["upstream", "downstream", "both"] = "upstream"
    probability: float = 1.0  # share of transfer connections affected (seeded draw per connection)
    seed: int = 0

    def validate(self, where: str) -> None:
        _check_probability(where, self.probability)
        if self.mode == "latency" and self.latency_ms <= 0 and self.jitter_ms <= 0:
            raise UsageError(f"{where}.latency_ms: latency mode needs latency_ms or jitter_ms above 0")
        if self.latency_ms < 0 or self.jitter_ms < 0:
            raise UsageError(f"{where}.latency_ms/jitter_ms: must not be negative")
        if self.bandwidth_bytes_per_s < 1:
            raise UsageError(f"{where}.bandwidth_bytes_per_s: {self.bandwidth_bytes_per_s} must be at least 1")
        if self.truncate_after_bytes < 0:
            raise UsageError(f"{where}.truncate_after_bytes: {self.truncate_after_bytes} must not be negative")


class KvTransfer(ProxyFault):
    name = "kv_transfer"
    summary = (
        "degrade the KV transfer link through its fault proxy: latency/jitter, bandwidth, reset, truncate, blackhole"
    )
    Params = KvTransferParams
    targets = frozenset({"sim"})

    @property
    def p(self) -> KvTransferParams:
        return self.params  # type: ignore[return-value]

    def link(self) -> str:
        return "kv_transfer"

    def destructive(self) -> bool:
        return self.p.mode in ("reset", "truncate", "blackhole")

    def spec(self) -> FaultSpec:
        p = self.p
        faults = {
            "latency": StreamFaults(latency_ms=p.latency_ms, jitter_ms=p.jitter_ms),
            "bandwidth": StreamFaults(bandwidth_bytes_per_s=p.bandwidth_bytes_per_s),
            "reset": StreamFaults(reset=True),
            "truncate": StreamFaults(truncate_after_bytes=p.truncate_after_bytes),
            "blackhole": StreamFaults(blackhole=True),
        }[p.mode]
        return _spec(p.direction, faults, p.probability, p.seed)

    def consequence_now(self, ctx: FaultContext) -> Any:
        return transfer_failures(ctx.target)

    def consequence(self, ctx: FaultContext, before: Any) -> tuple[bool, str]:
        failed = max(0.0, transfer_failures(ctx.target) - float(before or 0.0))
        return failed > 0, f"workers' failed-transfer counters +{failed:.0f}"


# ---------------------------------------------------------------------------- router_link ----


@dataclass(frozen=True)
class RouterLinkParams(FaultParams):
    link: Literal["prefill", "decode"] = "prefill"  # router->prefill or router->decode
    mode: Literal["latency", "partition"] = "latency"
    latency_ms: float = 200.0
    jitter_ms: float = 0.0
    probability: float = 1.0
    seed: int = 0

    def validate(self, where: str) -> None:
        _check_probability(where, self.probability)
        if self.latency_ms < 0 or self.jitter_ms < 0:
            raise UsageError(f"{where}.latency_ms/jitter_ms: must not be negative")
        if self.mode == "latency" and self.latency_ms <= 0 and self.jitter_ms <= 0:
            raise UsageError(f"{where}.latency_ms: latency mode needs latency_ms or jitter_ms above 0")


class RouterLink(ProxyFault):
    name = "router_link"
    summary = "latency or a partition (refuse + reset live connections) on router->prefill or router->decode"
    Params = RouterLinkParams
    targets = frozenset({"sim"})

    @property
    def p(self) -> RouterLinkParams:
        return self.params  # type: ignore[return-value]

    def link(self) -> str:
        return f"router_{self.p.link}"

    def destructive(self) -> bool:
        return self.p.mode == "partition"

    def spec(self) -> FaultSpec:
        p = self.p
        if p.mode == "partition":
            return _spec("both", StreamFaults(reset=True), p.probability, p.seed, refuse=True)
        return _spec("both", StreamFaults(latency_ms=p.latency_ms, jitter_ms=p.jitter_ms), p.probability, p.seed)

    def consequence_now(self, ctx: FaultContext) -> Any:
        return RouterReading.now(ctx)

    def consequence(self, ctx: FaultContext, before: Any) -> tuple[bool, str]:
        errors, lines = before.since(ctx)
        return errors > 0 or lines > 0, f"router errors since inject: /metrics +{errors:.0f}, error log lines {lines}"
