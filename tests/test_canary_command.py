"""``pdchaos canary``: against the embedded engine (clean), and against tiny servers that behave
like the incident (200 plus another request's marker), answer 500, report nothing, or are not there.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from chaos.canary.judging import judge_stream
from chaos.canary.reply import Reply, parse_sse
from chaos.cli.canary import main, register
from chaos.errors import UsageError
from chaos.targets.sim.stack import SimStack
from tests.aiohttp_thread import ThreadedServer

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"UUL[0-9A-HJKMNP-TV-Z]{14}")
LIMIT = 256  # the fake servers' context length, in words (one word = one token)


def run_handler(argv: list[str]) -> int:
    """Parse `argv` with our register() and call the handler, as `pdchaos canary` would."""
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    register(sub)
    args = parser.parse_args(["canary", *argv])
    return args.handler(args)


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    code = run_handler([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------ fake targets ----


class FakeTarget:
    """An OpenAI-compatible server in a thread. Words are tokens; prompts over LIMIT are
    over-length and get `over_length`: "leak" (200 with a marker an earlier request carried, as
    in the incident), "leak400" (a proper 400 whose message quotes such a marker), "500", or
    "400"."""

    def __init__(self, over_length: str, *, report_context: bool = True, usage: bool = True) -> None:
        self.over_length = over_length
        self.report_context = report_context
        self.usage = usage
        self.seen: list[str] = []  # markers of earlier requests, oldest first
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_post("/v1/completions", self.complete)
        self.server = ThreadedServer(app)
        self.url = self.server.url

    async def models(self, _: web.Request) -> web.Response:
        card: dict[str, Any] = {"id": "fake-model", "object": "model"}
        if self.report_context:
            card["max_model_len"] = LIMIT
        return web.json_response({"object": "list", "data": [card]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chat = request.path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        words = len(prompt.split())
        mine = set(MARKER.findall(prompt))
        earlier = [m for m in self.seen if m not in mine]
        self.seen.extend(m for m in MARKER.findall(prompt) if m not in self.seen)
        if words > LIMIT and self.over_length != "leak":
            status = 500 if self.over_length == "500" else 400
            message = f"Input length ({words} tokens) is too long" if status == 400 else "engine crashed"
            if self.over_length == "leak400" and earlier:
                message += f" (cached context: {earlier[-1]})"
            return web.json_response({"object": "error", "message": message, "code": status}, status=status)
        if words > LIMIT:  # the incident: a 200 built from another request's pages
            stale = earlier[-1] if earlier else "nothing"
            pieces = [f"Sure. The code word is {stale[:8]}", f"{stale[8:]}, as requested."]
        else:
            pieces = ["OK", "."]
        usage = {"prompt_tokens": words, "completion_tokens": 2, "total_tokens": words + 2}
        if not body.get("stream"):
            text = "".join(pieces)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                if chat
                else {"index": 0, "text": text, "finish_reason": "stop"}
            )
            payload: dict[str, Any] = {"id": "x", "object": "chat.completion", "choices": [choice]}
            if self.usage:
                payload["usage"] = usage
            return web.json_response(payload)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:  # the marker is split across two chunks
            choice = (
                {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                if chat
                else {"index": 0, "text": piece, "finish_reason": None}
            )
            await response.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        if self.usage:
            await response.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def __enter__(self) -> FakeTarget:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__(*exc)


@pytest.fixture()
def leaky() -> Iterator[FakeTarget]:
    with FakeTarget("leak") as target:
        yield target


# ----------------------------------------------------------------------------------- tests ----


def test_clean_embedded_engine_passes_and_every_probe_is_a_4xx(
    sim_stack: SimStack, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = run_json(["--url", sim_stack.router_url], capsys)
    assert code == 0, json.dumps(report, indent=1)[:4000]
    assert report["verdict"] == "PASS"
    target = report["target"]
    assert target["api"] == "sglang"  # /generate is probed too
    assert target["context_length"] == 8192 and target["max_total_num_tokens"] and target["max_req_input_len"]
    probes = report["probes"]
    assert {p["threshold"] for p in probes} == {"pool", "context", "band"}
    assert {p["route"] for p in probes} == {"chat", "completions", "generate"}
    assert {p["stream"] for p in probes} == {True, False}
    for probe in probes:
        assert probe["verdict"] == "PASS", probe
        assert 400 <= probe["rejected_status"] < 500, probe
        assert probe["leaks"] == []
        assert probe["exact_size"], probe
        if probe["measured_tokens"] is not None:  # the server's own count, from its message
            assert probe["measured_tokens"] >= probe["threshold_tokens"], probe
        if probe["threshold"] == "band":  # passes the tokenizer, only the scheduler rejects it
            assert probe["threshold_tokens"] <= probe["planned_tokens"] < probe["upper_tokens"]
    # SGLang answers the band's streamed probes 200 with the 400 inside the stream.
    assert any(p["http_status"] == 200 and p["stream_error_status"] == 400 for p in probes)
    assert report["summary"]["victims_clean"] == 8 and report["summary"]["leaks"] == 0


def test_incident_like_server_fails_with_the_leak_reported(
    leaky: FakeTarget, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report = run_json(["--url", leaky.url], capsys)
    assert code == 1
    assert report["verdict"] == "FAIL"
    assert report["target"]["api"] == "openai"  # no /generate on an OpenAI-only target
    probes = report["probes"]
    assert probes and all(p["verdict"] == "FAIL" for p in probes)
    assert all(p["http_status"] == 200 for p in probes)
    assert all(p["leaks"] for p in probes), [p["reason"] for p in probes]
    owners = {leak["owner"] for p in probes for leak in p["leaks"]}
    assert any(owner.startswith("victim") for owner in owners), owners
    # Streamed probes: the marker came split over two chunks, and is still found whole.
    streamed = [leak for p in probes if p["stream"] for leak in p["leaks"]]
    assert any(leak["kind"] == "whole" and leak["verified"] for leak in streamed)
    assert report["summary"]["victims_clean"] == 8


def test_text_output_is_a_table_with_the_leak_and_a_summary(
    leaky: FakeTarget, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_handler(["--url", leaky.url + "/v1/"]) == 1  # an OpenAI client's base URL works too
    out = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(out) if line.startswith("PROBE"))
    for column in ("TOKENS", "THRESHOLD", "ROUTE", "STREAM", "STATUS", "VERDICT", "REASON"):
        assert column in out[header]
    rows = out[header + 1 : header + 5]
    assert all("FAIL" in row and "LEAK" in row for row in rows), rows
    verdict_at = out[header].index("VERDICT")
    assert all(row[verdict_at:].startswith("FAIL") for row in rows)  # aligned
    assert out[-1].startswith("canary FAIL:") and "exit 1" in out[-1]


def test_over_length_answered_500_is_a_fail(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeTarget("500", usage=False) as target:
        code, report = run_json(["--url", target.url], capsys)
    assert code == 1
    probes = report["probes"]
    assert probes and all(p["verdict"] == "FAIL" and p["http_status"] == 500 for p in probes)
    assert all("server error 500" in p["reason"] for p in probes)
    # No usage in replies: sizes are estimates that over-shoot the context.
    assert all(not p["exact_size"] and p["planned_tokens"] > LIMIT for p in probes)


def test_a_4xx_that_carries_another_requests_marker_is_a_fail(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeTarget("leak400") as target:
        code, report = run_json(["--url", target.url], capsys)
    assert code == 1
    probes = report["probes"]
    assert probes and all(p["verdict"] == "FAIL" and p["rejected_status"] == 400 and p["leaks"] for p in probes)
    assert all(p["reason"].startswith("LEAK") for p in probes)


def test_a_target_that_reports_nothing_needs_max_tokens_probe(capsys: pytest.CaptureFixture[str]) -> None:
    with FakeTarget("400", report_context=False) as target:
        with pytest.raises(UsageError, match="--max-tokens-probe"):
            run_handler(["--url", target.url])
        assert main(["--url", target.url]) == 2
        err = capsys.readouterr().err
        assert "--max-tokens-probe" in err and "Traceback" not in err

        code, report = run_json(["--url", target.url, "--max-tokens-probe", str(LIMIT)], capsys)
    assert code == 0, report
    assert [p["target_tokens"] for p in report["probes"]][::4] == [LIMIT + 1, 2 * LIMIT]
    assert all(p["verdict"] == "PASS" and p["rejected_status"] == 400 for p in report["probes"])


def test_unreachable_and_malformed_urls_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UsageError, match=r"--url .*cannot reach"):
        run_handler(["--url", url])
    assert main(["--url", url]) == 2
    assert main(["--url", "localhost:8000"]) == 2
    err = capsys.readouterr().err
    assert err.count("--url") >= 2 and "Traceback" not in err


def test_exit_codes_end_to_end_in_a_subprocess(leaky: FakeTarget) -> None:
    script = "import sys; from chaos.cli.canary import main; sys.exit(main(sys.argv[1:]))"

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", script, *argv], cwd=REPO, check=False, capture_output=True, text=True, timeout=60
        )

    leak = run("canary", "--url", leaky.url)
    assert leak.returncode == 1, leak.stderr
    assert "LEAK" in leak.stdout and "canary FAIL" in leak.stdout

    gone = run("--url", f"http://127.0.0.1:{free_port()}", "--timeout", "5")
    assert gone.returncode == 2
    assert "--url" in gone.stderr and "Traceback" not in gone.stderr


# ------------------------------------------------------------------------- streaming rule ----


def sse(*events: dict[str, Any]) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


@pytest.mark.parametrize(
    ("events", "rejected"),
    [
        # In-stream 400, nothing streamed before it (SGLang's scheduler check): rejected.
        ([{"error": {"message": "Input length (9 tokens) exceeds", "type": "BadRequestError", "code": 400}}], 400),
        # The empty role chunk chat streams open with is not content.
        (
            [
                {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                {"error": {"message": "too long", "code": 400}},
            ],
            400,
        ),
        # /generate: the abort finish reason carries the status.
        (
            [
                {
                    "text": "",
                    "output_ids": [],
                    "meta_info": {"finish_reason": {"type": "abort", "status_code": 400, "message": "x"}},
                }
            ],
            400,
        ),
        # Content before the error: the prompt was served.
        ([{"choices": [{"delta": {"content": "hello"}}]}, {"error": {"message": "late", "code": 400}}], None),
        # A 5xx inside the stream is no rejection.
        ([{"error": {"message": "KVTransferError", "code": 500}}], None),
        # An abort without a status (a plain abort) is no rejection.
        (
            [
                {
                    "text": "",
                    "output_ids": [],
                    "meta_info": {"finish_reason": {"type": "abort", "status_code": None, "message": "Aborted"}},
                }
            ],
            None,
        ),
        # A stream that just ends.
        ([{"choices": [{"delta": {"content": ""}, "finish_reason": "stop"}]}], None),
    ],
)
def test_streaming_rejection_rule(events: list[dict[str, Any]], rejected: int | None) -> None:
    reply = parse_sse(sse(*events), Reply(http_status=200))
    status, _ = judge_stream(reply, "chat", "openai")
    assert status == rejected
