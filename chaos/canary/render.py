"""The canary's report as text: the target line, one row per probe, the victims that were not
clean, the notes and the summary line."""

from __future__ import annotations

from chaos.canary.report import CanaryReport, ProbeResult, verdict_name
from chaos.verdict import Verdict
from loadprofiles.exchange import ROUTES


def _status_cell(probe: ProbeResult) -> str:
    if probe.verdict is None:
        return "-"
    if probe.http_status is None:
        return "no answer"
    if probe.spec.stream and probe.http_status == 200 and probe.stream_error_status is not None:
        return f"200/{probe.stream_error_status} in-stream"
    return str(probe.http_status)


def _tokens_cell(probe: ProbeResult) -> str:
    if probe.measured_tokens is not None:
        return str(probe.measured_tokens)
    if probe.planned_tokens is None:
        return "-"
    return str(probe.planned_tokens) if probe.exact else f"~{probe.planned_tokens}"


def format_report(report: CanaryReport) -> str:
    target, facts = report.target, report.target.facts
    lines = [
        (
            f"target {target.url}  model {facts.model}  api {facts.api}  "
            f"context {facts.context_length or '?'}  pool {facts.max_total_num_tokens or '?'}  "
            f"max_req_input_len {facts.max_req_input_len or '?'}  run {report.run_prefix}"
        ),
    ]
    header = ["PROBE", "TOKENS", "THRESHOLD", "ROUTE", "STREAM", "STATUS", "VERDICT", "REASON"]
    rows = [header] + [
        [
            probe.spec.name,
            _tokens_cell(probe),
            probe.spec.threshold.label,
            ROUTES[probe.spec.route],
            "yes" if probe.spec.stream else "no",
            _status_cell(probe),
            verdict_name(probe.verdict),
            probe.reason,
        ]
        for probe in report.probes
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        cells = [cell.rjust(widths[i]) if i == 1 else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    bad_victims = [v for v in report.victims if v.verdict is not Verdict.PASS]
    for victim in bad_victims:
        lines.append(f"{victim.name} ({ROUTES[victim.route]}): {victim.verdict.value}: {victim.reason}")
    for note in report.notes:
        lines.append(f"note: {note}")
    lines.append(report.summary_line())
    return "\n".join(lines) + "\n"
