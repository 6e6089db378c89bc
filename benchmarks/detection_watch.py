"""Stop a `pdchaos run` of a defect once it has caught it: what costs a run that already FAILed.

A defect the default campaign catches in its first window would otherwise still run the whole
campaign (about four minutes on two cores). `wait_until_caught` waits for the run and, every few
seconds, judges what its journal holds so far with the product's own judge
(chaos/judging/judge.py, the function `pdchaos report` uses on a run that stopped); once one of
the oracles asked for already FAILs there, the run is interrupted with SIGINT, the user's Ctrl-C:
it heals the fault in effect, stops the load and judges and reports what it journaled
(chaos/stop_signals.py). The verdict that counts is that run's own, never this module's look.

The first look comes once the load has started, so after the baseline, and never while Ray
starts the load actors (a signal raised inside Ray's own calls can be swallowed there, and the
run then goes on to its end). Two oracles judge samples the baseline makes:
the tenant probe's statistical test and the timing oracle's fit. Judged part-way, their
verdict could be revised by the rest of the sample, and stopping at the first look that crosses
would count chance as a detection (optional stopping). After the baseline, every FAIL an oracle
finds stays a FAIL as the journal grows, so up to the interrupt the run is the campaign's run,
and whether and when it catches the defect is what the whole run would show. What it gives up is
what would have failed later. A run in which nothing asked for fails runs to its end.

Each look costs CPU the run shares (about 1.5 s to judge a whole default run's journal). Used
by the detection matrix (`--stop-at-detection`) and tests/test_defects.py.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable, Set
from pathlib import Path

from chaos.journal import Journal
from chaos.judging.judge import judge
from chaos.verdict import Verdict

log = logging.getLogger("pdchaos.detection_watch")

WATCH_S = 5.0  # between two looks; a look judges the journal so far (about 1.5 s of CPU on a whole default run)
HEAL_GRACE_S = 120.0  # a run past its time gets this long after SIGINT to heal and report, then SIGKILL


def failing_so_far(run_dir: Path) -> set[str]:
    """The oracles that already FAIL on what a run in progress has journaled; none before its
    load has started."""
    try:
        with Journal.open(run_dir, readonly=True) as journal:
            if journal.get_meta("load_started_at") is None:
                return set()
            judgement = judge(journal)
    except FileNotFoundError:  # not made yet
        return set()
    except Exception:  # a journal caught mid-write (busy, half a schema), or a judge that broke: the next look
        log.warning("could not judge %s so far; looking again", run_dir, exc_info=True)
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


def stop_past_time(process: subprocess.Popen[bytes] | subprocess.Popen[str], send: Callable[[int], None]) -> int:
    """Stop a run that outlived its time: SIGINT first (it heals and reports what it journaled),
    SIGKILL after HEAL_GRACE_S. `send` delivers a signal (to the driver, or its process group).
    Returns the exit code."""
    send(signal.SIGINT)
    try:
        return process.wait(timeout=HEAL_GRACE_S)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        return process.wait()
