"""The detection matrix's summary, and the committed document against the committed run records."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import detection_matrix as dm  # noqa: E402


def test_the_summary_self_test_passes() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "detection_matrix.py"), "--self-test"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "self-test passed" in result.stdout


def test_every_committed_record_reads_back_and_names_a_known_defect() -> None:
    found = dm.read_records([dm.DEFAULT_RECORDS])
    assert found, f"no run records under {dm.DEFAULT_RECORDS}"
    campaigns = {d.campaign for d in dm.DEFECTS.values()}
    for path, run in found:
        assert run.campaign in campaigns, path
        assert all(d in dm.DEFECTS for d in run.defects), path
        assert run.verdict in ("PASS", "FAIL", "INCONCLUSIVE"), path
        assert run.source_digest and run.commit, f"{path}: no provenance"
        assert path == dm.record_path(dm.DEFAULT_RECORDS, run.key, run.campaign, run.seed)


def _tables(text: str) -> list[str]:
    """The document's table rows, without the generated-at and command lines."""
    return [line for line in text.splitlines() if line.startswith("|")]


def test_the_committed_document_is_what_the_committed_records_say(tmp_path: Path) -> None:
    doc = tmp_path / "matrix.md"
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "detection_matrix.py"), "--from-records",
                             str(dm.DEFAULT_RECORDS), "--any-source", "--doc", str(doc)],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0 and doc.is_file(), result.stdout + result.stderr
    committed = (ROOT / "docs" / "detection-matrix.md").read_text()
    assert _tables(doc.read_text()) == _tables(committed), "regenerate: benchmarks/detection_matrix.py --from-records"
