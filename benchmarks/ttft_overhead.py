"""The run's own overhead on the TTFT it reports: client-journaled TTFT against the engine's own.

Starts the embedded stack as the default campaign configures it (`campaigns/default.yaml`'s
`target.sim`: fault proxies on the router->worker and KV links included, unless `--no-proxies`),
with each worker's timing log on (chaos/targets/sim/timing.py: `time.time()` when a request's
handler started and when its first token left). Then:

1. `floor`: a bare client (blocking sockets, a kept connection per kind of request, one request
   at a time) sends `--floor` `/generate` requests to the idle stack, in turn a whole reply, a
   stream, and a stream read with TCP_QUICKACK: the least a client can add, so what remains is
   the router, the proxies and the kernel.
2. `load`: `pdchaos load` (Ray-placed Locust actors, every request journaled: the path a run
   takes) at the campaign's load level: its profile, users, actors and max_tokens, steady for
   `--duration`. Meanwhile the bare client goes on, one request every `--floor-interval`
   seconds (`floor_under_load`): what the same router and engine give a bare client under
   that load, so the difference to the load users' figures is the users' own.

Each journaled request is joined to the decode worker's line by its id (the users send it as
`X-Request-ID`, which the router passes on; `/generate` bodies also carry it as `rid`). For each
joined request with a first token on both sides:

    overhead = (client t_first_token - client t_send) - (server t_first_token - server t_recv)

the time the request spent outside the decode worker's handler before its first token was in
the client's hands: client stack, router (and proxy) both ways, kernel. It splits exactly into
`to_server` (client t_send -> server t_recv) and `to_client` (server first token -> client
first token), both on one wall clock. Reported: median, p90, p99 in ms and the joined count,
overall and by route and streaming.

    .venv/bin/python benchmarks/ttft_overhead.py --json benchmarks/results/ttft-overhead.json
    .venv/bin/python benchmarks/ttft_overhead.py --short --json /tmp/ttft.json     # ~1 minute

Every process it starts is stopped at the end, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from harness import REPO, StopOnExit, command_line, machine_info, make_run_dir, utc_stamp, write_json

if str(REPO) not in sys.path:  # run as a script: the repository's packages come first
    sys.path.insert(0, str(REPO))

from chaos.campaign_validation import load_campaign
from chaos.journal import Journal, Outcome, RequestRecord
from chaos.targets.sim.stack import SimStack, sim_stack_config

DEFAULT_CAMPAIGN = REPO / "campaigns" / "default.yaml"
TARGET_MS = 1.0  # the target: a median difference of at most 1 ms at the default load


# ----------------------------------------------------------------------------- statistics ----


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank, as benchmarks/router_throughput.py."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100.0 * len(ordered)) - 1))
    return ordered[rank]


def dist(values_s: list[float]) -> dict[str, Any]:
    ms = [1000.0 * v for v in values_s]
    return {
        "n": len(ms),
        "median_ms": percentile(ms, 50),
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "min_ms": min(ms) if ms else None,
        "max_ms": max(ms) if ms else None,
    }


# ------------------------------------------------------------------------------- the join ----


def read_timing(path: Path) -> dict[str, dict[str, Any]]:
    """The worker's lines by request id (X-Request-ID, else the engine's rid)."""
    out: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        key = entry.get("request_id") or entry.get("rid")
        if key:
            out[str(key)] = entry
    return out


def join(records: list[RequestRecord], server: dict[str, dict[str, Any]], by_kind: bool = False) -> dict[str, Any]:
    """Client TTFT minus server TTFT per request that has a first token on both sides; grouped by
    route and streaming (the load), or by the bare client's kind of request (`by_kind`)."""
    rows: list[dict[str, Any]] = []
    with_ttft = 0
    for r in records:
        if r.t_first_token is None or r.t_send is None:
            continue
        with_ttft += 1
        s = server.get(r.id)
        if s is None or s.get("t_first_token") is None:
            continue
        client_ttft = r.t_first_token - r.t_send
        server_ttft = s["t_first_token"] - s["t_recv"]
        rows.append(
            {
                "group": r.user_kind if by_kind else f"{r.endpoint} {'stream' if r.stream else 'whole'}",
                "endpoint": r.endpoint,
                "stream": r.stream,
                "outcome": r.outcome.value,
                "client_ttft": client_ttft,
                "server_ttft": server_ttft,
                "overhead": client_ttft - server_ttft,
                "to_server": s["t_recv"] - r.t_send,
                "to_client": r.t_first_token - s["t_first_token"],
            }
        )

    def summary(subset: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "overhead": dist([x["overhead"] for x in subset]),
            "to_server": dist([x["to_server"] for x in subset]),
            "to_client": dist([x["to_client"] for x in subset]),
            "client_ttft": dist([x["client_ttft"] for x in subset]),
            "server_ttft": dist([x["server_ttft"] for x in subset]),
        }

    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(row["group"], []).append(row)
    return {
        "records": len(records),
        "records_with_ttft": with_ttft,
        "joined": len(rows),
        "not_joined": with_ttft - len(rows),
        **summary(rows),
        "by_route": {name: summary(subset) for name, subset in sorted(groups.items())},
    }


