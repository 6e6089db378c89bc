"""Canary markers: self-attributing codes planted in prompts, and the scan that finds them.

A marker names its owner: the run, the request's sequence number in the run, a slot (head or tail
of the prompt) and a check code. So one scan of a response, knowing nothing about which requests
are in flight, tells whose content it carries. A marker owned by another request is a leak.

Format (17 characters, upper case and digits only)::

    UUL  K7QX  00002B  1  9F3
    |    |     |       |  check: 3 chars of a keyed hash over run + id + slot
    |    |     |       slot: 1 char
    |    |     owner request index: 6 chars, fixed width
    |    run prefix: 4 chars
    sentinel

The body (everything after the sentinel) uses Crockford's base32 alphabet, which has no I, L, O or
U; the sentinel is made only of those letters. So a sentinel can never occur inside a body: the
scan needs no backtracking, and two markers written back to back never merge. The scan is
case-sensitive and markers are upper case, which keeps them clear of ordinary lower-case prose.

A KV leak moves whole pages, so a leaked marker is often cut at a page boundary. The scan reports
such *fragments* too: a sentinel with a prefix of the body, or a body tail that still starts with
this run's prefix (the sentinel fell on the other page) and carries the full owner id.
"""

from __future__ import annotations

import enum
import hashlib
import re
import secrets
from bisect import bisect_left
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple

SENTINEL = "UUL"
ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"  # Crockford base32: no I, L, O, U
_BODY_CHAR = "[0-9A-HJKMNP-TV-Z]"

RUN_WIDTH = 4
ID_WIDTH = 6  # 32**6 ~ 1.07e9 requests: a 1000 req/s soak runs for 12 days
SLOT_WIDTH = 1
CHECK_WIDTH = 3  # 1 in 32768 random bodies pass the check
GARBLED_MAX_CHARS = 2  # a miscopy of a request's own marker changes at most this many characters

_ID_END = RUN_WIDTH + ID_WIDTH
_SLOT_END = _ID_END + SLOT_WIDTH
BODY_WIDTH = _SLOT_END + CHECK_WIDTH
MARKER_WIDTH = len(SENTINEL) + BODY_WIDTH

MAX_REQUEST_INDEX: int = len(ALPHABET) ** ID_WIDTH - 1
MAX_SLOT: int = len(ALPHABET) ** SLOT_WIDTH - 1

# Not a secret: the key only separates this hash from any other use of blake2b, so that every run
# (and every later reader of an old journal) can verify any run's markers.
_CHECK_KEY = b"pdchaos/canary/v1"

assert not set(SENTINEL) & set(ALPHABET), "a sentinel letter inside a body breaks the scan"


class HitKind(str, enum.Enum):
    WHOLE = "whole"  # all 17 characters present (the check may still fail: a mixed marker)
    FRAGMENT = "fragment"


@dataclass(frozen=True)
class Marker:
    run_prefix: str
    request_index: int
    slot: int

    @property
    def text(self) -> str:
        return encode_marker(self.run_prefix, self.request_index, self.slot)


class MarkerHit(NamedTuple):
    """One marker or fragment found in a text.

    `request_index` and `slot` are those of run `run_prefix`; for a foreign run they are that
    run's numbers, never one of ours. They are None when the fragment is cut before them.

    A named tuple rather than a frozen dataclass: the scan builds one per hit, and a frozen
    dataclass's __init__ (one object.__setattr__ per field) cost more than all the rest of the
    per-hit work. It is just as immutable and hashable, with the same fields and repr; being a
    tuple, it also unpacks and equals a plain tuple of the same fields.
    """

    text: str
    offset: int
    kind: HitKind
    body: str  # the visible characters after the sentinel position, run prefix first
    run_prefix: str | None
    request_index: int | None
    slot: int | None
    verified: bool  # the full check code is present and matches
    foreign_run: bool

    @property
    def end(self) -> int:
        return self.offset + len(self.text)

    def could_be_owned_by(self, run_prefix: str, request_index: int) -> bool:
        """Whether the visible characters agree with that request's markers (any slot)."""
        if self.run_prefix != run_prefix:
            return False
        seen_id = self.body[RUN_WIDTH:_ID_END]
        return _encode_int(request_index, ID_WIDTH).startswith(seen_id)


