"""Measure the vLLM pair: startup, RSS, idle CPU, PD request latency (figures for docs/performance.md).

    .venv/bin/python -m chaos.targets.vllm.measure [--delay-us 10000] [--idle-s 20] [--out DIR]

Starts the pair as a campaign would (VllmStack), then, with nothing else sent to it: the RSS of
each process group, the CPU its groups burn while idle, and the latency of sequential requests
through the router (PD: prefill, NIXL pull, decode) and straight to decode alone. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from chaos.process import group_members
from chaos.targets.vllm.spec import VllmSpec
from chaos.targets.vllm.stack import VllmStack

PROMPT = "pdchaos measures the vLLM pair with a prompt of a few hundred tokens. " * 40


def group_rss_mib(pgid: int) -> float:
    total = 0
    for pid in group_members(pgid):
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
    return total / 2**20


def group_cpu_ticks(pgids: list[int]) -> int:
    ticks = 0
    for pgid in pgids:
        for pid in group_members(pgid):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])
            except (OSError, IndexError, ValueError):
                continue
    return ticks


def idle_cpu_percent(pgids: list[int], seconds: float) -> float:
    """CPU the groups used over `seconds`, in percent of one core."""
    before = group_cpu_ticks(pgids)
    time.sleep(seconds)
    return 100.0 * (group_cpu_ticks(pgids) - before) / os.sysconf("SC_CLK_TCK") / seconds


def latencies(url: str, count: int, max_tokens: int = 16) -> tuple[list[float], int]:
    times, prompt_tokens = [], 0
    with httpx.Client(timeout=120.0, trust_env=False) as client:
        for i in range(count):
            started = time.monotonic()
            response = client.post(
                f"{url}/v1/completions",
                json={"prompt": f"{i} {PROMPT}", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            )
            response.raise_for_status()
            times.append(time.monotonic() - started)
            prompt_tokens = response.json()["usage"]["prompt_tokens"]
    return times, prompt_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--delay-us",
        type=int,
        default=VllmSpec().nixl_progress_delay_us,
        help="NIXL pthrDelay (0 = NIXL's own default, a busy-polling progress thread)",
    )
    parser.add_argument("--idle-s", type=float, default=20.0)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    run_dir = args.out or Path(tempfile.mkdtemp(prefix="vllm-measure-"))
    stack = VllmStack(VllmSpec(nixl_progress_delay_us=args.delay_us), run_dir)
    started = time.monotonic()
    stack.up()
    try:
        ready_s = time.monotonic() - started
        time.sleep(5.0)  # let start-up work settle before measuring idle
        pgids = [p.pgid for role in ("prefill", "decode") for p in stack.processes(role)]
        idle = idle_cpu_percent(pgids, args.idle_s)
        rss = {name: round(group_rss_mib(p.pgid)) for name, p in stack.procs.items()}
        pd, tokens = latencies(stack.router_url, args.requests)
        alone, _ = latencies(stack.worker_url("decode"), args.requests)
        result = {
            "nixl_pthr_delay_us": args.delay_us,
            "ready_s": round(ready_s, 1),
            "startup_s": {k: round(v, 1) for k, v in stack.startup_s.items()},
            "rss_mib": rss,
            "rss_total_mib": sum(rss.values()),
            f"idle_cpu_pct_of_one_core_engines_{args.idle_s:g}s": round(idle, 1),
            "prompt_tokens": tokens,
            "max_tokens": 16,
            "pd_latency_s": {
                "median": round(statistics.median(pd), 3),
                "min": round(min(pd), 3),
                "max": round(max(pd), 3),
            },
            "decode_alone_latency_s": {"median": round(statistics.median(alone), 3), "min": round(min(alone), 3)},
            "load_average": os.getloadavg(),
        }
    finally:
        stack.down()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
