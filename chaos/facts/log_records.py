"""SGLang log records: a log line taken apart into timestamp, rank prefix and message.

Log format (SGLang ``configure_logger``): ``[%(asctime)s{prefix}] %(message)s`` with the date format
``%Y-%m-%d %H:%M:%S``. The scheduler's prefix names its ranks, in this order and each only when that
dimension is > 1 (DP only when DP is on): `` DP{dp}``, `` PP{pp}``, `` ATTN_CP{cp}``,
`` MOE_DP{r}``, `` TP{tp}``, `` EP{ep}``. So ``[2026-08-16 10:00:00 DP0 TP1]``,
``[2026-08-16 10:00:00 TP3 EP3]``, and ``[2026-08-16 10:00:00]`` both for the main process and
for the only scheduler of a TP=1 server. Logs in the wild add ANSI colours, a collector's own
timestamp or pod name before the bracket, and tqdm progress bars joined to a line by carriage
returns; all of those are tolerated.
A line with no bracket header is still read, with no timestamp and the empty rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

# CSI sequences (colours, cursor moves), OSC sequences (titles, links) and lone two-byte escapes.
_ANSI = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI ... final byte
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC ... BEL or ST
    r"|\x1b[@-Z\\-_]"  # two-byte escapes
    r"|\x9b[0-?]*[ -/]*[@-~]"  # 8-bit CSI
)

_HEADER = re.compile(
    r"\[(?P<ts>\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d{1,9})?)"
    r"(?P<tags>(?:[ \t]+[A-Za-z][A-Za-z_]*\d*)*)[ \t]*\][ \t]?"
)
_TAG = re.compile(r"([A-Za-z][A-Za-z_]*?)(\d*)")


def strip_ansi(text: str) -> str:
    """Remove ANSI escape sequences (colours, cursor moves, OSC titles) from text."""
    return _ANSI.sub("", text)


@dataclass(frozen=True)
class LogLine:
    """One log record: where it came from and what it says, with the header taken apart.

    ``rank`` is the rank prefix as written (``"DP0 TP1"``, ``"TP3 EP3"``) or ``""`` when the line
    has none (the main process, or the scheduler of a TP=1 server, or a line with no header).
    """

    lineno: int
    timestamp: str | None
    rank: str
    message: str

    @property
    def rank_parts(self) -> dict[str, int | None]:
        """The rank prefix as a mapping, e.g. ``{"DP": 0, "TP": 1}``."""
        return parse_rank(self.rank)


def parse_rank(rank: str) -> dict[str, int | None]:
    """``"DP0 TP1 EP1"`` -> ``{"DP": 0, "TP": 1, "EP": 1}``; a tag without a number maps to None."""
    parts: dict[str, int | None] = {}
    for token in rank.split():
        match = _TAG.fullmatch(token)
        if match is None:
            continue
        name, number = match.group(1).upper(), match.group(2)
        parts[name] = int(number) if number else None
    return parts


def split_log_line(text: str, lineno: int = 0) -> LogLine:
    """Split one log record into timestamp, rank prefix and message (ANSI codes removed).

    The bracket header is searched for anywhere in the line, so a collector's own prefix before it
    (a Docker timestamp, ``pod/name |``) is skipped. A line without a header keeps its whole text
    as the message.
    """
    clean = strip_ansi(text).rstrip("\r\n")
    match = _HEADER.search(clean)
    if match is None:
        return LogLine(lineno=lineno, timestamp=None, rank="", message=clean.strip())
    rank = " ".join(match.group("tags").split())
    return LogLine(
        lineno=lineno,
        timestamp=match.group("ts"),
        rank=rank,
        message=clean[match.end() :].strip(),
    )


def iter_log_records(lines: Iterable[str]) -> Iterator[LogLine]:
    """Log records of a stream of physical lines, numbered from 1.

    A physical line holding carriage returns (a tqdm bar redrawn in place, then a log record) is
    split at them; every piece keeps the physical line number.
    """
    for lineno, physical in enumerate(lines, start=1):
        text = strip_ansi(physical.rstrip("\n"))
        for piece in text.split("\r"):
            if piece.strip():
                yield split_log_line(piece, lineno)
