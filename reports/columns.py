"""The request columns the plots and latency tables need, read straight into numpy arrays.

`Journal.iter_requests` builds a full `RequestRecord` per row (every column, two JSON decodes);
for 50k requests that alone takes several seconds. The reports need nine columns and every
token time, so they read just those with one query on their own read-only connection, and parse
all token times in one vectorised call. The journal's schema version is checked by
`Journal.open` before this runs, so the column names are the contract's.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

OUTCOME_CODES = {"ok": 0, "fail": 1, "info": 2}
# A 4xx's error detail says why the server refused (reports/outcomes.py reads it); other rows' are not read.
_QUERY = (
    "SELECT t_send, t_first_token, t_end, outcome, status, phase, user_kind, error_class, token_times, "
    "CASE WHEN status BETWEEN 400 AND 499 THEN substr(error_detail, 1, 500) END "
    "FROM requests ORDER BY rowid"
)


def _empty_floats() -> np.ndarray:
    return np.zeros(0, dtype=np.float64)


@dataclass
class RequestColumns:
    """One entry per request, in journal order; NaN where a time is missing."""

    t_send: np.ndarray = field(default_factory=_empty_floats)
    t_first_token: np.ndarray = field(default_factory=_empty_floats)
    t_end: np.ndarray = field(default_factory=_empty_floats)
    outcome: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int8))  # OUTCOME_CODES
    status: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int16))  # HTTP status; -1: none
    phase: list[str | None] = field(default_factory=list)
    user_kind: list[str] = field(default_factory=list)
    error_class: list[str | None] = field(default_factory=list)
    token_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    token_times: np.ndarray = field(default_factory=_empty_floats)  # all requests' token times, concatenated
    refusal: list[str | None] = field(default_factory=list)  # a 4xx's error detail; None otherwise (may be empty)

    def __len__(self) -> int:
        return int(self.t_send.size)


CHUNK_ROWS = 50_000  # rows parsed at a time: a million-request journal never sits in memory as Python rows


def read_columns(journal_file: Path) -> RequestColumns:
    conn = sqlite3.connect(f"{journal_file.resolve().as_uri()}?mode=ro", uri=True, timeout=10.0)
    parts: list[RequestColumns] = []
    shared: dict[str, str] = {}  # phase, user kind and error class repeat: one string object each
    try:
        cursor = conn.execute(_QUERY)
        while rows := cursor.fetchmany(CHUNK_ROWS):
            parts.append(_parse(rows, shared))
    finally:
        conn.close()
    if not parts:
        return RequestColumns()
    return parts[0] if len(parts) == 1 else _concatenate(parts)


def _concatenate(parts: list[RequestColumns]) -> RequestColumns:
    """The chunks as one: arrays concatenated, lists joined, field by field."""
    joined: dict[str, Any] = {}
    for f in fields(RequestColumns):
        values = [getattr(p, f.name) for p in parts]
        joined[f.name] = np.concatenate(values) if isinstance(values[0], np.ndarray) else [x for v in values for x in v]
    return RequestColumns(**joined)


def _parse(rows: list[tuple[Any, ...]], shared: dict[str, str]) -> RequestColumns:
    t_send, first, end, outcome, status, phase, kind, error, tokens, refusal = zip(*rows, strict=True)
    # Token times are JSON lists of floats: strip the brackets, join, and parse once, in C.
    counts = np.fromiter((0 if t == "[]" else t.count(",") + 1 for t in tokens), dtype=np.int64, count=len(rows))
    joined = ",".join(t[1:-1] for t in tokens if t != "[]")
    flat = np.fromstring(joined, dtype=np.float64, sep=",") if joined else _empty_floats()
    if flat.size != int(counts.sum()):
        raise ValueError(f"token_times: {flat.size} numbers parsed where the lists hold {int(counts.sum())}")
    return RequestColumns(
        t_send=_floats(t_send),
        t_first_token=_floats(first),
        t_end=_floats(end),
        outcome=np.fromiter((OUTCOME_CODES.get(o, 2) for o in outcome), dtype=np.int8, count=len(rows)),
        status=np.fromiter((-1 if v is None else v for v in status), dtype=np.int16, count=len(rows)),
        phase=_shared(phase, shared),
        user_kind=_shared(kind, shared),
        error_class=_shared(error, shared),
        token_counts=counts,
        token_times=flat,
        refusal=list(refusal),
    )


def _shared(values: tuple[str | None, ...], shared: dict[str, str]) -> list[Any]:
    return [v if v is None else shared.setdefault(v, v) for v in values]


def _floats(values: tuple[float | None, ...]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)
