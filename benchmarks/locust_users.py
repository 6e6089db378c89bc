"""Requests/s of one Locust process with our users, side by side with Locust's FastHttpUser.

Both hit the same trivial SSE endpoint (`benchmarks/sse_server.py`, one aiohttp process):

  ours      `loadprofiles/locustfile.py` exactly as `pdchaos run` starts it (a `LoadConfig` in
            `PDCHAOS_LOAD_CONFIG`), mix `canary_chat`: canary-marked prompts, /generate,
            /v1/chat/completions and /v1/completions, streaming and not, every reply read as it
            arrives (SSE parsed line by line, each piece timed), judged and appended to a records
            file; each user on its own connection (loadprofiles/http_client.py).
  httpx     (only when named in --variants) ours with `http_client: "httpx"`: the same users,
            sending through httpx, the client the probes use.
  fasthttp  this file as a locustfile: a `FastHttpUser` that POSTs the same request bodies (built
            beforehand with the same prompt factory and route/stream choices) and reads each
            reply whole, with no parsing and no records.

Both run `--users` users with no think time, for `--duration` seconds per run, one Locust
process at a time, taking turns (ours, fasthttp, then fasthttp, ours, ...) for `--rounds`
rounds. req/s is Locust's own request count over the time between its first and last request.
CPU is read from /proc: the Locust process and the server, sampled from 3 s after the start
(imports and spawning done) to the end of the run, divided by the req/s of that run.

Marker scanning does not happen inside the Locust process: the users plant markers in the
prompts and record the replies; the leak oracle scans the records afterwards, in the driver.
So the scan is timed separately, over the records this run wrote (`MarkerCodec.scan` on every
response text, as `chaos/oracles/leaks.py` does), and reported per request. The records are
also checked: every completed reply must carry its own head marker back (the server echoes the
start of the prompt) and nothing else.

    .venv/bin/python benchmarks/locust_users.py                   # 2 rounds x 2 x 12 s, about 60 s
    .venv/bin/python benchmarks/locust_users.py --users 20 --duration 12 --rounds 2 --json out.json
    .venv/bin/python benchmarks/locust_users.py --short           # 1 round x 2 x 5 s: it runs (tests)

The server and every Locust process it starts are stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import itertools
import json
import os

BODIES_ENV = "PDCHAOS_BENCH_BODIES"

if os.environ.get(BODIES_ENV):
    # ------------------------------------------------ imported by Locust as a locustfile ----
    from locust import FastHttpUser, constant, task

    with open(os.environ[BODIES_ENV]) as _fh:
        _BODIES: list[tuple[str, str, str]] = [tuple(x) for x in json.load(_fh)]
    _NEXT = itertools.count()

    class SameBodiesUser(FastHttpUser):
        """POSTs the prepared bodies in turn and reads each reply whole."""

        wait_time = constant(0)

        @task
        def post(self) -> None:
            path, name, body = _BODIES[next(_NEXT) % len(_BODIES)]
            self.client.post(path, data=body, headers={"Content-Type": "application/json"}, name=name)


# --------------------------------------------------------------------------------- driver ----

import argparse
import datetime
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
WARMUP_S = 3.0  # CPU is counted from this long after a Locust process starts
VARIANTS = ("ours", "fasthttp", "httpx")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def proc_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of one process (all its threads), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_ticks() -> tuple[int, int]:
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])
    return total - idle, total


def machine() -> dict[str, Any]:
    model = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return "?"

    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "locust": version("locust"),
        "httpx": version("httpx"),
        "geventhttpclient": version("geventhttpclient"),
        "orjson": version("orjson"),
        "aiohttp": version("aiohttp"),
        "loadavg_start": list(os.getloadavg()),
    }


# ------------------------------------------------------------------------------- bodies ----


def build_bodies(count: int, seed: int, max_tokens: int, index_base: int) -> list[tuple[str, str, str]]:
    """(path, name, JSON body) as the canary_chat user would send them (same choices, same factory)."""
    from chaos.markers import MarkerCodec, new_run_prefix
    from chaos.targets.discovery import TargetFacts
    from loadprofiles.exchange import ROUTES, request_body
    from loadprofiles.prompts import PromptFactory
    from loadprofiles.sse import Api

    codec = MarkerCodec(new_run_prefix())
    prompts = PromptFactory(codec, seed, TargetFacts())
    rng = random.Random(seed)
    out = []
    for i in range(count):
        index = index_base + i
        prompt = prompts.canary(index, medium=rng.random() < 0.3, repeat=rng.random() < 0.5)
        routes: list[Api] = ["generate", "chat", "completions"] if prompt.chat_ok else ["generate", "completions"]
        route = rng.choice(routes)
        stream = rng.random() < 0.5
        rid = f"{codec.run_prefix}-load-{index:09d}-bench" if route == "generate" else None
        body = request_body(route, prompt, stream=stream, max_tokens=max_tokens, model="default", rid=rid)
        name = f"{ROUTES[route]}{' stream' if stream else ''}"
        out.append((ROUTES[route], name, json.dumps(body)))
    return out


# ---------------------------------------------------------------------------------- runs ----


@dataclass
class RunResult:
    variant: str
    round: int
    requests: int = 0
    failures: int = 0
    seconds: float = 0.0
    rps: float = 0.0
    locust_cores: float | None = None  # CPU seconds per second, steady state
    server_cores: float | None = None
    machine_busy: float | None = None
    rc: int | None = None
    wall_s: float = 0.0
    records: dict[str, Any] = field(default_factory=dict)

    def cpu_ms_per_req(self, cores: float | None) -> float | None:
        return None if cores is None or not self.rps else 1000.0 * cores / self.rps


def locust_totals(stdout: str) -> tuple[int, int, float]:
    """(requests, failures, seconds from the first request to the last) from Locust's --json list."""
    start = stdout.find("[")
    stats = json.loads(stdout[start:]) if start >= 0 else []
    requests = sum(int(s.get("num_requests", 0)) for s in stats)
    failures = sum(int(s.get("num_failures", 0)) for s in stats)
    first = min((float(s["start_time"]) for s in stats if s.get("num_requests")), default=0.0)
    last = max((float(s["last_request_timestamp"]) for s in stats if s.get("last_request_timestamp")), default=0.0)
    return requests, failures, max(0.0, last - first)


