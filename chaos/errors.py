"""Errors every layer may raise; the CLI turns them into exit codes without a traceback."""

from __future__ import annotations


class UsageError(Exception):
    """Bad input from the user (a flag, a file, a campaign field). Exit code 2.

    The message names what was wrong and how to fix it.
    """


class TargetError(Exception):
    """The target could not be started, reached or acted on."""
