"""Who answers a prompt that prefill rejects and decode admits: sglang-router against smg.

The incident's pools on the real SGLang CPU pair (`campaigns/sglang-cpu-incident.yaml`: prefill
1,024 tokens, so a largest input of 1,018; decode 8,192; context 2,048; decode's waiting timeout
20 s). A prompt of 1,500 tokens passes both tokenizers; prefill's scheduler rejects it with 400 at
once, and decode, which admitted it, waits for KV that never comes. With sglang-router 0.3.2 the
client gets decode's 500 after the waiting timeout (docs/sglang-cpu-tier.md). This script sends
the same prompt, and a 500-token one that both accept, through the pair's sglang-router and
through smg (the Shepherd Model Gateway, the router's successor on PyPI) in PD mode in front of
the same two servers, and records each answer: status, time, body, and the waiting timeouts
decode logged meanwhile. So it says whether the 500 is the router's doing (a front that forwards
prefill's 400 and cancels decode would fix it) or decode's.

Needs `make sglang-env` (add `--venv .venv-sglang-0.5.19` for that release); smg is one of
pdchaos's dependencies. About 3 minutes:

    .venv/bin/python benchmarks/sglang_gateway_handoff.py --json out.json [--venv .venv-sglang-0.5.19]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from chaos.campaign_validation import load_campaign  # noqa: E402
from chaos.process import free_port  # noqa: E402
from chaos.targets.sglang.stack import SGLangStack  # noqa: E402

CAMPAIGN = ROOT / "campaigns" / "sglang-cpu-incident.yaml"
TIMEOUT_LINE = "timed out"  # decode: "Request ... timed out after 20.0s in KVPoll.WaitingForInput"


def ask(front: str, tokens: int, timeout_s: float) -> dict[str, Any]:
    body = {
        "input_ids": [100 + i % 1500 for i in range(tokens)],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0},
    }
    started = time.monotonic()
    try:
        response = httpx.post(f"{front}/generate", json=body, timeout=timeout_s, trust_env=False)
        return {
            "tokens": tokens,
            "status": response.status_code,
            "took_s": round(time.monotonic() - started, 2),
            "body": response.text[:400],
        }
    except httpx.HTTPError as exc:
        return {
            "tokens": tokens,
            "status": None,
            "took_s": round(time.monotonic() - started, 2),
            "body": type(exc).__name__,
        }


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> float:
    """Until a short prompt is served: smg 1.13 answers its health routes, and 503
    `no_available_workers` to requests, while it is still registering the workers."""
    started = time.monotonic()
    while time.monotonic() < started + timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"smg exited with {proc.returncode}")
        if ask(url, 16, 30)["status"] == 200:
            return round(time.monotonic() - started, 1)
        time.sleep(1)
    raise RuntimeError(f"smg served nothing at {url} within {timeout_s:.0f} s")


def through(name: str, front: str, stack: SGLangStack, timeout_s: float) -> dict[str, Any]:
    before = stack.logs("decode").count(TIMEOUT_LINE)
    band = ask(front, 1500, timeout_s)
    time.sleep(2)
    after = stack.logs("decode").count(TIMEOUT_LINE)
    return {
        "front": name,
        "band": band,
        "decode_waiting_timeouts": after - before,
        "under_limits": ask(front, 500, 120),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smg", default=None, help="an smg executable (default: python -m smg from this venv)")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / time.strftime("sglang-gateway-%Y%m%d-%H%M%S"))
    parser.add_argument("--venv", default=None, help="the SGLang venv (default: the campaign's, .venv-sglang)")
    args = parser.parse_args(argv)
    spec = load_campaign(CAMPAIGN).target.sglang
    assert spec is not None
    if args.venv:
        spec = spec.model_copy(update={"venv": args.venv})
    waiting = float(spec.waiting_timeout_s or 300)
    smg_argv = [args.smg] if args.smg else [sys.executable, "-m", "smg"]
    version = subprocess.run([*smg_argv, "--version"], capture_output=True, text=True).stdout.strip()
    stack = SGLangStack(spec, args.out)
    result: dict[str, Any] = {
        "campaign": str(CAMPAIGN.relative_to(ROOT)),
        "venv": spec.venv,
        "waiting_timeout_s": waiting,
        "smg": version,
    }
    stack.up()
    smg: subprocess.Popen[bytes] | None = None
    try:
        result["sglang_router"] = through("sglang-router", stack.router_url, stack, waiting + 60)
        port = free_port()
        argv_smg = [
            *smg_argv,
            "launch",
            "--pd-disaggregation",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prefill",
            stack.worker_url("prefill"),
            str(stack.ports.bootstrap),
            "--decode",
            stack.worker_url("decode"),
            "--disable-retries",
            "--disable-circuit-breaker",
        ]
        result["smg_command"] = ["smg", *argv_smg[len(smg_argv) :]]
        with (args.out / "smg.log").open("wb") as log:
            smg = subprocess.Popen(argv_smg, stdout=log, stderr=subprocess.STDOUT)
            front = f"http://127.0.0.1:{port}"
            result["smg_ready_after_s"] = wait_ready(front, smg)
            result["smg_run"] = through("smg", front, stack, waiting + 60)
    finally:
        if smg is not None:
            smg.terminate()
            smg.wait(timeout=30)
        stack.down()
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    for key in ("sglang_router", "smg_run"):
        r = result.get(key)
        if r:
            print(
                f"{r['front']}: band {r['band']['status']} in {r['band']['took_s']} s ({r['band']['body'][:120]!r}); "
                f"decode waiting timeouts {r['decode_waiting_timeouts']}; under both limits {r['under_limits']['status']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
