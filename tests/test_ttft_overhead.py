"""The TTFT-overhead benchmark (benchmarks/ttft_overhead.py): its join, and its short mode end to
end with the fields docs/performance.md quotes from its JSON. The overhead itself is the
benchmark's to measure, not this test's: no figure is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.journal import RequestRecord

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import ttft_overhead  # noqa: E402


def _record(
    rid: str, t_send: float, t_first: float | None, endpoint: str = "/generate", stream: bool = False
) -> RequestRecord:
    return RequestRecord(
        id=rid, request_index=0, endpoint=endpoint, stream=stream, t_send=t_send, t_first_token=t_first, outcome="ok"
    )


def test_join_splits_the_overhead_into_the_two_legs() -> None:
    records = [
        _record("a", 100.000, 100.050),
        _record("b", 200.000, 200.020, endpoint="/v1/chat/completions", stream=True),
        _record("c", 300.000, None),  # no first token: not counted
        _record("d", 400.000, 400.010),  # no server line
    ]
    server = {
        "a": {"t_recv": 100.001, "t_first_token": 100.048},
        "b": {"t_recv": 200.002, "t_first_token": 200.012},
    }
    joined = ttft_overhead.join(records, server)
    assert joined["records"] == 4 and joined["records_with_ttft"] == 3
    assert joined["joined"] == 2 and joined["not_joined"] == 1
    # a: client 50 ms, server 47 ms -> 3 ms = 1 ms there + 2 ms back; b: 20 - 10 = 10 = 2 + 8
    assert sorted(joined["by_route"]) == ["/generate whole", "/v1/chat/completions stream"]
    a = joined["by_route"]["/generate whole"]
    assert a["overhead"]["median_ms"] == pytest.approx(3.0)
    assert a["to_server"]["median_ms"] == pytest.approx(1.0)
    assert a["to_client"]["median_ms"] == pytest.approx(2.0)
    assert joined["overhead"]["p99_ms"] == pytest.approx(10.0)


def test_read_timing_keys_lines_by_the_request_id_header_then_the_rid(tmp_path: Path) -> None:
    path = tmp_path / "timing.jsonl"
    lines = [
        {"rid": "engine-1", "request_id": "client-1", "t_recv": 1.0, "t_first_token": 2.0},
        {"rid": "client-2", "request_id": None, "t_recv": 3.0, "t_first_token": None},
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    read = ttft_overhead.read_timing(path)
    assert set(read) == {"client-1", "client-2"}
    assert ttft_overhead.read_timing(tmp_path / "absent.jsonl") == {}


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_the_short_mode_runs_and_writes_the_quoted_fields(tmp_path: Path) -> None:
    out = tmp_path / "ttft.json"
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/ttft_overhead.py",
            "--short",
            "--json",
            str(out),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "The run's own overhead on TTFT" in result.stdout
    report = json.loads(out.read_text())
    for name in ("floor", "floor_under_load", "load"):
        section = report[name]
        assert section["joined"] > 0
        for leg in ("overhead", "to_server", "to_client", "client_ttft", "server_ttft"):
            assert set(section[leg]) >= {"n", "median_ms", "p90_ms", "p99_ms"}
        assert section["by_route"]
    assert set(report["floor"]["by_route"]) == {"whole", "stream", "stream+quickack"}
    assert report["load"]["records_with_ttft"] >= report["load"]["joined"]
    assert report["load_run"]["summary"]["requests"] == report["load"]["records"]
    assert isinstance(report["target_met"], bool) and report["target_ms"] == 1.0
    assert report["params"]["load"]["profile"] == "mixed" and report["params"]["proxied_links"] is True
    assert report["server_lines"]["decode"] > 0 and report["server_lines"]["prefill"] > 0
    assert {"nproc", "cpu_model", "loadavg_start", "loadavg_end"} <= set(report["machine"])
