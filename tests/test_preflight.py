"""`pdchaos preflight`: the readers in chaos/facts/, the rule in chaos/preflight.py, the CLI.

Log fixtures live in tests/fixtures/preflight/ and are generated from SGLang's format strings by
make_fixtures.py there (a test below keeps them in sync).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import math
import re
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from chaos import cli
from chaos.cli.preflight import register
from chaos.errors import UsageError
from chaos.facts.endpoints import parse_models, parse_server_info
from chaos.facts.log_facts import parse_kv_alloc_line, parse_server_args_line, parse_startup_line
from chaos.facts.log_records import parse_rank, split_log_line, strip_ansi
from chaos.facts.log_starts import (
    BOUNDARY_AFTER_READY,
    BOUNDARY_BANNER,
    BOUNDARY_FIRST,
    BOUNDARY_RANK_AGAIN,
    parse_log,
    read_log,
)
from chaos.facts.pool_metrics import read_pool_metrics
from chaos.facts.prometheus import PrometheusParseError, find_samples, parse_prometheus_text
from chaos.facts.values import to_int
from chaos.preflight import (
    PreflightInputs,
    check_log,
    check_url,
    compute_band,
    format_report,
    judge_pool,
    run_preflight,
)
from chaos.verdict import Verdict
from tests.aiohttp_thread import ThreadedServer

FIXTURES = Path(__file__).parent / "fixtures" / "preflight"
POOL, CONTEXT = 681280, 1048576  # the incident's numbers


def fixture(name: str) -> Path:
    return FIXTURES / name


# --------------------------------------------------------------------------------------------------
# Fixtures are generated from SGLang's format strings
# --------------------------------------------------------------------------------------------------


def test_committed_fixtures_match_their_generator() -> None:
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    for name, text in module.render_fixtures().items():
        assert (FIXTURES / name).read_bytes() == text.encode("utf-8"), (
            f"{name} is stale: run python tests/fixtures/preflight/make_fixtures.py"
        )


# --------------------------------------------------------------------------------------------------
# Log lines
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "timestamp", "rank", "message"),
    [
        ("[2026-08-16 10:00:00 TP0] hello", "2026-08-16 10:00:00", "TP0", "hello"),
        ("[2026-08-16 10:00:00 DP0 TP1] hello", "2026-08-16 10:00:00", "DP0 TP1", "hello"),
        ("[2026-08-16 10:00:00 TP3 EP3] hello", "2026-08-16 10:00:00", "TP3 EP3", "hello"),
        ("[2026-08-16 10:00:00 DP1 PP0 ATTN_CP1 TP2] x=1", "2026-08-16 10:00:00", "DP1 PP0 ATTN_CP1 TP2", "x=1"),
        ("[2026-08-16 10:00:00] The server is fired up", "2026-08-16 10:00:00", "", "The server is fired up"),
        ("plain line with no header", None, "", "plain line with no header"),
        ("\x1b[32m[2026-08-16 10:00:00 TP0]\x1b[0m \x1b[1mbold\x1b[0m\n", "2026-08-16 10:00:00", "TP0", "bold"),
        (
            "2026-08-16T10:00:00.123456789Z prefill-0 | [2026-08-16 10:00:00,123 DP0 TP0] m",
            "2026-08-16 10:00:00,123",
            "DP0 TP0",
            "m",
        ),
    ],
)
def test_split_log_line(line: str, timestamp: str | None, rank: str, message: str) -> None:
    record = split_log_line(line, lineno=7)
    assert (record.lineno, record.timestamp, record.rank, record.message) == (
        7,
        timestamp,
        rank,
        message,
    )


def test_strip_ansi_and_parse_rank() -> None:
    assert strip_ansi("\x1b[1;31mred\x1b[0m \x1b]0;title\x07plain \x1b[2K") == "red plain "
    assert parse_rank("DP1 TP3 EP3") == {"DP": 1, "TP": 3, "EP": 3}
    assert parse_rank("ATTN_CP0 MOE_DP1") == {"ATTN_CP": 0, "MOE_DP": 1}
    assert parse_rank("") == {}


def test_parse_startup_line_gpu_cpu_and_older_formats() -> None:
    gpu = parse_startup_line(
        "max_total_num_tokens=681280, chunked_prefill_size=8192, max_prefill_tokens=16384, "
        "max_running_requests=128, context_len=1048576, available_gpu_mem=11.80 GB"
    )
    assert gpu is not None
    assert (gpu.max_total_num_tokens, gpu.context_len) == (POOL, CONTEXT)
    assert (gpu.chunked_prefill_size, gpu.max_prefill_tokens, gpu.max_running_requests) == (
        8192,
        16384,
        128,
    )
    assert (gpu.available_mem_gb, gpu.mem_device) == (11.8, "gpu")

    cpu = parse_startup_line(
        "max_total_num_tokens=65536, chunked_prefill_size=None, max_prefill_tokens=16384, "
        "max_running_requests=16, context_len=40960, available_cpu_mem=183.40 GB"
    )
    assert cpu is not None
    assert (cpu.max_total_num_tokens, cpu.context_len, cpu.mem_device) == (65536, 40960, "cpu")
    assert cpu.chunked_prefill_size is None
    assert cpu.available_mem_gb == pytest.approx(183.4)

    old = parse_startup_line(
        "[gpu_id=0] max_total_num_tokens=284928, max_prefill_tokens=16384, "
        "max_running_requests=2049, context_len=1048576"
    )
    assert old is not None and (old.max_total_num_tokens, old.context_len) == (284928, CONTEXT)
    assert old.available_mem_gb is None and old.chunked_prefill_size is None

    # Lines that mention the pool without the context length are not the startup line.
    resize = "New memory pool size: 20.00 GB, max_total_num_tokens=5, max_num_reqs=2"
    assert parse_startup_line(resize) is None
    assert parse_startup_line("Prefill batch, #new-seq: 1, #new-token: 8192") is None


def test_parse_kv_alloc_line_variants() -> None:
    mha = parse_kv_alloc_line(
        "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 402816, K size: 10.65 GB, V size: 10.65 GB"
    )
    assert mha is not None
    assert (mha.tokens, mha.dtype, mha.k_size_gb, mha.v_size_gb, mha.kv_size_gb) == (
        402816,
        "torch.bfloat16",
        10.65,
        10.65,
        None,
    )
    mla = parse_kv_alloc_line("KV Cache is allocated. #tokens: 383872, KV size: 19.36 GB")
    assert mla is not None
    assert (mla.tokens, mla.dtype, mla.k_size_gb, mla.v_size_gb, mla.kv_size_gb) == (
        383872,
        None,
        None,
        None,
        19.36,
    )
    assert parse_kv_alloc_line("Memory pool end. avail mem=12.00 GB") is None


def test_parse_server_args_line() -> None:
    banner = parse_server_args_line(
        "server_args=ServerArgs(model_path='zai-org/GLM-5.3', context_length=None, "
        "max_total_tokens=None, page_size=64, tp_size=8, dp_size=1, "
        "disaggregation_mode='prefill', disaggregation_transfer_backend='mooncake')"
    )
    assert banner is not None
    assert banner.disaggregation_mode == "prefill"
    assert banner.context_length is None and banner.max_total_tokens is None
    assert (banner.page_size, banner.tp_size, banner.dp_size) == (64, 8, 1)
    assert banner.model_path == "zai-org/GLM-5.3"
    assert parse_server_args_line("[gpu_id=0] server_args: {...}") is None


# --------------------------------------------------------------------------------------------------
# Starts
# --------------------------------------------------------------------------------------------------


def test_multirank_dp_attention_log() -> None:
    starts = read_log(fixture("multirank_dp_attention.log"))
    assert len(starts) == 1
    start = starts[0]
    assert start.boundary == BOUNDARY_BANNER and start.ready
    assert start.role == "decode"
    assert set(start.ranks) == {"DP0 TP0 EP0", "DP0 TP1 EP1", "DP1 TP2 EP2", "DP1 TP3 EP3"}
    # the KV line glued to a tqdm bar by a carriage return is still read, with its rank
    assert start.ranks["DP1 TP3 EP3"].kv_allocs[0].tokens == 1310720
    assert [r.rank for r in start.startup_ranks] == ["DP0 TP0 EP0"]
    assert (start.pool_tokens, start.context_len) == (1310720, CONTEXT)


def test_multirank_pool_is_the_minimum_over_ranks() -> None:
    starts = read_log(fixture("multirank_dp_min_pool.log"))
    assert len(starts) == 1
    start = starts[0]
    assert sorted(r.rank for r in start.startup_ranks) == ["DP0 TP0", "DP1 TP0"]
    assert (start.pool_tokens, start.context_len) == (240000, 262144)


def test_restarts_are_split_by_each_rule() -> None:
    fail_then_ok = read_log(fixture("restarts_fail_then_ok.log"))
    assert [s.boundary for s in fail_then_ok] == [BOUNDARY_BANNER, BOUNDARY_BANNER]
    assert [(s.pool_tokens, s.context_len) for s in fail_then_ok] == [
        (POOL, CONTEXT),
        (POOL, 524288),
    ]

    ok_then_fail = read_log(fixture("restarts_ok_then_fail.log"))
    assert [s.boundary for s in ok_then_fail] == [BOUNDARY_BANNER, BOUNDARY_AFTER_READY]
    # the relaunch's own KV lines (after the first start's ready line) belong to the relaunch
    assert len(ok_then_fail[0].ranks["TP0"].kv_allocs) == 1
    assert len(ok_then_fail[1].ranks["TP0"].kv_allocs) == 1

    crash = read_log(fixture("restart_no_banner_crash.log"))
    assert [s.boundary for s in crash] == [BOUNDARY_BANNER, BOUNDARY_RANK_AGAIN]
    assert [s.ready for s in crash] == [False, True]
    assert [s.pool_tokens for s in crash] == [300000, 200000]


def test_parse_log_plain_lines_crlf_and_implicit_start() -> None:
    lines = [
        "some preamble\r\n",
        "max_total_num_tokens=1000, max_prefill_tokens=16, max_running_requests=4, context_len=900\r\n",
        "The server is fired up and ready to roll!\r\n",
    ]
    starts = parse_log(lines)
    assert len(starts) == 1
    assert starts[0].boundary == BOUNDARY_FIRST and starts[0].first_lineno == 2
    assert (starts[0].pool_tokens, starts[0].context_len, starts[0].ready) == (1000, 900, True)
    assert starts[0].role is None
    assert parse_log(["nothing to see\n", "\n"]) == []


def test_facts_quoted_inside_a_message_are_not_facts() -> None:
    """With --log-requests a user's prompt reaches the log; it must not forge a start."""
    fake = "max_total_num_tokens=99999999, max_prefill_tokens=1, max_running_requests=1, context_len=1"
    lines = list(fixture("incident_prefill.log").read_text().splitlines(keepends=True)) + [
        f"[2026-08-27 07:00:00 TP0] Receive: obj=GenerateReqInput(text='{fake}', rid='x')\n",
        "[2026-08-27 07:00:00] Receive: text='The server is fired up and ready to roll!'\n",
        "[2026-08-27 07:00:01 TP0] echo: KV Cache is allocated. #tokens: 5, KV size: 1.00 GB\n",
    ]
    starts = parse_log(lines)
    assert [(s.pool_tokens, s.context_len) for s in starts] == [(POOL, CONTEXT)]
    assert starts[0].kv_tokens == POOL


