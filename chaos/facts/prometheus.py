"""A parser of the Prometheus (and OpenMetrics) text exposition format: `parse_prometheus_text`,
`find_samples`."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field


class PrometheusParseError(ValueError):
    """A line of Prometheus text that is not a valid sample."""


@dataclass(frozen=True)
class Sample:
    """One sample: metric name, labels and value (NaN and +/-Inf kept as floats).

    ``timestamp`` is the optional trailing timestamp as written (milliseconds in the Prometheus
    format, seconds in OpenMetrics).
    """

    name: str
    labels: dict[str, str] = field(default_factory=dict, hash=False)
    value: float = math.nan
    timestamp: float | None = None

    def label(self, key: str, default: str | None = None) -> str | None:
        return self.labels.get(key, default)


_METRIC_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
_NUMBER = re.compile(
    r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
    r"|[Ii][Nn][Ff](?:[Ii][Nn][Ii][Tt][Yy])?|[Nn][Aa][Nn])"
)


def _skip_spaces(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t":
        pos += 1
    return pos


def _read_quoted(text: str, pos: int) -> tuple[str, int]:
    """Read a double-quoted string starting at ``text[pos] == '"'``; return (value, next pos)."""
    out: list[str] = []
    pos += 1
    while pos < len(text):
        char = text[pos]
        if char == "\\" and pos + 1 < len(text):
            nxt = text[pos + 1]
            out.append(_ESCAPES.get(nxt, "\\" + nxt))
            pos += 2
            continue
        if char == '"':
            return "".join(out), pos + 1
        out.append(char)
        pos += 1
    raise PrometheusParseError("unterminated quoted string")


def _parse_number(token: str) -> float:
    if not _NUMBER.fullmatch(token):
        raise PrometheusParseError(f"not a number: {token!r}")
    return float(token)


def _parse_sample_line(line: str) -> Sample:
    pos = 0
    name: str | None = None
    match = _METRIC_NAME.match(line)
    if match is not None:
        name, pos = match.group(0), match.end()
    labels: dict[str, str] = {}
    brace = _skip_spaces(line, pos)
    if brace < len(line) and line[brace] == "{":
        pos = brace + 1
        while True:
            pos = _skip_spaces(line, pos)
            if pos >= len(line):
                raise PrometheusParseError("unterminated label set")
            if line[pos] == "}":
                pos += 1
                break
            if line[pos] == '"':
                key, pos = _read_quoted(line, pos)
                quoted_key = True
            else:
                key_match = _LABEL_NAME.match(line, pos)
                if key_match is None:
                    raise PrometheusParseError(f"bad label name at column {pos + 1}")
                key, pos = key_match.group(0), key_match.end()
                quoted_key = False
            pos = _skip_spaces(line, pos)
            if pos < len(line) and line[pos] == "=":
                pos = _skip_spaces(line, pos + 1)
                if pos >= len(line) or line[pos] != '"':
                    raise PrometheusParseError(f"label {key!r} has no quoted value")
                value, pos = _read_quoted(line, pos)
                if key in labels:
                    raise PrometheusParseError(f"duplicate label {key!r}")
                labels[key] = value
            elif quoted_key and name is None:
                name = key  # OpenMetrics 2 / UTF-8 names: {"metric.name", label="v"}
            else:
                raise PrometheusParseError(f"label {key!r} has no value")
            pos = _skip_spaces(line, pos)
            if pos < len(line) and line[pos] == ",":
                pos += 1
            elif pos < len(line) and line[pos] == "}":
                continue
            else:
                raise PrometheusParseError(f"expected ',' or '}}' at column {pos + 1}")
    if not name:
        raise PrometheusParseError("no metric name")
    rest = line[pos:]
    if rest and rest[0] not in " \t":
        raise PrometheusParseError(f"unexpected {rest[0]!r} after metric name")
    rest = rest.split("#", 1)[0]  # an OpenMetrics exemplar follows '#'
    parts = rest.split()
    if not parts or len(parts) > 2:
        raise PrometheusParseError("expected a value and an optional timestamp")
    number = _parse_number(parts[0])
    timestamp = _parse_number(parts[1]) if len(parts) == 2 else None
    return Sample(name=name, labels=labels, value=number, timestamp=timestamp)


def parse_prometheus_text(text: str, *, strict: bool = False) -> list[Sample]:
    """Samples of a Prometheus (or OpenMetrics) text exposition, in order.

    Comments, ``# HELP``/``# TYPE``/``# EOF`` and blank lines are skipped. Label values may hold
    escaped quotes, backslashes and newlines (``\\"``, ``\\\\``, ``\\n``) and any of ``{},=#``.
    Values ``NaN``, ``+Inf``, ``-Inf`` are kept as floats. Exemplars are dropped. A malformed line
    is skipped, or raises `PrometheusParseError` naming its line number when ``strict``.
    """
    samples: list[Sample] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            samples.append(_parse_sample_line(line))
        except PrometheusParseError as exc:
            if strict:
                raise PrometheusParseError(f"line {lineno}: {exc}: {raw!r}") from None
    return samples


def find_samples(samples: Iterable[Sample], name: str, **labels: str) -> list[Sample]:
    """Samples named ``name`` whose labels include every given ``label=value``."""
    return [
        sample
        for sample in samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]
