"""The SGLang launch target without a GPU: its campaign section, the exact commands, and the readers.

Flag names are checked against the real `sglang.launch_server --help` of `make sglang-env`'s SGLang
(CPU build) and the real `sglang_router.launch_router --help`. Fixtures under
tests/fixtures/sglang/ are written from SGLang's formats (`http_server.py`, `scheduler.py`).
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from pydantic import ValidationError

from chaos.campaign_validation import load_campaign, parse_campaign
from chaos.errors import TargetError, UsageError
from chaos.facts.endpoints import loads_ranks, parse_models, parse_server_info
from chaos.facts.log_starts import parse_log
from chaos.facts.pool_metrics import read_pool_metrics
from chaos.facts.prometheus import parse_prometheus_text
from chaos.oracles.integrity import CORRUPTION_SIGNALS, TRANSFER_SIGNALS
from chaos.pools import idle
from chaos.targets.dialect import SGLANG
from chaos.targets.launcher import PlannedCommand
from chaos.targets.sglang.commands import server_command, server_env
from chaos.targets.sglang.pool import memory_from_log, memory_from_metrics
from chaos.targets.sglang.settings import with_overrides
from chaos.targets.sglang.spec import SGLangSpec
from chaos.targets.sglang.stack import SGLangStack
from tests.fixtures.sglang.fake_launch_server import SWITCHES, VALUED

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures" / "sglang"

# Every launch_server flag pdchaos may emit: the flags the stand-in launch_server takes, switches and
# valued ones (test_server_flags_exist_in_the_installed_sglang holds them to the real SGLang's).
SGLANG_SERVER_FLAGS = SWITCHES | VALUED


class FakeLauncher:
    """Records what would start, starts nothing; ports count up so every one is distinct."""

    def __init__(self) -> None:
        self.next_port = 40000
        self.launched: list[PlannedCommand] = []

    def host(self, role: str) -> str:
        return {"prefill": "10.0.0.11", "decode": "10.0.0.12", "router": "10.0.0.10"}[role]

    def free_port(self, role: str) -> int:
        self.next_port += 1
        return self.next_port

    def placement(self, role: str) -> str:
        return f"node of {role}"

    def launch(self, command: PlannedCommand) -> None:
        raise AssertionError(f"FakeLauncher starts nothing (asked for {command.name})")

    def state(self) -> dict[str, object]:
        return {}

    def close(self) -> None:
        pass


def full_spec(**changes: object) -> SGLangSpec:
    data: dict[str, object] = {
        "model_path": "/models/Qwen3-32B",
        "served_model_name": "qwen",
        "python": "/opt/sglang/bin/python",
        "tp_size": 2,
        "mem_fraction_static": 0.85,
        "context_length": 40960,
        "page_size": 64,
        "transfer_backend": "mooncake",
        "ib_device": "mlx5_0,mlx5_1",
        "bootstrap_port": 8998,
        "deterministic": True,
        "random_seed": 7,
        "kv_canary": "raise",
        "kv_canary_real_data": "partial",
        "kv_canary_sweep_interval": 100,
        "kv_checksum": True,
        "trust_remote_code": True,
        "bootstrap_timeout_s": 20,
        "waiting_timeout_s": 25,
        "heartbeat_interval_s": 2.5,
        "heartbeat_max_failure": 1,
        "env": {"MC_TRANSFER_TIMEOUT": "10"},
        "prefill": {
            "port": 30100,
            "nccl_port": 30300,
            "gpu_ids": [0, 1],
            "env": {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "99"},
        },
        "decode": {
            "port": 30200,
            "nccl_port": 30400,
            "gpu_ids": [2, 3],
            "mem_fraction_static": 0.7,
            "max_total_tokens": 500000,
            "extra_args": ["--max-running-requests", "64"],
        },
        "router": {"port": 30000, "metrics_port": 30090},
    }
    data.update(changes)
    return SGLangSpec.model_validate(data)


def flag_values(argv: list[str]) -> dict[str, str | None]:
    """--flag -> its value (None for a switch); the program and `-m module` are left out."""
    args = argv[3:]
    out: dict[str, str | None] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else None
            out[arg] = None if nxt is None or nxt.startswith("--") else nxt
    return out


# ------------------------------------------------------------------------------- commands ----


def test_server_commands_carry_every_setting_with_sglang_flag_names(tmp_path: Path) -> None:
    stack = SGLangStack(full_spec(), tmp_path, FakeLauncher())  # type: ignore[arg-type]
    prefill, decode, router = stack.plan()
    assert prefill.argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    p, d = flag_values(prefill.argv), flag_values(decode.argv)
    assert set(p) | set(d) <= SGLANG_SERVER_FLAGS
    assert p == {
        "--model-path": "/models/Qwen3-32B",
        "--disaggregation-mode": "prefill",
        "--host": "10.0.0.11",
        "--port": "30100",
        "--tp-size": "2",
        "--base-gpu-id": "0",
        "--nccl-port": "30300",
        "--disaggregation-transfer-backend": "mooncake",
        "--disaggregation-bootstrap-port": "8998",
        "--served-model-name": "qwen",
        "--mem-fraction-static": "0.85",
        "--context-length": "40960",
        "--page-size": "64",
        "--disaggregation-ib-device": "mlx5_0,mlx5_1",
        "--random-seed": "7",
        "--kv-canary-real-data": "partial",
        "--kv-canary-sweep-interval": "100",
        "--kv-canary": "raise",
        "--enable-deterministic-inference": None,
        "--disaggregation-enable-kv-checksum": None,
        "--enable-metrics": None,
        "--enable-cache-report": None,
        "--trust-remote-code": None,
    }
    # decode: its own mode, port, fraction and pool; the same bootstrap port (it falls back to it)
    assert (d["--disaggregation-mode"], d["--host"], d["--port"], d["--nccl-port"]) == (
        "decode",
        "10.0.0.12",
        "30200",
        "30400",
    )
    assert (d["--mem-fraction-static"], d["--max-total-tokens"], d["--disaggregation-bootstrap-port"]) == (
        "0.7",
        "500000",
        "8998",
    )
    assert decode.argv[-2:] == ["--max-running-requests", "64"]
    assert "--max-total-tokens" not in p
    assert (prefill.ready_url, decode.ready_url) == ("http://10.0.0.11:30100/health", "http://10.0.0.12:30200/health")
    assert router.ready_url == "http://10.0.0.10:30000/readiness"
    assert [c.role for c in (prefill, decode, router)] == ["prefill", "decode", "router"]


def test_server_environment_gpus_timeouts_and_campaign_env(tmp_path: Path) -> None:
    prefill, decode, _ = SGLangStack(full_spec(), tmp_path, FakeLauncher()).plan()  # type: ignore[arg-type]
    assert prefill.env == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "20",
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "99",  # the role's own env wins over the typed field
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2.5",
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "1",
        "MC_TRANSFER_TIMEOUT": "10",
    }
    assert decode.env["CUDA_VISIBLE_DEVICES"] == "2,3" and decode.env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] == "25"
    assert prefill.shell().startswith("CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=0,1 MC_TRANSFER_TIMEOUT=10 ")


def test_defaults_one_node_layout_shortened_timeouts_and_engine_defaults(tmp_path: Path) -> None:
    spec = SGLangSpec(model_path="m", tp_size=2)
    stack = SGLangStack(spec, tmp_path, FakeLauncher())  # type: ignore[arg-type]
    prefill, decode, _ = stack.plan()
    assert (prefill.env["CUDA_VISIBLE_DEVICES"], decode.env["CUDA_VISIBLE_DEVICES"]) == ("0,1", "2,3")
    assert (
        prefill.env["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] == "30"
        and prefill.env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] == "30"
    )
    assert "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL" not in prefill.env
    flags = flag_values(prefill.argv)
    # What the campaign leaves out, SGLang decides: no flag at all, not a guessed value.
    for flag in (
        "--mem-fraction-static",
        "--context-length",
        "--max-total-tokens",
        "--page-size",
        "--kv-canary",
        "--disaggregation-ib-device",
        "--enable-deterministic-inference",
        "--disaggregation-enable-kv-checksum",
    ):
        assert flag not in flags
    assert "--enable-metrics" in flags and prefill.argv[0] == sys.executable
    ports = stack.ports
    assert (
        len(
            {
                ports.prefill,
                ports.decode,
                ports.prefill_nccl,
                ports.decode_nccl,
                ports.bootstrap,
                ports.router,
                ports.router_metrics,
            }
        )
        == 7
    )
    assert stack.plan() == [prefill, decode, stack.plan()[2]]  # planned once: plan() and up() agree
    no_timeouts = SGLangStack(
        SGLangSpec(model_path="m", bootstrap_timeout_s=None, waiting_timeout_s=None), tmp_path, FakeLauncher()
    ).plan()[0]  # type: ignore[arg-type]
    assert not any(k.startswith("SGLANG_") for k in no_timeouts.env)


def test_mooncake_tcp_and_nixl_take_no_ib_device(tmp_path: Path) -> None:
    for backend in ("mooncake_tcp", "nixl"):
        argv = (
            SGLangStack(SGLangSpec(model_path="m", transfer_backend=backend), tmp_path, FakeLauncher()).plan()[0].argv
        )  # type: ignore[arg-type]
        assert flag_values(argv)["--disaggregation-transfer-backend"] == backend
        assert "--disaggregation-ib-device" not in argv
        with pytest.raises(ValidationError, match="ib_device applies to transfer_backend mooncake only"):
            SGLangSpec(model_path="m", transfer_backend=backend, ib_device="mlx5_0")


def test_router_command_is_pd_mode_with_retries_and_breaker_off_by_default(tmp_path: Path) -> None:
    router = SGLangStack(full_spec(), tmp_path, FakeLauncher()).plan()[2]  # type: ignore[arg-type]
    assert router.argv[1:3] == ["-m", "sglang_router.launch_router"]
    flags = flag_values(router.argv)
    assert "--pd-disaggregation" in flags and "--disable-retries" in flags and "--disable-circuit-breaker" in flags
    i = router.argv.index("--prefill")
    assert router.argv[i : i + 3] == ["--prefill", "http://10.0.0.11:30100", "8998"]
    assert router.argv[router.argv.index("--decode") + 1] == "http://10.0.0.12:30200"
    assert (flags["--host"], flags["--port"], flags["--prometheus-host"], flags["--prometheus-port"]) == (
        "10.0.0.10",
        "30000",
        "10.0.0.10",
        "30090",
    )
    assert (flags["--policy"], flags["--health-check-interval-secs"]) == ("round_robin", "5")

    kept = (
        SGLangStack(
            full_spec(
                router={
                    "retries": True,
                    "max_retries": 2,
                    "circuit_breaker": True,
                    "cb_failure_threshold": 4,
                    "policy": "cache_aware",
                    "extra_args": ["--log-level", "debug"],
                }
            ),
            tmp_path,
            FakeLauncher(),
        )
        .plan()[2]
        .argv
    )  # type: ignore[arg-type]
    kept_flags = flag_values(kept)
    assert "--disable-retries" not in kept_flags and "--disable-circuit-breaker" not in kept_flags
    assert (kept_flags["--retry-max-retries"], kept_flags["--cb-failure-threshold"], kept_flags["--policy"]) == (
        "2",
        "4",
        "cache_aware",
    )
    assert kept[-2:] == ["--log-level", "debug"]


def test_smg_front_takes_the_same_flags_and_is_ready_when_it_lists_both_roles(tmp_path: Path) -> None:
    """smg (`python -m smg launch`) in front instead of sglang-router: the same flags after the
    module; readiness is its /workers list, since its /readiness is 200 before it has workers."""
    from chaos.targets.sglang.readiness import workers_ready

    stack = SGLangStack(
        full_spec(router={"port": 30000, "metrics_port": 30090, "front": "smg"}), tmp_path, FakeLauncher()
    )  # type: ignore[arg-type]
    router = stack.plan()[2]
    classic = SGLangStack(full_spec(), tmp_path, FakeLauncher()).plan()[2]  # type: ignore[arg-type]
    assert router.argv[1:4] == ["-m", "smg", "launch"] and router.argv[4:] == classic.argv[3:]
    assert (
        router.ready_url == "http://10.0.0.10:30000/workers" and classic.ready_url == "http://10.0.0.10:30000/readiness"
    )
    prefill = {"worker_type": "prefill", "is_healthy": True, "status": "ready", "bootstrap_port": 8998}
    decode = {"worker_type": "decode", "is_healthy": True, "status": "ready"}
    assert workers_ready({"workers": [prefill, decode], "total": 2})
    assert not workers_ready({"workers": [], "total": 0})  # what smg 1.13 answers while it registers them
    assert not workers_ready({"workers": [prefill, {**decode, "is_healthy": False}]})
    assert not workers_ready({"workers": [prefill]}) and not workers_ready("not json")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("front", ["sglang-router", "smg"])
def test_router_flags_exist_in_the_installed_router(tmp_path: Path, front: str) -> None:
    module = ["-m", "sglang_router.launch_router"] if front == "sglang-router" else ["-m", "smg", "launch"]
    help_text = subprocess.run(
        [sys.executable, *module, "--help"], capture_output=True, text=True, timeout=100, check=False
    ).stdout
    assert "--pd-disaggregation" in help_text, help_text[:2000]
    known = set(re.findall(r"--[a-z][a-z0-9-]+", help_text))
    for router in ({}, {"retries": True, "max_retries": 2, "circuit_breaker": True, "cb_failure_threshold": 4}):
        argv = SGLangStack(full_spec(router={**router, "front": front}), tmp_path, FakeLauncher()).plan()[2].argv  # type: ignore[arg-type]
        emitted = {a for a in argv if a.startswith("--")}
        assert emitted <= known, f"not flags of the installed router: {sorted(emitted - known)}"


@pytest.mark.timeout(180)
def test_server_flags_exist_in_the_installed_sglang(tmp_path: Path) -> None:
    """Every launch_server flag the plan emits, and every flag the stand-in launch_server accepts,
    is one the real SGLang of `make sglang-env` knows (its `--help`)."""
    python = ROOT / ".venv-sglang" / "bin" / "python"
    if not (ROOT / ".venv-sglang" / ".installed").exists():
        pytest.skip("SGLang is not installed here: run `make sglang-env` (CI does)")
    help_text = subprocess.run(
        [str(python), "-m", "sglang.launch_server", "--help"], capture_output=True, text=True, timeout=150, check=False
    ).stdout
    assert "--disaggregation-mode" in help_text, help_text[:2000]
    known = set(re.findall(r"--[a-z][a-z0-9-]+", help_text))
    prefill, decode, _router = SGLangStack(full_spec(), tmp_path, FakeLauncher()).plan()  # type: ignore[arg-type]
    emitted = {a for a in (*prefill.argv, *decode.argv) if a.startswith("--")}
    assert emitted <= known, f"not flags of the installed SGLang: {sorted(emitted - known)}"
    assert known >= SGLANG_SERVER_FLAGS, (
        f"the stand-in accepts flags SGLang lacks: {sorted(SGLANG_SERVER_FLAGS - known)}"
    )


# ----------------------------------------------------------------------------- validation ----


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"kv_canary": "none", "kv_canary_sweep_interval": 5, "kv_canary_real_data": None},
            "need kv_canary: log or raise",
        ),
        ({"prefill": {"gpu_ids": [0]}}, r"prefill.gpu_ids \[0\] has 1 GPU\(s\) for tp_size 2"),
        ({"prefill": {"gpu_ids": [0, 0]}}, "lists a GPU twice"),
        (
            {"host": "10.0.0.5", "decode": {"gpu_ids": [1, 2]}, "mem_fraction_static": None},
            r"share GPU\(s\) \[1\] on one host: set mem_fraction_static",
        ),
        (
            {"host": "10.0.0.5", "decode": {"gpu_ids": [1, 2], "mem_fraction_static": 0.5}},
            "leave no room for activations",
        ),
        ({"extra_args": ["--port=1"]}, "extra_args sets --port"),
        ({"decode": {"extra_args": ["--tp", "4"]}}, "extra_args sets --tp"),
        ({"host": "0.0.0.0"}, "is a wildcard"),
        ({"bootstrap_port": 30100}, "are both port 30100"),
        ({"router": {"max_retries": 3}}, "max_retries needs retries: true"),
        ({"router": {"extra_args": ["--disable-retries"]}}, "router.extra_args sets --disable-retries"),
        ({"transfer_backend": "fake"}, "transfer_backend"),
    ],
)
def test_spec_rejects_inconsistent_settings(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        full_spec(**changes)


def test_roles_on_one_gpu_with_fractions_that_fit_and_ports_on_separate_hosts(tmp_path: Path) -> None:
    one_gpu = SGLangSpec(
        model_path="m",
        prefill={"gpu_ids": [0], "mem_fraction_static": 0.4},
        decode={"gpu_ids": [0], "mem_fraction_static": 0.4},
    )
    assert one_gpu.gpu_ids_of("prefill") == one_gpu.gpu_ids_of("decode") == [0]
    assert SGLangStack(one_gpu, tmp_path).plan()[0].env["CUDA_VISIBLE_DEVICES"] == "0"
    # Two nodes may use the same port and the same GPU index.
    SGLangSpec(
        model_path="m",
        prefill={"host": "10.0.0.11", "port": 30000, "gpu_ids": [0]},
        decode={"host": "10.0.0.12", "port": 30000, "gpu_ids": [0]},
    )


def test_one_gpu_for_both_roles_is_checked_with_the_hosts_the_launcher_gives(tmp_path: Path) -> None:
    """Without hosts in the campaign, only the launcher knows whether both roles share a node."""
    spec = SGLangSpec(model_path="m", prefill={"gpu_ids": [0]}, decode={"gpu_ids": [0]})
    local = SGLangStack(spec, tmp_path)
    assert [c.name for c in local.plan()] == ["prefill", "decode", "router"]  # plan places every role here anyway
    with pytest.raises(UsageError, match=r"target.sglang: prefill and decode share GPU\(s\) \[0\] on one host"):
        local.up()  # this machine for both: refused before anything starts
    assert local.procs == {} and not (tmp_path / "target.json").exists()
    with pytest.raises(AssertionError, match=r"starts nothing \(asked for prefill\)"):
        SGLangStack(spec, tmp_path, FakeLauncher()).up()  # type: ignore[arg-type]  # two nodes: it goes on to launch


def test_campaign_errors_name_the_sglang_field() -> None:
    with pytest.raises(UsageError, match=r"target.sglang.decode.mem_fraction_static: .*less than 1"):
        parse_campaign(
            {
                "name": "x",
                "target": {"kind": "sglang", "sglang": {"model_path": "m", "decode": {"mem_fraction_static": 1.5}}},
            }
        )
    with pytest.raises(UsageError, match=r"target.sglang.tp_sise: unknown field"):
        parse_campaign({"name": "x", "target": {"kind": "sglang", "sglang": {"model_path": "m", "tp_sise": 2}}})


def test_shipped_launch_campaign_validates_and_plans(tmp_path: Path) -> None:
    campaign = load_campaign(ROOT / "campaigns" / "sglang-launch.yaml")
    assert campaign.target.kind == "sglang" and campaign.target.sglang is not None
    from faults.registry import FAULTS

    applicable = {name for name, cls in FAULTS.items() if "sglang" in cls.targets}
    assert {w.fault for w in campaign.windows()} == applicable  # one window of every fault that applies
    from chaos.targets.factory import build_stack

    stack = build_stack(campaign, tmp_path, FakeLauncher())  # type: ignore[arg-type]  # what `pdchaos run` and `plan` build
    assert isinstance(stack, SGLangStack) and stack.kind == "sglang" and stack.dialect is SGLANG
    prefill, decode, router = stack.plan()
    assert (prefill.env["CUDA_VISIBLE_DEVICES"], decode.env["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    assert int(prefill.env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"]) < 300
    assert "--disable-retries" in router.argv and "--disable-circuit-breaker" in router.argv
    stall = next(w for w in campaign.windows() if w.fault == "transfer_stall")
    timeouts = (campaign.target.sglang.waiting_timeout_s, campaign.target.sglang.bootstrap_timeout_s)
    assert all(t is not None and stall.duration_s > t for t in timeouts)  # the stall outlasts the peer's timeouts


# ------------------------------------------------------------------------------ restarts ----


def test_restart_settings_change_what_the_fault_changes_and_nothing_fixed(tmp_path: Path) -> None:
    stack = SGLangStack(full_spec(), tmp_path, FakeLauncher())  # type: ignore[arg-type]
    before = stack.role_settings("decode")
    assert {"mem_fraction_static", "max_total_tokens", "context_length", "env"} <= set(before)
    settings = with_overrides(
        stack.settings["decode"],
        {"SGLANG_TEST_DISAGG_FAILURE_PROB": "0.1"},
        {"mem_fraction_static": 0.5, "max_total_tokens": None, "gpu_ids": [2, 3]},
    )
    flags = flag_values(server_command(settings))
    assert flags["--mem-fraction-static"] == "0.5" and "--max-total-tokens" not in flags
    assert server_env(settings)["SGLANG_TEST_DISAGG_FAILURE_PROB"] == "0.1"
    assert settings.gpu_ids == (2, 3)
    with pytest.raises(TargetError, match="port cannot change on restart"):
        with_overrides(stack.settings["decode"], None, {"port": 1})
    with pytest.raises(TargetError, match="unknown setting"):
        with_overrides(stack.settings["decode"], None, {"mem_fraction": 0.5})
    assert json.loads(json.dumps(before)) == before  # journaled undo plans replay it as JSON


# ------------------------------------------------------------------------ readers on fixtures ----


def test_server_info_and_models_fixtures() -> None:
    info = parse_server_info(json.loads((FIXTURES / "server_info_prefill.json").read_text()))
    assert (info.max_total_num_tokens, info.max_req_input_len, info.context_length) == (402816, 40954, None)
    assert (info.page_size, info.disaggregation_mode, info.version) == (64, "prefill", "0.5.17")
    models = parse_models(json.loads((FIXTURES / "models.json").read_text()))
    assert models.models == (("/models/Qwen3-32B", 40960),) and models.max_model_len == 40960


def test_metrics_fixture_pool_constants_memory_and_dialect_counters() -> None:
    text = (FIXTURES / "metrics_prefill_tp2.txt").read_text()
    pool = read_pool_metrics(text)
    assert (pool.max_total_num_tokens, pool.context_len, pool.page_size, pool.engine_types) == (
        402816,
        40960,
        64,
        ("prefill",),
    )
    assert len(pool.series) == 2  # one per TP rank
    memory = memory_from_metrics(text)
    assert (memory.weights_gib, memory.kv_gib, memory.pool_tokens) == (30.62, 36.86, 402816)  # worst rank of each
    from chaos.facts.prometheus import parse_prometheus_text

    names = {s.name for s in parse_prometheus_text(text)}
    assert set(SGLANG.transfer_failure_metrics) <= names and set(SGLANG.aborted_metrics) <= names


def test_log_fixture_starts_memory_of_the_latest_start() -> None:
    lines = (FIXTURES / "prefill_tp2.log").read_text().splitlines(keepends=True)
    starts = parse_log(lines)
    assert [(s.role, s.pool_tokens, s.context_len, s.ready) for s in starts] == [
        ("prefill", 402816, 40960, True),
        ("prefill", 153600, 40960, True),
    ]
    memory = memory_from_log(lines)  # a restarted server appends: the latest start is the one running
    assert memory.pool_tokens == 153600 and memory.weights_gib == 30.64
    assert memory.kv_gib == pytest.approx(14.06)
    decode = memory_from_log((FIXTURES / "decode.log").read_text().splitlines())
    assert (decode.pool_tokens, decode.weights_gib) == (811008, None) and decode.kv_gib == pytest.approx(74.24)


def _classify(line: str) -> str | None:
    for name, needle in CORRUPTION_SIGNALS:
        if needle in line:
            return name
    for name, pattern in TRANSFER_SIGNALS:
        if pattern.search(line):
            return name
    return None


def test_integrity_signals_and_fault_confirmations_recognise_sglang_log_lines() -> None:
    prefill = (FIXTURES / "prefill_tp2.log").read_text().splitlines()
    decode = (FIXTURES / "decode.log").read_text().splitlines()
    found = {c for line in prefill + decode if (c := _classify(line))}
    assert {
        "kv_canary_violation",
        "context_corruption",
        "kv_transfer_error",
        "send_kv_chunk_failed",
        "get_kvcache_failed",
        "lost_prefill_connection",
        "poll_timeout",
    } <= found
    # transfer_stall confirms from the peer's log with the dialect's pattern
    timeout = re.compile(SGLANG.transfer_timeout_log)
    assert sum(bool(timeout.search(line)) for line in prefill) == 2  # the poll timeout and the failure carrying it
    assert any(timeout.search(line) and "WaitingForInput" in line for line in decode)
    assert any("Lost connection" in line and timeout.search(line) for line in decode)
    assert not any(_classify(line) for line in prefill[:11])  # startup lines are no signal


@pytest.fixture
def fixture_server(tmp_path: Path) -> Iterator[str]:
    """The fixtures served as a worker would (/server_info, /v1/models), on loopback."""
    (tmp_path / "v1").mkdir()
    (tmp_path / "server_info").write_text((FIXTURES / "server_info_prefill.json").read_text())
    (tmp_path / "v1" / "models").write_text((FIXTURES / "models.json").read_text())
    handler = partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_dialect_limits_read_server_info_then_models_for_the_context(fixture_server: str) -> None:
    limits = SGLANG.limits(fixture_server)
    # /server_info's context_length is the CLI value (null here); the resolved one is /v1/models'.
    assert limits.as_tuple() == (402816, 40960, 40954)


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_gpu_tests_short_campaign_validates(gpus: int, tmp_path: Path) -> None:
    """The `gpu` test's campaign must be valid before anyone finds a GPU to run it on."""
    from tests.test_sglang_gpu import short_campaign

    campaign = parse_campaign(short_campaign(gpus, "/models/m", sys.executable, "mooncake_tcp"))
    assert campaign.target.sglang is not None
    prefill, decode, _ = SGLangStack(campaign.target.sglang, tmp_path, FakeLauncher()).plan()  # type: ignore[arg-type]
    assert (prefill.env["CUDA_VISIBLE_DEVICES"], decode.env["CUDA_VISIBLE_DEVICES"]) == (
        ("0", "0") if gpus == 1 else ("0", "1")
    )