def run_locust(
    variant: str,
    round_no: int,
    argv: list[str],
    env: dict[str, str],
    duration: float,
    server_pid: int,
    pin: bool,
    children: list[subprocess.Popen[str] | subprocess.Popen[bytes]],
) -> RunResult:
    result = RunResult(variant, round_no)
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    children.append(proc)
    if pin:
        os.sched_setaffinity(proc.pid, {0})
    window: list[tuple[float, float, float, tuple[int, int]]] = []  # (t, locust cpu, server cpu, ticks)
    end_at = started + duration - 0.5
    while proc.poll() is None and time.monotonic() < started + duration + 30:
        now = time.monotonic()
        if now - started >= WARMUP_S and now <= end_at:
            cpu, server = proc_cpu_s(proc.pid), proc_cpu_s(server_pid)
            if cpu is not None and server is not None:
                window.append((now, cpu, server, machine_ticks()))
        time.sleep(0.25)
    try:
        stdout, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
    children.remove(proc)
    result.rc = proc.returncode
    result.wall_s = time.monotonic() - started
    if proc.returncode != 0:
        print(f"[locust_users] {variant}: Locust exited {proc.returncode}:\n{stderr[-3000:]}", file=sys.stderr)
    try:
        result.requests, result.failures, result.seconds = locust_totals(stdout)
    except (ValueError, KeyError) as exc:
        print(f"[locust_users] {variant}: cannot read Locust's JSON ({exc}): {stdout[:500]!r}", file=sys.stderr)
    result.rps = result.requests / result.seconds if result.seconds else 0.0
    if len(window) >= 2:
        (t0, c0, s0, m0), (t1, c1, s1, m1) = window[0], window[-1]
        result.locust_cores = (c1 - c0) / (t1 - t0)
        result.server_cores = (s1 - s0) / (t1 - t0)
        result.machine_busy = (m1[0] - m0[0]) / max(1, m1[1] - m0[1])
    return result


