"""The embedded PD engine behind the real sglang-router: API, determinism, isolation, handoff."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from chaos.process import free_port, launch, pid_alive, wait_http_ok
from chaos.targets.sim.settings import TransferTimeouts, WorkerSettings
from chaos.targets.sim.stack import SimStack, SimStackConfig
from chaos.targets.sim.worker import command_for
from chaos.targets.state import stop_from_state
from tests.conftest import another_runs_server, running, start_stack, wait_until

pytestmark = pytest.mark.integration

GREEDY = {"temperature": 0}


def generate(client: httpx.Client, base: str, text: str, max_new_tokens: int = 16, **extra: object) -> httpx.Response:
    body = {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, **GREEDY}, **extra}
    return client.post(f"{base}/generate", json=body)


def loads(client: httpx.Client, url: str) -> dict:
    return client.get(f"{url}/v1/loads").json()


def pool_idle(client: httpx.Client, stack: SimStack) -> bool:
    """Both pools back at their idle baseline: nothing used, nothing quarantined, queues empty."""
    for role in ("prefill", "decode"):
        data = loads(client, stack.worker_url(role))
        queues = {k: v for k, v in data["disaggregation"].items() if k.endswith("_reqs")}
        if data["num_used_tokens"] or data["quarantined_tokens"] or data["num_running_reqs"] or any(queues.values()):
            return False
    return True


# ------------------------------------------------------------------------------ determinism ----


def test_greedy_output_is_the_same_every_time_with_and_without_the_router(
    sim_stack: SimStack, client: httpx.Client, tmp_path: Path
) -> None:
    prompt = "Write three words about the sea and the harbour lights."
    through_router = {generate(client, sim_stack.router_url, prompt).json()["text"] for _ in range(3)}
    assert len(through_router) == 1
    text = through_router.pop()
    assert len(text) > 10

    # Without the router: a standalone (non-disaggregated) worker computes the same output.
    port = free_port()
    proc = launch("null", command_for(WorkerSettings(role="null", port=port)), tmp_path / "null.log")
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 20, proc)
        assert generate(client, f"http://127.0.0.1:{port}", prompt).json()["text"] == text
    finally:
        proc.stop()

    # And the handoff done by hand, as the router does it: same body to both workers at once.
    body = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": 16, **GREEDY},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": sim_stack.endpoints.workers[0].bootstrap_port,
        "bootstrap_room": 123456789,
    }

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=30) as ac:
            return await asyncio.gather(
                ac.post(sim_stack.worker_url("prefill") + "/generate", json=body),
                ac.post(sim_stack.worker_url("decode") + "/generate", json=body),
            )

    prefill, decode = asyncio.run(both())
    assert prefill.status_code == 200 and decode.status_code == 200
    assert prefill.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert decode.json()["text"] == text


def test_repeat_prompt_comes_back_verbatim_and_generate_prompt_does_not(
    sim_stack: SimStack, client: httpx.Client
) -> None:
    repeat = "Please repeat this: order 4711 ships to Oslo on Friday."
    assert generate(client, sim_stack.router_url, repeat, 64).json()["text"] == repeat
    other = generate(client, sim_stack.router_url, "Tell me about order 4711 shipping to Oslo.", 64).json()["text"]
    assert "4711" not in other


def test_prefix_cache_hit_gives_the_same_output(sim_stack: SimStack, client: httpx.Client) -> None:
    prompt = "Shared system prompt for agents. " * 20 + "Question one?"
    cold = generate(client, sim_stack.router_url, prompt).json()
    warm = generate(client, sim_stack.router_url, prompt).json()
    assert warm["meta_info"]["cached_tokens"] > 0
    assert warm["text"] == cold["text"]


# -------------------------------------------------------------------------------- streaming ----


def _sse_events(response: httpx.Response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def test_streaming_generate_and_chat(sim_stack: SimStack, client: httpx.Client) -> None:
    prompt = "Stream a short answer about trains."
    plain = generate(client, sim_stack.router_url, prompt, 12).json()["text"]
    body = {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": 12, **GREEDY}}
    with client.stream("POST", f"{sim_stack.router_url}/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2
    assert chunks[-1]["text"] == plain  # cumulative text, as SGLang streams by default
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] in ("length", "stop")

    chat = {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with client.stream("POST", f"{sim_stack.router_url}/v1/chat/completions", json=chat) as response:
        assert response.status_code == 200
        events = _sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] >= 1 and usage["prompt_tokens"] > 0
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish and finish[-1] in ("length", "stop")
    nonstream = client.post(
        f"{sim_stack.router_url}/v1/chat/completions", json={**chat, "stream": False, "stream_options": None}
    ).json()
    assert nonstream["choices"][0]["message"]["content"] == content
    assert nonstream["usage"]["prompt_tokens"] == usage["prompt_tokens"]


# ------------------------------------------------------------------------------ concurrency ----


def test_concurrent_requests_each_get_their_own_output(sim_stack: SimStack, client: httpx.Client) -> None:
    prompts = [
        f"Please repeat: customer {i:03d} owes {i * 37 % 1000} crowns. " + "detail " * (i * 13 % 90) for i in range(40)
    ]
    references = [generate(client, sim_stack.router_url, p, 48).json()["text"] for p in prompts]
    assert len(set(references)) == len(prompts)

    async def blast() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as ac:
            return await asyncio.gather(
                *(
                    ac.post(
                        f"{sim_stack.router_url}/generate",
                        json={"text": p, "sampling_params": {"max_new_tokens": 48, **GREEDY}},
                    )
                    for p in prompts * 2
                )
            )

    replies = asyncio.run(blast())
    assert [r.status_code for r in replies] == [200] * len(replies)
    assert [r.json()["text"] for r in replies] == references * 2


# ------------------------------------------------------------------------------ over-length ----


def test_over_length_prompts_get_400_on_both_endpoints(sim_stack: SimStack, client: httpx.Client) -> None:
    context = sim_stack.settings["decode"].context_length
    too_long = "word " * (context + 10)
    r = client.post(
        f"{sim_stack.router_url}/generate", json={"text": too_long, "sampling_params": {"max_new_tokens": 4}}
    )
    assert r.status_code == 400
    assert "longer than the model's context length" in r.text
    r = client.post(
        f"{sim_stack.router_url}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": too_long}], "max_tokens": 4},
    )
    assert r.status_code == 400
    assert "context length" in r.text
    # Just inside the context but at the scheduler's limit (max_req_input_len): also 400.
    limit = sim_stack.settings["decode"].max_req_input_len
    r = client.post(
        f"{sim_stack.router_url}/generate", json={"input_ids": [7] * limit, "sampling_params": {"max_new_tokens": 1}}
    )
    assert r.status_code == 400
    assert "exceeds the maximum allowed length" in r.text
    # The stack still serves.
    assert generate(client, sim_stack.router_url, "still alive?").status_code == 200
    wait_until(lambda: pool_idle(client, sim_stack), what="pools idle after rejections")


# ---------------------------------------------------------------------------- introspection ----


def test_server_info_loads_and_metrics_carry_sglang_fields(sim_stack: SimStack, client: httpx.Client) -> None:
    for role in ("prefill", "decode"):
        url = sim_stack.worker_url(role)
        info = client.get(f"{url}/server_info").json()
        for key in ("max_total_num_tokens", "max_req_input_len", "context_length", "page_size", "disaggregation_mode"):
            assert key in info, key
        assert info["disaggregation_mode"] == role
        assert info["max_req_input_len"] == min(info["context_length"] - 1, info["max_total_num_tokens"] - 1) - 5
        assert client.get(f"{url}/get_server_info").json()["max_total_num_tokens"] == info["max_total_num_tokens"]
        models = client.get(f"{url}/v1/models").json()
        assert models["data"][0]["max_model_len"] == info["context_length"]
        data = loads(client, url)
        for key in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens", "token_usage"):
            assert key in data, key
        for key in (
            "prefill_bootstrap_queue_reqs",
            "prefill_inflight_queue_reqs",
            "decode_prealloc_queue_reqs",
            "decode_transfer_queue_reqs",
            "kv_transfer_speed_gb_s",
            "kv_transfer_latency_ms",
        ):
            assert key in data["disaggregation"], key
        metrics = client.get(f"{url}/metrics").text
        for name in (
            "sglang:max_total_num_tokens",
            "sglang:context_len",
            "sglang:page_size",
            "sglang:num_used_tokens",
            "sglang:num_bootstrap_failed_reqs_total",
            "sglang:num_transfer_failed_reqs_total",
            "sglang:num_aborted_requests_total",
            "sglang:prompt_tokens_total",
            "sglang:num_requests_total",
        ):
            assert name in metrics, name
        assert f'engine_type="{role}"' in metrics
    log = sim_stack.logs("prefill")
    assert "max_total_num_tokens=" in log and "context_len=" in log and "KV Cache is allocated" in log


# -------------------------------------------------------------------------------- bad input ----


@pytest.mark.parametrize(
    "raw",
    [
        b'{"text": "unterminated',
        b"\xff\xfe not utf-8",
        b"[1, 2, 3]",
        b'{"text": 42}',
        b'{"text": "x", "sampling_params": {"max_new_tokens": -3}}',
        b'{"text": "x", "sampling_params": {"max_new_tokens": "ten"}}',
        b'{"text": "x", "stream": "yes"}',
    ],
)
def test_bad_input_gets_sglang_shaped_400_and_the_worker_keeps_serving(
    sim_stack: SimStack, client: httpx.Client, raw: bytes
) -> None:
    direct = client.post(
        f"{sim_stack.worker_url('decode')}/generate", content=raw, headers={"content-type": "application/json"}
    )
    assert direct.status_code == 400, direct.text
    assert direct.json()["error"]["message"]
    # The router checks types itself (422) before it forwards; either way the client gets a 4xx.
    routed = client.post(f"{sim_stack.router_url}/generate", content=raw, headers={"content-type": "application/json"})
    assert routed.status_code in (400, 422), routed.text
    assert generate(client, sim_stack.router_url, "and still serving").status_code == 200


# --------------------------------------------------------------------------- handoff faults ----


SLOW_TRANSFER = SimStackConfig(
    worker=WorkerSettings(transfer_tokens_per_s=1500.0, timeouts=replace(TransferTimeouts(), waiting_timeout_s=2.0)),
)
LONG_PROMPT = "Please repeat the ledger. " + "ledger line with amounts " * 400


def _post_in_background(url: str, body: dict) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        with httpx.Client(timeout=60) as c:
            r = c.post(url, json=body)
            box["status"], box["body"] = r.status_code, r.text

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_abort_mid_transfer_ends_as_abort_and_pools_return_to_baseline(tmp_path: Path, client: httpx.Client) -> None:
    stack = start_stack(tmp_path, SLOW_TRANSFER)
    try:
        rid = "abort-me-0001"
        thread, box = _post_in_background(
            f"{stack.router_url}/generate",
            {"text": LONG_PROMPT, "rid": rid, "sampling_params": {"max_new_tokens": 8, **GREEDY}},
        )
        wait_until(
            lambda: loads(client, stack.worker_url("prefill"))["disaggregation"]["prefill_inflight_queue_reqs"] == 1,
            what="the transfer to start",
        )
        for role in ("prefill", "decode"):  # as SGLang's own PD abort test does: both workers
            assert client.post(f"{stack.worker_url(role)}/abort_request", json={"rid": rid[:8]}).status_code == 200
        thread.join(30)
        assert not thread.is_alive()
        assert box["status"] == 200 and json.loads(box["body"])["meta_info"]["finish_reason"]["type"] == "abort", box
        wait_until(lambda: pool_idle(client, stack), what="pools back at baseline after the abort")
        assert "Aborted by AbortReq" in stack.logs("decode")
        assert generate(client, stack.router_url, "after the abort").status_code == 200
    finally:
        stack.down()


def test_transfer_stalled_past_waiting_timeout_fails_with_kvtransfererror(tmp_path: Path, client: httpx.Client) -> None:
    stack = start_stack(tmp_path, SLOW_TRANSFER)
    try:
        thread, box = _post_in_background(
            f"{stack.router_url}/generate", {"text": LONG_PROMPT, "sampling_params": {"max_new_tokens": 8, **GREEDY}}
        )
        wait_until(
            lambda: loads(client, stack.worker_url("prefill"))["disaggregation"]["prefill_inflight_queue_reqs"] == 1,
            what="the transfer to start",
        )
        prefill = stack.procs["prefill"]
        prefill.signal_group(signal.SIGSTOP)
        try:
            wait_until(
                lambda: "KVPoll.WaitingForInput" in stack.logs("decode"), timeout_s=10, what="the waiting timeout"
            )
            # The stalled sender may still write: decode must hold those pages back, not reuse them.
            assert loads(client, stack.worker_url("decode"))["quarantined_tokens"] > 0
        finally:
            prefill.signal_group(signal.SIGCONT)
        thread.join(30)
        assert box["status"] == 500, box
        assert "KVTransferError" in box["body"]
        assert "Decode transfer failed" in stack.logs("decode")
        wait_until(lambda: pool_idle(client, stack), what="pools back at baseline after the stall")
        metrics = client.get(f"{stack.worker_url('decode')}/metrics").text
        assert (
            'sglang:num_transfer_failed_reqs_total{model_name="pdchaos/toy-1",engine_type="decode",tp_rank="0",pp_rank="0"} 1'
            in metrics
        )
        assert generate(client, stack.router_url, "after the stall").status_code == 200
    finally:
        stack.down()


# ----------------------------------------------------------------------------------- the CLI ----


def test_sim_up_answers_through_the_router_and_sim_down_stops_it(tmp_path: Path, client: httpx.Client) -> None:
    up = subprocess.run(
        [sys.executable, "-m", "chaos.cli", "sim", "up", "--detach", "--json", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert up.returncode == 0, up.stderr
    urls = json.loads(up.stdout.splitlines()[0])
    try:
        # `up` returns only once the router answers (startup time is a benchmark, not a test bound).
        assert generate(client, urls["router"], "hello").status_code == 200
    finally:
        down = subprocess.run(
            [sys.executable, "-m", "chaos.cli", "sim", "down", "--dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert down.returncode == 0
    assert "stopped router" in down.stdout
    with pytest.raises(httpx.HTTPError):
        client.get(urls["router"] + "/health", timeout=2)


def test_a_stack_whose_router_port_another_run_took_starts_again_on_new_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Two runs on one machine: the port picked for our router is bound first by another run's
    server, which then answers our readiness check. The stack must see that the answer is not its
    router's and start again on new ports, not run against the other run's stack."""
    with another_runs_server() as taken:
        stack = SimStack(SimStackConfig(proxied_links=False), tmp_path)
        picks = iter([taken])
        original = stack.launcher.free_port
        monkeypatch.setattr(
            stack.launcher,
            "free_port",
            lambda role: next(picks, None) or original(role) if role == "router" else original(role),
        )
        with running(stack):
            assert stack.router_url != f"http://127.0.0.1:{taken}"
            assert httpx.get(stack.router_url + "/readiness", timeout=5).status_code == 200
        assert f"http://127.0.0.1:{taken}/readiness is answered by pid" in caplog.text, caplog.text


