"""`report.html`: one self-contained page a release manager can read, sign and attach.

Order is what a reader needs first: the verdict and why, the fault × oracle matrix, every leak
side by side with its victim, then the plots, the faults, each oracle's evidence, the traffic,
the environment fingerprint and the campaign that replays the run. Every journal string is
escaped: responses are untrusted text (a leak can carry anyone's HTML).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from chaos import __version__
from chaos.journal import RequestRecord
from chaos.verdict import Finding, Verdict
from reports.htmlkit import (
    badge,
    cell_class,
    color_of,
    compact_json,
    kv_table,
    ms,
    page,
    pct,
    secs,
    table,
    when,
)
from reports.matrix import OUTSIDE
from reports.model import Leak, RunReport
from reports.plots import all_plots
from reports.svg import format_seconds
from reports.traffic import LatencyStats

MAX_LEAKS_SHOWN = 50
MAX_FINDINGS_SHOWN = 100
CLIP_CHARS = 1500  # of text each side of a highlighted marker

SECTIONS = (
    ("matrix", "Fault × oracle"),
    ("leaks", "Leaks"),
    ("plots", "Plots"),
    ("faults", "Faults"),
    ("oracles", "Oracles"),
    ("traffic", "Traffic"),
    ("environment", "Environment"),
    ("campaign", "Campaign"),
)


def render_html(report: RunReport) -> str:
    body = [
        _banner(report),
        "<main>",
        "<nav>" + "".join(f'<a href="#{key}">{escape(name)}</a>' for key, name in SECTIONS) + "</nav>",
        _cards(report),
        _matrix(report),
        _leaks(report),
        _plots(report),
        _faults(report),
        _oracles(report),
        _traffic(report),
        _environment(report),
        _campaign(report),
        _problems(report),
        f"<footer>Rendered by pdchaos {escape(__version__)} from {escape(str(report.run_dir / 'journal.sqlite'))}. "
        f"Every report of a run is a pure function of its journal: <code>pdchaos report {escape(str(report.run_dir))}</code> "
        "renders them again.</footer>",
        "</main>",
    ]
    return page(f"pdchaos {report.verdict_label}: {report.campaign_name}", "".join(body))


# ------------------------------------------------------------------------------ headline ----


def _banner(report: RunReport) -> str:
    label = report.verdict_label
    headline = label if report.complete else f"{label} — judged from the journal: the run recorded no verdict itself"
    seed = "—" if report.seed is None else str(report.seed)
    sub = (
        f"campaign <b>{escape(report.campaign_name)}</b> · seed {escape(seed)} · exit code {report.exit_code} · "
        f"started {escape(when(report.started_at))} · run {escape(report.run_dir.name)}"
    )
    reasons = "".join(f"<li>{escape(r)}</li>" for r in report.reasons) or "<li>no reasons recorded</li>"
    return (
        f'<header class="banner" id="verdict" data-verdict="{escape(label)}" style="background:{color_of(label)}">'
        f'<h1>{escape(headline)}</h1><div class="sub">{sub}</div><ul>{reasons}</ul></header>'
    )


def _cards(report: RunReport) -> str:
    t, e = report.traffic, report.endings
    confirmed = sum(1 for f in report.faults if f.confirmed is True)
    healed = sum(1 for f in report.faults if f.end is not None and f.healed)
    duration = (
        (report.ended_at - report.origin) if report.ended_at else (t.last_end - report.origin if t.last_end else None)
    )
    cards = [
        ("leaks", str(len(report.leaks)), "bad" if report.leaks else "good"),
        ("requests", f"{t.counts.total:,}", ""),
        ("answered / as intended / under a fault", f"{e.answered:,} / {e.as_intended:,} / {e.under_fault:,}", ""),
        ("unexplained endings", f"{e.unexplained:,}", "warn" if e.unexplained else "good"),
        ("attempts on an unavailable endpoint (refused, 503)", f"{e.unavailable_attempts:,}", ""),
        ("faults confirmed", f"{confirmed} of {len(report.faults)}", "warn" if confirmed < len(report.faults) else ""),
        ("faults healed", f"{healed} of {len(report.faults)}", "bad" if healed < len(report.faults) else ""),
        ("TTFT p99 outside / under faults", f"{ms(t.outside_faults.ttft.p99)} / {ms(t.under_faults.ttft.p99)} ms", ""),
        ("run length", secs(duration), ""),
    ]
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card"><div class="v {cls}">{escape(v)}</div><div class="k">{escape(k)}</div></div>'
            for k, v, cls in cards
        )
        + "</div>"
    )


# -------------------------------------------------------------------------------- matrix ----


def _matrix(report: RunReport) -> str:
    out = [
        '<h2 id="matrix">Fault × oracle</h2>',
        '<p class="muted">Each cell: what the oracle concluded about requests during that fault window. '
        "A window whose fault was not confirmed proves nothing, so it cannot pass.</p>",
    ]
    columns = [c.oracle for c in report.matrix[0].cells] if report.matrix else []
    if not columns:
        out.append('<p class="warn">No oracle result in the journal: the run stopped before the oracles ran.</p>')
    head = "<th>fault window</th><th>confirmed</th>" + "".join(
        f"<th>{escape(name)}<br>{badge(_oracle_label(report, name))}</th>" for name in columns
    )
    rows = []
    for row in report.matrix:
        if row.fault is None:
            title, state = f"<i>{escape(OUTSIDE)}</i>", "—"
        else:
            f = row.fault
            title = f"<b>{escape(row.key)}</b><br><span class='muted mono'>{escape(compact_json(f.params))}</span>"
            state = (
                '<span class="good">yes</span>'
                if f.confirmed
                else '<span class="bad">NO</span>'
                if f.confirmed is False
                else '<span class="warn">never</span>'
            )
        cells = []
        for cell in row.cells:
            count = f" ({len(cell.findings)})" if cell.findings else ""
            cells.append(
                f'<td class="cell {cell_class(cell.label)}" title="{escape(cell.why)}">'
                f'<a href="#oracle-{escape(cell.oracle)}">{escape(cell.label)}{count}</a></td>'
            )
        rows.append(f"<tr><td>{title}</td><td>{state}</td>{''.join(cells)}</tr>")
    out.append(f'<table class="matrix"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>')
    return "".join(out)


def _oracle_label(report: RunReport, name: str) -> str:
    result = report.oracle(name)
    return result.verdict.value if result else "NOT RUN"


# --------------------------------------------------------------------------------- leaks ----


def _leaks(report: RunReport) -> str:
    out = ['<h2 id="leaks">Leaks</h2>']
    canary = report.oracle("canary")
    if not report.leaks:
        text = (
            "No response carried another request's marker"
            + (f" ({canary.checked:,} responses scanned)." if canary else ".")
            if canary
            else "The canary oracle did not run: leaks were not checked."
        )
        out.append(f'<p class="{"good" if canary else "warn"}">{escape(text)}</p>')
        return "".join(out)
    out.append(
        f'<p class="bad">{len(report.leaks)} response(s) carried another request\'s canary marker.'
        + (
            f" The first {MAX_LEAKS_SHOWN} are shown; report.json lists all."
            if len(report.leaks) > MAX_LEAKS_SHOWN
            else ""
        )
        + "</p>"
    )
    for number, leak in enumerate(report.leaks[:MAX_LEAKS_SHOWN], 1):
        out.append(_leak(report, number, leak))
    return "".join(out)


def _leak(report: RunReport, number: int, leak: Leak) -> str:
    f = leak.finding
    offender, victim = leak.offender, leak.victim
    left = ["<h4>Response that leaked: " + escape(f.request_id or "?") + "</h4>"]
    if offender is not None:
        left.append(_request_facts(report, offender, leak.faults_active))
        spans = _spans_at(offender.response_text, leak.marker, leak.offset)
        left.append(f"<pre>{highlight(offender.response_text, spans)}</pre>")
    else:
        left.append(
            f"<p class='muted'>Request not fetched; the oracle's excerpt:</p><pre>{highlight(leak.excerpt, _spans_at(leak.excerpt, leak.marker, None))}</pre>"
        )
    right = ["<h4>Victim: " + escape(f.victim_request_id or "not journaled") + " — its prompt</h4>"]
    if victim is not None:
        right.append(_request_facts(report, victim, leak.victim_faults_active))
        if victim.prompt:
            right.append(f"<pre>{highlight(victim.prompt, _victim_spans(victim, leak.marker))}</pre>")
        else:
            right.append(
                f"<p class='muted'>Prompt not kept ({victim.prompt_chars:,} characters). Its markers: "
                f"<code>{escape(', '.join(victim.markers))}</code></p>"
            )
    else:
        right.append(
            "<p class='muted'>The marker names no journaled request (a fragment too short to name it, "
            "or a request the journal did not record).</p>"
        )
    windows = ", ".join(leak.faults_active) or "none"
    return (
        f'<div class="leak" id="leak-{number}"><h3>Leak {number}: {escape(f.summary)}</h3>'
        f"<p>marker <code>{escape(leak.marker)}</code> ({escape(leak.kind or '?')}) · faults active at send: "
        f"<b>{escape(windows)}</b> · window: {escape(f.window or 'none')}</p>"
        f'<div class="side"><div>{"".join(left)}</div><div>{"".join(right)}</div></div></div>'
    )


def _request_facts(report: RunReport, r: RequestRecord, windows: Sequence[str]) -> str:
    sent = report.offset(r.t_send)
    rows = [
        ("phase / user", f"{r.phase or '?'} / {r.user_kind or '?'}"),
        ("endpoint", f"{r.endpoint}{' (stream)' if r.stream else ''}"),
        ("sent", f"{format_seconds(round(sent, 2)) if sent is not None else '—'} ({when(r.t_send)})"),
        (
            "status / outcome",
            f"{r.status if r.status is not None else '—'} / {r.outcome.value}"
            + (f" ({r.error_class})" if r.error_class else ""),
        ),
        (
            "finish / tokens",
            f"{r.finish_reason or '—'} / {r.completion_tokens if r.completion_tokens is not None else '—'}",
        ),
        ("faults active", ", ".join(windows) or "none"),
    ]
    return kv_table(rows)


def _spans_at(text: str, marker: str, offset: int | None) -> list[tuple[int, int]]:
    if not marker:
        return []
    if offset is not None and text[offset : offset + len(marker)] == marker:
        return [(offset, offset + len(marker))]
    return _find_all(text, marker)


def _victim_spans(victim: RequestRecord, leaked: str) -> list[tuple[int, int]]:
    """Where the victim's prompt holds what leaked: the leaked text itself, else its whole markers."""
    spans = _find_all(victim.prompt, leaked) if leaked else []
    if not spans:
        for marker in victim.markers:
            spans += _find_all(victim.prompt, marker)
    return sorted(spans)


