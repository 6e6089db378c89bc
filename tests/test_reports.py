"""Reports from a run journal: HTML (screenshot in headless Chromium), JUnit, JSON, Markdown,
reproduce.yaml, `pdchaos report` and `pdchaos compare`. Journals come from tests/run_fixtures.py."""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import numpy as np
import pytest
import yaml

from chaos.campaign import Campaign
from chaos.cli import report as cli_report
from chaos.errors import UsageError
from chaos.journal import Journal, JournalEvent, Outcome
from chaos.loadstats import compute
from chaos.verdict import Finding, OracleResult, Verdict
from reports.compare import EXIT_OK, EXIT_REGRESSED, EXIT_UNPROVEN, compare_runs
from reports.fault_record import FaultRecord
from reports.formats import FILENAMES
from reports.html import highlight
from reports.htmlkit import VERDICT_COLORS
from reports.matrix import OUTSIDE, build_matrix
from reports.model import load_run
from reports.render import FORMATS, render_all
from reports.svg import Band, Series, format_seconds, line_plot, nice_step
from reports.traffic import MAX_BUCKETS
from tests.run_fixtures import (
    HOSTILE,
    write_crashed_run,
    write_empty_run,
    write_fail_run,
    write_inconclusive_run,
    write_large_run,
    write_pass_run,
)

ROOT = Path(__file__).resolve().parent.parent
FILES = {"report.html", "junit.xml", "report.json", "summary.md", "reproduce.yaml"}
N_ORACLES = 7


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    built = {
        name: writer(root / name)
        for name, writer in (
            ("pass", write_pass_run),
            ("fail", write_fail_run),
            ("inconclusive", write_inconclusive_run),
            ("crashed", write_crashed_run),
            ("empty", write_empty_run),
        )
    }
    Journal.create(root / "bare").close()  # a run that died right after creating its journal
    built["bare"] = root / "bare"
    for run_dir in built.values():
        render_all(run_dir)
    return built


