"""The embedded engine's opt-in timing log (chaos/targets/sim/timing.py): off by default, and with
`--timing-log` one line per answered generation request, keyed by the client's X-Request-ID."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from chaos.process import ManagedProcess, free_port, launch, wait_http_ok
from chaos.targets.sim.settings import WorkerSettings
from chaos.targets.sim.worker import build_parser, command_for, settings_from_args


def test_the_timing_log_is_off_unless_asked_for() -> None:
    assert WorkerSettings().timing_log is None
    assert "--timing-log" not in command_for(WorkerSettings())
    argv = command_for(replace(WorkerSettings(), timing_log="/tmp/t.jsonl"))
    assert argv[argv.index("--timing-log") + 1] == "/tmp/t.jsonl"
    assert settings_from_args(build_parser().parse_args(argv[3:])).timing_log == "/tmp/t.jsonl"


@pytest.fixture()
def null_worker(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    log = tmp_path / "timing.jsonl"
    port = free_port()
    settings = replace(WorkerSettings(), role="null", port=port, timing_log=str(log), decode_step_s=0.002)
    proc: ManagedProcess = launch("null", command_for(settings), tmp_path / "worker.log", None)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 30, proc)
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.stop()


def _lines(log: Path, count: int) -> list[dict[str, object]]:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
        if len(lines) >= count:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"{count} timing lines expected in {log}")


@pytest.mark.integration
def test_each_answered_request_gets_a_line_with_its_times(null_worker: tuple[str, Path]) -> None:
    url, log = null_worker
    with httpx.Client(timeout=30) as client:
        sent = time.time()
        whole = client.post(
            url + "/generate",
            json={"text": "hello there", "rid": "rid-whole", "sampling_params": {"max_new_tokens": 5}},
            headers={"X-Request-ID": "id-whole"},
        )
        assert whole.status_code == 200
        with client.stream(
            "POST",
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
            headers={"X-Request-ID": "id-chat"},
        ) as stream:
            assert stream.status_code == 200
            stream.read()
        with client.stream(
            "POST", url + "/generate", json={"text": "again", "rid": "rid-stream", "stream": True}
        ) as stream:
            stream.read()
        bad = client.post(url + "/generate", json={"text": ""}, headers={"X-Request-ID": "id-bad"})
        assert bad.status_code == 400  # refused before it became a request: no line
    lines = {str(x["request_id"] or x["rid"]): x for x in _lines(log, 3)}
    assert set(lines) == {"id-whole", "id-chat", "rid-stream"}
    w = lines["id-whole"]
    assert w["rid"] == "rid-whole" and w["api"] == "generate" and w["stream"] is False
    assert w["role"] == "null" and w["status"] == 200 and w["output_tokens"] == 5
    for line in lines.values():
        assert isinstance(line["t_recv"], float) and isinstance(line["t_first_token"], float)
        assert sent <= line["t_recv"] <= line["t_first_token"] <= line["t_end"]  # type: ignore[operator]
    assert lines["id-chat"]["api"] == "chat" and lines["id-chat"]["stream"] is True