def _find_all(text: str, needle: str) -> list[tuple[int, int]]:
    spans, start = [], text.find(needle)
    while needle and start >= 0:
        spans.append((start, start + len(needle)))
        start = text.find(needle, start + len(needle))
    return spans


def highlight(text: str, spans: Sequence[tuple[int, int]], clip: int = CLIP_CHARS) -> str:
    """Escaped text with each span in <mark>, clipped to `clip` characters around the spans."""
    if spans:
        lo, hi = max(0, spans[0][0] - clip), min(len(text), spans[-1][1] + clip)
    else:
        lo, hi = 0, min(len(text), 2 * clip)
    out, pos = ["…" if lo > 0 else ""], lo
    for start, end in spans:
        if start < pos:
            continue
        out.append(escape(text[pos:start]))
        out.append(f"<mark>{escape(text[start:end])}</mark>")
        pos = end
    out.append(escape(text[pos:hi]))
    out.append("…" if hi < len(text) else "")
    return "".join(out) or '<span class="muted">(empty)</span>'


# --------------------------------------------------------------------------------- plots ----


def _plots(report: RunReport) -> str:
    legend = (
        '<p class="muted">Time is seconds since the run started. Red bands: confirmed fault windows; '
        "hatched grey: faults never confirmed; dashed lines: load start/end and drain end.</p>"
    )
    return '<h2 id="plots">Plots</h2>' + legend + "".join(all_plots(report))


