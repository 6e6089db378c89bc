"""Every defect switch is caught by its campaign through the intended oracle; the clean engine passes.

The campaigns are the shipped ones in campaigns/defects/ (about a minute each here). A leak
finding must name a victim that is really in the journal and whose marker really is in the
offending response.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from chaos.journal import Journal
from chaos.targets.sim.defects import DEFECTS

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent
CAMPAIGNS = ROOT / "campaigns" / "defects"

# defect -> (campaign, oracles of which at least one must FAIL), from the defect registry
EXPECTED = {d.name: (d.campaign, set(d.caught_by)) for d in DEFECTS.values()}
# defect -> a finding that must be among the failing ones: the campaign's lull catches the page
# leak while the run goes on, not only after the drain
MUST_FIND = {"pages_leak_on_abort": ("liveness", "still in use at two idle moments mid-load")}


def run(campaign: str, out: Path, defect: str | None) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "chaos.cli", "run", str(CAMPAIGNS / f"{campaign}.yaml"), "--out", str(out), "--quiet"]
    if defect:
        args += ["--defect", defect]
    return subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)


def failing_oracles(out: Path) -> dict[str, list[dict]]:
    with Journal.open(out, readonly=True) as journal:
        return {e.data["name"]: e.data["findings"] for e in journal.iter_events(kind="verdict", name="oracle")
                if e.data["verdict"] == "FAIL"}


@pytest.mark.parametrize("campaign", sorted({c for c, _ in EXPECTED.values()}))
def test_the_clean_engine_passes_every_defect_campaign(tmp_path: Path, campaign: str) -> None:
    result = run(campaign, tmp_path / "run", None)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


@pytest.mark.parametrize("defect", sorted(EXPECTED))
def test_each_defect_fails_through_its_oracle(tmp_path: Path, defect: str) -> None:
    campaign, oracles = EXPECTED[defect]
    out = tmp_path / "run"
    result = run(campaign, out, defect)
    assert result.returncode == 1, result.stdout + result.stderr[-2000:]
    failed = failing_oracles(out)
    assert oracles & set(failed), f"{defect}: expected one of {oracles} to fail, got {sorted(failed)}"
    if defect in MUST_FIND:
        oracle, words = MUST_FIND[defect]
        summaries = [f["summary"] for f in failed.get(oracle, [])]
        assert any(words in s for s in summaries), f"{defect}: no {oracle} finding says {words!r}: {summaries}"
    with Journal.open(out, readonly=True) as journal:
        for finding in failed.get("canary", []):
            victim = finding.get("victim_request_id")
            if victim is None:
                continue
            offender, record = journal.get_request(finding["request_id"]), journal.get_request(victim)
            assert offender is not None and record is not None
            marker = finding["evidence"]["marker"]
            assert marker in offender.response_text
            assert any(marker in m for m in record.markers) or marker in record.prompt  # the victim's own
