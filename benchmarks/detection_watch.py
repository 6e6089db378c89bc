"""Stop a `pdchaos run` of a defect once it has caught it: what costs a run that already FAILed.

A defect the default campaign catches in its first window would otherwise still run the whole
campaign (about four minutes on two cores). `wait_until_caught` waits for the run and, every few
seconds, judges what its journal holds so far with the product's own judge
(chaos/judging/judge.py, the function `pdchaos report` uses on a run that stopped); once one of
the oracles asked for already FAILs there, the run is interrupted with SIGINT, the user's Ctrl-C:
it heals the fault in effect, stops the load and judges and reports what it journaled
(chaos/stop_signals.py). The verdict that counts is that run's own, never this module's look.

Up to the interrupt the run is the campaign's run, so whether and when it catches the defect is
what the whole run would show; what it gives up is what would have failed later. A run in which
nothing asked for fails runs to its end. Used by the detection matrix (`--stop-at-detection`)
and tests/test_defects.py.
"""

from __future__ import annotations

import sqlite3
import subprocess
import time
from collections.abc import Callable, Set
from pathlib import Path

from chaos.journal import Journal, JournalError
from chaos.judging.judge import judge
from chaos.verdict import Verdict

WATCH_S = 5.0  # between two looks; a look judges the journal so far (about 1.5 s of CPU on a whole default run)


def failing_so_far(run_dir: Path) -> set[str]:
    """The oracles that already FAIL on what a run in progress has journaled (none before its
    journal holds a campaign)."""
    try:
        with Journal.open(run_dir, readonly=True) as journal:
            judgement = judge(journal)
    except (FileNotFoundError, JournalError, sqlite3.Error):  # not made yet, or busy: the next look
        return set()
    return {o.name for o in judgement.oracles if o.verdict is Verdict.FAIL}


def wait_until_caught(
    process: subprocess.Popen[bytes] | subprocess.Popen[str],
    run_dir: Path,
    oracles: Set[str],
    timeout_s: float,
    interrupt: Callable[[], None],
) -> bool:
    """Wait for the run `process` makes in `run_dir`; the first time one of `oracles` FAILs on its
    journal, call `interrupt` (which sends the SIGINT) and go on waiting for the run to end.
    Returns whether it was interrupted so. Raises subprocess.TimeoutExpired after `timeout_s`
    (the caller stops the run)."""
    deadline = time.monotonic() + timeout_s
    interrupted = False
    while True:
        left = deadline - time.monotonic()
        try:
            process.wait(timeout=max(0.0, min(WATCH_S, left)))
            return interrupted
        except subprocess.TimeoutExpired:
            if left <= WATCH_S:
                raise
        if not interrupted and oracles & failing_so_far(run_dir):
            interrupt()
            interrupted = True
