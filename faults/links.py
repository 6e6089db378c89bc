"""Link faults: degrade the KV transfer channel or a router->worker link, or partition a port.

- kv_transfer: latency/jitter, bandwidth, reset, truncation or a black hole on the KV transfer
  link, through the fault proxy decode advertises to prefill (`SimStackConfig.proxied_links`).
- router_link: latency, or a partition (new connections refused with a RST, live ones reset at
  their next chunk), on router->prefill or router->decode, through the proxy the router uses.
- netns_partition: iptables rules (DROP, or REJECT with a TCP reset) on one link's destination
  port, in a network namespace (`ip netns exec`) or in the suite's own; see `NetnsPartition`.

Undo: a proxy fault's heal is "clear_proxy" with the proxy's control URL, journaled before
inject, so `pdchaos heal` clears it after a SIGKILL (and stopping the stack stops the proxy).
A partition's rules live as long as a small holder process (`python -m faults.links hold ...`)
started before inject; its heal is "stop_pid", and the holder removes its rules on SIGTERM.

Confirmation: the proxy's (or the rules') own counters show traffic was touched since inject
AND, for destructive modes (reset, truncate, blackhole, partition), something downstream noticed:
failed-transfer counters on the workers' /metrics, or router errors (5xx responses and worker
errors on the router's /metrics, error lines in its log). Touching nothing is INCONCLUSIVE.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import httpx

from chaos.errors import UsageError
from chaos.facts import parse_prometheus_text
from chaos.process import launch
from faults.base import Confirmation, Fault, FaultContext, FaultParams
from faults.proxy import FaultSpec, ProxyStats, StreamFaults
from faults.proxy_control import ControlClient
from faults.signals import LogCursor, transfer_failures
from faults.undo import UndoAction

# What the real sglang-router (smg) logs when a request or a health check to a worker fails.
ROUTER_ERROR_LINE = (
    r"request failed with server error|error sending request|returned error status|"
    r"[Hh]ealth check failed|marked (as )?unhealthy|[Cc]onnection (refused|reset)"
)
METRICS_TIMEOUT_S = 3.0


class FaultNotAvailable(RuntimeError):
    """This fault cannot act on this target or host; the message says why ("not available here: ...")."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"not available here: {reason}")


# ------------------------------------------------------------------------------ readings ----


def router_errors(ctx: FaultContext) -> float:
    """5xx responses plus worker errors on the router's /metrics; 0 when unreadable."""
    url = ctx.target.endpoints.router_metrics_url
    if not url:
        return 0.0
    try:
        text = httpx.get(url, timeout=METRICS_TIMEOUT_S, trust_env=False).text
    except httpx.HTTPError:
        return 0.0
    total = 0.0
    for sample in parse_prometheus_text(text):
        server_error = sample.name == "smg_http_responses_total" and sample.labels.get("status_code", "").startswith("5")
        if server_error or sample.name == "smg_worker_errors_total":
            total += sample.value
    return total


def _router_log(ctx: FaultContext) -> str:
    logs = getattr(ctx.target, "logs", None)  # an attached target may have no router log
    try:
        return logs("router") if callable(logs) else ""
    except (OSError, KeyError, ValueError):
        return ""


@dataclass
class RouterReading:
    """Router-side errors since a point in time: metrics and log lines."""

    errors: float
    log: LogCursor

    @classmethod
    def now(cls, ctx: FaultContext) -> RouterReading:
        return cls(router_errors(ctx), LogCursor.at_end(_router_log(ctx)))

    def since(self, ctx: FaultContext) -> tuple[float, int]:
        return max(0.0, router_errors(ctx) - self.errors), self.log.count(_router_log(ctx), ROUTER_ERROR_LINE)


def proxy_of(ctx: FaultContext, link: str) -> Any:
    """The target's fault proxy on `link` (a `ProxyHandle`), or FaultNotAvailable."""
    proxies = getattr(ctx.target, "proxies", None) or {}
    handle = proxies.get(link)
    if handle is None:
        raise FaultNotAvailable(
            f"the target has no fault proxy on its {link} link (run the embedded stack with proxied_links: true)"
        )
    return handle


# ------------------------------------------------------------------------- proxy faults ----


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
    summary = "degrade the KV transfer link through its fault proxy: latency/jitter, bandwidth, reset, truncate, blackhole"
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


# ------------------------------------------------------------------------ netns_partition ----


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