_OFFSET = attrgetter("offset")
_WHOLE, _FRAGMENT = HitKind.WHOLE, HitKind.FRAGMENT  # an enum member lookup costs 0.1 us a hit
_new_hit = tuple.__new__
# kind, body, run_prefix, request_index, slot, verified, foreign_run: a MarkerHit after its offset
_HitFields = tuple[HitKind, str, str | None, int | None, int | None, bool, bool]
_KNOWN_HEADS_MAX = 1 << 12  # head matches remembered per codec: about 1.5 MB at most


def _encode_int(value: int, width: int) -> str:
    chars = []
    for _ in range(width):
        value, digit = divmod(value, len(ALPHABET))
        chars.append(ALPHABET[digit])
    if value:
        raise ValueError(f"{value} does not fit in {width} base32 characters")
    return "".join(reversed(chars))


# Crockford digits to the ones int(..., 32) reads, so decoding runs in C. A bytes table:
# str.translate looks each character up in a dict, bytes.translate indexes 256 bytes (half the cost).
_TO_STANDARD_BASE32 = bytes.maketrans(ALPHABET.encode(), b"0123456789ABCDEFGHIJKLMNOPQRSTUV")


def _decode_int(text: str) -> int:
    return int(text.encode("ascii").translate(_TO_STANDARD_BASE32), 32)


# The hash state holding the key: copying it costs half of keying a new one (the check, 3/4).
_CHECK_HASH = hashlib.blake2b(key=_CHECK_KEY, digest_size=8)
_BITS = 5  # per base32 character
assert len(ALPHABET) == 1 << _BITS
_SLOT_MASK = (1 << _BITS * SLOT_WIDTH) - 1
_CHECK_MASK = (1 << _BITS * CHECK_WIDTH) - 1


def _check_value(payload: bytes) -> int:
    """The check code of a body's run + id + slot characters, as the number its characters spell."""
    digest = _CHECK_HASH.copy()
    digest.update(payload)
    return int.from_bytes(digest.digest(), "big") & _CHECK_MASK


def _check_of(payload: str) -> str:
    """The check characters for a body's run + id + slot characters."""
    return _encode_int(_check_value(payload.encode("ascii")), CHECK_WIDTH)


def validate_run_prefix(run_prefix: str) -> str:
    """A run prefix is 4 base32 characters, at least one digit and one letter, not periodic.

    A tail fragment is found by the run prefix alone, so a word or a year ("TEST", "2026") would
    match ordinary text; and a prefix that overlaps itself ("A1A1") could hide one occurrence
    inside another, which the scan relies on not happening.
    """
    if (
        len(run_prefix) != RUN_WIDTH
        or any(c not in ALPHABET for c in run_prefix)
        or not any(c.isdigit() for c in run_prefix)
        or not any(c.isalpha() for c in run_prefix)
        or any(run_prefix[k:] == run_prefix[:-k] for k in range(1, RUN_WIDTH))
    ):
        raise ValueError(
            f"run prefix {run_prefix!r}: need {RUN_WIDTH} characters of {ALPHABET} with at "
            "least one digit and one letter, not overlapping itself (new_run_prefix() makes one)"
        )
    return run_prefix


def new_run_prefix() -> str:
    """A fresh random run prefix."""
    while True:
        candidate = "".join(secrets.choice(ALPHABET) for _ in range(RUN_WIDTH))
        try:
            return validate_run_prefix(candidate)
        except ValueError:
            continue


def encode_marker(run_prefix: str, request_index: int, slot: int = 0) -> str:
    if not 0 <= request_index <= MAX_REQUEST_INDEX:
        raise ValueError(f"request index {request_index} outside 0..{MAX_REQUEST_INDEX}")
    if not 0 <= slot <= MAX_SLOT:
        raise ValueError(f"slot {slot} outside 0..{MAX_SLOT}")
    payload = validate_run_prefix(run_prefix) + _encode_int(request_index, ID_WIDTH) + _encode_int(slot, SLOT_WIDTH)
    return SENTINEL + payload + _check_of(payload)


