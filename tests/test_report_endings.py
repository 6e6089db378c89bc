"""Endings (reports/outcomes.py): every request of the load in exactly one class, each class pinned
by the requests that must land in it, and the classes in every rendering of a real run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from reports.columns import OUTCOME_CODES, RequestColumns
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


def columns(rows: list[tuple]) -> RequestColumns:
    """Each request takes a second from its send to its end."""
    n = len(rows)
    sent = np.array([r[5] for r in rows], dtype=np.float64)
    return RequestColumns(
        t_send=sent, t_first_token=np.full(n, np.nan), t_end=sent + 1.0,
        outcome=np.array([OUTCOME_CODES[r[2]] for r in rows], dtype=np.int8), status=np.array([r[3] for r in rows], dtype=np.int16),
        phase=[r[0] for r in rows], user_kind=[r[1] for r in rows], error_class=[r[4] for r in rows],
        token_counts=np.zeros(n, dtype=np.int64))


@pytest.mark.parametrize(("row", "expected"), CASES, ids=[f"{r[1]}-{r[3]}-{r[4]}-{r[5]:g}s" for r, _ in CASES])
def test_each_ending_lands_in_its_class(row: tuple, expected: str | None) -> None:
    classes = classify(columns([row]), [WINDOW]).to_json()
    counts = {k: v for k, v in classes.items() if k not in ("unexplained_error_classes", "unavailable_attempts")}
    assert counts == {k: int(k == expected) for k in counts}


def test_every_request_of_the_load_is_in_exactly_one_class_and_the_unexplained_are_named() -> None:
    rows = [r for r, _ in CASES]
    classes = classify(columns(rows), [WINDOW])
    assert classes.total == sum(1 for r in rows if r[0] != "baseline")
    assert dict(classes.unexplained_error_classes) == {"http_503": 2, "http_404": 1, "http_500": 1, "http_502": 1,
                                                       "read_timeout": 1}
    assert classes.unavailable_attempts == 4  # refused by the killed router, or 503: no worker to send to


def test_the_endings_are_in_every_rendering_of_a_run(tmp_path: Path) -> None:
    run = write_pass_run(tmp_path / "run")
    render_all(run)
    endings = json.loads((run / "report.json").read_text())["requests"]["endings"]
    assert set(endings) == {"answered", "as_intended", "under_fault", "unexplained", "unexplained_error_classes",
                            "unavailable_attempts"}
    assert endings["answered"] > 0
    summary = (run / "summary.md").read_text()
    assert "**Endings**" in summary
    # The headline does not call refusals the run asked for "fail" (report.json keeps ok/fail/info).
    headline = next(line for line in summary.splitlines() if line.startswith("**Leaks:**"))
    assert "fail" not in headline and "ok " not in headline, headline
    assert "<h3>Endings</h3>" in (run / "report.html").read_text()
