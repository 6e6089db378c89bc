"""`junit.xml`: one test case per fault window × oracle, so CI shows a run natively.

Mapping: FAIL → <failure>; an INCONCLUSIVE window cell → <skipped> (the window proved nothing:
not a pass, not a failure of the engine); an oracle that never ran → <skipped>. One suite per
fault window, one for findings outside any window, and a `run` suite whose `verdict` case carries
the run's verdict and one case per gate. An INCONCLUSIVE run verdict is a <failure> of type
INCONCLUSIVE by default, because a CI job that gates on JUnit would show an unproven run green;
the campaign's `report.junit_inconclusive: skipped` keeps it <skipped>. A run that stopped before
it judged itself is judged from its journal, and shown as any run with that verdict. Run facts
(seed, campaign, engine versions) are suite properties.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections.abc import Sequence

from chaos.verdict import Finding, Verdict
from reports.matrix import MatrixCell
from reports.model import RunReport

MAX_DETAIL_FINDINGS = 50
# XML 1.0 cannot hold most control characters, and a leaked response may contain any of them.
_NOT_XML = re.compile("[^\x09\x0a\x0d\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def render_junit(report: RunReport) -> str:
    campaign = report.campaign_name
    root = ET.Element("testsuites", name=f"pdchaos {campaign}")
    for row in report.matrix:
        suite = ET.SubElement(root, "testsuite", name=row.key)
        _properties(suite, report, row.fault.label if row.fault else None)
        duration = row.fault.duration_s if row.fault and row.fault.duration_s is not None else 0.0
        for cell in row.cells:
            case = ET.SubElement(
                suite, "testcase", classname=f"pdchaos.{campaign}.{row.key}", name=cell.oracle, time=f"{duration:.3f}"
            )
            _outcome(case, cell)
        _count(suite)
    run = ET.SubElement(root, "testsuite", name="run")
    _properties(run, report, None)
    verdict = ET.SubElement(run, "testcase", classname=f"pdchaos.{campaign}.run", name="verdict")
    message = "; ".join(report.reasons)
    if report.run_verdict.verdict is Verdict.FAIL:
        ET.SubElement(verdict, "failure", message=message, type="FAIL").text = "\n".join(report.reasons)
    elif report.run_verdict.verdict is Verdict.INCONCLUSIVE:
        if _inconclusive_as(report) == "skipped":
            ET.SubElement(verdict, "skipped", message=f"INCONCLUSIVE: {message}")
        else:
            ET.SubElement(verdict, "failure", message=f"INCONCLUSIVE: {message}", type="INCONCLUSIVE").text = "\n".join(
                report.reasons
            )
    for number, gate in enumerate(report.gates, 1):
        case = ET.SubElement(
            run, "testcase", classname=f"pdchaos.{campaign}.gates", name=f"gate {number}: {gate.window or 'run'}"
        )
        if gate.verdict is Verdict.FAIL:
            ET.SubElement(case, "failure", message=gate.summary, type="FAIL")
        elif gate.verdict is Verdict.INCONCLUSIVE:
            ET.SubElement(case, "skipped", message=f"INCONCLUSIVE: {gate.summary}")
    _count(run)
    for attr in ("tests", "failures", "errors", "skipped"):
        root.set(attr, str(sum(int(s.get(attr, "0")) for s in root.iter("testsuite"))))
    _sanitize(root)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _inconclusive_as(report: RunReport) -> str:
    """The campaign's `report.junit_inconclusive`; "failure" when the journal's campaign has none."""
    campaign = report.meta.get("campaign")
    spec = campaign.get("report") if isinstance(campaign, dict) else None
    chosen = spec.get("junit_inconclusive") if isinstance(spec, dict) else None
    return chosen if chosen in ("failure", "skipped") else "failure"


def _outcome(case: ET.Element, cell: MatrixCell) -> None:
    if cell.verdict is Verdict.FAIL:
        fails = [f for f in cell.findings if f.verdict is Verdict.FAIL]
        failure = ET.SubElement(case, "failure", message=cell.why, type="FAIL")
        failure.text = _details(fails)
    elif cell.verdict is Verdict.INCONCLUSIVE:
        ET.SubElement(case, "skipped", message=f"INCONCLUSIVE: {cell.why}")
    elif cell.verdict is None:
        ET.SubElement(case, "skipped", message=f"NOT RUN: {cell.why}")


def _details(findings: Sequence[Finding]) -> str:
    lines = []
    for f in findings[:MAX_DETAIL_FINDINGS]:
        who = (
            f" [request {f.request_id}" + (f", victim {f.victim_request_id}" if f.victim_request_id else "") + "]"
            if f.request_id
            else ""
        )
        marker = f" marker {f.evidence['marker']}" if "marker" in f.evidence else ""
        lines.append(f"{f.summary}{who}{marker}")
    if len(findings) > MAX_DETAIL_FINDINGS:
        lines.append(f"... {len(findings) - MAX_DETAIL_FINDINGS} more in report.json")
    return "\n".join(lines)


def _properties(suite: ET.Element, report: RunReport, window: str | None) -> None:
    props = ET.SubElement(suite, "properties")
    values = {
        "campaign": report.campaign_name,
        "seed": report.seed,
        "verdict": report.verdict_label,
        "run_dir": str(report.run_dir),
    }
    engine = report.environment.get("engine")
    if isinstance(engine, dict):
        for role, info in engine.items():
            if isinstance(info, dict):
                values[f"engine.{role}.version"] = info.get("version")
    fault = next((f for f in report.faults if f.label == window), None)
    if fault is not None:
        values.update(
            {
                "fault": fault.fault,
                "confirmed": fault.confirmed,
                "confirm_evidence": fault.confirm_evidence,
                "healed": fault.end is not None and fault.healed,
            }
        )
    for name, value in values.items():
        ET.SubElement(props, "property", name=name, value="" if value is None else str(value))


def _count(suite: ET.Element) -> None:
    cases = suite.findall("testcase")
    suite.set("tests", str(len(cases)))
    suite.set("failures", str(sum(1 for c in cases if c.find("failure") is not None)))
    suite.set("errors", str(sum(1 for c in cases if c.find("error") is not None)))
    suite.set("skipped", str(sum(1 for c in cases if c.find("skipped") is not None)))


def _sanitize(root: ET.Element) -> None:
    for element in root.iter():
        if element.text:
            element.text = _NOT_XML.sub("\ufffd", element.text)
        for key, value in element.attrib.items():
            element.set(key, _NOT_XML.sub("\ufffd", value))