def test_read_log_gz(tmp_path: Path) -> None:
    path = tmp_path / "node.log.gz"
    path.write_bytes(gzip.compress(fixture("incident_prefill.log").read_bytes()))
    starts = read_log(path)
    assert [(s.pool_tokens, s.context_len) for s in starts] == [(POOL, CONTEXT)]


# --------------------------------------------------------------------------------------------------
# /server_info, /v1/models, Prometheus
# --------------------------------------------------------------------------------------------------


def test_to_int_never_guesses() -> None:
    assert to_int(5) == 5 and to_int(681280.0) == 681280 and to_int("42") == 42
    for value in (None, True, 1.5, math.nan, math.inf, "1e6", "12 GB", [], {}):
        assert to_int(value) is None


def test_parse_server_info_and_models() -> None:
    info = parse_server_info(
        {
            "max_total_num_tokens": POOL,
            "max_req_input_len": POOL - 6,
            "context_length": None,
            "page_size": 64,
            "disaggregation_mode": "prefill",
            "version": "0.5.17",
        }
    )
    assert (info.max_total_num_tokens, info.max_req_input_len, info.context_length) == (
        POOL,
        POOL - 6,
        None,
    )
    assert (info.page_size, info.disaggregation_mode, info.version) == (64, "prefill", "0.5.17")
    assert parse_server_info(["not", "a", "dict"]).max_total_num_tokens is None
    assert parse_server_info({"max_total_num_tokens": True}).max_total_num_tokens is None

    models = parse_models(
        {
            "object": "list",
            "data": [
                {"id": "base", "max_model_len": 131072},
                {"id": "long", "max_model_len": CONTEXT},
                {"id": "no-len"},
                "junk",
            ],
        }
    )
    assert models.max_model_len == CONTEXT
    assert models.models == (("base", 131072), ("long", CONTEXT), ("no-len", None))
    assert parse_models({"data": "x"}).max_model_len is None
    assert parse_models(None).max_model_len is None