# ------------------------------------------------------------------------------ readiness ----


class FakeProcess:
    def __init__(self, alive: bool = True) -> None:
        self.name, self.returncode, self._alive = "prefill", None if alive else 1, alive

    def alive(self) -> bool:
        return self._alive

    def read_log(self) -> str:
        return "Loading safetensors checkpoint shards\nCUDA out of memory"


@pytest.fixture
def health_server() -> Iterator[tuple[str, list[float]]]:
    """/health answers 503 twice, then 200 after 2.5 s (SGLang's generate-backed health, warming up)."""
    import time
    from http.server import BaseHTTPRequestHandler

    calls: list[float] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            calls.append(time.monotonic())
            if len(calls) <= 2:
                self.send_response(503)
            else:
                time.sleep(2.5)
                self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health", calls
    finally:
        server.shutdown()


@pytest.mark.timeout(60)
def test_readiness_waits_through_503_and_slow_answers(health_server: tuple[str, list[float]]) -> None:
    from chaos.targets.sglang.readiness import await_health

    url, calls = health_server
    await_health(url, 30, FakeProcess())  # type: ignore[arg-type]
    assert len(calls) == 3  # the slow 200 was waited for, not abandoned and retried


def test_readiness_stops_at_once_when_the_server_dies_and_names_its_log() -> None:
    from chaos.targets.sglang.readiness import await_health

    with pytest.raises(RuntimeError, match=r"(?s)prefill exited with code 1 .*CUDA out of memory"):
        await_health("http://127.0.0.1:9/health", 30, FakeProcess(alive=False))  # type: ignore[arg-type]
    with pytest.raises(
        TimeoutError, match=r"(?s)did not answer 200 within 1s \(last: ConnectError\).*CUDA out of memory"
    ):
        await_health("http://127.0.0.1:9/health", 1, FakeProcess())  # type: ignore[arg-type]