# -------------------------------------------------------------------------------- faults ----


def _faults(report: RunReport) -> str:
    out = ['<h2 id="faults">Faults</h2>']
    if not report.faults:
        out.append('<p class="muted">No fault window in the journal.</p>')
    rows = []
    for f in report.faults:
        w = report.traffic.per_window.get(f.label, LatencyStats())
        start, end = report.offset(f.start), report.offset(f.end)
        confirmed = (
            '<span class="good">confirmed</span>'
            if f.confirmed
            else '<span class="bad">NOT confirmed</span>'
            if f.confirmed is False
            else '<span class="warn">no confirm step</span>'
        )
        healed = (
            '<span class="good">healed</span>'
            if f.end is not None and f.healed
            else '<span class="bad">heal failed</span>'
            if f.end is not None
            else '<span class="bad">NOT healed</span>'
        )
        audit = (
            "—"
            if f.audit_clean is None
            else '<span class="good">clean</span>'
            if f.audit_clean
            else '<span class="bad">left: ' + escape("; ".join(f.leftovers)) + "</span>"
        )
        rows.append(
            (
                f"<b>{escape(f.label)}</b>",
                f"<span class='mono'>{escape(compact_json(f.params))}</span>",
                escape(format_seconds(round(start, 1)) if start is not None else "never injected"),
                escape(format_seconds(round(end, 1)) if end is not None else "—"),
                escape(secs(f.duration_s)),
                f"{confirmed}<br><span class='muted'>{escape(f.confirm_evidence)}</span>",
                f"<span class='muted'>{escape(f.provocation or '—')}</span>",
                healed,
                audit,
                escape(f.error or ""),
                f"{w.counts.total:,}",
                pct(w.error_rate),
                ms(w.ttft.p50),
                ms(w.ttft.p99),
            )
        )
    if rows:
        out.append(
            table(
                (
                    "window",
                    "params",
                    "start",
                    "end",
                    "length",
                    "confirmation",
                    "provocation",
                    "heal",
                    "audit",
                    "error",
                    "requests",
                    "not answered",
                    "TTFT p50 ms",
                    "TTFT p99 ms",
                ),
                rows,
                numeric=(10, 11, 12, 13),
            )
        )
    planned = report.meta.get("windows_planned")
    if isinstance(planned, list) and len(planned) > len(report.faults):
        out.append(
            f'<p class="warn">{len(planned)} window(s) were planned, {len(report.faults)} reached the journal.</p>'
        )
    return "".join(out)