TRICKY_METRICS = r"""
# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="m",engine_type="prefill",tp_rank="0",pp_rank="0"} 681280.0
# a free comment with "quotes" and {braces}
req_total{path="/a,b}",msg="say \"hi\"\nbye",back="c:\\dir",empty=""} 3 1700000000000
nan_metric NaN
up{job="a",} +Inf
down -Inf
sci 1.5e+06
spaced { a = "b" , c="d" } 2
{"utf8.metric.name", zone="x"} 7
bucket{le="0.5"} 10 # {trace_id="abc"} 0.3 1.6e9

bad line here
unterminated{a="x} 1
under 1_000
# EOF
"""


def test_prometheus_parser_on_tricky_input() -> None:
    samples = parse_prometheus_text(TRICKY_METRICS)
    by_name = {s.name: s for s in samples}
    assert list(by_name) == [
        "sglang:max_total_num_tokens",
        "req_total",
        "nan_metric",
        "up",
        "down",
        "sci",
        "spaced",
        "utf8.metric.name",
        "bucket",
    ]
    pool = by_name["sglang:max_total_num_tokens"]
    assert pool.labels == {
        "model_name": "m",
        "engine_type": "prefill",
        "tp_rank": "0",
        "pp_rank": "0",
    }
    assert pool.value == 681280.0 and pool.timestamp is None
    req = by_name["req_total"]
    assert req.labels == {"path": "/a,b}", "msg": 'say "hi"\nbye', "back": "c:\\dir", "empty": ""}
    assert (req.value, req.timestamp) == (3.0, 1700000000000.0)
    assert math.isnan(by_name["nan_metric"].value)
    assert by_name["up"].value == math.inf and by_name["up"].labels == {"job": "a"}
    assert by_name["down"].value == -math.inf
    assert by_name["sci"].value == 1.5e6
    assert by_name["spaced"].labels == {"a": "b", "c": "d"}
    assert by_name["utf8.metric.name"].labels == {"zone": "x"}
    assert (by_name["bucket"].value, by_name["bucket"].timestamp) == (10.0, None)
    assert find_samples(samples, "sglang:max_total_num_tokens", engine_type="prefill") == [pool]
    assert find_samples(samples, "sglang:max_total_num_tokens", engine_type="decode") == []

    with pytest.raises(PrometheusParseError, match="line 15"):
        parse_prometheus_text(TRICKY_METRICS, strict=True)
    with pytest.raises(PrometheusParseError):
        parse_prometheus_text('x{a="1",a="2"} 1', strict=True)


