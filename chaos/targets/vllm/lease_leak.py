"""A minimal reproduction: vLLM's decode pulls KV blocks that prefill freed at lease expiry and
has since filled with other requests' prompts, and answers 200 with their content.

The pair serves the telltale model (`chaos/targets/models/telltale.py`: greedy decoding names the
marker words in the KV a request attends; docs/telltale-model.md), with a small KV pool and a
short NixlConnector lease:

1. decode is paused (SIGSTOP to its process group) and request A, whose prompt carries only its
   own word, is sent through the router: prefill computes A's KV and holds it for decode;
2. the lease passes: prefill logs "Releasing expired KV blocks for request ..." and frees A's
   blocks (as designed);
3. requests B0, B1, B2, each carrying its own word, are sent to prefill alone, one after the
   other, until their prompts have filled every free block of the pool, A's among them;
4. decode resumes, pulls A's block ids (which nothing stops it from doing) and answers A from
   what those blocks hold now.

An engine that honoured the lease would fail A's pull or recompute it; its reply would name A's
own word. vLLM 0.32.0 (NixlConnector) answers A with 200 and the B requests' words: a reply that
quotes prompts A never saw, the read-after-free of bug class K1 (docs/architecture.md) turned into
a cross-request content leak (docs/vllm-tier.md).

    .venv/bin/python -m chaos.targets.vllm.lease_leak [--model DIR] [--json]

Exit 1 when A's reply names another request (the leak reproduced), 0 when it does not, 2 when the
pair or the model could not be set up. Builds the model into `.venv-vllm/models/telltale` when
it is missing (about 10 s); the pair takes 1-3 minutes to start on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from chaos.errors import TargetError
from chaos.targets.models.telltale import FILLER, load_words, read_reply, telltale_text
from chaos.targets.vllm.spec import VllmSpec
from chaos.targets.vllm.stack import VllmStack

REPO = Path(__file__).resolve().parents[3]
TELLTALE_BUILDER = REPO / "chaos" / "targets" / "models" / "telltale.py"
LEASE_S = 10
POOL_BYTES = 4 << 20  # 4,096 tokens of this model's KV: three prompts fill it
PAGE = 16  # vLLM's CPU block size, in tokens
A_FILLER = 240  # A's prompt: about 18 blocks
B_REQUESTS = 3
EXPIRY_LINE = "Releasing expired KV blocks for request"
REPLY_TOKENS = 6


@dataclass
class LeaseLeak:
    """What A's reply said, and whose words it holds."""

    own: str  # A's word
    status: int
    reply: str
    named: list[str]  # the marker words of A's reply, in order
    others: dict[str, str] = field(default_factory=dict)  # word -> the request (B0...) that carried it
    other_replies: dict[str, str] = field(default_factory=dict)  # B0... -> its own reply
    expiry_logged: bool = False

    @property
    def leaked(self) -> list[str]:
        """The words of A's reply that belong to other requests."""
        return [w for w in self.named if w in self.others]


def prompt(word: str, filler_count: int) -> str:
    return telltale_text(word, [FILLER[i % len(FILLER)] for i in range(filler_count)], page=PAGE)


def leak_spec(model_dir: Path, venv: str = ".venv-vllm") -> VllmSpec:
    return VllmSpec(venv=venv, model=str(model_dir), max_model_len=2048, kv_cache_bytes=POOL_BYTES, kv_lease_s=LEASE_S)


