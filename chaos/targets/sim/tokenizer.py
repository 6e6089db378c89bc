"""A deterministic, reversible toy tokenizer: the same ids in every process, about 4 chars a token.

Text is cut into pieces: a run of ASCII letters or digits (with the one space before it), a run
of other printable ASCII, or one non-ASCII character. Runs are cut into pieces of at most four
characters. A piece of printable ASCII maps to a base-96 number (so ids never depend on what a
process has seen); any other character maps to `UNICODE_BASE + codepoint`. So
`detokenize(tokenize(t)) == t` for every string, and ids are stable across processes and runs.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

PIECE_CHARS = 4
_ASCII_FIRST = 0x20  # space
_ASCII_LAST = 0x7E  # '~'
_RADIX = _ASCII_LAST - _ASCII_FIRST + 2  # 95 printable + the "no character" digit 0
ASCII_SPACE: int = _RADIX**PIECE_CHARS  # ids below this are ASCII pieces
UNICODE_BASE = ASCII_SPACE
EOS_ID = UNICODE_BASE + 0x110000  # past every code point: never produced by tokenize()

# One space + a word, a run of other printable ASCII, or one non-ASCII character.
_PIECE_RE = re.compile(r" ?[A-Za-z0-9]+|[\x20-\x7e]|[^\x20-\x7e]")


def _ascii_piece_id(piece: str) -> int:
    value = 0
    for char in piece:
        value = value * _RADIX + (ord(char) - _ASCII_FIRST + 1)
    return value


def _ascii_piece_text(token_id: int) -> str:
    chars: list[str] = []
    while token_id:
        token_id, digit = divmod(token_id, _RADIX)
        chars.append(chr(digit - 1 + _ASCII_FIRST))
    return "".join(reversed(chars))


def _pieces(text: str) -> Iterable[str]:
    for match in _PIECE_RE.finditer(text):
        run = match.group()
        for start in range(0, len(run), PIECE_CHARS):
            yield run[start : start + PIECE_CHARS]


def _merge_punctuation(pieces: Iterable[str]) -> Iterable[str]:
    """Glue single punctuation/space pieces into runs of up to four ASCII characters."""
    pending = ""
    for piece in pieces:
        single_ascii = len(piece) == 1 and _ASCII_FIRST <= ord(piece) <= _ASCII_LAST and not piece.isalnum()
        if single_ascii and len(pending) < PIECE_CHARS:
            pending += piece
            continue
        if pending:
            yield pending
            pending = ""
        if single_ascii:
            pending = piece
        else:
            yield piece
    if pending:
        yield pending


def tokenize(text: str) -> list[int]:
    ids: list[int] = []
    for piece in _merge_punctuation(_pieces(text)):
        if _ASCII_FIRST <= ord(piece[0]) <= _ASCII_LAST:
            ids.append(_ascii_piece_id(piece))
        else:
            ids.append(UNICODE_BASE + ord(piece))
    return ids


def token_text(token_id: int) -> str:
    """The text of one token; EOS and ids outside the vocabulary render as nothing."""
    if 0 < token_id < ASCII_SPACE:
        return _ascii_piece_text(token_id)
    if UNICODE_BASE <= token_id < EOS_ID:
        codepoint = token_id - UNICODE_BASE
        if 0xD800 <= codepoint <= 0xDFFF:  # lone surrogates cannot be encoded as UTF-8
            return "\ufffd"
        return chr(codepoint)
    return ""


def detokenize(ids: Sequence[int]) -> str:
    return "".join(token_text(int(token_id)) for token_id in ids)
