"""Requests/s of short greedy `/generate` calls through the real `sglang-router`, side by side.

Targets, all up at once and measured in the same run (`--targets`):

  embedded     router -> embedded PD engine (SimStack: prefill + decode worker, KV handoff over TCP)
  stub         the same router command -> two trivial stub workers (benchmarks/stub_worker.py)
  null-direct  one embedded `null`-mode worker, no router (the engine's own cost; PD mode cannot
               be driven without the router, both workers must get each request)
  stub-direct  the stub decode worker, no router (the ceiling of this load generator here)

For each concurrency a closed loop of that many clients sends requests back to back for
`--duration` seconds per target, split into `--rounds` slices; the targets take turns slice by
slice (A B C D, then D C B A, ...), so drift on a shared machine hits all of them alike. Each
slice starts with a discarded warm-up. Every prompt is unique (no prefix-cache hits) and
exactly `--prompt-tokens` tokens in the embedded engine's tokenizer. Before measuring, the
embedded engines are driven until their prefix caches fill the KV pool (`--fill-timeout`),
the state a server that has been up for a while is in: every allocation then evicts. (Until
the engine counted evictable pages as they change, its cost per request also grew with the
number of cached pages, so a cold engine drifted slower through a run; docs/performance.md.)

Reported per target and concurrency: requests/s, p50/p99 latency, errors, CPU milliseconds per
request of each process group (router, prefill, decode or worker, this client) read from
/proc, and how busy the whole machine was. Ratios embedded/stub are the numbers to quote;
absolute figures drift with whatever else runs on the machine.

    .venv/bin/python benchmarks/router_throughput.py                # 1,8,32 clients, 10 s each
    .venv/bin/python benchmarks/router_throughput.py --concurrency 1,16 --duration 5 --json out.json

Every process it starts is stopped at the end, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import resource
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from harness import StopOnExit, command_line, machine_info, make_run_dir, utc_stamp, write_json

from chaos.process import ManagedProcess, free_port, launch, wait_http_ok
from chaos.targets.sglang.router import RouterOptions, router_command
from chaos.targets.sim.settings import WorkerSettings
from chaos.targets.sim.stack import LOOPBACK, ROUTER_ENV, SimStack, SimStackConfig
from chaos.targets.sim.tokenizer import tokenize
from chaos.targets.sim.worker import command_for, env_for

HERE = Path(__file__).resolve().parent
STUB = HERE / "stub_worker.py"
ALL_TARGETS = ("embedded", "stub", "null-direct", "stub-direct")
CLK_TCK = os.sysconf("SC_CLK_TCK")
REQUEST_TIMEOUT_S = 60.0


# ------------------------------------------------------------------------------ machine ----


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in a process group (all threads)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                raw = fh.read()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
    return total / CLK_TCK


def machine_busy_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])
    return total - idle, total


def self_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# ------------------------------------------------------------------------------ targets ----


@dataclass
class Target:
    name: str
    url: str  # POST here + "/generate"
    groups: dict[str, int]  # component name -> process group id, for CPU accounting
    description: str
    # Embedded workers whose prefix cache fills up as unique prompts arrive (prefill, null).
    caching_workers: list[str] = field(default_factory=list)


class Deployments:
    """Everything the benchmark starts; `close()` stops it all and may be called twice."""

    def __init__(self, run_dir: Path, worker: WorkerSettings, wanted: list[str]) -> None:
        self.run_dir = run_dir
        self.worker = worker
        self.wanted = wanted
        self.stack: SimStack | None = None
        self.procs: list[ManagedProcess] = []
        self.targets: dict[str, Target] = {}
        self.router_argv: list[str] = []

    def up(self) -> dict[str, Target]:
        if "embedded" in self.wanted:
            self.stack = SimStack(SimStackConfig(worker=self.worker), self.run_dir / "embedded")
            ep = self.stack.up()
            router = self.stack.procs["router"]
            self.router_argv = router.argv if isinstance(router, ManagedProcess) else []
            self.targets["embedded"] = Target(
                "embedded",
                ep.router_url,
                {name: self.stack.procs[name].pgid for name in ("router", "prefill", "decode")},
                "router -> embedded prefill + decode",
                [self.stack.worker_url("prefill")],
            )
        if "stub" in self.wanted or "stub-direct" in self.wanted:
            self._up_stubs()
        if "null-direct" in self.wanted:
            port = free_port()
            settings = replace(self.worker, role="null", host=LOOPBACK, port=port)
            proc = self._launch("null-worker", command_for(settings), env_for(settings.timeouts), "null/worker.log")
            wait_http_ok(f"http://{LOOPBACK}:{port}/health", 30, proc)
            self.targets["null-direct"] = Target(
                "null-direct",
                f"http://{LOOPBACK}:{port}",
                {"worker": proc.pgid},
                "embedded null-mode worker, no router",
                [f"http://{LOOPBACK}:{port}"],
            )
        return {name: self.targets[name] for name in self.wanted}

    def _launch(self, name: str, argv: list[str], env: dict[str, str] | None, log: str) -> ManagedProcess:
        proc = launch(name, argv, self.run_dir / log, env)
        self.procs.append(proc)
        return proc

    def _up_stubs(self) -> None:
        ports = {name: free_port() for name in ("prefill", "decode", "router", "metrics", "bootstrap")}
        urls = {role: f"http://{LOOPBACK}:{ports[role]}" for role in ("prefill", "decode")}
        stubs = {}
        for role in ("prefill", "decode"):
            argv = [
                sys.executable,
                str(STUB),
                "--disaggregation-mode",
                role,
                "--port",
                str(ports[role]),
                "--disaggregation-bootstrap-port",
                str(ports["bootstrap"]),
            ]
            stubs[role] = self._launch(f"stub-{role}", argv, None, f"stub/{role}.log")
        for role in ("prefill", "decode"):
            wait_http_ok(urls[role] + "/health", 30, stubs[role])
        if "stub" in self.wanted:
            # The very argv SimStack builds, only with the stubs' addresses.
            argv = router_command(
                RouterOptions(), ports["router"], ports["metrics"], urls["prefill"], ports["bootstrap"], urls["decode"]
            )
            router = self._launch("stub-router", argv, ROUTER_ENV, "stub/router.log")
            router_url = f"http://{LOOPBACK}:{ports['router']}"
            wait_http_ok(router_url + "/readiness", 30, router)
            self.targets["stub"] = Target(
                "stub",
                router_url,
                {"router": router.pgid, "prefill": stubs["prefill"].pgid, "decode": stubs["decode"].pgid},
                "same router command -> stub prefill + decode",
            )
        if "stub-direct" in self.wanted:
            self.targets["stub-direct"] = Target(
                "stub-direct", urls["decode"], {"worker": stubs["decode"].pgid}, "stub decode worker, no router"
            )

    def close(self) -> None:
        for proc in reversed(self.procs):
            try:
                proc.stop()
            except Exception as exc:  # keep stopping the rest
                print(f"warning: stopping {proc.name}: {exc!r}", file=sys.stderr)
        self.procs = []
        if self.stack is not None:
            self.stack.down()
            self.stack = None


# ------------------------------------------------------------------------- load generator ----


class Prompts:
    """Unique prompts of exactly n tokens: three words carry a counter, the rest are fixed."""

    ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"

    def __init__(self, n_tokens: int, max_new_tokens: int) -> None:
        if n_tokens < 4:
            raise ValueError("--prompt-tokens must be at least 4")
        self.n = n_tokens
        self.max_new_tokens = max_new_tokens
        self.counter = 0
        self.tail = " the" * (n_tokens - 3)
        probe = self.text(0)
        if len(tokenize(probe)) != n_tokens:
            raise AssertionError(f"prompt builder made {len(tokenize(probe))} tokens, not {n_tokens}: {probe!r}")

    def text(self, k: int) -> str:
        digits = []
        for _ in range(6):
            k, d = divmod(k, len(self.ALPHABET))
            digits.append(self.ALPHABET[d])
        a = "".join(digits)
        return f"q{a[0:2]} x{a[2:4]} z{a[4:6]}{self.tail}"  # one token each ("q" + 2 chars, " x" + 2 ...)

    def body(self) -> bytes:
        self.counter += 1
        return json.dumps(
            {
                "text": self.text(self.counter),
                "sampling_params": {"max_new_tokens": self.max_new_tokens, "temperature": 0},
            }
        ).encode()


@dataclass
class Slice:
    ok: int = 0
    errors: int = 0
    latencies: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)
    seconds: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)
    machine_busy: float = 0.0  # fraction of all CPUs


async def closed_loop(
    session: aiohttp.ClientSession, url: str, clients: int, seconds: float, prompts: Prompts, record: bool
) -> Slice:
    out = Slice(seconds=seconds)
    deadline = time.perf_counter() + seconds
    headers = {"Content-Type": "application/json"}

    async def client() -> None:
        while time.perf_counter() < deadline:
            body = prompts.body()
            started = time.perf_counter()
            err = None
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    data = await resp.read()
                    if resp.status != 200:
                        err = f"HTTP {resp.status}: {data[:200]!r}"
            except Exception as exc:  # counted, the loop goes on
                err = f"{type(exc).__name__}: {exc}"
            ended = time.perf_counter()
            if not record or ended > deadline:
                continue
            if err is None:
                out.ok += 1
                out.latencies.append(ended - started)
            else:
                out.errors += 1
                if len(out.error_samples) < 5:
                    out.error_samples.append(err)

    await asyncio.gather(*(client() for _ in range(clients)))
    return out


async def measure_slice(target: Target, clients: int, seconds: float, warmup: float, prompts: Prompts) -> Slice:
    connector = aiohttp.TCPConnector(limit=clients, limit_per_host=clients)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        url = target.url + "/generate"
        if warmup > 0:
            await closed_loop(session, url, clients, warmup, prompts, record=False)
        cpu0 = {name: group_cpu_s(pgid) for name, pgid in target.groups.items()}
        client0 = self_cpu_s()
        busy0, total0 = machine_busy_ticks()
        result = await closed_loop(session, url, clients, seconds, prompts, record=True)
        busy1, total1 = machine_busy_ticks()
        result.cpu_s = {name: group_cpu_s(pgid) - cpu0[name] for name, pgid in target.groups.items()}
        result.cpu_s["client"] = self_cpu_s() - client0
        result.machine_busy = (busy1 - busy0) / max(1, total1 - total0)
    return result


def _gauge(metrics_text: str, name: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith((f"sglang:{name}{{", f"sglang:{name} ")):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def fill_caches(targets: dict[str, Target], prompts: Prompts, timeout_s: float) -> dict[str, Any]:
    """Drive the embedded targets until their KV pools are full of cached prefixes.

    Each unique prompt leaves its full pages in the prefix cache until the pool is full; a
    long-running server sits in that full state, where every allocation evicts. (The engine's
    cost per request once grew with the number of cached pages, so a cold engine drifted slower
    through a run in a way interleaving cannot cancel; it no longer does, docs/performance.md.)
    """
    todo = {name: t for name, t in targets.items() if t.caching_workers}
    out: dict[str, Any] = {}
    if not todo:
        return out
    started = time.perf_counter()
    served = {name: 0 for name in todo}

    async def full(session: aiohttp.ClientSession, t: Target) -> bool:
        for url in t.caching_workers:
            async with session.get(url + "/metrics") as resp:
                text = await resp.text()
            if _gauge(text, "kv_available_tokens") > 0.05 * _gauge(text, "max_total_num_tokens"):
                return False
        return True

    async def fill(name: str, t: Target) -> None:
        connector = aiohttp.TCPConnector(limit=32)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        ) as session:
            while not await full(session, t):
                if time.perf_counter() - started > timeout_s:
                    out[name] = {
                        "full": False,
                        "requests": served[name],
                        "seconds": round(time.perf_counter() - started, 1),
                    }
                    return
                s = await closed_loop(session, t.url + "/generate", 32, 2.0, prompts, record=True)
                served[name] += s.ok + s.errors
        out[name] = {"full": True, "requests": served[name], "seconds": round(time.perf_counter() - started, 1)}

    await asyncio.gather(*(fill(name, t) for name, t in todo.items()))
    return out


async def sanity_check(targets: dict[str, Target], max_new_tokens: int, prompts: Prompts) -> dict[str, str]:
    """One request per target before measuring: HTTP 200 and the expected number of tokens."""
    notes = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as session:
        for name, target in targets.items():
            async with session.post(
                target.url + "/generate", data=prompts.body(), headers={"Content-Type": "application/json"}
            ) as resp:
                text = await resp.text()
                if resp.status != 200:
                    raise RuntimeError(f"{name}: sanity request got HTTP {resp.status}: {text[:300]}")
                body = json.loads(text)
                got = len(body.get("output_ids") or [])
                reason = (body.get("meta_info") or {}).get("finish_reason")
                notes[name] = f"{got} output tokens, finish_reason {reason}"
                if got != max_new_tokens:
                    notes[name] += f" (expected {max_new_tokens})"
    return notes


async def idle_probe(targets: dict[str, Target], seconds: float) -> dict[str, Any]:
    """CPU the deployments burn with no load, and how busy the machine is without us (other tenants)."""
    groups = {f"{t.name}/{name}": pgid for t in targets.values() for name, pgid in t.groups.items()}
    groups = {k: v for k, v in groups.items() if not k.startswith("stub-direct/")}  # same process as stub/decode
    cpu0 = {k: group_cpu_s(pgid) for k, pgid in groups.items()}
    busy0, total0 = machine_busy_ticks()
    await asyncio.sleep(seconds)
    busy1, total1 = machine_busy_ticks()
    cores = {k: (group_cpu_s(pgid) - cpu0[k]) / seconds for k, pgid in groups.items()}
    return {"seconds": seconds, "cores": cores, "machine_busy": (busy1 - busy0) / max(1, total1 - total0)}


# ------------------------------------------------------------------------------ results ----


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    rank = max(0, min(len(sorted_values) - 1, math.ceil(q / 100.0 * len(sorted_values)) - 1))  # nearest rank
    return sorted_values[rank]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def summarize(slices: list[Slice]) -> dict[str, Any]:
    ok = sum(s.ok for s in slices)
    seconds = sum(s.seconds for s in slices)
    lat = sorted(x for s in slices for x in s.latencies)
    cpu: dict[str, float] = {}
    for s in slices:
        for name, value in s.cpu_s.items():
            cpu[name] = cpu.get(name, 0.0) + value
    done = ok + sum(s.errors for s in slices)
    return {
        "requests_ok": ok,
        "errors": sum(s.errors for s in slices),
        "seconds": seconds,
        "rps": ok / seconds if seconds else 0.0,
        "p50_ms": _ms(percentile(lat, 50)),
        "p99_ms": _ms(percentile(lat, 99)),
        "mean_ms": None if not lat else 1000 * sum(lat) / len(lat),
        "cpu_ms_per_req": {name: 1000 * v / done if done else None for name, v in cpu.items()},
        "cpu_cores": {name: v / seconds if seconds else None for name, v in cpu.items()},
        "machine_busy": sum(s.machine_busy * s.seconds for s in slices) / seconds if seconds else 0.0,
        "per_slice_rps": [round(s.ok / s.seconds, 1) for s in slices],
        "error_samples": [e for s in slices for e in s.error_samples][:5],
    }


def total_cpu(row: dict[str, Any]) -> float | None:
    """CPU ms per request of every process on the request's path, the client included."""
    values = list(row["cpu_ms_per_req"].values())
    return None if not values or any(v is None for v in values) else sum(values)


def fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def markdown(report: dict[str, Any]) -> str:
    m, p = report["machine"], report["params"]
    lines = [
        "## Router throughput: embedded engine vs stub workers",
        "",
        (
            f"- machine: {m['nproc']} usable CPUs (`nproc`), {m['cpu_model']}; Linux {m['kernel']}, Python {m['python']}, "
            f"sglang-router {m['sglang_router']}, aiohttp {m['aiohttp']}"
        ),
        (
            f"- load average at start {' '.join(f'{x:.2f}' for x in m['loadavg_start'])}, "
            f"at end {' '.join(f'{x:.2f}' for x in m['loadavg_end'])}"
        ),
        (
            f"- load: closed loop, `/generate`, {p['prompt_tokens']}-token unique prompts, max_new_tokens {p['max_new_tokens']}, "
            f"temperature 0; {p['duration_s']:g} s per target and concurrency in {p['rounds']} interleaved slices "
            f"(+{p['warmup_s']:g} s discarded warm-up each)"
        ),
        (
            f"- engine speeds: decode step {p['decode_step_ms']:g} ms, prefill {p['prefill_tokens_per_s']:g} tok/s, "
            f"KV transfer {p['transfer_tokens_per_s']:g} tok/s"
        ),
        f"- command: `{report['command']}`",
    ]
    idle = report.get("idle")
    if idle:
        total = sum(idle["cores"].values())
        busiest = ", ".join(f"{k} {v:.3f}" for k, v in idle["cores"].items() if v >= 0.005) or "none over 0.005"
        lines.append(
            f"- idle probe ({idle['seconds']:g} s, no load): machine {100 * idle['machine_busy']:.0f}% busy, of which "
            f"these deployments {100 * total / max(1, m['nproc']):.0f}% (cores: {busiest}); the rest is other tenants"
        )
    if report.get("cache_fill"):
        lines.append(
            "- before measuring, KV pools filled with cached prefixes (steady state): "
            + ", ".join(
                f"{k} {'full' if v['full'] else 'NOT full'} after {v['requests']} requests"
                for k, v in report["cache_fill"].items()
            )
            + f" ({max(v['seconds'] for v in report['cache_fill'].values()):g} s)"
        )
    elif report["params"].get("fill_timeout_s") == 0:
        lines.append(
            "- cold engines: prefix caches not filled first (--fill-timeout 0); they fill during the measurement"
        )
    lines += [
        "",
        (
            "| clients | target | req/s | p50 ms | p99 ms | errors | router CPU ms/req | prefill/worker CPU ms/req "
            "| decode CPU ms/req | client CPU ms/req | all CPU ms/req | machine busy (this target + client) |"
        ),
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["results"]:
        cpu = row["cpu_ms_per_req"]
        ours = sum(v or 0.0 for v in row["cpu_cores"].values()) / max(1, m["nproc"])
        lines.append(
            f"| {row['concurrency']} | {row['target']} | {fmt(row['rps'])} | {fmt(row['p50_ms'])} | {fmt(row['p99_ms'])} "
            f"| {row['errors']} | {fmt(cpu.get('router'), 2)} | {fmt(cpu.get('prefill', cpu.get('worker')), 2)} "
            f"| {fmt(cpu.get('decode'), 2)} | {fmt(cpu.get('client'), 2)} | {fmt(total_cpu(row), 2)} | {100 * row['machine_busy']:.0f}% ({100 * ours:.0f}%) |"
        )
    if report["ratios"]:
        lines += [
            "",
            "Ratios measured side by side in this run (embedded / stub, both through the same router command):",
            "",
            (
                "| clients | req/s embedded/stub | p50 embedded/stub | p99 embedded/stub "
                "| all CPU per request stub/embedded | req/s embedded/null-direct |"
            ),
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in report["ratios"]:
            lines.append(
                f"| {r['concurrency']} | {fmt(r['rps'], 3)} | {fmt(r['p50'], 2)} | {fmt(r['p99'], 2)} | {fmt(r['cpu'], 3)} | {fmt(r.get('rps_vs_null'), 3)} |"
            )
    lines += ["", "Sanity request per target: " + "; ".join(f"{k}: {v}" for k, v in report["sanity"].items())]
    if report["log_findings"]:
        lines += ["", "Log lines at WARN/ERROR level after the run:"]
        lines += [f"- {k}: {v}" for k, v in report["log_findings"].items()]
    errs = [(r["concurrency"], r["target"], r["error_samples"]) for r in report["results"] if r["error_samples"]]
    for c, t, samples in errs:
        lines.append(f"- errors at {c} clients on {t}: {samples}")
    return "\n".join(lines)


def ratios(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    by = {(r["concurrency"], r["target"]): r for r in results}
    for c in sorted({r["concurrency"] for r in results}):
        emb, stub, null = by.get((c, "embedded")), by.get((c, "stub")), by.get((c, "null-direct"))
        if not (emb and stub):
            continue

        def div(a: float | None, b: float | None) -> float | None:
            return None if a is None or not b else a / b

        row = {
            "concurrency": c,
            "rps": div(emb["rps"], stub["rps"]),
            "p50": div(emb["p50_ms"], stub["p50_ms"]),
            "p99": div(emb["p99_ms"], stub["p99_ms"]),
            "cpu": div(total_cpu(stub), total_cpu(emb)),
        }
        if null:
            row["rps_vs_null"] = div(emb["rps"], null["rps"])
        out.append(row)
    return out


LOG_MARKERS = (" WARN ", " ERROR ", "Traceback", "[http_server] Error", "failed", "Failed", "Abort", "disconnected")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Expected at every router start (docs/performance.md): the tokenizer lookup goes to a dead loopback
# HF_ENDPOINT, and /readiness is 503 until both workers are registered.
BENIGN = ("Failed to load tokenizer", "uri=/readiness")


def log_findings(run_dir: Path) -> dict[str, str]:
    """WARN/ERROR-looking lines per log file; the known startup noise is counted apart."""
    found = {}
    for path in sorted(run_dir.rglob("*.log")):
        lines = [ANSI.sub("", line) for line in path.read_text(errors="replace").splitlines()]
        hits = [line for line in lines if any(m in line for m in LOG_MARKERS)]
        if not hits:
            continue
        odd = [line for line in hits if not any(b in line for b in BENIGN)]
        text = f"{len(odd)} unexpected"
        if odd:
            text += f", e.g. {odd[-1][:240]!r}"
        if len(hits) > len(odd):
            text += f" (+{len(hits) - len(odd)} expected startup lines: tokenizer lookup, /readiness 503)"
        found[str(path.relative_to(run_dir))] = text
    return found


# --------------------------------------------------------------------------------- main ----


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = WorkerSettings()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated client counts (default 1,8,32)")
    p.add_argument(
        "--duration", type=float, default=10.0, help="measured seconds per target and concurrency (default 10)"
    )
    p.add_argument("--rounds", type=int, default=2, help="interleaved slices the duration is split into (default 2)")
    p.add_argument("--warmup", type=float, default=0.5, help="discarded seconds before each slice (default 0.5)")
    p.add_argument(
        "--idle-probe",
        type=float,
        default=3.0,
        help="seconds of no load first, to see idle CPU and other tenants' load (default 3; 0: skip)",
    )
    p.add_argument(
        "--fill-timeout",
        type=float,
        default=60.0,
        help="first drive the embedded engines until their prefix caches fill the KV pool, for at most "
        "this many seconds (default 60; 0: measure cold engines)",
    )
    p.add_argument(
        "--targets", default=",".join(ALL_TARGETS), help=f"comma-separated subset of {','.join(ALL_TARGETS)}"
    )
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument(
        "--decode-step-ms",
        type=float,
        default=d.decode_step_s * 1000,
        help=f"embedded engine's simulated decode step (default {d.decode_step_s * 1000:g})",
    )
    p.add_argument("--prefill-tokens-per-s", type=float, default=d.prefill_tokens_per_s)
    p.add_argument("--transfer-tokens-per-s", type=float, default=d.transfer_tokens_per_s)
    p.add_argument(
        "--zero-sim-time",
        action="store_true",
        help="no simulated GPU time (decode step 0, prefill/transfer 1e12 tok/s): CPU cost only",
    )
    p.add_argument("--run-dir", type=Path, default=None, help="logs go here (default runs/router_throughput-<time>)")
    p.add_argument("--json", dest="json_path", default=None, help="also write the results as JSON here ('-': stdout)")
    args = p.parse_args(argv)
    args.concurrency_levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    args.target_list = [t.strip() for t in args.targets.split(",") if t.strip()]
    bad = [t for t in args.target_list if t not in ALL_TARGETS]
    if bad or not args.target_list:
        p.error(f"unknown targets {bad}; choose from {ALL_TARGETS}")
    if args.rounds < 1 or args.duration <= 0 or any(c < 1 for c in args.concurrency_levels):
        p.error("--rounds, --duration and every concurrency must be positive")
    if args.zero_sim_time:
        args.decode_step_ms, args.prefill_tokens_per_s, args.transfer_tokens_per_s = 0.0, 1e12, 1e12
    return args


async def run_all(args: argparse.Namespace, targets: dict[str, Target], prompts: Prompts) -> list[dict[str, Any]]:
    results = []
    slice_s = args.duration / args.rounds
    order = list(targets)
    for clients in args.concurrency_levels:
        slices: dict[str, list[Slice]] = {name: [] for name in order}
        for rnd in range(args.rounds):
            for name in order if rnd % 2 == 0 else list(reversed(order)):
                s = await measure_slice(targets[name], clients, slice_s, args.warmup, prompts)
                slices[name].append(s)
                print(
                    f"  clients={clients:<3} round={rnd + 1} {name:<12} {s.ok / s.seconds:8.1f} req/s  errors={s.errors}",
                    file=sys.stderr,
                    flush=True,
                )
        for name in order:
            results.append(
                {
                    "concurrency": clients,
                    "target": name,
                    "description": targets[name].description,
                    **summarize(slices[name]),
                }
            )
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = make_run_dir(args.run_dir, "router_throughput", utc_stamp())
    worker = replace(
        WorkerSettings(),
        decode_step_s=args.decode_step_ms / 1000.0,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        transfer_tokens_per_s=args.transfer_tokens_per_s,
    )
    prompts = Prompts(args.prompt_tokens, args.max_new_tokens)
    info = machine_info(cpu_count=True, versions=("sglang-router", "aiohttp"))
    deployments = Deployments(run_dir, worker, args.target_list)
    started = time.monotonic()
    with StopOnExit(deployments.close) as stopping:
        print(f"starting {', '.join(args.target_list)} (logs: {run_dir})", file=sys.stderr, flush=True)
        targets = deployments.up()
        sanity = asyncio.run(sanity_check(targets, args.max_new_tokens, prompts))
        idle = asyncio.run(idle_probe(targets, args.idle_probe)) if args.idle_probe > 0 else None
        filled: dict[str, Any] = {}
        if args.fill_timeout > 0:
            print(
                "filling the embedded engines' KV pools with cached prefixes (steady state)",
                file=sys.stderr,
                flush=True,
            )
            filled = asyncio.run(fill_caches(targets, prompts, args.fill_timeout))
        results = asyncio.run(run_all(args, targets, prompts))
    if stopping.interrupted:
        return 130
    info["loadavg_end"] = list(os.getloadavg())
    report = {
        "machine": info,
        "params": {
            "concurrency": args.concurrency_levels,
            "duration_s": args.duration,
            "rounds": args.rounds,
            "warmup_s": args.warmup,
            "prompt_tokens": args.prompt_tokens,
            "max_new_tokens": args.max_new_tokens,
            "decode_step_ms": args.decode_step_ms,
            "prefill_tokens_per_s": args.prefill_tokens_per_s,
            "transfer_tokens_per_s": args.transfer_tokens_per_s,
            "targets": args.target_list,
            "fill_timeout_s": args.fill_timeout,
        },
        "command": command_line("router_throughput.py", argv),
        "router_argv": deployments.router_argv,
        "run_dir": str(run_dir),
        "wall_s": round(time.monotonic() - started, 1),
        "sanity": sanity,
        "idle": idle,
        "cache_fill": filled,
        "results": results,
        "ratios": ratios(results),
        "log_findings": log_findings(run_dir),
    }
    print(markdown(report))
    print(f"\n(total {report['wall_s']} s; logs in {run_dir})")
    write_json(report, args.json_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