def netns_unavailable(netns: str = "") -> str | None:
    """Why iptables partitions cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "iptables needs root (CAP_NET_ADMIN); run the suite as root or skip netns_partition"
    if shutil.which("iptables") is None:
        return "iptables is not installed (apt-get install iptables)"
    if netns:
        if shutil.which("ip") is None:
            return "the `ip` command (iproute2) is not installed"
        listed = _run(["ip", "netns", "list"])
        names = {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}
        if netns not in names:
            return f"network namespace {netns!r} does not exist (ip netns list: {sorted(names) or 'none'})"
    probe = _run(_iptables(netns) + ["-L", "OUTPUT", "-n"])
    if probe.returncode != 0:
        return f"iptables cannot run here: {(probe.stderr or probe.stdout).strip()[:200]}"
    return None


def _iptables(netns: str) -> list[str]:
    return (["ip", "netns", "exec", netns] if netns else []) + ["iptables", "-w", "5"]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:  # no such binary, or it hung
        return subprocess.CompletedProcess(argv, 127, "", f"{type(exc).__name__}: {exc}")


def partition_rules(chain: str, host: str, port: int, action: str) -> list[list[str]]:
    """The rule specs of one partition (without the iptables prefix)."""
    target = ["REJECT", "--reject-with", "tcp-reset"] if action == "reject" else ["DROP"]
    return [
        # Resets from the port pass: REJECT's own RST leaves through OUTPUT too, and without
        # this rule the sport rule would swallow it and a reject would behave like a drop.
        ["-A", chain, "-p", "tcp", "-s", host, "--sport", str(port), "--tcp-flags", "RST", "RST", "-j", "RETURN"],
        ["-A", chain, "-p", "tcp", "-d", host, "--dport", str(port), "-j", *target],
        ["-A", chain, "-p", "tcp", "-s", host, "--sport", str(port), "-j", *target],
    ]


def install_partition(netns: str, chain: str, host: str, port: int, action: str) -> None:
    ipt = _iptables(netns)
    steps = [["-N", chain], *partition_rules(chain, host, port, action), ["-I", "OUTPUT", "1", "-j", chain]]
    for step in steps:
        done = _run(ipt + step)
        if done.returncode != 0:
            remove_partition(netns, chain)
            raise RuntimeError(f"iptables {' '.join(step)}: {(done.stderr or done.stdout).strip()}")


def remove_partition(netns: str, chain: str) -> None:
    """Idempotent: unhook the chain from OUTPUT (every copy), flush and delete it."""
    ipt = _iptables(netns)
    for _ in range(16):
        if _run(ipt + ["-D", "OUTPUT", "-j", chain]).returncode != 0:
            break
    _run(ipt + ["-F", chain])
    _run(ipt + ["-X", chain])


def partition_present(netns: str, chain: str) -> bool:
    if shutil.which("iptables") is None:
        return False
    return _run(_iptables(netns) + ["-S", chain]).returncode == 0


def partition_packets(netns: str, chain: str) -> int:
    """Packets the chain's rules matched so far (0 when the chain is gone)."""
    listing = _run(_iptables(netns) + ["-L", chain, "-v", "-x", "-n"])
    if listing.returncode != 0:
        return 0
    total = 0
    for line in listing.stdout.splitlines()[2:]:
        fields = line.split()
        if fields and fields[0].isdigit():
            total += int(fields[0])
    return total


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
    proxies = getattr(ctx.target, "proxies", None) or {}
    if "kv_transfer" in proxies:
        return _host_port(proxies["kv_transfer"].upstream)
    settings = ctx.target.role_settings("decode") if hasattr(ctx.target, "role_settings") else {}
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
    raise TimeoutError(f"partition holder said nothing of {sorted(wanted)} within {timeout_s:.0f}s; see {proc.log_path}")


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
        seed = f"{getattr(ctx.target, 'run_dir', '')}|{ctx.window_id}|{os.getpid()}|{time.time_ns()}"
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
        argv = [sys.executable, "-m", "faults.links", "hold", "--chain", chain, "--host", host, "--port", str(port),
                "--action", p.action, "--max-hold-s", str(p.max_hold_s)]
        if p.netns:
            argv += ["--netns", p.netns]
        log_path = Path(getattr(ctx.target, "run_dir", None) or ".") / "logs" / f"netns_partition-{chain}.log"
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
        return Confirmation(errors > 0 or lines > 0,
                            f"{touched}; router errors since inject: /metrics +{errors:.0f}, error log lines {lines}")

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


# ------------------------------------------------------------------------ partition holder ----


def hold(argv: Sequence[str] | None = None) -> int:
    """`python -m faults.links hold ...`: arm, install on SIGUSR1, remove on SIGTERM/SIGINT/SIGHUP
    or after --max-hold-s. One JSON line per step on stdout (the fault reads them from the log)."""
    parser = argparse.ArgumentParser(prog="python -m faults.links hold")
    parser.add_argument("--chain", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--action", choices=("reject", "drop"), default="reject")
    parser.add_argument("--netns", default="")
    parser.add_argument("--max-hold-s", type=float, default=900.0)
    args = parser.parse_args(argv)
    state = {"install": False, "stop": False}

    def on_install(*_: object) -> None:
        state["install"] = True

    def on_stop(*_: object) -> None:
        state["stop"] = True

    signal.signal(signal.SIGUSR1, on_install)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_stop)

    def say(event: str, **data: object) -> None:
        print(json.dumps({"event": event, "pid": os.getpid(), **data}), flush=True)

    say("armed", chain=args.chain)
    deadline = time.monotonic() + args.max_hold_s
    installed = False
    try:
        while not state["stop"] and time.monotonic() < deadline:
            if state["install"] and not installed:
                try:
                    install_partition(args.netns, args.chain, args.host, args.port, args.action)
                except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                    say("error", error=str(exc))
                    return 1
                installed = True
                say("installed", chain=args.chain, host=args.host, port=args.port, action=args.action)
            time.sleep(0.05)
    finally:
        remove_partition(args.netns, args.chain)
        say("removed", chain=args.chain, expired=time.monotonic() >= deadline)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "hold":
        print("usage: python -m faults.links hold --chain C --host H --port P [--action reject|drop] [--netns NS]", file=sys.stderr)
        return 2
    return hold(argv[1:])


if __name__ == "__main__":
    from faults.links import (
        main as _main,  # the imported module's copy, as faults.proxy does
    )

    sys.exit(_main())