def test_read_pool_metrics_per_rank() -> None:
    text = (
        "\n".join(
            f'sglang:{name}{{model_name="m",engine_type="decode",tp_rank="{rank}",pp_rank="0"}} {value}'
            for rank, pool in ((0, 900000.0), (1, 850000.0))
            for name, value in (("max_total_num_tokens", pool), ("context_len", 1048576.0), ("page_size", 64.0))
        )
        + '\nsglang:context_len{model_name="m",engine_type="decode",tp_rank="2",pp_rank="0"} NaN\n'
    )
    metrics = read_pool_metrics(text)
    assert len(metrics.series) == 3
    assert metrics.max_total_num_tokens == 850000
    assert metrics.context_len == CONTEXT
    assert metrics.page_size == 64
    assert metrics.engine_types == ("decode",)
    assert read_pool_metrics("").max_total_num_tokens is None


# --------------------------------------------------------------------------------------------------
# The rule
# --------------------------------------------------------------------------------------------------


def test_judge_pool() -> None:
    assert judge_pool(CONTEXT, CONTEXT)[0] is Verdict.PASS
    status, reason = judge_pool(POOL, CONTEXT)
    assert status is Verdict.FAIL
    assert "367,296 tokens" in reason and "35%" in reason
    assert judge_pool(None, CONTEXT)[0] is Verdict.INCONCLUSIVE
    assert judge_pool(POOL, None)[0] is Verdict.INCONCLUSIVE
    assert judge_pool(0, CONTEXT)[0] is Verdict.INCONCLUSIVE
    band = compute_band(POOL - 6, CONTEXT)
    assert band is not None and (band.min_tokens, band.max_tokens) == (POOL - 6, CONTEXT - 1)
    assert compute_band(None, CONTEXT) is None


