"""The embedded engine's toy tokenizer: reversible, stable across processes, ~4 chars a token."""

from __future__ import annotations

import json
import os
import random
import string
import subprocess
import sys
from pathlib import Path

import pytest

from chaos.targets.sim.tokenizer import (
    ASCII_SPACE,
    EOS_ID,
    PIECE_CHARS,
    UNICODE_BASE,
    detokenize,
    token_text,
    tokenize,
)

REPO_ROOT = Path(__file__).resolve().parents[1]

PROSE = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair. Prefill and decode disaggregation separates the compute-bound prompt processing "
    "from the memory-bound token generation, so each phase can be scaled on its own hardware."
)

FIXED_CASES = [
    "",
    " ",
    "  ",
    "a",
    "Hello world",
    " leading space",
    "trailing space ",
    "double  space",
    "tabs\tand\nnewlines\r\n",
    "punctuation!!!!!?...,,;;::",
    "a,b.c;d",
    "x" * 1000,
    " " * 257,
    "!" * 33,
    "1234567890" * 7,
    "\x00\x01\x02\x1f\x7f",
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8",
    "emoji \U0001f600\U0001f680 and a flag \U0001f1fa\U0001f1f8 and zwj \U0001f468\u200d\U0001f469\u200d\U0001f467",
    "combining e\u0301 and \u0041\u030a",
    "\u200b\ufeff\u2028\u2029",
    "\U0010ffff\U00010000\uffff",
    "~}|{`_^]\\[@?>=<;:/.-,+*)('&%$#\"! ",
    '{"json": [1, 2.5, "x"], "nested": {"k": null}}',
    "repeat: SECRET-MARKER-7731 ZEBRA",
]


def _assert_round_trip(text: str) -> None:
    ids = tokenize(text)
    assert detokenize(ids) == text, (text, ids)


@pytest.mark.parametrize("text", FIXED_CASES)
def test_round_trip_fixed_cases(text: str) -> None:
    _assert_round_trip(text)


def test_round_trip_random_printable_ascii() -> None:
    rng = random.Random(1234)
    alphabet = string.printable  # letters, digits, punctuation, whitespace (incl. \t\n\r\x0b\x0c)
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        _assert_round_trip(text)


def test_round_trip_random_unicode() -> None:
    rng = random.Random(99)
    pools = [
        (0x00, 0x7F),  # ASCII incl. control characters
        (0x80, 0x7FF),  # two-byte UTF-8
        (0x800, 0xD7FF),  # BMP below the surrogates
        (0xE000, 0xFFFF),  # BMP above the surrogates
        (0x10000, 0x10FFFF),  # astral planes (emoji etc.)
    ]
    for _ in range(2000):
        chars = []
        for _ in range(rng.randint(0, 30)):
            lo, hi = rng.choice(pools)
            chars.append(chr(rng.randint(lo, hi)))
        _assert_round_trip("".join(chars))


def test_round_trip_random_words_and_punctuation() -> None:
    """Text shaped like prose: words of every length, runs of spaces and punctuation."""
    rng = random.Random(7)
    for _ in range(1000):
        parts = []
        for _ in range(rng.randint(1, 20)):
            kind = rng.random()
            if kind < 0.6:
                parts.append(
                    " " * rng.randint(0, 3)
                    + "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(rng.randint(1, 13)))
                )
            elif kind < 0.9:
                parts.append("".join(rng.choice(string.punctuation + " ") for _ in range(rng.randint(1, 9))))
            else:
                parts.append(rng.choice(["\n", "\u00e9", "\U0001f600", "\t", "\u4e2d"]))
        _assert_round_trip("".join(parts))


def test_pieces_are_at_most_four_characters() -> None:
    rng = random.Random(5)
    text = "".join(rng.choice(string.printable) for _ in range(5000)) + PROSE
    for token_id in tokenize(text):
        assert 1 <= len(token_text(token_id)) <= PIECE_CHARS


def test_known_ids() -> None:
    """Ids are pure arithmetic on the text: pin a few so a silent scheme change is caught."""
    # " the" in base 96 with digit = ord(c) - 0x20 + 1.
    expected = ((1 * 96 + (ord("t") - 31)) * 96 + (ord("h") - 31)) * 96 + (ord("e") - 31)
    assert tokenize(" the") == [expected]
    assert tokenize("\u00e9") == [UNICODE_BASE + 0xE9]
    assert tokenize("\n") == [UNICODE_BASE + 0x0A]
    assert tokenize("") == []
    assert tokenize("Hello world") == tokenize("Hello") + tokenize(" world")


def test_ascii_and_unicode_id_ranges_are_disjoint() -> None:
    for token_id in tokenize(PROSE + "~!@#"):
        assert 0 < token_id < ASCII_SPACE
    for token_id in tokenize("\u00e9\U0001f600\x00\x7f"):
        assert UNICODE_BASE <= token_id < EOS_ID


def test_about_four_chars_per_token_on_english_prose() -> None:
    ratio = len(PROSE) / len(tokenize(PROSE))
    assert 3.0 <= ratio <= 5.0, ratio


def test_eos_never_produced() -> None:
    rng = random.Random(11)
    texts = [PROSE, "\U0010ffff" * 10, "".join(chr(rng.randint(0, 0x10FFFF)) for _ in range(5000))]
    for text in texts:
        ids = tokenize(text)
        assert EOS_ID not in ids
        assert max(ids) < EOS_ID


def test_eos_and_out_of_vocabulary_render_as_nothing() -> None:
    assert token_text(EOS_ID) == ""
    assert token_text(0) == ""
    assert token_text(-5) == ""
    assert token_text(EOS_ID + 12345) == ""
    assert detokenize(tokenize("ab") + [EOS_ID] + tokenize("cd")) == "abcd"


def test_lone_surrogate_renders_as_replacement_character() -> None:
    """A lone surrogate (possible from JSON "\\ud800") cannot be UTF-8 encoded: it renders as U+FFFD.

    This is the one documented exception to the round trip; the output must stay encodable.
    """
    ids = tokenize("a\ud800b")
    assert ids[1] == UNICODE_BASE + 0xD800
    assert detokenize(ids) == "a\ufffdb"
    detokenize(ids).encode("utf-8")  # would raise for a lone surrogate


_CHILD = """
import json, sys
from chaos.targets.sim.tokenizer import tokenize
texts = json.loads(sys.stdin.read())
print(json.dumps([tokenize(t) for t in texts]))
"""


def _ids_in_subprocess(texts: list[str], hash_seed: str) -> list[list[int]]:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(texts),
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        env=env,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)


def test_ids_identical_across_processes() -> None:
    rng = random.Random(3)
    texts = [PROSE, *FIXED_CASES] + [
        "".join(chr(rng.randint(0x20, 0x2FFF)) for _ in range(rng.randint(0, 40))) for _ in range(50)
    ]
    first = _ids_in_subprocess(texts, "1")
    second = _ids_in_subprocess(texts, "2")
    assert first == second
    assert first == [tokenize(t) for t in texts]