def test_readiness_believes_the_log_over_a_health_answer_when_the_port_was_taken(
    health_server: tuple[str, list[float]],
) -> None:
    """The port was free when chosen and taken before the server bound it (uvicorn logs the
    failure and the server lingers): whatever took it may answer /health. The stack starts again
    on fresh ports (`PortTaken`), never trusting that answer."""
    from chaos.process import PortTaken
    from chaos.targets.sglang.readiness import await_health

    class Unbound(FakeProcess):
        def read_log(self) -> str:
            return (
                "INFO:     Application startup complete.\n"
                "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 34775): address already in use\n"
            )

    url, calls = health_server
    with pytest.raises(PortTaken, match="could not bind its port"):
        await_health(url, 30, Unbound())  # type: ignore[arg-type]
    assert calls == []  # not asked at all


@pytest.mark.timeout(60)
def test_a_role_started_again_is_judged_by_its_own_log_lines_not_by_the_start_before(
    tmp_path: Path, health_server: tuple[str, list[float]]
) -> None:
    """Every start of a role appends to one log. A start that lost its port leaves "address already
    in use" there; the next start must be judged by the lines it writes itself, or every start after
    the first lost port fails the same way (CI saw three in a row)."""
    from chaos.process import PortTaken

    url, calls = health_server
    port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
    first_lines = iter(
        [
            "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 1): address already in use\n",
            "INFO:     Application startup complete.\n",
        ]
    )

    class Started(FakeProcess):
        pid = pgid = 4242
        node = "local"

        def __init__(self, command: PlannedCommand | None = None) -> None:
            super().__init__()
            self.log_path = command.log_path if command else tmp_path / "logs" / "prefill.log"
            if command:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                with self.log_path.open("a") as log:
                    log.write(next(first_lines))

        def read_log(self) -> str:
            return self.log_path.read_text() if self.log_path.exists() else ""

        def stop(self, timeout_s: float = 10.0) -> int:
            self._alive = False
            return 0

    class Loopback(FakeLauncher):
        asked = False

        def host(self, role: str) -> str:
            return "127.0.0.1"

        def free_port(self, role: str) -> int:  # prefill's HTTP port (asked first): the health server's
            first, self.asked = not self.asked, True
            return port if first else super().free_port(role)

        def launch(self, command: PlannedCommand) -> Started:  # type: ignore[override]
            return Started(command)

    stack = SGLangStack(SGLangSpec(model_path="m"), tmp_path, Loopback())  # type: ignore[arg-type]
    stack.procs["prefill"] = Started()  # the role as it ran before
    with pytest.raises(PortTaken):
        stack.restart("prefill")  # the start that lost its port
    stack.restart("prefill")  # its successor: served, though the log still holds the error above
    assert len(calls) == 3 and "address already in use" in stack.logs("prefill")