# ------------------------------------------------------------------------------- oracles ----


def _oracles(report: RunReport) -> str:
    out = ['<h2 id="oracles">Oracles</h2>']
    if not report.oracles:
        out.append('<p class="warn">No oracle result in the journal.</p>')
    for o in report.oracles:
        out.append(
            f'<h3 id="oracle-{escape(o.name)}">{escape(o.name)} {badge(o.verdict.value)} '
            f'<span class="muted">checked {o.checked:,}, {len(o.findings):,} finding(s)</span></h3>'
        )
        if o.notes:
            out.append("<ul>" + "".join(f"<li class='muted'>{escape(n)}</li>" for n in o.notes) + "</ul>")
        if o.findings:
            out.append(_findings(o.findings))
    if report.gates:
        out.append('<h3 id="gates">Run gates</h3>' + _findings(report.gates))
    return "".join(out)


def _findings(findings: Sequence[Finding]) -> str:
    shown = sorted(findings, key=lambda f: {Verdict.FAIL: 0, Verdict.INCONCLUSIVE: 1, Verdict.PASS: 2}[f.verdict])
    rows = [
        (
            badge(f.verdict.value),
            escape(f.summary),
            f"<code>{escape(f.request_id or '')}</code>",
            f"<code>{escape(f.victim_request_id or '')}</code>",
            escape(f.window or "—"),
        )
        for f in shown[:MAX_FINDINGS_SHOWN]
    ]
    more = (
        f"<p class='muted'>{len(findings) - MAX_FINDINGS_SHOWN:,} more in report.json.</p>"
        if len(findings) > MAX_FINDINGS_SHOWN
        else ""
    )
    return table(("verdict", "finding", "request", "victim", "window"), rows) + more


