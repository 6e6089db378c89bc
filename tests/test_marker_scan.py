"""benchmarks/marker_scan.py in its short mode: it asserts nothing about speed, but its JSON must
hold the figures docs/performance.md quotes ("Marker scan against a naive per-marker search")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_marker_scan_benchmark_runs_and_records_what_the_doc_quotes(tmp_path: Path) -> None:
    out = tmp_path / "marker-scan.json"
    result = subprocess.run(
        [sys.executable, "benchmarks/marker_scan.py", "--short", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "scan / marker-free speed" in result.stdout and "scan / naive speed" in result.stdout
    report = json.loads(out.read_text())
    assert {"nproc", "cpu_model", "loadavg", "python"} <= set(report["machine"]) and len(report["loadavg_end"]) == 3
    assert report["corpus"]["responses"] > 0 and report["corpus"]["fragments"] > 0
    assert report["clean_corpus"]["mb"] > 0 and report["clean_corpus"]["responses"] > 0
    rows = report["rows"]
    assert [(r["markers_in_flight"], r["unit"]) for r in rows] == [
        (count, unit) for count in (10, 10_000, 1_000_000) for unit in ("response", "joined")
    ]
    for row in rows:
        for key in ("scan_mb_s", "clean_mb_s", "naive_mb_s", "scan_over_clean", "scan_over_naive", "scan_s", "naive_s"):
            assert row[key] > 0, (key, row)
        assert row["scan_over_clean"] == pytest.approx(row["scan_mb_s"] / row["clean_mb_s"])
        assert row["scan_over_naive"] == pytest.approx(row["scan_mb_s"] / row["naive_mb_s"])
        assert isinstance(row["per_hit_us"], float) and row["methods_agree"] is True
        assert (
            0 < row["distinct_hits"] <= row["scan_hits"] and 0 < row["naive_markers_timed"] <= row["markers_in_flight"]
        )
        assert row["extrapolated"] == (row["naive_markers_timed"] < row["markers_in_flight"])
    for row in rows:  # the scan as the leak oracle calls it (own markers passed), per response only
        if row["unit"] == "response":
            assert row["scan_own_mb_s"] > 0 and row["scan_own_over_clean"] == pytest.approx(
                row["scan_own_mb_s"] / row["clean_mb_s"]
            )
            assert row["scan_own_over_naive"] == pytest.approx(row["scan_own_mb_s"] / row["naive_mb_s"])
            assert 0 < row["scan_own_hits"] < row["scan_hits"]  # the echoed own markers are left out
        else:
            assert row["scan_own_mb_s"] is None
    # the same texts at every count: the scan finds as many hits; only 10 in flight repeats markers
    assert len({r["scan_hits"] for r in rows}) == 1
    assert rows[0]["distinct_hits"] < rows[-1]["distinct_hits"]
