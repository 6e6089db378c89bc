"""What every HTML page of the reports shares: one stylesheet, the verdict colours, escaping and
formatting helpers. No scripts, fonts or URLs from outside: a report is one file that opens
offline, forever, and can be attached to a release ticket.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from html import escape
from typing import Any

# Banner backgrounds (white text on each passes WCAG AA); the screenshot test looks for them.
VERDICT_COLORS = {
    "PASS": "#1a7f37",
    "FAIL": "#cf222e",
    "INCONCLUSIVE": "#9a6700",
    "NOT RUN": "#6e7781",
}

CSS = """
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 -apple-system,"Segoe UI",Helvetica,Arial,"DejaVu Sans",sans-serif;color:#1f2328;background:#f6f8fa}
main{max-width:1400px;margin:0 auto;padding:0 20px 40px}
h1{font-size:40px;margin:0;letter-spacing:1px}
h2{font-size:20px;margin:28px 0 10px;padding-bottom:4px;border-bottom:1px solid #d0d7de}
h3{font-size:16px;margin:18px 0 6px}
code,pre,.mono{font-family:ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:12.5px}
pre{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:10px;white-space:pre-wrap;word-break:break-all;margin:6px 0;max-height:420px;overflow:auto}
.banner{color:#fff;padding:22px 28px;margin:0 0 12px}
.banner .sub{font-size:15px;opacity:.95;margin-top:4px}
.banner ul{margin:10px 0 0;padding-left:20px;font-size:15px}
.banner li{margin:2px 0}
nav{font-size:13px;margin:0 0 8px}
nav a{margin-right:14px;color:#0969da;text-decoration:none}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:10px 0}
.card{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:10px 14px;min-width:150px}
.card .v{font-size:22px;font-weight:600}
.card .k{font-size:12px;color:#57606a}
table{border-collapse:collapse;background:#fff;margin:6px 0;font-size:13px}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.badge{display:inline-block;color:#fff;border-radius:4px;padding:1px 7px;font-size:12px;font-weight:600}
.cell-PASS{background:#dafbe1;color:#116329}
.cell-FAIL{background:#ffebe9;color:#a40e26;font-weight:700}
.cell-INCONCLUSIVE{background:#fff8c5;color:#7d4e00}
.cell-NOTRUN{background:#eaeef2;color:#57606a}
.matrix td.cell{text-align:center;white-space:nowrap}
.matrix td.cell a{color:inherit;text-decoration:none}
.muted{color:#57606a}
.warn{color:#9a6700;font-weight:600}
.bad{color:#cf222e;font-weight:600}
.good{color:#1a7f37;font-weight:600}
.leak{background:#fff;border:2px solid #cf222e;border-radius:8px;padding:12px;margin:12px 0}
.leak h3{margin-top:0;color:#a40e26}
.side{display:grid;grid-template-columns:1fr 1fr;gap:14px}
.side>div{min-width:0}
mark{background:#ff8182;color:#000;font-weight:700;padding:0 1px;border-radius:2px}
.plot{background:#fff;border:1px solid #d0d7de;border-radius:6px;margin:6px 0 10px;display:block}
.plot .tick{font-size:11px;fill:#57606a}
.plot .legend{font-size:12px;fill:#1f2328}
.plot .plot-title{font-size:14px;font-weight:600;fill:#1f2328}
.plot .band-label{font-size:10px;fill:#82071e}
.plot .nodata{font-size:16px;fill:#8c959f}
details summary{cursor:pointer;color:#0969da}
footer{margin-top:30px;font-size:12px;color:#57606a}
"""


def page(title: str, body: str) -> str:
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head><body>{body}</body></html>\n"
    )


def color_of(label: str) -> str:
    return VERDICT_COLORS.get(label, VERDICT_COLORS["NOT RUN"])


def badge(label: str) -> str:
    return f'<span class="badge" style="background:{color_of(label)}">{escape(label)}</span>'


def cell_class(label: str) -> str:
    return "cell-" + label.replace(" ", "")


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], *, cls: str = "", numeric: Sequence[int] = ()) -> str:
    """Cells are HTML already (callers escape); `numeric` columns are right-aligned."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = []
    for row in rows:
        body.append(
            "<tr>"
            + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>" for i, c in enumerate(row))
            + "</tr>"
        )
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def kv_table(rows: Iterable[tuple[str, str]]) -> str:
    """A two-column table of plain-text facts (both sides escaped here)."""
    body = "".join(f'<tr><th scope="row">{escape(k)}</th><td>{escape(v)}</td></tr>' for k, v in rows)
    return f'<table class="kv"><tbody>{body}</tbody></table>'


def when(t: float | None) -> str:
    if t is None:
        return "—"
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def ms(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    value = seconds * 1000.0
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def pct(fraction: float | None) -> str:
    return "—" if fraction is None else f"{fraction * 100:.1f}%"


def secs(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} s"


def compact_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(", ", ": "), default=str)