# ------------------------------------------------------------------------------- traffic ----


def _traffic(report: RunReport) -> str:
    t = report.traffic
    out = ['<h2 id="traffic">Traffic</h2>']
    if t.counts.total == 0:
        out.append('<p class="warn">The journal holds no request.</p>')
    lat_rows = [("all but baseline", t.overall), ("outside faults", t.outside_faults), ("under faults", t.under_faults)]
    lat_rows += [(f.label, t.per_window.get(f.label, LatencyStats())) for f in report.faults if f.start is not None]
    out.append(
        "<h3>Latency (ms) and errors by span</h3>"
        + table(
            (
                "span",
                "requests",
                "not answered",
                "TTFT p50",
                "TTFT p90",
                "TTFT p99",
                "ITL p50",
                "ITL p99",
                "E2E p50",
                "E2E p99",
            ),
            [
                (
                    escape(name),
                    f"{s.counts.total:,}",
                    pct(s.error_rate),
                    ms(s.ttft.p50),
                    ms(s.ttft.p90),
                    ms(s.ttft.p99),
                    ms(s.itl.p50),
                    ms(s.itl.p99),
                    ms(s.e2e.p50),
                    ms(s.e2e.p99),
                )
                for name, s in lat_rows
            ],
            numeric=tuple(range(1, 10)),
        )
    )
    counts = (
        [("all", t.counts)]
        + [(f"phase {k}", v) for k, v in t.by_phase.items()]
        + [(f"user {k}", v) for k, v in t.by_user_kind.items()]
    )
    out.append(
        "<h3>Outcomes</h3>"
        + table(
            ("requests", "total", "ok", "fail", "info"),
            [(escape(k), f"{c.total:,}", f"{c.ok:,}", f"{c.fail:,}", f"{c.info:,}") for k, c in counts],
            numeric=(1, 2, 3, 4),
        )
    )
    e = report.endings
    out.append(
        "<h3>Endings</h3><p>How each request of the load ended, read for a release decision "
        "(the baseline aside): <em>as intended</em> is an over-length prompt refused with a 4xx or an "
        "abort that ended as one (whether each refusal was the right one is the status oracle's "
        "verdict); <em>under a fault</em> is any other ending of a request sent while a fault was "
        "active or just after its heal; <em>unexplained</em> is the rest, worth reading one by one.</p>"
        + table(
            ("answered", "as intended", "under a fault", "unexplained", "unexplained by error class"),
            [
                (
                    f"{e.answered:,}",
                    f"{e.as_intended:,}",
                    f"{e.under_fault:,}",
                    f"{e.unexplained:,}",
                    escape(", ".join(f"{k} {n:,}" for k, n in e.unexplained_error_classes) or "—"),
                )
            ],
            numeric=(0, 1, 2, 3),
        )
    )
    if t.error_classes:
        out.append(
            "<h3>Error classes</h3>"
            + table(
                ("error class", "whole run", "under faults"),
                [
                    (f"<code>{escape(k)}</code>", f"{v:,}", f"{t.error_classes_under_faults.get(k, 0):,}")
                    for k, v in t.error_classes.items()
                ],
                numeric=(1, 2),
            )
        )
    recorded = report.run_verdict.requests
    if recorded and recorded.get("total") not in (None, t.counts.total):
        out.append(
            f'<p class="warn">The verdict counted {recorded.get("total")} request(s); the journal holds {t.counts.total}.</p>'
        )
    return "".join(out)


# --------------------------------------------------------------------------- environment ----


