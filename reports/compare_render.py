"""The engine-upgrade diff as files: `compare.html`, `compare.md` and `compare.json`.

The HTML leads with the outcome (REGRESSED / NOT PROVEN / NO REGRESSION) and its reasons, then
both runs' identities (engine versions first: that is what changed), the matrix as base → candidate,
error classes, latency ratios, and TTFT and error rate of both runs on one time axis (seconds
since each run's load started, so the same seeded schedule lines up).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from html import escape
from pathlib import Path
from typing import Any

from reports.compare import MIN_LATENCY_SAMPLES, CellChange, Comparison, LatencyChange
from reports.htmlkit import badge, cell_class, color_of, ms, page, pct, table, when
from reports.markdown import SYMBOL, md
from reports.model import RunReport
from reports.plots import BLUE, RED
from reports.render import write_atomic
from reports.svg import Band, Series, line_plot

OUTCOME_COLORS = {
    "REGRESSED": color_of("FAIL"),
    "NOT PROVEN": color_of("INCONCLUSIVE"),
    "NO REGRESSION": color_of("PASS"),
}
GREY = "#8c959f"


def write_comparison(c: Comparison, out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return {
        "html": write_atomic(out_dir / "compare.html", render_compare_html(c)),
        "markdown": write_atomic(out_dir / "compare.md", render_compare_markdown(c)),
        "json": write_atomic(out_dir / "compare.json", json.dumps(compare_json(c), indent=2, default=str) + "\n"),
    }


def _engine(r: RunReport) -> str:
    engine = r.environment.get("engine")
    if not isinstance(engine, dict):
        return "—"
    return ", ".join(f"{role} {info.get('version')}" for role, info in engine.items() if isinstance(info, dict)) or "—"


def _router(r: RunReport) -> str:
    router = r.environment.get("router")
    return ", ".join(f"{k} {v}" for k, v in router.items()) if isinstance(router, dict) else "—"


# ---------------------------------------------------------------------------------- json ----


def compare_json(c: Comparison) -> dict[str, Any]:
    def run(r: RunReport) -> dict[str, Any]:
        return {
            "dir": str(r.run_dir),
            "verdict": r.verdict_label,
            "exit_code": r.exit_code,
            "campaign": r.campaign_name,
            "seed": r.seed,
            "engine": _engine(r),
            "leaks": len(r.leaks),
            "requests": r.traffic.counts.to_json(),
        }

    return {
        "schema": "pdchaos.compare/1",
        "outcome": c.outcome,
        "exit_code": c.exit_code,
        "base": run(c.base),
        "candidate": run(c.candidate),
        "regressions": c.regressions,
        "unproven": c.unproven,
        "improvements": c.improvements,
        "warnings": c.warnings,
        "cells": [{"window": x.window, "oracle": x.oracle, "base": x.base, "candidate": x.candidate} for x in c.cells],
        "failure_kinds": [
            {"oracle": x.oracle, "rule": x.rule, "base": x.base, "candidate": x.candidate, "example": x.example}
            for x in c.failure_kinds
        ],
        "error_classes": [
            {
                "name": e.name,
                "base": e.base,
                "candidate": e.candidate,
                "base_under_faults": e.base_under_faults,
                "candidate_under_faults": e.candidate_under_faults,
                "new": e.new,
            }
            for e in c.error_classes
        ],
        "latency": [
            {
                "span": x.span,
                "metric": x.metric,
                "base_s": x.base_s,
                "candidate_s": x.candidate_s,
                "ratio": x.ratio,
                "base_count": x.base_count,
                "candidate_count": x.candidate_count,
            }
            for x in c.latency
        ],
        "max_latency_ratio": c.max_latency_ratio,
    }


# ------------------------------------------------------------------------------ markdown ----


def render_compare_markdown(c: Comparison) -> str:
    b, k = c.base, c.candidate
    lines = [
        f"## pdchaos compare: {c.outcome} (exit {c.exit_code})",
        "",
        f"Base **{md(b.run_dir.name)}** ({md(_engine(b))}): {SYMBOL.get(b.verdict_label, b.verdict_label)} · "
        f"candidate **{md(k.run_dir.name)}** ({md(_engine(k))}): {SYMBOL.get(k.verdict_label, k.verdict_label)}",
        "",
    ]
    for title, items in (
        ("Regressions", c.regressions),
        ("Not proven", c.unproven),
        ("Improvements", c.improvements),
        ("Warnings", c.warnings),
    ):
        if items:
            lines += [f"**{title}**", ""] + [f"- {md(x)}" for x in items] + [""]
    if c.cells:
        lines += ["| fault window × oracle | base | candidate |", "|---|---|---|"]
        lines += [
            f"| {md(x.window)} × {md(x.oracle)} | {SYMBOL.get(x.base, x.base)} | {SYMBOL.get(x.candidate, x.candidate)} |"
            for x in c.cells
        ]
        lines.append("")
    if c.failure_kinds:
        lines += ["| failure (oracle, rule) | base | candidate |", "|---|---:|---:|"]
        lines += [f"| {md(x.oracle)} {md(x.rule)} | {x.base} | {x.candidate} |" for x in c.failure_kinds]
        lines.append("")
    under = [x for x in c.latency if x.span == "under faults"]
    if under:
        lines += ["| under faults | base ms | candidate ms | ratio |", "|---|---:|---:|---:|"]
        lines += [f"| {x.metric} | {ms(x.base_s)} | {ms(x.candidate_s)} | {_ratio(x.ratio)} |" for x in under]
        lines.append("")
    lines += [
        f"Leaks: {len(b.leaks)} → {len(k.leaks)} · requests: {b.traffic.counts.total:,} → {k.traffic.counts.total:,}",
        "",
    ]
    return "\n".join(lines)


def _ratio(ratio: float | None) -> str:
    return "—" if ratio is None else f"×{ratio:.2f}"


# ---------------------------------------------------------------------------------- html ----


def render_compare_html(c: Comparison) -> str:
    b, k = c.base, c.candidate
    color = OUTCOME_COLORS[c.outcome]
    reasons = (
        c.regressions
        or c.unproven
        or ["every fault × oracle cell, leak count, error class and latency under faults held"]
    )
    body = [
        f'<header class="banner" id="verdict" data-outcome="{escape(c.outcome)}" style="background:{color}">'
        f"<h1>{escape(c.outcome)}</h1><div class='sub'>candidate <b>{escape(k.run_dir.name)}</b> ({escape(_engine(k))}) vs "
        f"base <b>{escape(b.run_dir.name)}</b> ({escape(_engine(b))}) · exit code {c.exit_code}</div>"
        "<ul>" + "".join(f"<li>{escape(r)}</li>" for r in reasons) + "</ul></header><main>",
        _runs(c),
    ]
    for title, items, cls in (
        ("Not proven", c.unproven if c.regressions else [], "warn"),
        ("Improvements", c.improvements, "good"),
        ("Warnings", c.warnings, "warn"),
    ):
        if items:
            body.append(
                f"<h2>{title}</h2><ul>" + "".join(f"<li class='{cls}'>{escape(x)}</li>" for x in items) + "</ul>"
            )
    body += [_matrix(c), _failures(c), _leaks(c), _errors(c), _latency(c), _plots(c), "</main>"]
    return page(f"pdchaos compare: {c.outcome}", "".join(body))


def _failures(c: Comparison) -> str:
    if not c.failure_kinds:
        return ""
    rows = [
        (
            escape(f"{x.oracle} {x.rule}" if x.rule != x.oracle else x.oracle),
            str(x.base),
            str(x.candidate),
            escape(x.example[:160]),
        )
        for x in c.failure_kinds
    ]
    return "<h2>Kinds of failure</h2>" + table(("oracle, rule", "base", "candidate", "example"), rows)


def _runs(c: Comparison) -> str:
    rows = []
    facts: tuple[tuple[str, Callable[[RunReport], str]], ...] = (
        ("run", lambda r: escape(str(r.run_dir))),
        ("verdict", lambda r: badge(r.verdict_label)),
        ("engine", lambda r: escape(_engine(r))),
        ("router", lambda r: escape(_router(r))),
        ("Mooncake", lambda r: escape(str(r.environment.get("mooncake", "—")))),
        ("campaign / seed", lambda r: escape(f"{r.campaign_name} / {r.seed}")),
        ("started", lambda r: escape(when(r.started_at))),
        (
            "requests (ok / fail / info)",
            lambda r: escape(
                f"{r.traffic.counts.total:,} ({r.traffic.counts.ok:,} / "
                f"{r.traffic.counts.fail:,} / {r.traffic.counts.info:,})"
            ),
        ),
        ("leaks", lambda r: str(len(r.leaks))),
        ("faults confirmed", lambda r: f"{sum(1 for f in r.faults if f.confirmed)} of {len(r.faults)}"),
    )
    for name, get in facts:
        rows.append((escape(name), get(c.base), get(c.candidate)))
    return "<h2>Runs</h2>" + table(("", "base", "candidate"), rows)


def _matrix(c: Comparison) -> str:
    changed = {(x.window, x.oracle): x for x in c.cells}
    oracles = list(dict.fromkeys(cell.oracle for pair in c.windows for row in pair if row for cell in row.cells))
    rows = []
    for base_row, cand_row in c.windows:
        label = (cand_row or base_row).key  # type: ignore[union-attr]
        cells = []
        for oracle in oracles:
            change = changed.get((label, oracle))
            if change is not None:
                cells.append(_changed_cell(change))
            else:
                cell = (cand_row or base_row).cell(oracle)  # type: ignore[union-attr]
                text = cell.label if cell else "absent"
                cells.append(f'<td class="cell {cell_class(text)}" style="opacity:.55">{escape(text)}</td>')
        rows.append(f"<tr><td><b>{escape(label)}</b></td>{''.join(cells)}</tr>")
    head = "<th>fault window</th>" + "".join(f"<th>{escape(o)}</th>" for o in oracles)
    return (
        '<h2 id="matrix">Fault × oracle, base → candidate</h2><p class="muted">Changed cells are bold; '
        "unchanged ones are faded.</p>"
        f'<table class="matrix"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    )


def _changed_cell(x: CellChange) -> str:
    return (
        f'<td class="cell {cell_class(x.candidate)}" style="font-weight:700" title="{escape(x.base)} → {escape(x.candidate)}">'
        f"{escape(x.base)} → {escape(x.candidate)}</td>"
    )


def _errors(c: Comparison) -> str:
    if not c.error_classes:
        return "<h2>Error classes</h2><p class='muted'>Neither run recorded an error class.</p>"
    rows = [
        (
            f"<code>{escape(e.name)}</code>" + (" <span class='bad'>NEW</span>" if e.new else ""),
            f"{e.base:,}",
            f"{e.candidate:,}",
            f"{e.base_under_faults:,}",
            f"{e.candidate_under_faults:,}",
        )
        for e in c.error_classes
    ]
    return "<h2>Error classes</h2>" + table(
        ("error class", "base", "candidate", "base under faults", "candidate under faults"), rows, numeric=(1, 2, 3, 4)
    )


def _latency(c: Comparison) -> str:
    metrics = list(dict.fromkeys(x.metric for x in c.latency))
    spans: dict[str, dict[str, LatencyChange]] = {}
    for change in c.latency:
        spans.setdefault(change.span, {})[change.metric] = change
    rows = []
    for span, by_metric in spans.items():
        cells = []
        for metric in metrics:
            x = by_metric.get(metric)
            if x is None:
                cells.append("—")
                continue
            ratio = x.ratio
            hot = ratio is not None and c.max_latency_ratio > 0 and ratio >= c.max_latency_ratio
            cls = "bad" if hot else "good" if ratio is not None and ratio <= 1 / 1.2 else "muted"
            cells.append(f"{ms(x.base_s)} → {ms(x.candidate_s)} <span class='{cls}'>{escape(_ratio(ratio))}</span>")
        counts = next(iter(by_metric.values()))
        rows.append((escape(span), *cells, f"{counts.base_count:,} / {counts.candidate_count:,}"))
    rates = [
        ("under faults", c.base.traffic.under_faults.error_rate, c.candidate.traffic.under_faults.error_rate),
        ("outside faults", c.base.traffic.outside_faults.error_rate, c.candidate.traffic.outside_faults.error_rate),
    ]
    limit = f"×{c.max_latency_ratio:g}" if c.max_latency_ratio > 0 else "off"
    return (
        f"<h2>Latency (ms, base → candidate)</h2><p class='muted'>Gate: TTFT p50/p99 and ITL p99 under faults, "
        f"limit {escape(limit)}, at least {MIN_LATENCY_SAMPLES} values in both runs.</p>"
        + table(("span", *metrics, "TTFT values"), rows, numeric=tuple(range(1, len(metrics) + 2)))
        + "<h3>Error rate (not ok)</h3>"
        + table(("span", "base", "candidate"), [(escape(n), pct(rb), pct(rk)) for n, rb, rk in rates], numeric=(1, 2))
    )


def _leaks(c: Comparison) -> str:
    k = c.candidate
    out = [f"<h2>Leaks</h2><p>base {len(c.base.leaks)} → candidate <b>{len(k.leaks)}</b></p>"]
    if k.leaks:
        out.append(
            table(
                ("request", "victim", "marker", "faults active"),
                [
                    (
                        f"<code>{escape(x.finding.request_id or '?')}</code>",
                        f"<code>{escape(x.finding.victim_request_id or '?')}</code>",
                        f"<code>{escape(x.marker)}</code>",
                        escape(", ".join(x.faults_active) or "none"),
                    )
                    for x in k.leaks[:50]
                ],
            )
        )
    return "".join(out)


def _plots(c: Comparison) -> str:
    def zero(r: RunReport) -> float:
        start = r.meta.get("load_started_at")
        return float(start) if isinstance(start, (int, float)) else r.origin

    def points(r: RunReport, value: Any) -> list[tuple[float, float | None]]:
        shift = r.origin - zero(r)
        return [(bucket.mid_s + shift, value(bucket)) for bucket in r.traffic.buckets]

    k = c.candidate
    bands = [
        Band(f.start - zero(k), None if f.end is None else f.end - zero(k), f.label, f.confirmed)
        for f in k.faults
        if f.start is not None
    ]
    ttft = line_plot(
        "compare-ttft",
        "TTFT p99 (ms), seconds since load start; bands: the candidate's fault windows",
        [
            Series(
                "base",
                GREY,
                points(c.base, lambda b: None if b.stats.ttft.p99 is None else b.stats.ttft.p99 * 1000),
                dashed=True,
            ),
            Series(
                "candidate", BLUE, points(k, lambda b: None if b.stats.ttft.p99 is None else b.stats.ttft.p99 * 1000)
            ),
        ],
        bands=bands,
        y_label="ms",
    )
    errors = line_plot(
        "compare-errors",
        "Error rate (% not ok)",
        [
            Series(
                "base",
                GREY,
                points(c.base, lambda b: None if b.stats.error_rate is None else b.stats.error_rate * 100),
                dashed=True,
            ),
            Series(
                "candidate", RED, points(k, lambda b: None if b.stats.error_rate is None else b.stats.error_rate * 100)
            ),
        ],
        bands=bands,
        y_label="%",
        y_min_top=10.0,
    )
    return '<h2 id="plots">Plots</h2>' + ttft + errors