@pytest.mark.parametrize(
    ("name", "status", "pool", "context", "role", "n_starts"),
    [
        ("ok_prefill.log", Verdict.PASS, 402816, 131072, "prefill", 1),
        ("ok_decode.log", Verdict.PASS, 811008, 131072, "decode", 1),
        ("incident_prefill.log", Verdict.FAIL, POOL, CONTEXT, "prefill", 1),
        ("no_startup.log", Verdict.INCONCLUSIVE, None, None, "decode", 1),
        ("multirank_dp_attention.log", Verdict.PASS, 1310720, CONTEXT, "decode", 1),
        ("multirank_dp_min_pool.log", Verdict.FAIL, 240000, 262144, "prefill", 1),
        ("restarts_fail_then_ok.log", Verdict.PASS, POOL, 524288, "prefill", 2),
        ("restarts_ok_then_fail.log", Verdict.FAIL, 811008, CONTEXT, None, 2),
        ("restart_no_banner_crash.log", Verdict.FAIL, 200000, 262144, None, 2),
        ("restart_then_crash.log", Verdict.INCONCLUSIVE, None, None, "prefill", 2),
        ("cpu_ok.log", Verdict.PASS, 65536, 40960, "prefill", 1),
    ],
)
def test_check_log_fixtures(
    name: str,
    status: Verdict,
    pool: int | None,
    context: int | None,
    role: str | None,
    n_starts: int,
) -> None:
    row = check_log(fixture(name))
    assert (row.status, row.pool_tokens, row.context_len, row.role) == (status, pool, context, role)
    assert len(row.starts) == n_starts
    assert [s.judged for s in row.starts] == [False] * (n_starts - 1) + [True]
    assert row.source == "log" and row.location == str(fixture(name))