class MarkerCodec:
    """Markers of one run, and the scan that finds markers of any run in a text.

    `min_fragment_body`: a sentinel followed by fewer body characters is not reported. The
    default, 4, is the run prefix: a shorter fragment cannot even say which run it came from.
    """

    def __init__(self, run_prefix: str, *, min_fragment_body: int = RUN_WIDTH) -> None:
        self.run_prefix = validate_run_prefix(run_prefix)
        if not 1 <= min_fragment_body <= BODY_WIDTH:
            raise ValueError(f"min_fragment_body must be in 1..{BODY_WIDTH}")
        self.min_fragment_body = min_fragment_body
        # Two compiled patterns, independent of how many markers are in flight. Each starts with
        # a literal, which lets the regex engine skip ahead to it (about 1 ms per MB); one
        # alternation of both has no literal prefix and scans 30 times slower.
        self._head = re.compile(f"{SENTINEL}({_BODY_CHAR}{{{min_fragment_body},{BODY_WIDTH}}})")
        # Every own marker's body matches the tail pattern too. When the sentinel + prefix before
        # it is always a reported head (min_fragment_body <= 4), the tail pass would only skip it:
        # the lookbehind does so inside the regex engine instead of in the Python loop.
        own_head = f"(?<!{SENTINEL}{run_prefix})" if min_fragment_body <= RUN_WIDTH else ""
        self._tail = re.compile(f"{run_prefix}{own_head}{_BODY_CHAR}{{{ID_WIDTH},{BODY_WIDTH - RUN_WIDTH}}}")
        self._known_heads: dict[str, tuple[str, _HitFields]] = {}

    def marker(self, request_index: int, slot: int = 0) -> str:
        return encode_marker(self.run_prefix, request_index, slot)

    @staticmethod
    def decode(text: str) -> Marker | None:
        """The marker `text` is exactly (any run), or None when it is not one or fails its check."""
        if len(text) != MARKER_WIDTH or not text.startswith(SENTINEL):
            return None
        body = text[len(SENTINEL) :]
        if any(c not in ALPHABET for c in body):
            return None
        if body[_SLOT_END:] != _check_of(body[:_SLOT_END]):
            return None
        return Marker(
            run_prefix=body[:RUN_WIDTH],
            request_index=_decode_int(body[RUN_WIDTH:_ID_END]),
            slot=_decode_int(body[_ID_END:_SLOT_END]),
        )

    def scan(self, text: str, own: Collection[str] = ()) -> list[MarkerHit]:
        """Every marker and fragment in `text`, by offset: two linear passes, one per pattern.

        `own`: whole markers to leave out (the replying request's own, which a reply may echo
        many times): each costs one lookup instead of a hit. The rest is found exactly as without.
        """
        heads, skipped = self._scan_heads(text, own)
        tails = self._scan_tails(text, heads, skipped)
        # Each list is in offset order already; a hit-free or head-only text needs no sort.
        return sorted(heads + tails, key=_OFFSET) if tails and heads else heads or tails

    def _scan_heads(self, text: str, own: Collection[str]) -> tuple[list[MarkerHit], list[tuple[int, int]]]:
        """The head hits, and the spans of the `own` markers left out."""
        hits: list[MarkerHit] = []
        skipped: list[tuple[int, int]] = []
        known = self._known_heads
        for match in self._head.finditer(text):
            matched = match[0]
            if matched in own:  # a whole marker: the head pattern takes at most one marker's length
                skipped.append(match.span())
                continue
            # What a head match reports depends on its characters only, and markers recur (a
            # prompt repeats its own, a reply echoes them): a repeat costs a dict lookup, not a
            # decode and a keyed hash.
            head = known.get(matched) or self._decode_head(matched)
            if head is not None:
                # tuple.__new__ skips the named tuple's Python-level __new__ (a third of its cost)
                hits.append(_new_hit(MarkerHit, (head[0], match.start()) + head[1]))
        return hits, skipped

    def _decode_head(self, matched: str) -> tuple[str, _HitFields] | None:
        """The text and fields of the hit a head match reports (None: none), remembered."""
        text, body = matched, matched[len(SENTINEL) :]
        cut = self._cut_point(body)
        if cut > 0:
            if cut < self.min_fragment_body:
                return None  # the tail pass reports what starts at the cut
            body = body[:cut]
            text = SENTINEL + body
        kind = _WHOLE if len(body) == BODY_WIDTH else _FRAGMENT
        if len(self._known_heads) >= _KNOWN_HEADS_MAX:
            self._known_heads.clear()  # bounded: a long run's old markers rarely come back
        head = self._known_heads[matched] = (text, self._fields(body, kind))
        return head

    def _scan_tails(self, text: str, heads: list[MarkerHit], skipped: list[tuple[int, int]]) -> list[MarkerHit]:
        """Bodies that lost their sentinel; a match inside a head hit (or a `skipped` own marker)
        is that head's own body."""
        hits: list[MarkerHit] = []
        search = self._tail.search
        if (match := search(text)) is None:
            return hits  # the usual case: no tail match at all
        spans = sorted([(h.offset, h.end) for h in heads] + skipped) if skipped else [(h.offset, h.end) for h in heads]
        next_head, head_count = 0, len(spans)
        while match is not None:
            start = match.start()
            while next_head < head_count and spans[next_head][1] <= start:
                next_head += 1
            if next_head < head_count and spans[next_head][0] <= start:
                match = search(text, spans[next_head][1])  # a cut head may end before this match does
                continue
            body = match[0]
            cut = self._cut_point(body)
            if cut > 0:
                body = body[:cut]
            if len(body) >= _ID_END:
                hits.append(_new_hit(MarkerHit, (body, start) + self._fields(body, _FRAGMENT)))
            match = search(text, start + len(body))
        return hits

    def _cut_point(self, body: str) -> int:
        """Where our run prefix starts again inside an unverified body, else -1.

        Two cut markers back to back ("UULK7QX00" + "K7QX000005...") read as one body that
        fails its check; ending the first at the second's run prefix lets both be attributed.
        The prefix is looked for first, so the check is hashed here only in the rare case.
        """
        cut = body.find(self.run_prefix, 1)
        if cut > 0 and len(body) == BODY_WIDTH and body[_SLOT_END:] == _check_of(body[:_SLOT_END]):
            return -1
        return cut

    def _fields(self, body: str, kind: HitKind) -> _HitFields:
        """A hit's fields after its offset."""
        size = len(body)
        run = body[:RUN_WIDTH] if size >= RUN_WIDTH else None
        index = slot = None
        verified = False
        if size >= _ID_END:
            # id, slot and the visible check characters as one base32 number: one decode, in C;
            # base 32 is 5 bits a character, so shifts and masks split it.
            raw = body.encode("ascii")
            value = int(raw[RUN_WIDTH:].translate(_TO_STANDARD_BASE32), 32)
            after_id = _BITS * (size - _ID_END)
            index = value >> after_id
            if size >= _SLOT_END:
                slot = (value >> (after_id - _BITS * SLOT_WIDTH)) & _SLOT_MASK
            verified = size == BODY_WIDTH and value & _CHECK_MASK == _check_value(raw[:_SLOT_END])
        return kind, body, run, index, slot, verified, run is not None and run != self.run_prefix

    def garbled_own(self, hit: MarkerHit, owner_index: int, indices: Sequence[int]) -> str | None:
        """The owner's marker that `hit` is a miscopy of, or None when it may be another's.

        A model that repeats its prompt can miscopy a character of its own marker: a whole hit that
        fails its check and names some other id. It is the owner's own when (1) it differs from the
        owner's marker of the same slot in at most GARBLED_MAX_CHARS characters, and (2) no request
        of the run (`indices`, sorted) has an id that starts like the hit's, up to and including
        its first differing character. A page swapped in mid-marker (another request's start, the
        owner's end) needs such a request; without one, no request of this run wrote that start.
        """
        if hit.kind is not _WHOLE or hit.verified or hit.run_prefix != self.run_prefix or hit.slot is None:
            return None
        own = self.marker(owner_index, hit.slot)
        differ = [i for i, (seen, meant) in enumerate(zip(hit.text, own, strict=True)) if seen != meant]
        if not 0 < len(differ) <= GARBLED_MAX_CHARS:
            return None
        id_start = len(SENTINEL) + RUN_WIDTH
        if differ[0] < id_start + ID_WIDTH:  # (else the id is the owner's: never a leak)
            shared = hit.text[id_start : differ[0] + 1]  # the id up to the first difference
            span = len(ALPHABET) ** (ID_WIDTH - len(shared))
            low = _decode_int(shared) * span
            at = bisect_left(indices, low)
            if at < len(indices) and indices[at] < low + span:
                return None  # a request of this run could have written the differing start
        return own

    def scan_others(self, text: str, owner_index: int, own: Collection[str] = ()) -> list[MarkerHit]:
        """Hits of this run that cannot be `owner_index`'s own: the leak primitive.

        Includes fragments whose visible id already differs from the owner's, even when too short
        to name the victim; excludes foreign runs and fragments that may be the owner's own.
        `own`: the owner's whole markers, where known (a shortcut: `scan`).
        """
        return [
            hit
            for hit in self.scan(text, own)
            if hit.run_prefix == self.run_prefix and not hit.could_be_owned_by(self.run_prefix, owner_index)
        ]