def test_ports_chosen_free_never_repeat_one_already_taken(tmp_path: Path) -> None:
    class RepeatingLauncher(FakeLauncher):
        """Hands out 30100 (the campaign's prefill port) and each other port twice, as an OS may."""

        def __init__(self) -> None:
            super().__init__()
            self.answers = iter([30100, 41000, 41000, 41001, 41001, 41002, 41003, 41004, 41005])

        def free_port(self, role: str) -> int:
            return next(self.answers)

    ports = SGLangStack(SGLangSpec(model_path="m", prefill={"port": 30100}), tmp_path, RepeatingLauncher()).ports  # type: ignore[arg-type]
    assert (ports.prefill, ports.decode, ports.prefill_nccl, ports.decode_nccl) == (30100, 41000, 41001, 41002)
    assert (ports.bootstrap, ports.router, ports.router_metrics) == (41003, 41004, 41005)


# ------------------------------------------------------------------------- the CPU tier ----


def test_cpu_device_adds_only_what_cpu_needs_and_the_tier_defaults(tmp_path: Path) -> None:
    """`device: cpu` runs the same commands as on GPUs plus the CPU flags and environment
    (docs/sglang-cpu-tier.md): the venv's python and model, Mooncake over TCP, a small explicit pool."""
    cuda = SGLangStack(
        SGLangSpec(model_path="m", transfer_backend="mooncake_tcp", max_total_tokens=8192, mem_fraction_static=0.05),
        tmp_path,
        FakeLauncher(),
    ).plan()  # type: ignore[arg-type]
    cpu = SGLangStack(SGLangSpec(model_path="m", device="cpu"), tmp_path, FakeLauncher()).plan()  # type: ignore[arg-type]
    for role, gpu_cmd, cpu_cmd in (("prefill", cuda[0], cpu[0]), ("decode", cuda[1], cpu[1])):
        added = ["--device", "cpu", "--disable-overlap-schedule", "--disable-cuda-graph", "--sleep-on-idle"]
        if role == "decode":
            added += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
        assert cpu_cmd.argv[3:] == gpu_cmd.argv[3:] + added  # after the python and `-m sglang.launch_server`
        assert cpu_cmd.argv[0].endswith(".venv-sglang/bin/python")
        assert cpu_cmd.env["SGLANG_USE_CPU_ENGINE"] == "1" and cpu_cmd.env["SGLANG_HOST_IP"] == "10.0.0.1" + (
            "1" if role == "prefill" else "2"
        )
        assert cpu_cmd.env["LD_LIBRARY_PATH"].endswith(".venv-sglang/native/lib")
        assert "CUDA_VISIBLE_DEVICES" not in cpu_cmd.env
        assert (
            cpu_cmd.env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] == gpu_cmd.env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"]
        )
    assert cpu[2].argv == cuda[2].argv[:1] + cpu[2].argv[1:] and "--pd-disaggregation" in cpu[2].argv
    tier = SGLangSpec(device="cpu")
    assert (tier.transfer_backend, tier.max_total_tokens, tier.mem_fraction_static) == ("mooncake_tcp", 8192, 0.05)
    prefill = SGLangStack(tier, tmp_path, FakeLauncher()).plan()[0]  # type: ignore[arg-type]
    assert flag_values(prefill.argv)["--model-path"].endswith(".venv-sglang/models/tiny-llama")
    # A role's own pool wins over the tier's default (the incident's asymmetric pools).
    incident = SGLangSpec(device="cpu", prefill={"max_total_tokens": 1024}, decode={"max_total_tokens": 8192})
    assert incident.max_total_tokens is None
    with pytest.raises(ValidationError, match="no RDMA device"):
        SGLangSpec(device="cpu", transfer_backend="mooncake")
    with pytest.raises(ValidationError, match="CUDA-only"):
        SGLangSpec(device="cpu", kv_canary="log")
    with pytest.raises(ValidationError, match="model_path is required"):
        SGLangSpec()