def test_incident_log_is_fail_with_the_incidents_numbers() -> None:
    row = check_log(fixture("incident_prefill.log"), name="prefill-0")
    assert row.name == "prefill-0"
    assert row.status is Verdict.FAIL
    assert row.ratio == pytest.approx(POOL / CONTEXT)
    assert "681,280 < context 1,048,576" in row.reason


def test_restarts_report_every_start_and_judge_the_last() -> None:
    row = check_log(fixture("restarts_fail_then_ok.log"))
    assert [s.status for s in row.starts] == [Verdict.FAIL, Verdict.PASS]
    assert row.status is Verdict.PASS
    assert any("#1 FAIL" in note for note in row.notes)

    row = check_log(fixture("restarts_ok_then_fail.log"))
    assert [s.status for s in row.starts] == [Verdict.PASS, Verdict.FAIL]
    assert row.status is Verdict.FAIL

    # An earlier OK start never rescues a most recent start that cannot be read.
    row = check_log(fixture("restart_then_crash.log"))
    assert [s.status for s in row.starts] == [Verdict.PASS, Verdict.INCONCLUSIVE]
    assert row.status is Verdict.INCONCLUSIVE


def test_no_startup_line_is_unknown_with_a_reason(tmp_path: Path) -> None:
    row = check_log(fixture("no_startup.log"))
    assert row.status is Verdict.INCONCLUSIVE
    assert "no scheduler startup line" in row.reason and "811,008" in row.reason
    empty = tmp_path / "router.log"
    empty.write_text("[2026-08-16 10:00:00] router started\n")
    row = check_log(empty)
    assert row.status is Verdict.INCONCLUSIVE and row.starts == []
    assert "no SGLang start found" in row.reason


def test_ok_pair_passes_and_the_text_table() -> None:
    report = run_preflight(
        PreflightInputs(
            logs=[
                ("prefill-0", fixture("ok_prefill.log")),
                ("decode-0", fixture("ok_decode.log")),
            ]
        )
    )
    assert report.ok and report.exit_code == 0
    text = format_report(report)
    header, first, second = text.splitlines()[:3]
    assert header.split()[:8] == ["NODE", "SOURCE", "ROLE", "POOL", "CONTEXT", "RATIO", "MAX_INPUT", "STATUS"]
    # aligned columns: every row's STATUS cell starts where the header's does
    column = header.index("STATUS")
    assert first[column:].startswith("OK") and second[column:].startswith("OK")
    assert first.startswith("prefill-0") and "402,816" in first and "3.07" in first
    assert text.rstrip().splitlines()[-1].startswith("preflight: 2 nodes: 2 OK, 0 FAIL, 0 UNKNOWN")


# --------------------------------------------------------------------------------------------------
# Live workers (tiny aiohttp servers on 127.0.0.1)
# --------------------------------------------------------------------------------------------------


def metrics_text(pool: int, context: int, engine_type: str, ranks: int = 2) -> str:
    lines = []
    constants = (("max_total_num_tokens", pool), ("context_len", context), ("page_size", 64))
    for metric, value in constants:
        lines.append(f"# HELP sglang:{metric} {metric}.")
        lines.append(f"# TYPE sglang:{metric} gauge")
        for rank in range(ranks):
            lines.append(
                f'sglang:{metric}{{model_name="m",engine_type="{engine_type}",'
                f'tp_rank="{rank}",pp_rank="0"}} {float(value)}'
            )
    lines.append('sglang:num_running_reqs{model_name="m",engine_type="x",tp_rank="0",pp_rank="0"} 0.0')
    return "\n".join(lines) + "\n"


def worker_routes(
    pool: int, context: int, mode: str, *, context_flag: int | None = None, metrics: bool = True
) -> dict[str, tuple[int, str, str]]:
    info = {
        "model_path": "m",
        "disaggregation_mode": mode,
        "context_length": context_flag,
        "max_total_tokens": None,
        "page_size": 64,
        "status": "ready",
        "max_total_num_tokens": pool,
        "max_req_input_len": min(context - 1, pool - 1) - 5,
        "internal_states": [{"memory_usage": {}}],
        "version": "0.5.17",
    }
    models = {"object": "list", "data": [{"id": "m", "object": "model", "max_model_len": context}]}
    routes = {
        "/server_info": (200, json.dumps(info), "application/json"),
        "/v1/models": (200, json.dumps(models), "application/json"),
    }
    if metrics:
        routes["/metrics"] = (200, metrics_text(pool, context, mode), "text/plain; version=0.0.4")
    return routes


