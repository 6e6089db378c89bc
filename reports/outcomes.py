"""What each request's ending means to a reader: answered, ended as intended, hit by a fault, or
unexplained.

A request's outcome (ok / fail / info, Jepsen's) says whether it is known to have succeeded. A
release manager needs another cut: a PASS run of the default campaign ends about a third of its
requests "fail", most of them over-length prompts refused with 400 (what the incident's fix
demands) and connection errors while the router was killed on purpose. Read as errors, they make
the PASS look wrong, or teach the reader to skip the column. So every request falls in one class:

* answered: outcome ok.
* as intended: the ending its sender asked for. An over-length prompt (the `over_length` user,
  the over-length burst) refused with a 4xx about the prompt (not a 404 for a missing route or a
  401: chaos/http_status.py); an aborting client's request (the `aborting` user, `client_abort`'s
  own requests) ended as an abort or a disconnect; a request the load stopped at its end. And
  any user's prompt the server refused with a 4xx whose message states the prompt's size at or
  over a limit it names: the server measured it and found it too long (a `prefix_sharing` prompt
  over the input limit of a prefill whose pool was shrunk).
* under a fault: any other ending, of a request in flight while a fault window was open or within
  `AFTERSHOCK_S` after its heal (sent before the window closed, ended after it opened: the
  exposure the oracles use, chaos/windows.py).
* unexplained: the rest. On a healthy target under a well-placed schedule this is about zero;
  each one is worth reading.

Only the load's phases count (the baseline's isolated references are not traffic), as in
reports/traffic.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from chaos.http_status import rejects_the_prompt
from chaos.refusal import read_refusal
from chaos.windows import AFTERSHOCK_S
from loadprofiles.recorder import UNAVAILABLE_ENDINGS
from reports.columns import OUTCOME_CODES, RequestColumns
from reports.traffic import BASELINE_PHASE, Span

OVER_LENGTH_KINDS = frozenset({"over_length"})  # the load's user and the burst's prompts (faults/traffic.py)
ABORTING_KINDS = frozenset({"aborting", "fault_abort"})
ABORT_ENDINGS = frozenset({"abort", "disconnect"})
SUITE_ENDINGS = frozenset({"load_stopped"})  # the load's end stopped it in flight (loadprofiles/recorder.py)


@dataclass(frozen=True)
class OutcomeClasses:
    answered: int = 0
    as_intended: int = 0
    under_fault: int = 0
    unexplained: int = 0
    unexplained_error_classes: tuple[tuple[str, int], ...] = ()  # the most frequent first
    # Attempts an unavailable endpoint absorbed (connection refused or 503, whatever the class
    # above): the users back off on them (loadprofiles/users.py), a few per user per second.
    unavailable_attempts: int = 0

    @property
    def total(self) -> int:
        return self.answered + self.as_intended + self.under_fault + self.unexplained

    def to_json(self) -> dict[str, object]:
        return {
            "answered": self.answered,
            "as_intended": self.as_intended,
            "under_fault": self.under_fault,
            "unexplained": self.unexplained,
            "unexplained_error_classes": dict(self.unexplained_error_classes),
            "unavailable_attempts": self.unavailable_attempts,
        }


def as_intended(user_kind: str, status: int, error_class: str | None, refusal: str | None = None) -> bool:
    """Whether a request that did not succeed ended the way its sender meant it to, or the way a
    correct server must end it (a prompt it measured over its limit, refused)."""
    if error_class in SUITE_ENDINGS:
        return True
    if user_kind in OVER_LENGTH_KINDS:
        return rejects_the_prompt(status)  # a 404 or 401 never looked at the prompt
    if user_kind in ABORTING_KINDS:
        return error_class in ABORT_ENDINGS
    return rejects_the_prompt(status) and read_refusal(refusal).over_limit


def classify(cols: RequestColumns, spans: Sequence[Span], aftershock_s: float = AFTERSHOCK_S) -> OutcomeClasses:
    n = len(cols)
    if n == 0:
        return OutcomeClasses()
    loaded = np.fromiter((p != BASELINE_PHASE for p in cols.phase), dtype=bool, count=n)
    ok = cols.outcome == OUTCOME_CODES["ok"]
    intended = np.zeros(n, dtype=bool)
    for i in np.flatnonzero(~ok):  # only what did not succeed needs a reason: the fewer rows
        refusal = cols.refusal[i] if cols.refusal else None
        intended[i] = as_intended(cols.user_kind[i], int(cols.status[i]), cols.error_class[i], refusal)
    exposed = np.zeros(n, dtype=bool)
    sent = ~np.isnan(cols.t_send)
    last = np.where(np.isnan(cols.t_end), cols.t_send, cols.t_end)  # no end recorded: as long as we know
    for span in spans:
        inside = sent & (last >= span.start)
        if span.end is not None:
            inside &= cols.t_send <= span.end + aftershock_s
        exposed |= inside
    under = ~ok & ~intended & exposed
    rest = loaded & ~ok & ~intended & ~exposed
    counts: dict[str, int] = {}
    for error, flagged in zip(cols.error_class, rest, strict=True):
        if flagged:
            counts[error or "none"] = counts.get(error or "none", 0) + 1
    return OutcomeClasses(
        answered=int((loaded & ok).sum()),
        as_intended=int((loaded & intended).sum()),
        under_fault=int((loaded & under).sum()),
        unexplained=int(rest.sum()),
        unexplained_error_classes=tuple(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        unavailable_attempts=sum(
            1 for error, load in zip(cols.error_class, loaded, strict=True) if load and error in UNAVAILABLE_ENDINGS
        ),
    )
