"""Every exit code of `pdchaos`, in one place.

A code means the same in every command; what each command counts as wrong or unproven is in the
per-command table of docs/ci.md. `pdchaos --help`, README.md and docs/ci.md show this table, and
tests/test_exit_codes.py holds them to it.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """A `pdchaos` exit status; `meaning` is its one-line documentation."""

    meaning: str

    def __new__(cls, code: int, meaning: str) -> ExitCode:
        member = int.__new__(cls, code)
        member._value_ = code
        member.meaning = meaning
        return member

    def __str__(self) -> str:  # the number, as IntEnum prints from Python 3.11 on; on 3.10 too
        return int.__repr__(self)

    PASS = 0, "PASS: nothing wrong was found"
    FAIL = 1, "FAIL: something wrong was found (a leak, a regression, a node that fails preflight)"
    USAGE = 2, "usage error: a bad flag, file, run directory or campaign; a target that could not start"
    INCONCLUSIVE = 3, "INCONCLUSIVE: nothing wrong was found, but the evidence is too thin to pass"
    INTERRUPTED = 130, "interrupted (Ctrl-C) before a verdict"


def table() -> str:
    """The codes as `pdchaos --help` prints them: one line each, code and meaning."""
    return "\n".join(f"  {code.value:<5}{code.meaning}" for code in ExitCode)
