"""Endings (reports/outcomes.py): every request of the load in exactly one class, each class pinned
by the requests that must land in it, and the classes in every rendering of a real run."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
import pytest

from reports.columns import OUTCOME_CODES, RequestColumns, read_columns
from reports.outcomes import classify
from reports.render import render_all
from reports.traffic import Span
from tests.run_fixtures import write_pass_run

WINDOW = Span("process_kill#w1", start=100.0, end=110.0)

# (phase, user kind, outcome, status, error class, sent at) -> the class it must land in
CASES = [
    (("load", "canary_chat", "ok", 200, None, 50.0), "answered"),
    (("load", "over_length", "fail", 400, "http_400", 50.0), "as_intended"),  # refused, as the incident's fix demands
    (("load", "over_length", "fail", 413, "http_413", 50.0), "as_intended"),
    (("load", "over_length", "fail", 500, "http_500", 50.0), "unexplained"),  # a 5xx is no refusal
    (("load", "over_length", "fail", 404, "http_404", 50.0), "unexplained"),  # no such route: never looked at
    (("load", "over_length", "ok", 200, None, 50.0), "answered"),  # accepted: the status oracle judges it
    (("load", "aborting", "info", 200, "disconnect", 50.0), "as_intended"),
    (("load", "aborting", "info", -1, "abort", 50.0), "as_intended"),
    (("load", "fault_abort", "fail", 200, "abort", 105.0), "as_intended"),  # client_abort's own, aborted by id
    (("load", "aborting", "fail", 503, "http_503", 50.0), "unexplained"),  # not the abort it asked for
    (("load", "canary_chat", "fail", -1, "connect_error", 105.0), "under_fault"),  # the router was being killed
    (("load", "canary_chat", "fail", 503, "http_503", 115.0), "under_fault"),  # within the aftershock after heal
    (("load", "canary_chat", "fail", 503, "http_503", 125.0), "unexplained"),  # long after the heal
    (("load", "provocation", "info", 502, "http_502", 90.0), "unexplained"),  # ended before the window opened
    (("load", "canary_chat", "fail", 200, "abort", 99.5), "under_fault"),  # sent just before, ended inside
    (("load", "canary_chat", "info", -1, "load_stopped", 150.0), "as_intended"),  # the load's end stopped it
    (("load", "canary_chat", "fail", -1, "read_timeout", 20.0), "unexplained"),
    (("baseline", "probe", "fail", 500, "http_500", 10.0), None),  # the baseline is not traffic
]


# A load prompt of any user that the server refused because it measured the prompt over its limit
# is the refusal a correct server gives: as intended. The message must state both numbers, in order.
SGLANG_OVER = 'HTTP 400: Prefill server error (400 Bad Request): {"error":{"message":"Input length (1021 tokens) exceeds the maximum allowed length (1018 tokens). Use a shorter input'
REFUSALS = [
    (SGLANG_OVER, "as_intended"),  # real SGLang 0.5.23, a prefix_sharing prompt over a shrunken prefill's limit
    ("HTTP 400: The input (2049 tokens) is longer than the model's context length (2048 tokens).", "as_intended"),
    (
        "HTTP 400: The decoder prompt (length 2100) is longer than the maximum model length of 2048. Make sure",
        "as_intended",
    ),
    (
        "HTTP 400: This model's maximum context length is 2048 tokens. However, your prompt contains 2100 input tokens, which",
        "as_intended",
    ),
    (
        "HTTP 400: This model's maximum context length is 2048 tokens. However, your prompt contains 9000 characters (more than 8192 characters",
        "as_intended",
    ),
    (
        "HTTP 400: This model's maximum context length is 2048 tokens. However, you requested 2100 tokens (2092 in",
        "as_intended",
    ),
    (
        "HTTP 400: Input length (900 tokens) exceeds the maximum allowed length (1018 tokens).",
        "unexplained",
    ),  # not over: a false refusal
    ("HTTP 400: invalid sampling parameters", "unexplained"),  # about something else
    (None, "unexplained"),
]


@pytest.mark.parametrize(("refusal", "expected"), REFUSALS, ids=[f"refusal-{i}" for i in range(len(REFUSALS))])
def test_a_prompt_the_server_measured_over_its_limit_is_refused_as_intended(refusal: str | None, expected: str) -> None:
    cols = columns([("load", "prefix_sharing", "fail", 400, "http_400", 50.0)])
    cols.refusal = [refusal]
    assert classify(cols, [WINDOW]).to_json()[expected] == 1
    cols.status = np.array([404], dtype=np.int16)  # a missing route never measured the prompt, whatever it says
    assert classify(cols, [WINDOW]).unexplained == 1


def columns(rows: list[tuple]) -> RequestColumns:
    """Each request takes a second from its send to its end."""
    n = len(rows)
    sent = np.array([r[5] for r in rows], dtype=np.float64)
    return RequestColumns(
        t_send=sent,
        t_first_token=np.full(n, np.nan),
        t_end=sent + 1.0,
        outcome=np.array([OUTCOME_CODES[r[2]] for r in rows], dtype=np.int8),
        status=np.array([r[3] for r in rows], dtype=np.int16),
        phase=[r[0] for r in rows],
        user_kind=[r[1] for r in rows],
        error_class=[r[4] for r in rows],
        token_counts=np.zeros(n, dtype=np.int64),
    )


@pytest.mark.parametrize(("row", "expected"), CASES, ids=[f"{r[1]}-{r[3]}-{r[4]}-{r[5]:g}s" for r, _ in CASES])
def test_each_ending_lands_in_its_class(row: tuple, expected: str | None) -> None:
    classes = classify(columns([row]), [WINDOW]).to_json()
    counts = {k: v for k, v in classes.items() if k not in ("unexplained_error_classes", "unavailable_attempts")}
    assert counts == {k: int(k == expected) for k in counts}


def test_every_request_of_the_load_is_in_exactly_one_class_and_the_unexplained_are_named() -> None:
    rows = [r for r, _ in CASES]
    classes = classify(columns(rows), [WINDOW])
    assert classes.total == sum(1 for r in rows if r[0] != "baseline")
    assert dict(classes.unexplained_error_classes) == {
        "http_503": 2,
        "http_404": 1,
        "http_500": 1,
        "http_502": 1,
        "read_timeout": 1,
    }
    assert classes.unavailable_attempts == 4  # refused by the killed router, or 503: no worker to send to


def test_the_endings_are_in_every_rendering_of_a_run(tmp_path: Path) -> None:
    run = write_pass_run(tmp_path / "run")
    render_all(run)
    endings = json.loads((run / "report.json").read_text())["requests"]["endings"]
    assert set(endings) == {
        "answered",
        "as_intended",
        "under_fault",
        "unexplained",
        "unexplained_error_classes",
        "unavailable_attempts",
    }
    assert endings["answered"] > 0
    summary = (run / "summary.md").read_text()
    assert "**Endings**" in summary
    # The headline does not call refusals the run asked for "fail" (report.json keeps ok/fail/info).
    headline = next(line for line in summary.splitlines() if line.startswith("**Leaks:**"))
    assert "fail" not in headline and "ok " not in headline, headline
    assert "<h3>Endings</h3>" in (run / "report.html").read_text()


def test_a_4xx_refusal_is_read_from_the_journal_and_nothing_else_is(tmp_path: Path) -> None:
    run = write_pass_run(tmp_path / "run")
    render_all(run)
    was = json.loads((run / "report.json").read_text())["requests"]["endings"]
    conn = sqlite3.connect(run / "journal.sqlite")
    try:
        refused = conn.execute("SELECT rowid FROM requests WHERE phase = 'load' AND outcome = 'ok' LIMIT 1").fetchone()[
            0
        ]
        conn.execute(
            "UPDATE requests SET status = 400, outcome = 'fail', error_class = 'http_400', error_detail = ?, "
            "user_kind = 'prefix_sharing' WHERE rowid = ?",
            (SGLANG_OVER, refused),
        )
        conn.commit()
        details = conn.execute("SELECT error_detail FROM requests ORDER BY rowid").fetchall()
    finally:
        conn.close()
    assert sum(1 for (d,) in details if d) > 1  # the 5xx and disconnects carry details too: they are not read
    cols = read_columns(run / "journal.sqlite")
    assert len(cols.refusal) == len(cols)
    assert [r for r in cols.refusal if r is not None] == [SGLANG_OVER]
    before = classify(columns([("load", "prefix_sharing", "fail", 400, "http_400", 50.0)]), [])
    assert before.unexplained == 1  # without the detail, the same refusal would be unexplained
    render_all(run)
    endings = json.loads((run / "report.json").read_text())["requests"]["endings"]
    assert (endings["answered"], endings["as_intended"]) == (was["answered"] - 1, was["as_intended"] + 1), (
        was,
        endings,
    )