def report_json(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


# ----------------------------------------------------------------------------- every run ----


@pytest.mark.parametrize("name", ["pass", "fail", "inconclusive", "crashed", "empty", "bare"])
def test_every_run_renders_every_file_and_the_html_is_self_contained(runs: dict[str, Path], name: str) -> None:
    run_dir = runs[name]
    assert {p.name for p in run_dir.iterdir()} >= FILES
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")], "atomic writes left a temporary file"
    html = (run_dir / "report.html").read_text()
    for external in ("<script", "<link", "src=", 'href="http', "@import", "url(http"):
        assert external not in html, f"report.html must be self-contained, found {external!r}"
    assert html.count('<svg class="plot"') == 5  # throughput, errors, TTFT, ITL, KV pool
    ET.fromstring((run_dir / "junit.xml").read_bytes())  # parses
    data = report_json(run_dir)
    for key in ("verdict", "exit_code", "campaign", "target", "faults", "oracles", "leaks", "requests"):
        assert key in data, key


def test_pass_run(runs: dict[str, Path]) -> None:
    data = report_json(runs["pass"])
    assert (data["verdict"], data["exit_code"], data["complete"]) == ("PASS", 0, True)
    assert data["campaign"]["name"] == "pd-qualification" and data["campaign"]["seed"] == 7
    assert data["target"]["router_url"] == "http://127.0.0.1:30000"
    assert [(f["name"], f["window"], f["confirmed"], f["healed"]) for f in data["faults"]] == [
        ("transfer_stall", "w1", True, True),
        ("process_kill", "w2", True, True),
    ]
    assert all(f["end"] - f["start"] > 5 for f in data["faults"])
    assert next((o["name"], o["verdict"], o["evidence_count"]) for o in data["oracles"]) == ("canary", "PASS", 0)
    assert data["leaks"] == []
    with Journal.open(runs["pass"], readonly=True) as journal:
        assert data["requests"]["total"] == journal.count_requests()
        assert data["requests"]["ok"] == journal.count_requests(outcome=Outcome.OK)
    assert {m["verdict"] for m in data["matrix"]} == {"PASS"}
    html = (runs["pass"] / "report.html").read_text()
    assert 'data-verdict="PASS"' in html and VERDICT_COLORS["PASS"] in html


def test_fail_run_shows_the_leak_side_by_side_with_its_victim(runs: dict[str, Path]) -> None:
    data = report_json(runs["fail"])
    assert (data["verdict"], data["exit_code"]) == ("FAIL", 1)
    [leak] = data["leaks"]
    assert leak["request_id"] != leak["victim_request_id"] and leak["victim_request_id"]
    assert leak["marker"].startswith("UULK7QX") and leak["faults_active"] == ["transfer_stall#w1"]
    assert leak["victim_faults_active"] == ["transfer_stall#w1"]
    cells = {(m["window"], m["oracle"]): m["verdict"] for m in data["matrix"]}
    assert cells[("transfer_stall#w1", "canary")] == "FAIL"
    assert cells[("process_kill#w2", "canary")] == "PASS" and cells[(OUTSIDE, "canary")] == "PASS"

    html = (runs["fail"] / "report.html").read_text()
    section = html[html.index('id="leak-1"') :]
    assert leak["request_id"] in section and leak["victim_request_id"] in section
    # The marker is highlighted in the offending response and in the victim's prompt.
    assert section.count(f"<mark>{leak['marker']}</mark>") == 2
    # Response and prompt text are untrusted: never raw HTML.
    assert "<script>alert" not in html and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html
    assert HOSTILE not in (runs["fail"] / "summary.md").read_text()


def test_inconclusive_run_marks_the_unconfirmed_window(runs: dict[str, Path]) -> None:
    data = report_json(runs["inconclusive"])
    assert (data["verdict"], data["exit_code"]) == ("INCONCLUSIVE", 3)
    assert [f["confirmed"] for f in data["faults"]] == [True, False]
    cells = {(m["window"], m["oracle"]): m for m in data["matrix"]}
    assert {cells[("process_kill#w2", o)]["verdict"] for o in ("canary", "reference", "liveness")} == {"INCONCLUSIVE"}
    assert "not confirmed" in cells[("process_kill#w2", "canary")]["why"]
    assert cells[("transfer_stall#w1", "canary")]["verdict"] == "PASS"
    assert cells[(OUTSIDE, "liveness")]["verdict"] == "INCONCLUSIVE"  # a finding with no window
    assert data["gates"] and data["gates"][0]["window"] == "process_kill#w2"
    assert 'class="fault-band"' in (runs["inconclusive"] / "report.html").read_text()
    assert "url(#hatch-" in (runs["inconclusive"] / "report.html").read_text()  # unconfirmed: hatched band


def test_a_crashed_run_is_judged_from_its_journal_everywhere(runs: dict[str, Path]) -> None:
    run_dir = runs["crashed"]
    data = report_json(run_dir)
    assert (data["verdict"], data["exit_code"], data["complete"]) == ("INCONCLUSIVE", 3, False)
    assert any("stopped before it judged itself" in r and "last phase event: load:start" in r for r in data["reasons"])
    assert any("never healed: transfer_stall#w1" in r for r in data["reasons"])
    assert [f["healed"] for f in data["faults"]] == [False] and data["faults"][0]["end"] is None
    assert None not in {m["verdict"] for m in data["matrix"]}  # the oracles ran over what the journal holds
    html = (run_dir / "report.html").read_text()
    assert "INCONCLUSIVE — judged from the journal" in html and VERDICT_COLORS["INCONCLUSIVE"] in html
    run_suite = ET.fromstring((run_dir / "junit.xml").read_bytes()).find("testsuite[@name='run']")
    assert run_suite is not None and run_suite.find("testcase/failure[@type='INCONCLUSIVE']") is not None
    assert "Judged from the journal" in (run_dir / "summary.md").read_text()


def test_runs_without_requests_render(runs: dict[str, Path]) -> None:
    empty, bare = report_json(runs["empty"]), report_json(runs["bare"])
    assert empty["requests"]["total"] == 0 and empty["verdict"] == "INCONCLUSIVE"
    assert bare["verdict"] == "INCONCLUSIVE" and bare["faults"] == [] and bare["requests"]["total"] == 0
    assert ">no data</text>" in (runs["bare"] / "report.html").read_text()
    assert "cannot be replayed" in (runs["bare"] / "reproduce.yaml").read_text()


# -------------------------------------------------------------------------------- junit ----


def test_junit_has_one_case_per_window_and_oracle_and_parses(runs: dict[str, Path]) -> None:
    root = ET.fromstring((runs["fail"] / "junit.xml").read_bytes())
    assert root.tag == "testsuites"
    window_suites = [s for s in root.findall("testsuite") if s.get("name") != "run"]
    assert [s.get("name") for s in window_suites] == ["transfer_stall#w1", "process_kill#w2", OUTSIDE]
    for suite in window_suites:
        assert len(suite.findall("testcase")) == N_ORACLES == int(suite.get("tests", "0"))
    failures = [(c.get("classname"), c.get("name")) for c in root.iter("testcase") if c.find("failure") is not None]
    assert ("pdchaos.pd-qualification.transfer_stall#w1", "canary") in failures
    assert ("pdchaos.pd-qualification.run", "verdict") in failures
    leak = root.find(".//testcase[@name='canary']/failure")
    assert leak is not None and "LEAK" in (leak.get("message") or "") and "victim" in (leak.text or "")
    assert int(root.get("tests", "0")) == sum(int(s.get("tests", "0")) for s in root.findall("testsuite"))
    assert int(root.get("failures", "0")) == len(failures)

    skipped = ET.fromstring((runs["inconclusive"] / "junit.xml").read_bytes())
    suite = skipped.find("testsuite[@name='process_kill#w2']")
    assert suite is not None and suite.get("skipped") == str(N_ORACLES)
    assert skipped.find(".//property[@name='confirmed'][@value='False']") is not None


def test_junit_shows_an_inconclusive_run_as_a_failure_unless_the_campaign_keeps_it_skipped(
    runs: dict[str, Path],
) -> None:
    """A CI job that gates on JUnit must not show an unproven run green."""
    import copy

    from reports.junit import render_junit
    from reports.model import load_run

    root = ET.fromstring((runs["inconclusive"] / "junit.xml").read_bytes())
    verdict = root.find("testsuite[@name='run']/testcase[@name='verdict']")
    assert verdict is not None and verdict.find("skipped") is None
    failure = verdict.find("failure")
    assert (
        failure is not None
        and failure.get("type") == "INCONCLUSIVE"
        and (failure.get("message") or "").startswith("INCONCLUSIVE: ")
    )
    assert int(root.get("failures", "0")) >= 1

    report = load_run(runs["inconclusive"])
    meta = copy.deepcopy(report.meta)
    meta["campaign"]["report"] = {"junit_inconclusive": "skipped"}
    report.meta = meta
    kept = ET.fromstring(render_junit(report).encode())
    verdict = kept.find("testsuite[@name='run']/testcase[@name='verdict']")
    assert verdict is not None and verdict.find("failure") is None and verdict.find("skipped") is not None


# ------------------------------------------------------------------- markdown, reproduce ----


def test_summary_markdown(runs: dict[str, Path]) -> None:
    text = (runs["fail"] / "summary.md").read_text()
    assert text.startswith("## pdchaos ❌ FAIL — pd-qualification (seed 7)")
    assert "| fault window | canary |" in text and "❌ FAIL (1)" in text and "### Leaks" in text
    assert len(text.splitlines()) < 40  # short enough for a PR comment


def test_reproduce_yaml_is_the_exact_campaign_and_seed(runs: dict[str, Path]) -> None:
    for name in ("pass", "crashed"):
        data = yaml.safe_load((runs[name] / "reproduce.yaml").read_text())
        campaign = Campaign.model_validate(data)
        with Journal.open(runs[name], readonly=True) as journal:
            assert data == journal.get_meta("campaign")
            assert campaign.seed == journal.get_meta("seed") == 7
        assert [w.fault for w in campaign.windows()] == ["transfer_stall", "process_kill"]


# ------------------------------------------------------------------------------- compare ----


def test_compare_flags_a_run_that_went_from_pass_to_fail(runs: dict[str, Path], tmp_path: Path) -> None:
    comparison = compare_runs(load_run(runs["pass"]), load_run(runs["fail"]))
    assert comparison.exit_code == EXIT_REGRESSED and comparison.outcome == "REGRESSED"
    assert "run verdict PASS → FAIL" in comparison.regressions
    assert any(r.startswith("transfer_stall#w1 × canary: PASS → FAIL") for r in comparison.regressions)
    assert "leaks 0 → 1" in comparison.regressions
    assert any(r.startswith("new error class truncated_stream") for r in comparison.regressions)
    assert any(r.startswith("TTFT p99 under faults ×2.") for r in comparison.regressions)

    parser = argparse.ArgumentParser()
    cli_report.register(parser.add_subparsers())
    args = parser.parse_args(["compare", str(runs["pass"]), str(runs["fail"]), "--out", str(tmp_path)])
    assert args.handler(args) == 1
    html, md = (tmp_path / "compare.html").read_text(), (tmp_path / "compare.md").read_text()
    assert 'data-outcome="REGRESSED"' in html and "PASS → FAIL" in html and "<script" not in html
    assert "REGRESSED (exit 1)" in md and "| transfer\\_stall#w1 × canary | ✅ PASS | ❌ FAIL |" in md
    assert json.loads((tmp_path / "compare.json").read_text())["exit_code"] == 1


def test_compare_exit_codes(runs: dict[str, Path]) -> None:
    r = {name: load_run(runs[name]) for name in ("pass", "fail", "inconclusive", "crashed")}
    assert compare_runs(r["pass"], r["pass"]).exit_code == EXIT_OK
    better = compare_runs(r["fail"], r["pass"])
    assert better.exit_code == EXIT_OK and "leaks 1 → 0" in better.improvements
    weaker = compare_runs(r["pass"], r["inconclusive"])
    assert weaker.exit_code == EXIT_UNPROVEN and "run verdict PASS → INCONCLUSIVE" in weaker.unproven
    crashed = compare_runs(r["pass"], r["crashed"])
    assert crashed.exit_code == EXIT_UNPROVEN
    assert any("process_kill#w2 of the base has no counterpart" in u for u in crashed.unproven)
    assert compare_runs(r["pass"], r["fail"], max_latency_ratio=0).exit_code == EXIT_REGRESSED  # still leaks
    slow_only = compare_runs(r["pass"], r["fail"], max_latency_ratio=2.0)
    assert any("TTFT p50 under faults" in x for x in slow_only.regressions)


def test_compare_counts_a_new_engine_error_class_but_not_the_load_stopping_a_request(runs: dict[str, Path]) -> None:
    """A request the load's end cut off (`load_stopped`) is the suite's doing: one more of them in
    the candidate is no regression; a new error class from the engine is."""
    from dataclasses import replace

    base = load_run(runs["pass"])

    def with_errors(**classes: int):  # type: ignore[no-untyped-def]
        traffic = replace(base.traffic, error_classes={**base.traffic.error_classes, **classes})
        return replace(base, traffic=traffic)

    assert not compare_runs(base, with_errors(load_stopped=1), max_latency_ratio=0).regressions
    new = compare_runs(base, with_errors(abort=2), max_latency_ratio=0)
    assert (
        new.regressions == ["new error class abort: 2 request(s), 0 under faults"] and new.exit_code == EXIT_REGRESSED
    )


def test_compare_names_a_failure_that_changed_kind(runs: dict[str, Path], tmp_path: Path) -> None:
    """An upgrade that turns the incident's silent 200 into a 500: the status cell stays FAIL, yet
    one kind of failure went away and another appeared; the comparison says both."""
    from dataclasses import replace

    from reports.compare_render import write_comparison

    def with_status(report, rule: str, n: int):  # type: ignore[no-untyped-def]
        findings = [
            Finding("status", Verdict.FAIL, f"over-length prompt r{i}: {rule}", evidence={"rule": rule})
            for i in range(n)
        ]
        return replace(
            report,
            oracles=[
                *[o for o in report.oracles if o.name != "status"],
                OracleResult("status", Verdict.FAIL, n, findings),
            ],
        )

    base = load_run(runs["fail"])
    old, new = with_status(base, "over_length_accepted", 3), with_status(base, "over_length_5xx", 2)
    comparison = compare_runs(old, new)
    assert comparison.exit_code == EXIT_REGRESSED
    assert any(r.startswith("new kind of failure: status over_length_5xx ×2") for r in comparison.regressions)
    assert any(i.startswith("failure gone: status over_length_accepted ×3") for i in comparison.improvements)
    assert compare_runs(old, old).failure_kinds and not any(
        "kind of failure" in r for r in compare_runs(old, old).regressions
    )
    written = write_comparison(comparison, tmp_path)
    assert "| status over\\_length\\_5xx | 0 | 2 |" in written["markdown"].read_text()
    assert "Kinds of failure" in written["html"].read_text()
    kinds = json.loads(written["json"].read_text())["failure_kinds"]
    assert {(k["rule"], k["base"], k["candidate"]) for k in kinds} >= {
        ("over_length_5xx", 0, 2),
        ("over_length_accepted", 3, 0),
    }


# ----------------------------------------------------------------------------------- cli ----


def test_report_command(runs: dict[str, Path], tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cli_report.register(parser.add_subparsers())
    args = parser.parse_args(["report", str(runs["fail"]), "--format", "json", "--out", str(tmp_path)])
    assert args.handler(args) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"report.json", "reproduce.yaml"}
    args = parser.parse_args(["report", str(runs["inconclusive"]), "--exit-code", "--out", str(tmp_path / "all")])
    assert args.handler(args) == 3
    assert {p.name for p in (tmp_path / "all").iterdir()} == FILES
    args = parser.parse_args(["report", str(tmp_path / "nowhere")])
    with pytest.raises(UsageError, match=r"no journal.sqlite"):
        args.handler(args)
    assert set(FORMATS) == set(FILENAMES) == {"html", "junit", "json", "markdown", "reproduce"}
    assert {FORMATS[name][0] for name in FORMATS} == FILES


def test_report_and_compare_print_one_json_object_with_json(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """For CI scripts: stdout is exactly one JSON object, the same exit codes as without --json."""
    parser = argparse.ArgumentParser()
    cli_report.register(parser.add_subparsers())
    args = parser.parse_args(["report", str(runs["fail"]), "--json", "--exit-code", "--out", str(tmp_path / "r")])
    assert args.handler(args) == 1
    data = json.loads(capsys.readouterr().out)
    assert (data["verdict"], data["exit_code"], data["campaign"]) == ("FAIL", 1, "pd-qualification")
    assert data["reasons"] and Path(data["files"]["json"]).name == "report.json"
    args = parser.parse_args(["compare", str(runs["pass"]), str(runs["fail"]), "--json", "--out", str(tmp_path / "c")])
    assert args.handler(args) == 1
    data = json.loads(capsys.readouterr().out)
    assert (data["outcome"], data["exit_code"]) == ("REGRESSED", 1) and "leaks 0 → 1" in data["regressions"]
    assert Path(data["files"]["json"]).name == "compare.json"


def test_a_live_journal_renders_without_disturbing_the_writer(tmp_path: Path) -> None:
    journal = Journal.create(tmp_path)
    try:
        journal.set_meta("seed", 3)
        journal.append_event(JournalEvent("phase", "load:start", {}))
        rendered = render_all(tmp_path)
        assert rendered.report.verdict_label == "INCONCLUSIVE" and not rendered.report.complete
        journal.append_event(JournalEvent("phase", "load:end", {}))  # the writer carries on
    finally:
        journal.close()


# ------------------------------------------------------------------------- units of logic ----


def _fault(window_id: str, confirmed: bool | None) -> FaultRecord:
    return FaultRecord(
        window_id=window_id, fault="transfer_stall", start=10.0, end=20.0, confirmed=confirmed, healed=True
    )


def test_matrix_rules() -> None:
    faults = [_fault("w1", True), _fault("w2", False), _fault("w3", True)]
    oracles = [
        OracleResult(
            "canary",
            Verdict.FAIL,
            10,
            [
                Finding("canary", Verdict.FAIL, "leak", window="transfer_stall#w2"),  # FAIL beats unconfirmed
                Finding("canary", Verdict.FAIL, "stale", window="transfer_stall#w9"),  # unknown window: outside row
            ],
        ),
        OracleResult("usage", Verdict.INCONCLUSIVE, 0, [], ["checked 0 item(s)"]),  # concluded nothing anywhere
        OracleResult("status", Verdict.PASS, 5, []),
    ]
    gates = [Finding("gates", Verdict.INCONCLUSIVE, "thin window: 2 requests", window="transfer_stall#w3")]
    rows = {
        row.key: row for row in build_matrix(faults, oracles, gates, expected=["canary", "usage", "status", "timing"])
    }

    def cell(window: str, oracle: str) -> str:
        found = rows[window].cell(oracle)
        assert found is not None
        return found.label

    assert [c.oracle for c in rows["transfer_stall#w1"].cells] == ["canary", "usage", "status", "timing"]
    assert (cell("transfer_stall#w1", "canary"), cell("transfer_stall#w1", "status")) == ("PASS", "PASS")
    assert cell("transfer_stall#w2", "canary") == "FAIL" and cell("transfer_stall#w2", "status") == "INCONCLUSIVE"
    assert cell("transfer_stall#w3", "status") == "INCONCLUSIVE"  # the gate names w3
    assert cell(OUTSIDE, "canary") == "FAIL"
    assert cell("transfer_stall#w1", "usage") == "INCONCLUSIVE"
    assert cell("transfer_stall#w1", "timing") == "NOT RUN"


def test_time_series_agree_with_loadstats(runs: dict[str, Path]) -> None:
    report = load_run(runs["pass"])
    with Journal.open(runs["pass"], readonly=True) as journal:
        expected = compute(r for r in journal.iter_requests() if r.phase != "baseline")
    overall = report.traffic.overall
    assert (overall.ttft.p50, overall.ttft.p99, overall.itl.p50, overall.e2e.p99) == (
        expected.ttft_s.p50,
        expected.ttft_s.p99,
        expected.itl_s.p50,
        expected.e2e_s.p99,
    )
    assert sum(b.stats.counts.total for b in report.traffic.buckets) == report.traffic.counts.total
    assert report.traffic.under_faults.ttft.p50 > 10 * report.traffic.outside_faults.ttft.p50  # faults hurt TTFT


def test_svg_and_highlight_helpers() -> None:
    assert [nice_step(s) for s in (10, 75, 0.3)] == [2, 20, 0.1]
    assert [format_seconds(x) for x in (45, 150, 3900)] == ["45s", "2m30s", "1h05m"]
    svg = line_plot(
        "t<1>",
        "a <title>",
        [Series("s&p", "#000", [(0, 1), (1, None), (2, 3), (3, 4)])],
        bands=[Band(1, None, "f#<w>", False)],
    )
    assert svg.count("<polyline") == 1 and svg.count("<circle") == 1  # the gap splits the line
    assert "<title>a &lt;title&gt;</title>" in svg and "f#&lt;w&gt;" in svg and "never healed" in svg
    assert highlight("ab<X>cd", [(2, 5)]) == "ab<mark>&lt;X&gt;</mark>cd"
    assert highlight("x" * 5000, [(2500, 2501)], clip=10).startswith("…") and highlight("", []) != ""


# --------------------------------------------------------------------------------- scale ----


def test_a_50k_request_journal_renders_aggregated(tmp_path: Path) -> None:
    """A large journal renders with bounded plots and its one leak; how fast, and how a million
    requests fare, is benchmarks/report_scale.py's to measure (docs/performance.md)."""
    write_large_run(tmp_path, requests=50_000)
    rendered = render_all(tmp_path)
    report = rendered.report
    assert report.traffic.counts.total >= 50_000 and len(report.leaks) == 1
    assert len(report.traffic.buckets) <= MAX_BUCKETS


# ---------------------------------------------------------------------------- screenshot ----


def _chromium() -> str | None:
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _chromium_args(profile: Path) -> list[str]:
    return [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
    ]


def read_png(path: Path) -> np.ndarray:
    """The pixels (height x width x RGB) of an 8-bit RGB/RGBA PNG, as Chromium writes it: no image library."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    while pos < len(data):
        (n,), kind = struct.unpack(">I", data[pos : pos + 4]), data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color in (2, 6) and interlace == 0
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    bpp = 3 if color == 2 else 4
    stride = width * bpp
    raw = np.frombuffer(zlib.decompress(idat), dtype=np.uint8).reshape(height, stride + 1)
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        kind, line = raw[y, 0], raw[y, 1:]
        if kind == 0:
            cur = line.copy()
        elif kind == 1:  # Sub: a running sum along the row, per channel
            cur = (np.cumsum(line.reshape(width, bpp), axis=0, dtype=np.int64) % 256).astype(np.uint8).reshape(stride)
        elif kind == 2:  # Up
            cur = line + prev
        else:  # Average and Paeth depend on the pixel just decoded: byte by byte
            cur = _unfilter_slow(int(kind), line.tolist(), prev.tolist(), bpp)
        out[y] = cur
        prev = cur
    return out.reshape(height, width, bpp)[:, :, :3]


def _unfilter_slow(kind: int, line: list[int], prev: list[int], bpp: int) -> np.ndarray:
    for i in range(bpp):  # no pixel to the left: a = c = 0
        line[i] = (line[i] + (prev[i] >> 1 if kind == 3 else prev[i])) & 255
    if kind == 3:
        for i in range(bpp, len(line)):
            line[i] = (line[i] + ((line[i - bpp] + prev[i]) >> 1)) & 255
        return np.array(line, dtype=np.uint8)
    for i in range(bpp, len(line)):
        a, b, c = line[i - bpp], prev[i], prev[i - bpp]
        pa, pb = abs(b - c), abs(a - c)  # |p - a| and |p - b| where p = a + b - c
        pc = abs(a + b - c - c)
        line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    return np.array(line, dtype=np.uint8)


def _hex(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


def _count_near(pixels: np.ndarray, color: tuple[int, int, int], y0: int, y1: int, tolerance: int = 24) -> int:
    distance = np.abs(pixels[y0:y1].astype(np.int16) - np.array(color, dtype=np.int16)).sum(axis=2)
    return int(np.count_nonzero(distance <= tolerance))


@pytest.mark.skipif(
    _chromium() is None, reason="headless Chromium is not installed (Debian: apt-get install -y chromium)"
)
def test_report_html_screenshot_shows_the_verdict_and_the_plots(runs: dict[str, Path], tmp_path: Path) -> None:
    chromium = _chromium()
    assert chromium is not None
    report = (runs["fail"] / "report.html").resolve()
    dom = subprocess.run(
        [chromium, *_chromium_args(tmp_path / "dom-profile"), "--dump-dom", report.as_uri()],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert 'data-verdict="FAIL"' in dom.stdout and dom.stdout.count('class="plot"') == 5, dom.stderr[-2000:]

    shot = tmp_path / "report.png"
    subprocess.run(
        [
            chromium,
            *_chromium_args(tmp_path / "shot-profile"),
            f"--screenshot={shot}",
            "--window-size=1400,3000",
            report.as_uri(),
        ],
        check=False,
        capture_output=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert shot.is_file(), "Chromium wrote no screenshot"
    rows = read_png(shot)
    height, width = rows.shape[:2]
    assert (width, height) == (1400, 3000)
    # The verdict banner is the first thing on the page, in FAIL red, across the full width.
    fail_red = _hex(VERDICT_COLORS["FAIL"])
    assert _count_near(rows, fail_red, 0, 60, tolerance=6) > 0.8 * 60 * width
    # The plots are drawn: their line colours and the shaded fault windows are on screen.
    plots_from = 600
    assert _count_near(rows, _hex("#8250df"), plots_from, height) > 300, "no TTFT/ITL p99 line"  # purple p99 lines
    assert _count_near(rows, _hex("#bf3989"), plots_from, height) > 300, "no KV pool line"  # decode KV pool
    band = (248, 226, 227)  # FAIL red at 13% over white: a confirmed fault window
    assert _count_near(rows, band, plots_from, height, tolerance=9) > 20_000, "no shaded fault window"


def test_the_environment_shows_where_each_role_ran_and_its_kv_pool_check(runs: dict[str, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "placed"
    shutil.copytree(runs["pass"], run_dir)
    with Journal.open(run_dir) as journal:
        target = journal.get_meta("target")
        journal.set_meta(
            "target",
            {
                **target,
                "placement": {
                    "prefill": "Ray node 0123456789ab (gpu-a, 10.0.0.5)",
                    "decode": "Ray node ba9876543210 (gpu-b, 10.0.0.6)",
                },
            },
        )
        environment = journal.get_meta("environment")
        journal.set_meta(
            "environment",
            {
                **environment,
                "pool_check": [
                    {
                        "role": "decode",
                        "status": "low",
                        "gpu_ids": [1],
                        "mem_fraction_static": 0.88,
                        "expected_kv_gib": 52.1,
                        "reported_kv_gib": 31.0,
                        "reported_pool_tokens": 681280,
                        "reason": "another process holds 20 GiB of GPU 1",
                    }
                ],
            },
        )
    render_all(run_dir)
    html = (run_dir / "report.html").read_text()
    assert "prefill: Ray node 0123456789ab (gpu-a, 10.0.0.5)" in html
    assert "KV pool vs memory fraction" in html and "another process holds 20 GiB of GPU 1" in html and "681280" in html


def test_the_report_scale_benchmark_runs_and_records_what_the_doc_quotes(tmp_path: Path) -> None:
    """benchmarks/report_scale.py in a short mode (two small journals): it asserts nothing about
    speed, but its JSON must hold the figures docs/performance.md quotes."""
    out = tmp_path / "scale.json"
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/report_scale.py",
            "--sizes",
            "3000,6000",
            "--json",
            str(out),
            "--work",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["requests"] for r in rows] == [3000, 6000] and rows[0]["per_request_vs_smallest"] == 1.0
    for row in rows:
        assert row["report_wall_s"] > 0 and row["report_peak_rss_mb"] > 0 and row["journal_bytes"] > 0
        assert {"report.html", "report.json", "junit.xml"} <= set(row["files_bytes"])
        assert "FAIL" in row["verdict_line"]  # the journal holds a leak: the report says so


def test_request_columns_read_in_chunks_equal_one_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The column reader streams a big journal in chunks; the chunks must add up to one read."""
    from reports import columns

    write_large_run(tmp_path, requests=2_000)
    whole = columns.read_columns(tmp_path / "journal.sqlite")
    monkeypatch.setattr(columns, "CHUNK_ROWS", 333)
    chunked = columns.read_columns(tmp_path / "journal.sqlite")
    assert len(whole) >= 2_000 and whole.token_times.size > len(whole)
    for name in ("t_send", "t_first_token", "t_end", "outcome", "token_counts", "token_times"):
        assert np.array_equal(getattr(whole, name), getattr(chunked, name), equal_nan=True), name
    for name in ("phase", "user_kind", "error_class"):
        assert getattr(whole, name) == getattr(chunked, name), name
