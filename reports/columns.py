"""The request columns the plots and latency tables need, read straight into numpy arrays.

`Journal.iter_requests` builds a full `RequestRecord` per row (every column, two JSON decodes);
for 50k requests that alone takes several seconds. The reports need eight columns and every
token time, so they read just those with one query on their own read-only connection, and parse
all token times in one vectorised call. The journal's schema version is checked by
`Journal.open` before this runs, so the column names are the contract's.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

OUTCOME_CODES = {"ok": 0, "fail": 1, "info": 2}
_QUERY = ("SELECT t_send, t_first_token, t_end, outcome, phase, user_kind, error_class, token_times "
          "FROM requests ORDER BY rowid")


def _empty_floats() -> np.ndarray:
    return np.zeros(0, dtype=np.float64)


@dataclass
class RequestColumns:
    """One entry per request, in journal order; NaN where a time is missing."""

    t_send: np.ndarray = field(default_factory=_empty_floats)
    t_first_token: np.ndarray = field(default_factory=_empty_floats)
    t_end: np.ndarray = field(default_factory=_empty_floats)
    outcome: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int8))  # OUTCOME_CODES
    phase: list[str | None] = field(default_factory=list)
    user_kind: list[str] = field(default_factory=list)
    error_class: list[str | None] = field(default_factory=list)
    token_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    token_times: np.ndarray = field(default_factory=_empty_floats)  # all requests' token times, concatenated

    def __len__(self) -> int:
        return int(self.t_send.size)


def read_columns(journal_file: Path) -> RequestColumns:
    conn = sqlite3.connect(f"{journal_file.resolve().as_uri()}?mode=ro", uri=True, timeout=10.0)
    try:
        rows = conn.execute(_QUERY).fetchall()
    finally:
        conn.close()
    if not rows:
        return RequestColumns()
    t_send, first, end, outcome, phase, kind, error, tokens = zip(*rows)
    # Token times are JSON lists of floats: strip the brackets, join, and parse once.
    counts = np.fromiter((0 if t == "[]" else t.count(",") + 1 for t in tokens), dtype=np.int64, count=len(rows))
    joined = ",".join(t[1:-1] for t in tokens if t != "[]")
    flat = np.array(joined.split(","), dtype=np.float64) if joined else _empty_floats()
    return RequestColumns(
        t_send=_floats(t_send), t_first_token=_floats(first), t_end=_floats(end),
        outcome=np.fromiter((OUTCOME_CODES.get(o, 2) for o in outcome), dtype=np.int8, count=len(rows)),
        phase=list(phase), user_kind=list(kind), error_class=list(error), token_counts=counts, token_times=flat,
    )


def _floats(values: tuple[float | None, ...]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)
