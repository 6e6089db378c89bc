"""A deterministic, reversible toy tokenizer: the same ids in every process, about 4 chars a token.

Text is cut into pieces: a run of ASCII letters or digits (with the one space before it), a run
of other printable ASCII, or one non-ASCII character. Runs are cut into pieces of at most four
characters. A piece of printable ASCII maps to a base-96 number (so ids never depend on what a
process has seen); any other character maps to `UNICODE_BASE + codepoint`. So
`detokenize(tokenize(t)) == t` for every string, and ids are stable across processes and runs.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

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


def tokenize(text: str) -> list[int]:
    """Cut `text` into pieces (see the module docstring) and map each to its id.

    One pass over the regex's runs. A lone printable ASCII character that is not a letter or
    digit (punctuation, a space not before a word) is glued to its neighbours of the same kind,
    up to four characters; every other run is cut into pieces of four. A word's ids are
    memoised: prompts repeat their words, and this runs on every request in both workers.
    """
    ids: list[int] = []
    pending = ""  # glued punctuation not yet emitted
    for run in _PIECE_RE.findall(text):
        if len(run) == 1:
            code = ord(run)
            if _ASCII_FIRST <= code <= _ASCII_LAST and not run.isalnum():
                if len(pending) < PIECE_CHARS:
                    pending += run
                    continue
                ids.append(_ascii_piece_id(pending))
                pending = run
                continue
            if pending:
                ids.append(_ascii_piece_id(pending))
                pending = ""
            ids.append(_ascii_piece_id(run) if _ASCII_FIRST <= code <= _ASCII_LAST else UNICODE_BASE + code)
            continue
        if pending:
            ids.append(_ascii_piece_id(pending))
            pending = ""
        ids.extend(_word_ids(run))
    if pending:
        ids.append(_ascii_piece_id(pending))
    return ids


@functools.lru_cache(maxsize=1 << 16)
def _word_ids(run: str) -> tuple[int, ...]:
    """Ids of a run of letters or digits (with the space before it): pieces of four characters."""
    return tuple(_ascii_piece_id(run[start : start + PIECE_CHARS]) for start in range(0, len(run), PIECE_CHARS))


# Memoised: the engine renders every generated token, and a run's outputs come from a small
# vocabulary (the toy model's words, or the prompt's own pieces when it repeats).
@functools.lru_cache(maxsize=1 << 16)
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