def test_a_proxy_that_lost_its_port_makes_the_stack_start_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with another_runs_server() as taken:
        stack = SimStack(SimStackConfig(proxied_links=True), tmp_path)
        original = stack.launcher.free_port
        # Picked on the router's node: the router's port, its metrics port, then the first proxy's.
        picks = iter([None, None, taken])
        monkeypatch.setattr(
            stack.launcher,
            "free_port",
            lambda role: next(picks, None) or original(role) if role == "router" else original(role),
        )
        with running(stack):
            assert stack.proxies and all(p.listen != f"127.0.0.1:{taken}" for p in stack.proxies.values())
            assert httpx.get(stack.router_url + "/readiness", timeout=5).status_code == 200


def test_a_driver_lost_while_a_worker_restarts_leaves_its_new_pid_for_heal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restart (memory_fraction, engine_failure) records the new worker as soon as it is
    launched: a driver killed before the worker is ready must not leave it unknown to heal."""
    stack = SimStack(SimStackConfig(proxied_links=False), tmp_path)
    with running(stack):
        old_pgid = stack.procs["decode"].pgid

        def driver_killed(*_: object, **__: object) -> None:
            raise KeyboardInterrupt  # what the driver's death looks like to this frame

        monkeypatch.setattr("chaos.targets.sim.stack.wait_http_ok", driver_killed)
        with pytest.raises(KeyboardInterrupt):
            stack.restart("decode", max_total_tokens=2048)
        new_pgid = stack.procs["decode"].pgid
        assert new_pgid != old_pgid and pid_alive(new_pgid)
        recorded = json.loads(stack.state_path(tmp_path).read_text())
        assert new_pgid in {p["pgid"] for p in recorded["processes"]}
        assert any(f"process group {new_pgid}" in line for line in stop_from_state(tmp_path))
        assert stack.procs["decode"].popen.wait(timeout=10) is not None  # killed (and reaped: it is our child)
