"""netns_partition: one link's destination port partitioned with iptables, for as long as a
holder process (`python -m faults.links hold`, __main__.py) keeps its rules."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from chaos.errors import UsageError
from chaos.process import launch
from faults.base import Confirmation, Fault, FaultContext, FaultNotAvailable, FaultParams
from faults.links.iptables import netns_unavailable, partition_packets, partition_present
from faults.links.proxy_faults import link_proxies
from faults.signals import RouterReading, transfer_failures
from faults.undo import UndoAction

HOLD_READY_S = 10.0


@dataclass(frozen=True)
class NetnsPartitionParams(FaultParams):
    # Which link: its destination port is partitioned (router_*: the worker's HTTP port, so every
    # client of that port is cut, not only the router; kv_transfer: decode's transfer port).
    link: Literal["router_prefill", "router_decode", "kv_transfer"] = "router_prefill"
    action: Literal["reject", "drop"] = "reject"  # reject: TCP reset at once; drop: silence (timeouts)
    netns: str = ""  # the network namespace the link runs in ("" = the suite's own)
    max_hold_s: float = 900.0  # the holder removes its rules by itself after this long

    def validate(self, where: str) -> None:
        if self.max_hold_s <= 0:
            raise UsageError(f"{where}.max_hold_s: {self.max_hold_s} must be positive")
        if self.netns and ("/" in self.netns or self.netns.startswith(".")):
            raise UsageError(f"{where}.netns: {self.netns!r} is not a namespace name")


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "//" in url else f"//{url}")
    if parts.hostname is None or parts.port is None:
        raise FaultNotAvailable(f"cannot tell the host and port of {url!r}")
    return parts.hostname, parts.port


def partition_target(ctx: FaultContext, link: str) -> tuple[str, int]:
    """(host, port) a partition of `link` blocks."""
    endpoints = ctx.target.endpoints
    if link in ("router_prefill", "router_decode"):
        workers = endpoints.of(link.removeprefix("router_"))  # type: ignore[arg-type]
        if not workers:
            raise FaultNotAvailable(f"the target lists no {link.removeprefix('router_')} worker")
        return _host_port(workers[0].url)
    proxies = link_proxies(ctx)
    if "kv_transfer" in proxies:
        return _host_port(proxies["kv_transfer"].upstream)
    settings = ctx.target.role_settings("decode")
    if settings.get("transfer_port"):
        return str(settings.get("host", "127.0.0.1")), int(settings["transfer_port"])
    raise FaultNotAvailable("decode's KV transfer port is not fixed (run the embedded stack with proxied_links: true)")


def _read_events(path: Any) -> list[dict[str, Any]]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    events = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


def _wait_event(proc: Any, wanted: set[str], timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in _read_events(proc.log_path):
            if event.get("event") in wanted:
                return event
        if not proc.alive():
            raise RuntimeError(f"partition holder exited ({proc.popen.returncode}); see {proc.log_path}")
        time.sleep(0.05)
    raise TimeoutError(
        f"partition holder said nothing of {sorted(wanted)} within {timeout_s:.0f}s; see {proc.log_path}"
    )


class NetnsPartition(Fault):
    """Partition one link's destination port with iptables, where iptables runs.

    Supported subset: TCP to one (host, port), REJECT with a TCP reset or DROP, both directions
    (dport and sport rules in a chain of its own hooked into OUTPUT, which loopback traffic and a
    namespace's own traffic cross), in the namespace `netns` (`ip netns exec`) or the suite's own.
    Needs root and `iptables`; elsewhere `inject` raises "not available here: <reason>" and the
    window is reported unconfirmed with that reason. No partial (probabilistic) loss, no
    cross-host partitions.
    """

    name = "netns_partition"
    summary = "iptables partition (reject/drop) of one link's port, in a network namespace or the suite's own; root + iptables"
    Params = NetnsPartitionParams
    targets = frozenset({"sim", "sglang", "vllm"})

    @property
    def p(self) -> NetnsPartitionParams:
        return self.params  # type: ignore[return-value]

    def _chain(self, ctx: FaultContext) -> str:
        seed = f"{ctx.target.run_dir}|{ctx.window_id}|{os.getpid()}|{time.time_ns()}"
        return "PDCHAOS-" + hashlib.sha1(seed.encode()).hexdigest()[:10].upper()

    def undo_plan(self, ctx: FaultContext) -> list[UndoAction]:
        """Start the holder (armed, no rules yet): its pid is what heal must stop."""
        p = self.p
        reason = netns_unavailable(p.netns)
        if reason is None:
            try:
                host, port = partition_target(ctx, p.link)
            except FaultNotAvailable as exc:
                reason = str(exc).removeprefix("not available here: ")
        if reason is not None:
            ctx.baseline["unavailable"] = reason
            return []
        chain = self._chain(ctx)
        argv = [
            sys.executable,
            "-m",
            "faults.links",
            "hold",
            "--chain",
            chain,
            "--host",
            host,
            "--port",
            str(port),
            "--action",
            p.action,
            "--max-hold-s",
            str(p.max_hold_s),
        ]
        if p.netns:
            argv += ["--netns", p.netns]
        log_path = Path(ctx.target.run_dir) / "logs" / f"netns_partition-{chain}.log"
        proc = launch(f"partition {chain}", argv, log_path)
        ctx.baseline.update(holder=proc, chain=chain, host=host, port=port)
        _wait_event(proc, {"armed"}, HOLD_READY_S)
        return [UndoAction("stop_pid", pid=proc.pid)]

    def inject(self, ctx: FaultContext) -> None:
        if "unavailable" in ctx.baseline:
            raise FaultNotAvailable(ctx.baseline["unavailable"])
        proc = ctx.baseline["holder"]
        ctx.baseline["consequence_before"] = (
            transfer_failures(ctx.target) if self.p.link == "kv_transfer" else RouterReading.now(ctx)
        )
        os.kill(proc.pid, signal.SIGUSR1)
        event = _wait_event(proc, {"installed", "error"}, HOLD_READY_S)
        if event["event"] == "error":
            raise FaultNotAvailable(f"iptables refused the partition: {event.get('error')}")
        ctx.baseline["injected"] = True

    def confirm(self, ctx: FaultContext) -> Confirmation:
        if not ctx.baseline.get("injected"):
            return Confirmation(False, f"not available here: {ctx.baseline.get('unavailable', 'not injected')}")
        p = self.p
        packets = partition_packets(p.netns, ctx.baseline["chain"])
        where = f"{ctx.baseline['host']}:{ctx.baseline['port']}" + (f" in netns {p.netns}" if p.netns else "")
        touched = f"iptables chain {ctx.baseline['chain']} ({p.action} {where}) matched {packets} packet(s)"
        if packets <= 0:
            return Confirmation(False, touched + "; no traffic crossed the partition")
        before = ctx.baseline["consequence_before"]
        if p.link == "kv_transfer":
            failed = max(0.0, transfer_failures(ctx.target) - float(before))
            return Confirmation(failed > 0, f"{touched}; workers' failed-transfer counters +{failed:.0f}")
        errors, lines = before.since(ctx)
        return Confirmation(
            errors > 0 or lines > 0,
            f"{touched}; router errors since inject: /metrics +{errors:.0f}, error log lines {lines}",
        )

    def heal(self, ctx: FaultContext, plan: list[UndoAction]) -> None:
        holder = ctx.baseline.get("holder")
        if holder is not None:
            holder.stop()  # SIGTERM: it removes its rules; and we reap our own child
        super().heal(ctx, plan)

    def audit(self, ctx: FaultContext, plan: list[UndoAction]) -> list[str]:
        problems = super().audit(ctx, plan)
        chain = ctx.baseline.get("chain")
        if chain and partition_present(self.p.netns, chain):
            problems.append(f"iptables chain {chain} is still installed")
        return problems