class Worker:
    """A tiny aiohttp server in its own thread, listening on a free 127.0.0.1 port."""

    def __init__(self, routes: dict[str, tuple[int, str, str]]) -> None:
        self.routes = routes
        app = web.Application()
        for path in self.routes:
            app.router.add_get(path, self._handle)
        self.server = ThreadedServer(app)
        self.url = self.server.url

    async def _handle(self, request: web.Request) -> web.Response:
        status, body, content_type = self.routes[request.path]
        ctype, _, _charset = content_type.partition("; ")
        return web.Response(status=status, text=body, content_type=ctype)

    def __enter__(self) -> Worker:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__(*exc)


@pytest.fixture()
def fail_worker() -> Iterator[Worker]:
    with Worker(worker_routes(POOL, CONTEXT, "prefill")) as worker:
        yield worker


@pytest.fixture()
def ok_worker() -> Iterator[Worker]:
    with Worker(worker_routes(811008, 131072, "decode")) as worker:
        yield worker


@pytest.fixture()
def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_url_with_the_incidents_numbers_is_fail_with_the_band(fail_worker: Worker) -> None:
    row = check_url(fail_worker.url, "prefill-0")
    assert row.status is Verdict.FAIL
    assert (row.pool_tokens, row.context_len, row.role) == (POOL, CONTEXT, "prefill")
    assert row.max_req_input_len == POOL - 6
    assert row.context_source == "/v1/models max_model_len"
    assert row.band is not None
    assert (row.band.min_tokens, row.band.max_tokens) == (POOL - 6, CONTEXT - 1)
    assert row.notes == []


def test_url_ok(ok_worker: Worker) -> None:
    row = check_url(ok_worker.url + "/")
    assert row.status is Verdict.PASS
    assert (row.pool_tokens, row.context_len, row.role) == (811008, 131072, "decode")


def test_url_nothing_listens_is_unknown(dead_url: str) -> None:
    row = check_url(dead_url, timeout=2.0)
    assert row.status is Verdict.INCONCLUSIVE
    assert row.reason.startswith(f"cannot reach {dead_url}")


def test_url_context_precedence_and_fallbacks() -> None:
    # No /v1/models: the metric's context wins over the /server_info flag.
    routes = worker_routes(POOL, CONTEXT, "prefill", context_flag=524288)
    del routes["/v1/models"]
    with Worker(routes) as worker:
        row = check_url(worker.url)
    assert (row.context_len, row.context_source) == (CONTEXT, "metric sglang:context_len")
    assert row.status is Verdict.FAIL
    assert any("/v1/models: HTTP 404" in note for note in row.notes)
    assert any("context readings disagree" in note for note in row.notes)

    # Only /server_info, whose context_length flag is null: the context cannot be read.
    routes = worker_routes(POOL, CONTEXT, "prefill", metrics=False)
    del routes["/v1/models"]
    with Worker(routes) as worker:
        row = check_url(worker.url)
    assert row.status is Verdict.INCONCLUSIVE
    assert row.pool_tokens == POOL and row.context_len is None
    assert "context length could not be read" in row.reason


def test_url_old_server_info_alias() -> None:
    routes = worker_routes(811008, 131072, "decode")
    routes["/get_server_info"] = routes.pop("/server_info")
    with Worker(routes) as worker:
        row = check_url(worker.url)
    assert row.status is Verdict.PASS and row.max_req_input_len == 131066


# --------------------------------------------------------------------------------------------------
# The CLI
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdchaos")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    register(commands)
    return parser