def _environment(report: RunReport) -> str:
    env, target = report.environment, report.target
    rows: list[tuple[str, str]] = [
        ("pdchaos", str(env.get("pdchaos", "—"))),
        ("seed", "—" if report.seed is None else str(report.seed)),
        ("run prefix", str(report.meta.get("run_prefix", "—"))),
        ("target", f"{target.get('kind', '—')} · router {target.get('router_url', '—')}"),
        (
            "workers",
            ", ".join(f"{w.get('role')}: {w.get('url')}" for w in target.get("workers") or [] if isinstance(w, dict))
            or "—",
        ),
        ("placement", ", ".join(f"{role}: {where}" for role, where in (target.get("placement") or {}).items()) or "—"),
        ("router", _versions(env.get("router"))),
        ("Mooncake", str(env.get("mooncake", "—"))),
        ("GPUs", report.gpu_summary),
        ("CPU", _cpu(env.get("cpu"))),
        ("Python / platform", f"{env.get('python', '—')} / {env.get('platform', '—')}"),
        ("Ray / Locust", f"{env.get('ray') or '—'} / {env.get('locust') or '—'}"),
        ("started / ended", f"{when(report.started_at)} / {when(report.ended_at)}"),
    ]
    out = ['<h2 id="environment">Environment</h2>']
    if not env:
        out.append('<p class="warn">No environment fingerprint in the journal.</p>')
    out.append(kv_table(rows))
    pools = [c for c in env.get("pool_check") or [] if isinstance(c, Mapping)]
    if pools:
        out.append(
            "<h3>KV pool vs memory fraction (per role)</h3>"
            + table(
                (
                    "role",
                    "status",
                    "GPUs",
                    "fraction",
                    "expected KV GiB",
                    "reported KV GiB",
                    "reported pool tokens",
                    "why",
                ),
                [
                    tuple(
                        escape(str(c.get(k) if c.get(k) is not None else "—"))
                        for k in (
                            "role",
                            "status",
                            "gpu_ids",
                            "mem_fraction_static",
                            "expected_kv_gib",
                            "reported_kv_gib",
                            "reported_pool_tokens",
                            "reason",
                        )
                    )
                    for c in pools
                ],
            )
        )
    engine = env.get("engine")
    if isinstance(engine, Mapping) and engine:
        keys = sorted(
            {k for flags in engine.values() if isinstance(flags, Mapping) for k in flags},
            key=lambda k: (k != "version", k),
        )
        out.append(
            "<h3>Engine (per role)</h3>"
            + table(
                ("flag", *engine.keys()),
                [
                    (
                        escape(k),
                        *(
                            escape(str(flags.get(k, "—"))) if isinstance(flags, Mapping) else "—"
                            for flags in engine.values()
                        ),
                    )
                    for k in keys
                ],
            )
        )
    return "".join(out)


def _versions(value: Any) -> str:
    if isinstance(value, Mapping):
        return ", ".join(f"{k} {v or 'not installed'}" for k, v in value.items()) or "—"
    return "—" if value is None else str(value)


def _cpu(value: Any) -> str:
    if isinstance(value, Mapping):
        return f"{value.get('model', '?')} ({value.get('cores', '?')} cores)"
    return "—" if value is None else str(value)


# ------------------------------------------------------------------------------ campaign ----


def _campaign(report: RunReport) -> str:
    text = report.meta.get("campaign_yaml")
    out = [
        '<h2 id="campaign">Campaign</h2>',
        "<p><code>reproduce.yaml</code> next to this report replays this run (same campaign, same seed).</p>",
    ]
    if isinstance(text, str) and text.strip():
        out.append(f"<details><summary>campaign as given</summary><pre>{escape(text)}</pre></details>")
    elif report.meta.get("campaign") is None:
        out.append('<p class="warn">No campaign in the journal.</p>')
    return "".join(out)


def _problems(report: RunReport) -> str:
    if not report.problems:
        return ""
    return (
        '<h2 id="problems">Journal problems</h2><ul>'
        + "".join(f"<li class='warn'>{escape(p)}</li>" for p in report.problems)
        + "</ul>"
    )