def test_shipped_cpu_campaign_plans_the_tier(tmp_path: Path) -> None:
    campaign = load_campaign(ROOT / "campaigns" / "sglang-cpu.yaml")
    assert campaign.target.sglang is not None and campaign.target.sglang.device == "cpu"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "chaos.cli",
            "plan",
            str(ROOT / "campaigns" / "sglang-cpu.yaml"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("--device cpu") == 2 and "SGLANG_USE_CPU_ENGINE=1" in done.stdout
    assert "--disaggregation-decode-retraction-backup cpu_tensor" in done.stdout


def test_cpu_patcher_applies_once_reports_unneeded_and_refuses_unknown_text(tmp_path: Path) -> None:
    """The two source conditions of the CPU tier, on files written like SGLang's (not SGLang's code)."""
    from chaos.targets.sglang.cpu import patch_sources

    package = tmp_path / "sglang"
    prefill, nixl = (package / c.path for c in patch_sources.CONDITIONS)
    for path in (prefill, nixl):
        path.parent.mkdir(parents=True, exist_ok=True)
    prefill.write_text("def send_kv_chunk():\n" + patch_sources.CONDITIONS[0].old + "        x = y(pin_memory=True)\n")
    nixl.write_text(
        "class M:\n    def __init__(self, server_args):\n" + patch_sources.CONDITIONS[1].old + '        k = "VRAM"\n'
    )
    assert patch_sources.main(["--check", str(package)]) == 1  # unpatched
    assert patch_sources.main([str(package)]) == 0
    assert patch_sources.MARK in prefill.read_text() and patch_sources.MARK in nixl.read_text()
    assert patch_sources.main(["--check", str(package)]) == 0
    patched = prefill.read_text()
    assert patch_sources.main([str(package)]) == 0 and prefill.read_text() == patched  # idempotent
    # A version without the hazard needs no change; one whose text differs fails and changes nothing.
    prefill.write_text("def send_kv_chunk():\n    pass\n")
    nixl.write_text(patch_sources.CONDITIONS[1].old.replace("len(", "length(") + '        k = "VRAM"\n')
    before = nixl.read_text()
    assert patch_sources.main([str(package)]) == 1
    assert nixl.read_text() == before


def test_cpu_requirements_drop_cuda_only_packages_and_pin_the_index_torch() -> None:
    from chaos.targets.sglang.cpu.requirements import cpu_requirements

    declared = [
        "torch==2.14.1",
        "torchvision",
        "flashinfer_python[cu13]==0.7.2",
        "sglang-kernel==0.4.10",
        "fastapi",
        'av==16.1.0; sys_platform == "linux" and platform_machine == "aarch64"',
        'pytest; extra == "test"',
        "torchaudio==2.11.0",
        "transformers==5.19.0",
    ]
    assert cpu_requirements(declared) == ["torch===2.14.1", "torchvision", "fastapi", "transformers==5.19.0"]


REAL = FIXTURES / "cpu-0.5.23"  # written by a real SGLang 0.5.23 CPU pair (its README.md)


def test_real_0_5_23_startup_logs_server_info_and_metrics_read_as_the_suite_expects() -> None:
    for role in ("prefill", "decode"):
        starts = parse_log((REAL / f"{role}_startup.log").read_text().splitlines())
        assert len(starts) == 1 and starts[0].ready
        start = starts[0]
        assert start.server_args is not None and start.server_args.disaggregation_mode == role  # the dict banner
        assert (start.pool_tokens, start.context_len) == (8192, 2048)
        facts = next(iter(start.ranks.values())).startup
        assert facts.mem_device == "cpu" and facts.max_running_requests == 2048
        info = parse_server_info(json.loads((REAL / f"server_info_{role}.json").read_text()))
        # context_length is the flag (null: the model's own), the pool and max input are resolved
        assert (info.max_total_num_tokens, info.max_req_input_len, info.context_length) == (8192, 2042, None)
        pool = read_pool_metrics((REAL / f"metrics_{role}.txt").read_text())
        assert (pool.max_total_num_tokens, pool.context_len, pool.page_size, pool.engine_types) == (
            8192,
            2048,
            1,
            (role,),
        )
    assert parse_models(json.loads((REAL / "models.json").read_text())).max_model_len == 2048


def test_real_0_5_23_loads_nest_counters_per_dp_rank_and_the_drain_reads_them() -> None:
    for role in ("prefill", "decode"):
        loads = json.loads((REAL / f"loads_{role}_idle.json").read_text())
        assert set(loads) >= {"version", "loads"} and "num_running_reqs" not in loads  # not at the top level
        (rank,) = loads_ranks(loads)
        assert rank is loads["loads"][0]
        assert rank["dp_rank"] == 0 and rank["disaggregation"]["mode"] == role
        assert rank["num_used_tokens"] == 0 and rank["max_total_num_tokens"] == 8192
        assert "quarantined_tokens" not in rank  # held-back pages are a request gauge in /metrics only
        assert idle(loads)
        busy = copy.deepcopy(loads)
        busy["loads"][0]["num_used_tokens"] = 16  # pages still held: what the drain must wait out
        assert not idle(busy)


def test_real_0_5_23_fault_lines_and_counters_match_the_dialect() -> None:
    decode_lines = (REAL / "decode_fault_lines.log").read_text().splitlines()
    timeouts = [line for line in decode_lines if re.search(SGLANG.transfer_timeout_log, line)]
    assert len(timeouts) >= 3  # the heartbeat's lost connection and the waiting timeout
    for role in ("prefill", "decode"):
        text = (REAL / f"metrics_{role}_after_faults.txt").read_text()
        names = {s.name for s in parse_prometheus_text(text)}
        assert set(SGLANG.transfer_failure_metrics) <= names and set(SGLANG.aborted_metrics) <= names
        assert set(SGLANG.held_back_metrics) <= names
        # Counters appear only once they count: the idle recording has none of them.
        idle = {s.name for s in parse_prometheus_text((REAL / f"metrics_{role}.txt").read_text())}
        assert not set(SGLANG.transfer_failure_metrics) & idle
