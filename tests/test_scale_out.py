"""The scale-out benchmark (benchmarks/scale_out.py) in its short mode: load actors on Ray's
multi-node test cluster, one per node, and the fields docs/performance.md quotes from its JSON.
The rates themselves are the benchmark's to measure, not this test's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_the_short_scale_out_runs_each_actor_on_a_node_of_its_own(tmp_path: Path) -> None:
    out = tmp_path / "scale-out.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/scale_out.py", "--actors", "2", "--users", "4", "--duration", "9"]
        + ["--rounds", "1", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    points = {p["actors"]: p for p in report["points"]}
    assert sorted(points) == [1, 2]
    for actors, point in points.items():
        assert point["nodes_used"] == actors  # spread: an actor per node
        assert point["journaled"] > 0 and point["window_requests"] > 0
        assert point["rps"] == pytest.approx(point["window_requests"] / point["window_s"], rel=0.01)
        assert point["cpu_s_per_request"]["locust"] > 0 and point["cpu_s_per_request"]["driver"] > 0
    assert points[1]["per_actor_vs_one"] == 1.0
    assert points[2]["per_actor_vs_one"] == pytest.approx(
        points[2]["rps_per_actor"] / points[1]["rps_per_actor"], abs=0.01
    )
    for key in ("rps", "rps_per_actor", "client_cpu_us_per_request", "driver_cpu_us_per_request"):
        assert key in report["summary"]["2"]
