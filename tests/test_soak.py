"""The soak benchmark: its checks against a leaking and a flat history, and its short version run for real."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import soak  # noqa: E402


def _history(rss: dict[str, list[float]], fds: list[int], lag: list[int]) -> soak.SoakResult:
    """One sample a second over 100 s of load that starts at t=10 s."""
    result = soak.SoakResult("campaigns/soak.yaml", 100.0, 1.0, [], exit_code=0, verdict="PASS")
    result.load_started_at_s, result.load_ended_at_s = 10.0, 110.0
    for i in range(100):
        journaled = 1000 * i
        result.samples.append(
            soak.Sample(
                t=10.0 + i,
                rss_mb={g: rss.get(g, [100.0] * 100)[i] for g in soak.GROUPS},
                processes=dict.fromkeys(soak.GROUPS, 1),
                driver_fds=fds[i],
                driver_threads=20,
                locust_records=journaled + lag[i],
                journaled=journaled,
            )
        )
    result.locust_requests = result.journaled_requests = 99_000
    return result


def _failed(result: soak.SoakResult) -> list[str]:
    return [c.name for c in soak.judge(result, max_growth=0.10, fd_slack=10) if not c.ok]


FLAT = [100.0 + (i % 3) for i in range(100)]  # noise, no trend


def test_a_flat_history_passes_every_check() -> None:
    assert _failed(_history({"driver": FLAT}, [40 + i % 2 for i in range(100)], [50] * 100)) == []


def test_a_driver_that_grows_a_fifth_fails_the_memory_check() -> None:
    growing = [100.0 + 0.3 * i for i in range(100)]  # second quarter ~111 MB, last ~137 MB
    assert _failed(_history({"driver": growing}, [40] * 100, [50] * 100)) == ["memory:driver"]


def test_a_descriptor_leak_and_a_falling_behind_journal_fail_their_checks() -> None:
    leaking = [40 + i // 2 for i in range(100)]  # one descriptor every two seconds
    behind = [50 + 10 * i for i in range(100)]  # the journal trails Locust more and more
    assert _failed(_history({}, leaking, behind)) == ["driver_fds", "journal_lag"]


def test_records_lost_on_the_way_to_the_journal_fail_it() -> None:
    result = _history({}, [40] * 100, [50] * 100)
    result.journaled_requests = 98_990
    assert _failed(result) == ["journal_complete"]


def test_a_process_alive_after_the_run_fails_it() -> None:
    result = _history({}, [40] * 100, [50] * 100)
    result.left_behind = ["4242 python -m locust --headless"]
    assert _failed(result) == ["nothing_left"]


def test_a_shortened_soak_keeps_only_the_windows_that_fit() -> None:
    spec = yaml.safe_load(soak.SOAK_CAMPAIGN.read_text())
    short, windows = soak.shortened(spec, 90.0)
    assert short["load"]["duration"] == "90s"
    assert windows == ["kv_transfer@30s"]
    assert len(spec["faults"]["windows"]) == 10  # the original is untouched


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_short_soak_holds_its_checks_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """CI's short version: 90 s of load with the first window, sampled every 2 s."""
    record = tmp_path / "soak.json"
    code = soak.main(["--duration", "90s", "--interval", "2", "--out", str(tmp_path / "soak"), "--json", str(record)])
    data = json.loads(record.read_text())
    failed = [c for c in data["checks"] if not c["ok"]]
    assert code == 0 and not failed, failed
    assert data["windows"] == ["kv_transfer@30s"]
    assert data["locust_requests"] > 100
    assert max(s["rss_mb"]["locust"] for s in data["samples"]) > 0  # the groups are told apart
    assert max(s["rss_mb"]["load_actors"] for s in data["samples"]) > 0
    assert data["left_behind"] == []  # every process of the run (engine, Ray, Locust) exited