def run_handler(argv: list[str]) -> int:
    args = build_parser().parse_args(["preflight", *argv])
    return args.handler(args)


def test_cli_exit_0_when_every_node_is_ok(capsys: pytest.CaptureFixture[str], ok_worker: Worker) -> None:
    code = run_handler(
        [
            "--log",
            f"prefill-0={fixture('ok_prefill.log')}",
            f"decode-0={fixture('ok_decode.log')}",
            "--url",
            ok_worker.url,
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "prefill-0" in out and "decode-0" in out and ok_worker.url in out
    assert out.rstrip().splitlines()[-1].startswith("preflight: 3 nodes: 3 OK, 0 FAIL, 0 UNKNOWN")


def test_cli_exit_1_on_fail_or_unknown(capsys: pytest.CaptureFixture[str], fail_worker: Worker, dead_url: str) -> None:
    assert run_handler(["--log", str(fixture("ok_prefill.log")), str(fixture("incident_prefill.log"))]) == 1
    assert run_handler(["--log", str(fixture("ok_prefill.log")), "--log", str(fixture("no_startup.log"))]) == 1
    assert run_handler(["--url", fail_worker.url]) == 1
    assert run_handler(["--url", dead_url, "--timeout", "2"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "UNKNOWN" in out and "band: prompts of 681,274..1,048,575" in out


def test_cli_json(capsys: pytest.CaptureFixture[str], fail_worker: Worker, dead_url: str) -> None:
    code = run_handler(
        ["--json", "--log", str(fixture("restarts_fail_then_ok.log")), "--url", f"p0={fail_worker.url}", dead_url]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["exit_code"] == 1 and data["ok"] is False
    assert data["summary"] == {"total": 3, "ok": 1, "fail": 1, "unknown": 1}
    log_row, fail_row, dead_row = data["nodes"]
    assert log_row["status"] == "OK"
    starts = [(s["status"], s["judged"]) for s in log_row["starts"]]
    assert starts == [("FAIL", False), ("OK", True)]
    assert fail_row["name"] == "p0" and fail_row["status"] == "FAIL"
    assert fail_row["pool_tokens"] == POOL and fail_row["context_len"] == CONTEXT
    assert fail_row["ratio"] == round(POOL / CONTEXT, 4)
    assert fail_row["band"] == {"min_tokens": POOL - 6, "max_tokens": CONTEXT - 1}
    assert dead_row["status"] == "UNKNOWN"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give at least one --log FILE"),
        (["--log", "/no/such/node.log"], "--log /no/such/node.log: no such file"),
        (["--log", "prefill-0=/no/such/node.log"], "--log prefill-0=/no/such/node.log: no such file"),
        (["--url", "localhost:30000"], "--url localhost:30000: not an http(s) URL"),
    ],
)
def test_cli_usage_errors_raise(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        run_handler(argv)


def test_cli_directory_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not a regular file"):
        run_handler(["--log", str(tmp_path)])


@pytest.mark.parametrize("argv", [[], ["--log", "/no/such/node.log"]])
def test_cli_main_exits_2_without_a_traceback(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "build_parser", build_parser)
    assert cli.main(["preflight", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("pdchaos: error: ")
    assert "--log" in captured.err
    assert "Traceback" not in captured.err + captured.out


def test_vllm_states_its_pool_in_the_labels_of_cache_config_info() -> None:
    """vLLM 0.32's info gauge (format of vllm/v1/metrics/loggers.py): blocks x block size is the pool."""
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="128",cache_dtype="auto",enable_prefix_caching="True",'
        'gpu_memory_utilization="0.9",num_gpu_blocks="2048",num_cpu_blocks="None"} 1.0\n'
    )
    metrics = read_pool_metrics(text)
    assert metrics.max_total_num_tokens == 262_144 and metrics.page_size == 128
    assert (
        read_pool_metrics(text.replace('num_gpu_blocks="2048"', 'num_gpu_blocks="None"')).max_total_num_tokens is None
    )