def reproduce(stack: VllmStack, words: list[str], timeout_s: float = 120.0) -> LeaseLeak:
    """Steps 1-4 of the module's docstring on a started pair serving the telltale model."""
    own, b_words = words[1], words[2 : 2 + B_REQUESTS]
    result = LeaseLeak(own=own, status=0, reply="", named=[], others={w: f"B{i}" for i, w in enumerate(b_words)})
    decode = stack.processes("decode")
    reply_a: dict[str, object] = {}

    def send_a() -> None:
        body = {
            "model": stack.spec.served_model_name,
            "prompt": prompt(own, A_FILLER),
            "max_tokens": REPLY_TOKENS,
            "temperature": 0,
        }
        try:
            response = httpx.post(
                f"{stack.router_url}/v1/completions", json=body, timeout=timeout_s + 120, trust_env=False
            )
            reply_a["status"], reply_a["body"] = response.status_code, response.text
        except httpx.HTTPError as exc:
            reply_a["error"] = repr(exc)

    log_before = stack.logs("prefill").count(EXPIRY_LINE)
    for proc in decode:
        proc.signal_group(signal.SIGSTOP)
    try:
        sender = threading.Thread(target=send_a, name="lease-leak-a", daemon=True)
        sender.start()
        deadline = time.monotonic() + timeout_s
        while stack.logs("prefill").count(EXPIRY_LINE) <= log_before:  # step 2: the lease passed
            if time.monotonic() > deadline:
                raise TargetError(f"prefill logged no {EXPIRY_LINE!r} within {timeout_s:.0f} s of A")
            time.sleep(0.5)
        result.expiry_logged = True
        pool_tokens = int(stack.spec.kv_cache_bytes / stack.bytes_per_token["prefill"])
        per_b = (pool_tokens - 2 * PAGE) // B_REQUESTS  # together: every free block but the last
        filler = max(1, per_b * (PAGE - 2) // PAGE - 2)
        for i, word in enumerate(b_words):  # step 3, one at a time: each frees its blocks, keeping its KV
            body = {
                "model": stack.spec.served_model_name,
                "prompt": prompt(word, filler),
                "max_tokens": 1,
                "temperature": 0,
            }
            response = httpx.post(
                f"{stack.worker_url('prefill')}/v1/completions", json=body, timeout=timeout_s, trust_env=False
            )
            result.other_replies[f"B{i}"] = (
                response.json()["choices"][0]["text"] if response.status_code == 200 else f"HTTP {response.status_code}"
            )
    finally:
        for proc in decode:  # step 4
            proc.signal_group(signal.SIGCONT)
    sender.join(timeout_s + 150)
    if "error" in reply_a or "status" not in reply_a:
        raise TargetError(f"request A got no reply: {reply_a.get('error', 'timed out')}")
    result.status = int(reply_a["status"])  # type: ignore[call-overload]
    reply_body = str(reply_a["body"])
    result.reply = json.loads(reply_body)["choices"][0]["text"] if result.status == 200 else reply_body[:300]
    result.named = read_reply(result.reply, words)
    return result


def ensure_model(model_dir: Path, python: Path) -> None:
    if (model_dir / "telltale.json").exists():
        return
    built = subprocess.run(
        [str(python), str(TELLTALE_BUILDER), str(model_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if built.returncode != 0:
        raise TargetError(f"building the telltale model failed: {built.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m chaos.targets.vllm.lease_leak", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--venv", default=".venv-vllm", help="the vLLM venv (`make vllm-env`)")
    parser.add_argument(
        "--model", type=Path, help="a built telltale model (default: VENV/models/telltale, built if missing)"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args(argv)
    venv = (REPO / args.venv) if not Path(args.venv).is_absolute() else Path(args.venv)
    model_dir = args.model or venv / "models" / "telltale"
    try:
        ensure_model(model_dir, venv / "bin" / "python")
        with tempfile.TemporaryDirectory(prefix="pdchaos-lease-leak-") as tmp:
            stack = VllmStack(leak_spec(model_dir, str(venv)), Path(tmp))
            stack.up()
            try:
                result = reproduce(stack, load_words(model_dir))
            finally:
                stack.down()
    except TargetError as exc:
        print(f"lease_leak: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**asdict(result), "leaked": result.leaked}, indent=2))
    else:
        print(f"A (own word {result.own!r}): HTTP {result.status}, reply {result.reply!r}")
        print(
            "LEAK: A's reply names " + ", ".join(f"{w!r} ({result.others[w]})" for w in result.leaked)
            if result.leaked
            else "no leak: A's reply names no other request"
        )
    return 1 if result.leaked else 0


if __name__ == "__main__":
    sys.exit(main())
