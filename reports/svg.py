"""A tiny inline-SVG line/area plot with shaded fault windows (no plotting library).

Why our own: the report must be one self-contained file with no scripts and no external URLs,
and a release manager's browser must render it years later. Line, area, missing points (a gap
breaks the line), nice ticks, a legend, shaded bands (hatched when the fault was not
confirmed), vertical phase marks, and native tooltips through <title>.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape


@dataclass(frozen=True)
class Series:
    name: str
    color: str
    points: Sequence[tuple[float, float | None]]
    dashed: bool = False
    area: bool = False  # fill down to zero


@dataclass(frozen=True)
class Band:
    start: float
    end: float | None  # None: still open at the right edge (an unhealed fault)
    label: str
    confirmed: bool | None = True


@dataclass(frozen=True)
class Mark:
    x: float
    label: str


def nice_step(span: float, target_ticks: int = 5) -> float:
    """1, 2 or 5 times a power of ten, giving about `target_ticks` ticks over `span`."""
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / target_ticks
    power: float = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * power:
            return factor * power
    return 10 * power


def format_number(value: float) -> str:
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 10_000:
        return f"{value / 1000:.0f}k"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 1:
        return f"{value:.3g}"
    return f"{value:.2g}"


def format_seconds(value: float) -> str:
    """Axis label for a time offset: 45s, 2m30s, 1h05m."""
    sign, value = ("-" if value < 0 else ""), abs(value)
    if value < 120:
        return f"{sign}{value:g}s"
    minutes, seconds = divmod(round(value), 60)
    if minutes < 60:
        return f"{sign}{minutes}m{seconds:02d}s" if seconds else f"{sign}{minutes}m"
    hours, minutes = divmod(minutes, 60)
    return f"{sign}{hours}h{minutes:02d}m"


def _time_step(span: float) -> float:
    for step in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400):
        if span / step <= 10:
            return float(step)
    return nice_step(span, 8)


def line_plot(
    plot_id: str,
    title: str,
    series: Sequence[Series],
    *,
    bands: Sequence[Band] = (),
    marks: Sequence[Mark] = (),
    x_range: tuple[float, float] | None = None,
    y_label: str = "",
    y_min_top: float = 0.0,  # the y axis reaches at least this high (e.g. 1.0 for a rate)
    y_format: Callable[[float], str] = format_number,
    width: int = 1100,
    height: int = 240,
) -> str:
    left, right, top, bottom = 64, 16, 34, 34
    pw, ph = width - left - right, height - top - bottom
    xs = [x for s in series for x, _ in s.points]
    ys = [y for s in series for _, y in s.points if y is not None and math.isfinite(y)]
    if x_range is not None:
        x0, x1 = x_range
    elif xs:
        x0, x1 = min(xs), max(xs)
    else:
        x0, x1 = 0.0, 1.0
    if x1 <= x0:
        x1 = x0 + 1.0
    y_top = max([y_min_top, *ys]) if ys else max(y_min_top, 1.0)
    y_step = nice_step(y_top if y_top > 0 else 1.0)
    y1 = math.ceil(y_top * 1.05 / y_step) * y_step if y_top > 0 else y_step

    def sx(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return top + ph - max(0.0, min(y, y1)) / y1 * ph

    out = [
        f'<svg class="plot" data-plot="{escape(plot_id)}" xmlns="http://www.w3.org/2000/svg" '
        f'viewBox="0 0 {width} {height}" width="100%" role="img" aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
        f'<defs><pattern id="hatch-{escape(plot_id)}" width="8" height="8" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="8" height="8" fill="#eaeef2"/>'
        f'<line x1="0" y1="0" x2="0" y2="8" stroke="#8c959f" stroke-width="3"/></pattern></defs>',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#ffffff" stroke="#d0d7de"/>',
    ]
    out += _bands(bands, x0, x1, sx, top, ph, plot_id)
    # Grid and y ticks.
    tick = 0.0
    while tick <= y1 + y_step / 2:
        y = sy(tick)
        out.append(f'<line x1="{left}" y1="{y:.1f}" x2="{left + pw}" y2="{y:.1f}" stroke="#eaeef2"/>')
        out.append(
            f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">{escape(y_format(tick))}</text>'
        )
        tick += y_step
    x_step = _time_step(x1 - x0)
    tick = math.ceil(x0 / x_step) * x_step
    while tick <= x1 + 1e-9:
        x = sx(tick)
        out.append(f'<line x1="{x:.1f}" y1="{top + ph}" x2="{x:.1f}" y2="{top + ph + 4}" stroke="#57606a"/>')
        out.append(
            f'<text x="{x:.1f}" y="{top + ph + 16}" text-anchor="middle" class="tick">{escape(format_seconds(tick))}</text>'
        )
        tick += x_step
    for mark in marks:
        if x0 <= mark.x <= x1:
            x = sx(mark.x)
            out.append(
                f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + ph}" stroke="#8c959f" stroke-dasharray="2 3">'
                f"<title>{escape(mark.label)} at {escape(format_seconds(mark.x))}</title></line>"
            )
    for s in series:
        out += _series(s, sx, sy, top + ph)
    if not ys:
        out.append(f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" class="nodata">no data</text>')
    out.append(f'<text x="{left}" y="18" class="plot-title">{escape(title)}</text>')
    if y_label:
        out.append(
            f'<text x="14" y="{top + ph / 2}" transform="rotate(-90 14 {top + ph / 2})" text-anchor="middle" '
            f'class="tick">{escape(y_label)}</text>'
        )
    out += _legend(series, left + pw)
    out.append("</svg>")
    return "".join(out)


def _bands(
    bands: Sequence[Band], x0: float, x1: float, sx: Callable[[float], float], top: float, ph: float, plot_id: str
) -> list[str]:
    out = []
    for band in bands:
        start, end = max(band.start, x0), min(x1 if band.end is None else band.end, x1)
        if end < start:
            continue
        a, b = sx(start), max(sx(end), sx(start) + 2)  # a very short window still shows
        fill = "#cf222e" if band.confirmed else f"url(#hatch-{escape(plot_id)})"
        opacity = "0.13" if band.confirmed else "0.55"
        state = "confirmed" if band.confirmed else ("NOT confirmed" if band.confirmed is False else "not confirmed")
        tip = (
            f"{band.label}: {format_seconds(band.start)} to "
            + (format_seconds(band.end) if band.end is not None else "never healed")
            + f", {state}"
        )
        out.append(
            f'<rect class="fault-band" x="{a:.1f}" y="{top}" width="{b - a:.1f}" height="{ph}" fill="{fill}" '
            f'fill-opacity="{opacity}"><title>{escape(tip)}</title></rect>'
        )
        if b - a >= 6 * min(len(band.label), 12):  # narrow bands keep their label in the tooltip only
            out.append(f'<text x="{a + 3:.1f}" y="{top + 12}" class="band-label">{escape(band.label)}</text>')
    return out


def _series(s: Series, sx: Callable[[float], float], sy: Callable[[float], float], base_y: float) -> list[str]:
    segments: list[list[tuple[float, float]]] = [[]]
    for x, y in s.points:
        if y is None or not math.isfinite(y):
            if segments[-1]:
                segments.append([])
        else:
            segments[-1].append((sx(x), sy(y)))
    out = []
    dash = ' stroke-dasharray="6 4"' if s.dashed else ""
    for seg in segments:
        if not seg:
            continue
        if len(seg) == 1:
            x, y = seg[0]
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{s.color}"/>')
            continue
        path = " ".join(f"{x:.1f},{y:.1f}" for x, y in seg)
        if s.area:
            out.append(
                f'<polygon points="{seg[0][0]:.1f},{base_y:.1f} {path} {seg[-1][0]:.1f},{base_y:.1f}" '
                f'fill="{s.color}" fill-opacity="0.18" stroke="none"/>'
            )
        out.append(
            f'<polyline points="{path}" fill="none" stroke="{s.color}" stroke-width="2"{dash} '
            f'stroke-linejoin="round"><title>{escape(s.name)}</title></polyline>'
        )
    return out


def _legend(series: Sequence[Series], right_x: float) -> list[str]:
    out = []
    x = right_x
    for s in reversed(series):
        label_w = 7 * len(s.name) + 30
        x -= label_w
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        out.append(f'<line x1="{x:.0f}" y1="14" x2="{x + 20:.0f}" y2="14" stroke="{s.color}" stroke-width="3"{dash}/>')
        out.append(f'<text x="{x + 24:.0f}" y="18" class="legend">{escape(s.name)}</text>')
    return out