def check_records(path: Path) -> dict[str, Any]:
    """Outcomes, and the leak scan the driver would run over them, timed."""
    from chaos.journal import RequestRecord
    from chaos.markers import MarkerCodec

    records = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                records.append(RequestRecord(**json.loads(line)))
    if not records:
        return {"records": 0}
    codec = MarkerCodec(records[0].id.split("-", 1)[0])
    outcomes: dict[str, int] = {}
    for r in records:
        outcomes[r.outcome.value] = outcomes.get(r.outcome.value, 0) + 1
    texts = [(r.request_index, r.response_text) for r in records]
    start = time.perf_counter()
    scans = [(index, codec.scan(text)) for index, text in texts]
    scan_s = time.perf_counter() - start
    own = sum(1 for index, hits in scans if any(h.verified and h.request_index == index for h in hits))
    # What the leak oracle would flag: hits of this run that cannot be the request's own (a cut
    # tail marker of its own is not one).
    others = sum(
        1
        for index, hits in scans
        for h in hits
        if h.run_prefix == codec.run_prefix and not h.could_be_owned_by(codec.run_prefix, index)
    )
    with_text = sum(1 for _, text in texts if text)
    return {
        "records": len(records),
        "outcomes": outcomes,
        "with_text": with_text,
        "own_marker_back": own,
        "other_markers": others,
        "scan_us_per_request": 1e6 * scan_s / len(records),
        "text_bytes": sum(len(t) for _, t in texts),
    }


