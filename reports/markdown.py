"""`summary.md`: a short summary for a pull request or a release ticket.

Verdict and reasons, the fault × oracle matrix, leaks (first few), traffic and latency in one
table, and the environment in one line. Journal text is made inert: backticks and pipes
cannot break the table, and HTML is escaped.
"""

from __future__ import annotations

from html import escape
from typing import Any, cast

from reports.htmlkit import ms, pct
from reports.model import RunReport
from reports.outcomes import OutcomeClasses

MAX_LEAKS = 10
SYMBOL = {"PASS": "✅ PASS", "FAIL": "❌ FAIL", "INCONCLUSIVE": "⚠️ INCONCLUSIVE", "NOT RUN": "— not run"}


def md(text: object) -> str:
    """Inline-safe: no HTML, no table breaks, no code spans or emphasis opened by journal text."""
    out = escape(str(text)).replace("|", "\\|").replace("\n", " ")
    for ch in "`*_[]":
        out = out.replace(ch, "\\" + ch)
    return out


def endings_line(e: OutcomeClasses) -> str:
    """The four classes of reports/outcomes.py in one line, the unexplained ones named."""
    top = ", ".join(f"{md(name)} {n:,}" for name, n in e.unexplained_error_classes[:3])
    return (
        f"answered {e.answered:,} · ended as intended {e.as_intended:,} (over-length prompts refused, aborts) · "
        f"under a fault {e.under_fault:,} · **unexplained {e.unexplained:,}**"
        + (f" ({top})" if top else "")
        + (
            f" · attempts on an unavailable endpoint {e.unavailable_attempts:,} (refused or 503; users back off)"
            if e.unavailable_attempts
            else ""
        )
    )


def render_markdown(report: RunReport) -> str:
    label = report.verdict_label
    seed = "—" if report.seed is None else report.seed
    lines = [f"## pdchaos {SYMBOL.get(label, label)} — {md(report.campaign_name)} (seed {seed})", ""]
    if not report.complete:
        lines += [
            "**Judged from the journal:** the run stopped before it recorded a verdict itself; this one judges what "
            "its journal holds, as the run would have.",
            "",
        ]
    lines += [f"- {md(r)}" for r in report.reasons] + [""]
    t = report.traffic
    confirmed = sum(1 for f in report.faults if f.confirmed is True)
    lines += [
        # No ok/fail/info here: "fail" counts the refusals the run asked for (report.json keeps them).
        f"**Leaks:** {len(report.leaks)} · **requests:** {t.counts.total:,} · **faults confirmed:** "
        f"{confirmed}/{len(report.faults)} · **exit code:** {report.exit_code}",
        "",
        f"**Endings** (the baseline aside): {endings_line(report.endings)}",
        "",
    ]
    if report.matrix and report.matrix[0].cells:
        names = [c.oracle for c in report.matrix[0].cells]
        lines += ["| fault window | " + " | ".join(md(n) for n in names) + " |", "|---|" + "---|" * len(names)]
        for row in report.matrix:
            cells = [
                SYMBOL.get(c.label, c.label) + (f" ({len(c.findings)})" if c.findings and c.verdict else "")
                for c in row.cells
            ]
            lines.append(f"| {md(row.key)} | " + " | ".join(cells) + " |")
        lines.append("")
    provoked = [f for f in report.faults if f.provocation]
    if provoked:
        lines += ["### Provocations", ""] + [f"- {md(f.label)}: {md(f.provocation)}" for f in provoked] + [""]
    if report.leaks:
        lines += ["### Leaks", ""]
        for leak in report.leaks[:MAX_LEAKS]:
            f = leak.finding
            lines.append(
                f"- {md(f.request_id or '?')} carried marker {md(leak.marker)} of {md(f.victim_request_id or 'an unknown request')}"
                f" during {md(', '.join(leak.faults_active) or 'no fault')}"
            )
        if len(report.leaks) > MAX_LEAKS:
            lines.append(f"- … {len(report.leaks) - MAX_LEAKS} more (report.json)")
        lines.append("")
    lines += [
        "| span | requests | not answered (refusals too) | TTFT p50 ms | TTFT p99 ms | ITL p50 ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in (("outside faults", t.outside_faults), ("under faults", t.under_faults)):
        lines.append(
            f"| {name} | {s.counts.total:,} | {pct(s.error_rate)} | {ms(s.ttft.p50)} | {ms(s.ttft.p99)} | {ms(s.itl.p50)} |"
        )
    lines.append("")
    env = report.environment
    # dicts or {}: mypy does not narrow a get() by the isinstance of the same get()
    engine = cast(dict[str, Any], env.get("engine") if isinstance(env.get("engine"), dict) else {})
    versions = (
        ", ".join(f"{role} {info.get('version')}" for role, info in engine.items() if isinstance(info, dict)) or "—"
    )
    router = cast(dict[str, Any], env.get("router") if isinstance(env.get("router"), dict) else {})
    lines += [
        f"Engine {md(versions)} · router {md(', '.join(f'{k} {v}' for k, v in router.items()) or '—')} · "
        f"Mooncake {md(env.get('mooncake', '—'))} · GPUs: {md(report.gpu_summary)}",
        "",
        "Full report: `report.html` · replay: `reproduce.yaml` · machine-readable: `report.json`",
        "",
    ]
    return "\n".join(lines)