# ------------------------------------------------------------------------------ the floor ----

# The bare client's three kinds of request, each on its own kept connection (a reused connection
# is what the load users have): a whole reply; a stream; a stream whose reader sets TCP_QUICKACK
# before every read (Linux turns it off again after each), which shows what delayed ACKs cost.
FLOOR_KINDS = ("whole", "stream", "stream+quickack")
FLOOR_BLOCK = 10  # requests of one kind in a row


class BareClient:
    """Blocking sockets, one request at a time per kind, timed as the load users time theirs:
    t_send just before the request goes out, t_first_token when the first token arrives (a
    stream's first `data:` event; a whole reply once all of it is in)."""

    def __init__(self, host: str, port: int, max_tokens: int, prefix: str) -> None:
        self.host, self.port, self.max_tokens, self.prefix = host, port, max_tokens, prefix
        self.socks: dict[str, socket.socket] = {}
        self.records: list[RequestRecord] = []

    def _sock(self, kind: str) -> socket.socket:
        sock = self.socks.get(kind)
        if sock is None:
            sock = self.socks[kind] = socket.create_connection((self.host, self.port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def one(self, kind: str) -> None:
        i = len(self.records)
        rid = f"{self.prefix}-{i:06d}"
        stream = kind != "whole"
        body = json.dumps(
            {
                "text": f"floor probe {i}: tell me about lighthouses and patient cats, briefly.",
                "rid": rid,
                "stream": stream,
                "sampling_params": {"max_new_tokens": self.max_tokens, "temperature": 0},
            }
        ).encode()
        head = (
            f"POST /generate HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"X-Request-ID: {rid}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock = self._sock(kind)
        t_send = time.time()
        sock.sendall(head + body)
        status, t_first = _read_response(sock, quickack=kind.endswith("quickack"))
        self.records.append(
            RequestRecord(
                id=rid,
                request_index=i,
                user_kind=kind,
                endpoint="/generate",
                stream=stream,
                t_send=t_send,
                t_first_token=t_first if status == 200 else None,
                t_end=time.time(),
                status=status,
                outcome=Outcome.OK if status == 200 else Outcome.FAIL,
            )
        )

    def run(self, count: int | None, stop: threading.Event | None = None, interval_s: float = 0.0) -> None:
        """`count` requests (or until `stop`), the kinds in turn, FLOOR_BLOCK of a kind at a time
        back to back on its connection, as a load user sends its requests."""
        i = 0
        while (count is None or i < count) and not (stop is not None and stop.is_set()):
            self.one(FLOOR_KINDS[i // FLOOR_BLOCK % len(FLOOR_KINDS)])
            i += 1
            if interval_s:
                time.sleep(interval_s)

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()
        self.socks.clear()


def _read_response(sock: socket.socket, quickack: bool) -> tuple[int, float | None]:
    """Read one reply (length-delimited or chunked); (status, when its first token arrived)."""
    buf = b""
    first: float | None = None

    def more() -> bytes:
        if quickack:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the server closed the connection mid-reply")
        return chunk

    while b"\r\n\r\n" not in buf:
        buf += more()
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
    if headers.get(b"transfer-encoding", b"").lower() != b"chunked":
        length = int(headers.get(b"content-length", b"0"))
        while len(rest) < length:
            rest += more()
        return status, time.time()
    body = b""
    while True:
        while b"\r\n" not in rest:
            rest += more()
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        while len(rest) < size + 2:
            rest += more()
        body, rest = body + rest[:size], rest[size + 2 :]
        if first is None and b"data:" in body:
            first = time.time()
        if size == 0:
            return status, first if first is not None else time.time()


# ------------------------------------------------------------------------------- the load ----


def run_load(
    router_url: str, workers: list[str], out: Path, args: argparse.Namespace, load: dict[str, Any]
) -> dict[str, Any]:
    argv = [
        sys.executable,
        "-m",
        "chaos.cli",
        "load",
        "--target",
        router_url,
        *(a for w in workers for a in ("--worker", w)),
        "--profile",
        load["profile"],
        "--users",
        str(load["users"]),
        "--actors",
        str(load["actors"]),
        "--duration",
        f"{load['duration_s']:g}s",
        "--max-tokens",
        str(load["max_tokens"]),
        "--seed",
        str(args.seed),
        "--out",
        str(out),
    ]
    started = time.monotonic()
    result = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=load["duration_s"] + 300,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    (out.parent / "load.stderr").write_text(result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"pdchaos load exited {result.returncode}:\n{result.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return {"argv": argv, "wall_s": round(time.monotonic() - started, 1), "summary": summary}


# ------------------------------------------------------------------------------- the report ----


def fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    m, p = report["machine"], report["params"]
    lines = [
        "## The run's own overhead on TTFT",
        "",
        f"- machine: {m['nproc']} usable CPUs (`nproc`), {m['cpu_model']}; Linux {m['kernel']}, Python {m['python']}",
        f"- load average at start {' '.join(f'{x:.2f}' for x in m['loadavg_start'])}, at end "
        f"{' '.join(f'{x:.2f}' for x in m['loadavg_end'])}",
        f"- target: the embedded stack of `{p['campaign']}` (proxied links: {p['proxied_links']}), "
        "timing logs on both workers",
        f"- load: `pdchaos load`, profile {p['load']['profile']}, {p['load']['users']} users on "
        f"{p['load']['actors']} actors, steady, {p['load']['duration_s']:g} s, max_tokens {p['load']['max_tokens']}",
        f"- command: `{report['command']}`",
        "",
        "overhead = client TTFT (journal: t_first_token - t_send) - server TTFT (decode worker: first token "
        "sent - handler start); to_server = server t_recv - client t_send; to_client = client t_first_token - "
        "server first token sent. Milliseconds.",
        "",
        "| measured | joined / with TTFT | overhead median | p90 | p99 | to_server median | to_client median "
        "| client TTFT median | server TTFT median |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def row(name: str, j: dict[str, Any], with_ttft: int | None) -> str:
        o = j["overhead"]
        return (
            f"| {name} | {o['n']} / {with_ttft if with_ttft is not None else '–'} | {fmt(o['median_ms'])} "
            f"| {fmt(o['p90_ms'])} | {fmt(o['p99_ms'])} | {fmt(j['to_server']['median_ms'])} "
            f"| {fmt(j['to_client']['median_ms'])} | {fmt(j['client_ttft']['median_ms'], 1)} "
            f"| {fmt(j['server_ttft']['median_ms'], 1)} |"
        )

    for name in ("floor", "floor_under_load", "load"):
        j = report.get(name)
        if not j:
            continue
        lines.append(row(f"**{name}** (all)", j, j["records_with_ttft"]))
        for route, sub in j["by_route"].items():
            lines.append(row(f"{name}: {route}", sub, None))
    load = report.get("load")
    if load:
        median = load["overhead"]["median_ms"]
        verdict = "met" if median is not None and median <= TARGET_MS else "NOT met"
        lines += [
            "",
            f"Target (median overhead at most {TARGET_MS:g} ms at the default load): **{verdict}** "
            f"(median {fmt(median)} ms over {load['joined']} joined requests; {load['not_joined']} journaled "
            f"requests with a first token had no server line with one).",
        ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------- main ----


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--campaign", type=Path, default=DEFAULT_CAMPAIGN, help="its target.sim and load level are used")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of steady load (default 60)")
    p.add_argument("--floor", type=int, default=300, help="bare-client requests before the load (default 300; 0: none)")
    p.add_argument(
        "--floor-interval",
        type=float,
        default=0.02,
        help="seconds between the bare client's requests during the load (default 0.02; 0: none during the load)",
    )
    p.add_argument("--users", type=int, default=None, help="default: the campaign's")
    p.add_argument("--actors", type=int, default=None, help="default: the campaign's")
    p.add_argument(
        "--no-proxies", action="store_true", help="no fault proxies on the links, whatever the campaign says"
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--short", action="store_true", help="a quick check: 10 s of load from 2 users on 1 actor, 60 floor requests"
    )
    p.add_argument("--run-dir", type=Path, default=None, help="default runs/ttft_overhead-<time>")
    p.add_argument("--json", dest="json_path", default=None, help="also write the results as JSON here ('-': stdout)")
    args = p.parse_args(argv)
    if args.short:
        args.duration, args.floor = 10.0, 60
        args.users = args.users or 2
        args.actors = args.actors or 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    campaign = load_campaign(args.campaign)
    stamp = utc_stamp()
    run_dir = make_run_dir(args.run_dir, "ttft_overhead", stamp)
    config = sim_stack_config(campaign.target.sim)
    if args.no_proxies:
        config = replace(config, proxied_links=False)
    timing = {role: run_dir / f"timing-{role}.jsonl" for role in ("prefill", "decode")}
    config = replace(
        config,
        prefill_overrides={**config.prefill_overrides, "timing_log": str(timing["prefill"])},
        decode_overrides={**config.decode_overrides, "timing_log": str(timing["decode"])},
    )
    load = {
        "profile": campaign.load.profile,
        "users": args.users or campaign.load.users,
        "actors": args.actors or campaign.load.actors,
        "max_tokens": campaign.load.max_tokens,
        "duration_s": args.duration,
    }
    info = machine_info()
    stack = SimStack(config, run_dir / "stack")
    report: dict[str, Any] = {
        "machine": info,
        "params": {
            "campaign": str(args.campaign.resolve().relative_to(REPO))
            if args.campaign.resolve().is_relative_to(REPO)
            else str(args.campaign),
            "proxied_links": config.proxied_links,
            "load": load,
            "floor_requests": args.floor,
            "floor_interval_s": args.floor_interval,
            "short": args.short,
        },
        "command": command_line("ttft_overhead.py", argv),
        "run_dir": str(run_dir),
        "started_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    floors: dict[str, list[RequestRecord]] = {}
    with StopOnExit(stack.down) as stopping:
        print(f"starting the embedded stack (logs: {run_dir})", file=sys.stderr, flush=True)
        endpoints = stack.up()
        host, _, port = endpoints.router_url.removeprefix("http://").partition(":")
        if args.floor > 0:
            print(f"floor: {args.floor} bare-client requests", file=sys.stderr, flush=True)
            idle = BareClient(host, int(port), load["max_tokens"], f"floor{stamp}")
            try:
                idle.run(args.floor)
            finally:
                idle.close()
            floors["floor"] = idle.records
        print(f"load: pdchaos load for {args.duration:g} s", file=sys.stderr, flush=True)
        during = BareClient(host, int(port), load["max_tokens"], f"beside{stamp}")
        stop = threading.Event()
        beside = threading.Thread(target=during.run, args=(None, stop, args.floor_interval), daemon=True)
        if args.floor_interval > 0:
            beside.start()
        try:
            report["load_run"] = run_load(
                endpoints.router_url, [w.url for w in endpoints.workers], run_dir / "load", args, load
            )
        finally:
            stop.set()
            if beside.is_alive():
                beside.join(30)
            during.close()
        floors["floor_under_load"] = during.records
    if stopping.interrupted:
        return 130
    info["loadavg_end"] = list(os.getloadavg())
    server = read_timing(timing["decode"])
    for name, floor_records in floors.items():
        if floor_records:
            report[name] = join(floor_records, server, by_kind=True)
    with Journal.open(run_dir / "load", readonly=True) as journal:
        records = list(journal.iter_requests())
    report["load"] = join(records, server)
    report["server_lines"] = {role: len(read_timing(path)) for role, path in timing.items()}
    report["target_ms"] = TARGET_MS
    median = report["load"]["overhead"]["median_ms"]
    report["target_met"] = median is not None and median <= TARGET_MS
    print(markdown(report))
    print(f"\n(logs in {run_dir})")
    write_json(report, args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