def breakdown(count: int, seed: int, max_tokens: int, echo_chars: int, chunks: int) -> dict[str, float]:
    """Microseconds per request of our users' in-process work with no network: what of the
    Locust CPU per request is prompt building, reply parsing and the record, each done as the
    users do it (their codec, orjson bodies, a streamed reply fed an event per read, the record
    written to a file)."""
    from chaos.targets.discovery import TargetFacts
    from loadprofiles.codec import RecentMarkers
    from loadprofiles.exchange import json_bytes, request_body
    from loadprofiles.prompts import PromptFactory
    from loadprofiles.recorder import Observed, RecordWriter, Sent, build_record, judge
    from loadprofiles.sse import ResponseReader, parse_body

    codec = RecentMarkers("K7QX")
    prompts = PromptFactory(codec, seed, TargetFacts())
    rng = random.Random(seed)
    out: dict[str, float] = {}
    start = time.perf_counter()
    made = [prompts.canary(10_000 + i, medium=rng.random() < 0.3, repeat=rng.random() < 0.5) for i in range(count)]
    out["prompt"] = time.perf_counter() - start
    start = time.perf_counter()
    for p in made:
        json_bytes(request_body("generate", p, stream=True, max_tokens=max_tokens, model="default", rid="r"))
    out["request body"] = time.perf_counter() - start
    # A streamed /generate reply as sse_server.py sends it (cumulative text), and a whole one.
    text = made[0].as_text()[:echo_chars]
    size = max(1, -(-len(text) // chunks))
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    events, so_far = [], ""
    for n, piece in enumerate(pieces):
        so_far += piece
        finish = {"type": "length"} if n == len(pieces) - 1 else None
        meta = {"finish_reason": finish, "prompt_tokens": 50, "completion_tokens": n + 1, "cached_tokens": 0}
        events.append(b"data: " + json.dumps({"text": so_far, "meta_info": meta}).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    whole = json.dumps({"text": text, "meta_info": {"finish_reason": {"type": "length"}, "prompt_tokens": 50}}).encode()
    start = time.perf_counter()
    for _ in range(count):
        reader = ResponseReader("generate", sse=True)
        for event in events:
            reader.feed(event, time.time())
        parsed = reader.close(time.time())
    out[f"parse streamed reply ({len(pieces)} events, a read each)"] = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(count):
        parse_body("generate", whole, sse=False)
    out["parse whole reply"] = time.perf_counter() - start
    sent = Sent(
        id="r",
        request_index=10_000,
        phase="load",
        user_kind="canary_chat",
        actor="a0/u0",
        endpoint="/generate",
        stream=True,
        markers=made[0].markers,
        prompt=made[0].as_text(),
        max_tokens=max_tokens,
        planned_send=None,
    )
    obs = Observed(t_send=1.0, t_first_byte=1.0, t_end=2.0, status=200, sse=True, parsed=parsed)
    with tempfile.TemporaryDirectory(prefix="locust_users-") as tmp:
        writer = RecordWriter(os.path.join(tmp, "records.jsonl"))
        start = time.perf_counter()
        for _ in range(count):
            writer.write(build_record(sent, obs, judge(obs)))
        out["judge + record + write"] = time.perf_counter() - start
        writer.close()
    return {k: 1e6 * v / count for k, v in out.items()}


# -------------------------------------------------------------------------------- report ----


def fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def summarize(runs: list[RunResult]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for variant in VARIANTS:
        mine = [r for r in runs if r.variant == variant]
        if not mine:
            continue

        def med(values: list[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return statistics.median(known) if known else None

        out[variant] = {
            "rps": med([r.rps for r in mine]),
            "rps_each": [round(r.rps, 1) for r in mine],
            "requests": sum(r.requests for r in mine),
            "failures": sum(r.failures for r in mine),
            "locust_cores": med([r.locust_cores for r in mine]),
            "server_cores": med([r.server_cores for r in mine]),
            "locust_ms_per_req": med([r.cpu_ms_per_req(r.locust_cores) for r in mine]),
            "server_ms_per_req": med([r.cpu_ms_per_req(r.server_cores) for r in mine]),
            "machine_busy": med([r.machine_busy for r in mine]),
        }
    return out


def busy(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def markdown(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["summary"]
    lines = [
        (
            f"- machine: {m['nproc']} usable CPUs, {m['cpu_model']}; Linux {m['kernel']}, Python {m['python']}, "
            f"locust {m['locust']}, httpx {m['httpx']}, geventhttpclient {m['geventhttpclient']}, "
            f"orjson {m.get('orjson', '?')}, aiohttp {m['aiohttp']}"
        ),
        (
            f"- load average at start {' '.join(f'{x:.2f}' for x in m['loadavg_start'])}, "
            f"at end {' '.join(f'{x:.2f}' for x in report['loadavg_end'])}"
        ),
        (
            f"- {report['users']} users, no think time, {report['duration']:g} s per run, {report['rounds']} round(s); "
            f"order {' '.join(report['order'])}; "
            f"Locust {'pinned to CPU0, server to CPU1' if report['pin'] else 'and server unpinned'}"
        ),
        "",
        "| run | variant | req/s | failures | Locust CPU (cores) | Locust CPU ms/req | server CPU ms/req | machine busy |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for n, r in enumerate(report["runs"], 1):
        rr = RunResult(**{k: v for k, v in r.items()})
        lines.append(
            f"| {n} | {r['variant']} | {fmt(r['rps'])} | {r['failures']} | {fmt(r['locust_cores'], 2)} | "
            f"{fmt(rr.cpu_ms_per_req(r['locust_cores']), 3)} | {fmt(rr.cpu_ms_per_req(r['server_cores']), 3)} | "
            f"{busy(r['machine_busy'])} |"
        )
    if "ours" in s and "fasthttp" in s:
        o, f = s["ours"], s["fasthttp"]
        ratio, cpu = report["ratios"]["rps"], report["ratios"]["locust_cpu_per_req"]
        h = s.get("httpx")

        def extra(key: str, digits: int) -> str:
            return f" {fmt(h[key], digits)} |" if h else ""

        lines += [
            "",
            "| medians | ours | fasthttp | ours / fasthttp |" + (" httpx |" if h else ""),
            "|---|---:|---:|---:|" + ("---:|" if h else ""),
            f"| req/s | {fmt(o['rps'])} | {fmt(f['rps'])} | {fmt(ratio, 3)} |" + extra("rps", 1),
            f"| Locust CPU ms/req | {fmt(o['locust_ms_per_req'], 3)} | {fmt(f['locust_ms_per_req'], 3)} | {fmt(cpu, 2)} |"
            + extra("locust_ms_per_req", 3),
            f"| server CPU ms/req | {fmt(o['server_ms_per_req'], 3)} | {fmt(f['server_ms_per_req'], 3)} | |"
            + extra("server_ms_per_req", 3),
            f"| Locust CPU (cores) | {fmt(o['locust_cores'], 2)} | {fmt(f['locust_cores'], 2)} | |"
            + extra("locust_cores", 2),
        ]
    rec = [("ours", r) for r in report.get("records") or []]
    rec += [("httpx", r) for r in report.get("records_httpx") or []]
    if rec:
        lines += ["", "Records written by our users, and the leak scan over them (driver side, timed here):", ""]
        numbers: dict[str, int] = {}
        for variant, r in rec:
            n = numbers[variant] = numbers.get(variant, 0) + 1
            if not r.get("records"):
                lines.append(f"- {variant} run {n}: no records")
                continue
            lines.append(
                f"- {variant} run {n}: {r['records']:,} records {r['outcomes']}; {r['own_marker_back']:,} of "
                f"{r['with_text']:,} replies carry their own head marker back, {r['other_markers']} other markers; "
                f"scan {r['scan_us_per_request']:.1f} µs per request ({r['text_bytes'] / max(1, r['records']):.0f} "
                f"chars of reply each)"
            )
    parts = report.get("breakdown")
    if parts:
        common = sum(v for k, v in parts.items() if not k.startswith("parse"))
        streamed = common + next(v for k, v in parts.items() if k.startswith("parse streamed"))
        lines += [
            "",
            "Our users' in-process work per request with no network (µs, one core, timed here): "
            + ", ".join(f"{k} {v:.0f}" for k, v in parts.items())
            + f"; a streamed request {streamed:.0f}, a whole one {common + parts['parse whole reply']:.0f}.",
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main ----


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--duration", type=float, default=12.0, help="seconds per Locust run (default 12)")
    p.add_argument("--rounds", type=int, default=2, help="each round runs both variants (default 2)")
    p.add_argument("--variants", default="ours,fasthttp", help=f"of {','.join(VARIANTS)} (default ours,fasthttp)")
    p.add_argument(
        "--short", action="store_true", help="a check that it runs: 8 users, 1 round of 5 s, 300 bodies (about 20 s)"
    )
    p.add_argument("--bodies", type=int, default=3000, help="distinct bodies the FastHttpUser cycles through")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--echo-chars", type=int, default=160, help="server: reply with this much of the prompt")
    p.add_argument("--chunks", type=int, default=8, help="server: streamed pieces per reply")
    p.add_argument("--pin", action="store_true", help="pin Locust to CPU0 and the server to CPU1")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (records, bodies, server log)")
    p.add_argument("--json", default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.short:
        args.users, args.duration, args.rounds, args.bodies = 8, 5.0, 1, 300
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {', '.join(sorted(unknown))}; known: {', '.join(VARIANTS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started_utc = datetime.datetime.now(datetime.timezone.utc)
    sys.path.insert(0, str(REPO))
    from chaos.markers import new_run_prefix
    from chaos.targets.discovery import TargetFacts
    from loadprofiles.config import CONFIG_ENV, LoadConfig, ShapeSpec

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    report: dict[str, Any] = {
        "command": " ".join(["benchmarks/locust_users.py", *(sys.argv[1:] if argv is None else argv)]),
        "utc": started_utc.isoformat(timespec="seconds"),
        "machine": machine(),
        "users": args.users,
        "duration": args.duration,
        "rounds": args.rounds,
        "pin": args.pin,
        "runs": [],
        "records": [],
        "records_httpx": [],
    }
    children: list[subprocess.Popen[str] | subprocess.Popen[bytes]] = []
    tmp = Path(tempfile.mkdtemp(prefix="locust_users-"))

    def stop(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp / "server.log", "w") as server_log:
        server = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "sse_server.py"),
                "--port",
                str(port),
                "--echo-chars",
                str(args.echo_chars),
                "--chunks",
                str(args.chunks),
            ],
            cwd=REPO,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=server_log,
        )
    children.append(server)
    try:
        if args.pin:
            os.sched_setaffinity(server.pid, {1})
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise SystemExit(f"the SSE server did not come up; see {tmp / 'server.log'}")
        bodies = tmp / "bodies.json"
        bodies.write_text(json.dumps(build_bodies(args.bodies, args.seed, args.max_tokens, 10_000)))
        base_env = {k: v for k, v in os.environ.items() if k not in (CONFIG_ENV, BODIES_ENV)}
        order: list[str] = []
        for round_no in range(args.rounds):
            for variant in variants if round_no % 2 == 0 else list(reversed(variants)):
                order.append(variant)
                if variant in ("ours", "httpx"):
                    records = tmp / f"records-{variant}-{round_no}.jsonl"
                    config = LoadConfig(
                        run_prefix=new_run_prefix(),
                        target_url=url,
                        records_path=str(records),
                        facts=TargetFacts(),
                        mix={"canary_chat": 1.0},
                        shape=ShapeSpec(
                            kind="steady", duration_s=args.duration, users=args.users, spawn_rate=float(args.users)
                        ),
                        max_tokens=args.max_tokens,
                        think_time_s=(0.0, 0.0),
                        seed=args.seed,
                        index_base=10_000,
                        http_client="httpx" if variant == "httpx" else "fast",
                    )
                    argv_ = [
                        sys.executable,
                        "-m",
                        "locust",
                        "--headless",
                        "-f",
                        "loadprofiles/locustfile.py",
                        "--json",
                        "--only-summary",
                        "--skip-log",
                        "--host",
                        url,
                    ]
                    env = {**base_env, CONFIG_ENV: config.to_json()}
                else:
                    argv_ = [
                        sys.executable,
                        "-m",
                        "locust",
                        "--headless",
                        "-f",
                        str(HERE / "locust_users.py"),
                        "--users",
                        str(args.users),
                        "--spawn-rate",
                        str(args.users),
                        "--run-time",
                        f"{args.duration:g}s",
                        "--json",
                        "--only-summary",
                        "--skip-log",
                        "--host",
                        url,
                    ]
                    env = {**base_env, BODIES_ENV: str(bodies)}
                result = run_locust(variant, round_no, argv_, env, args.duration, server.pid, args.pin, children)
                report["runs"].append(result.__dict__)
                print(
                    f"[locust_users] round {round_no + 1} {variant}: {result.rps:,.1f} req/s, "
                    f"{result.requests:,} requests, {result.failures} failures, rc {result.rc}",
                    file=sys.stderr,
                    flush=True,
                )
                if variant in ("ours", "httpx"):
                    checked = check_records(records) if records.exists() else {"records": 0}
                    report["records" if variant == "ours" else "records_httpx"].append(checked)
        report["order"] = order
    finally:
        for proc in children:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in children:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        if args.keep:
            print(f"[locust_users] kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    report["loadavg_end"] = list(os.getloadavg())
    if "ours" in variants:
        count = 300 if args.short else 2000
        report["breakdown"] = breakdown(count, args.seed, args.max_tokens, args.echo_chars, args.chunks)
    report["summary"] = summary = summarize([RunResult(**r) for r in report["runs"]])
    if "ours" in summary and "fasthttp" in summary:
        o, f = summary["ours"], summary["fasthttp"]
        report["ratios"] = {
            "rps": o["rps"] / f["rps"] if o["rps"] and f["rps"] else None,
            "locust_cpu_per_req": (
                o["locust_ms_per_req"] / f["locust_ms_per_req"]
                if o["locust_ms_per_req"] and f["locust_ms_per_req"]
                else None
            ),
        }
    print(markdown(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    failed = any(r["rc"] != 0 for r in report["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
