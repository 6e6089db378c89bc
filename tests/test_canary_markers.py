"""Canary markers: the codec round-trips, the scan finds markers and fragments and nothing else."""

from __future__ import annotations

import hashlib
import random
import re
import string

import pytest

from chaos import markers
from chaos.markers import (
    ALPHABET,
    MARKER_WIDTH,
    MAX_REQUEST_INDEX,
    MAX_SLOT,
    SENTINEL,
    HitKind,
    Marker,
    MarkerCodec,
    encode_marker,
    new_run_prefix,
    validate_run_prefix,
)

RUN = "K7QX"
OTHER_RUN = "9ABC"


@pytest.fixture
def codec() -> MarkerCodec:
    return MarkerCodec(RUN)


@pytest.mark.parametrize("index", [0, 1, 31, 32, 1000, 123_456, 999_999, MAX_REQUEST_INDEX])
@pytest.mark.parametrize("slot", [0, 1, MAX_SLOT])
def test_marker_round_trips(codec: MarkerCodec, index: int, slot: int) -> None:
    text = codec.marker(index, slot)
    assert len(text) == MARKER_WIDTH
    assert re.fullmatch("[A-Z0-9]+", text), "upper-case ASCII letters and digits only"
    assert text.startswith(SENTINEL + RUN)
    assert codec.decode(text) == Marker(run_prefix=RUN, request_index=index, slot=slot)
    assert Marker(RUN, index, slot).text == text


def test_distinct_requests_and_slots_get_distinct_markers(codec: MarkerCodec) -> None:
    markers = {codec.marker(i, s) for i in range(2000) for s in (0, 1)}
    assert len(markers) == 4000


def test_marker_survives_a_four_char_tokenizer(codec: MarkerCodec) -> None:
    # The toy tokenizer cuts ASCII text into pieces of at most 4 chars; a page boundary can fall
    # between any two pieces, and joining the pieces back must give the marker unchanged.
    text = f"Remember {codec.marker(77, 1)} please."
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    assert [h.request_index for h in codec.scan("".join(pieces))] == [77]


def test_encode_rejects_out_of_range_values(codec: MarkerCodec) -> None:
    with pytest.raises(ValueError, match="request index"):
        codec.marker(MAX_REQUEST_INDEX + 1)
    with pytest.raises(ValueError, match="request index"):
        codec.marker(-1)
    with pytest.raises(ValueError, match="slot"):
        codec.marker(1, MAX_SLOT + 1)


@pytest.mark.parametrize("prefix", ["TEST", "2026", "K7Q", "K7QXY", "k7qx", "K7QI", "A1A1"])
def test_bad_run_prefixes_are_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="run prefix"):
        MarkerCodec(prefix)


def test_new_run_prefixes_are_valid_and_vary() -> None:
    prefixes = {new_run_prefix() for _ in range(200)}
    assert all(validate_run_prefix(p) == p for p in prefixes)
    assert len(prefixes) > 150


def test_decode_rejects_a_wrong_check_code_and_non_markers(codec: MarkerCodec) -> None:
    text = codec.marker(4242, 1)
    for position in range(MARKER_WIDTH - 3, MARKER_WIDTH):  # the check characters
        for replacement in "0Z":
            if text[position] != replacement:
                mutated = text[:position] + replacement + text[position + 1 :]
                assert codec.decode(mutated) is None
    assert codec.decode(text[:-1]) is None
    assert codec.decode(text.lower()) is None
    assert codec.decode("X" + text[1:]) is None
    assert codec.decode(text + "0") is None


def test_random_text_yields_no_verified_marker(codec: MarkerCodec) -> None:
    rng = random.Random(20260601)
    alphabet = string.ascii_uppercase + string.digits
    text = "".join(rng.choice(alphabet) for _ in range(1_000_000))
    hits = codec.scan(text)
    assert hits, "1 MB of random text does hold some sentinels; the scan must see them"
    assert not [h for h in hits if h.verified]
    assert not [h for h in hits if h.run_prefix == RUN]
    assert codec.scan_others(text, owner_index=0) == []


def test_markers_planted_in_noise_are_all_found_at_their_offsets(codec: MarkerCodec) -> None:
    rng = random.Random(7)
    alphabet = string.ascii_uppercase + string.digits
    parts, expected = [], []
    offset = 0
    for index in range(0, 5000, 37):
        noise = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        marker = codec.marker(index, index % 2)
        offset += len(noise)
        parts += [noise, marker]
        expected.append((offset, index, index % 2))
        offset += len(marker)
    hits = [h for h in codec.scan("".join(parts)) if h.verified]
    assert [(h.offset, h.request_index, h.slot) for h in hits] == expected
    assert all(h.kind is HitKind.WHOLE and not h.foreign_run for h in hits)


def test_head_fragments_are_found_and_attributed_once_the_id_is_complete(
    codec: MarkerCodec,
) -> None:
    marker = codec.marker(1000, 1)
    body_start = len(SENTINEL)
    for cut in range(body_start + 4, MARKER_WIDTH):
        hits = codec.scan(f"the answer is {marker[:cut]} and more")
        assert len(hits) == 1, cut
        hit = hits[0]
        assert (hit.kind, hit.offset, hit.text) == (HitKind.FRAGMENT, 14, marker[:cut])
        assert hit.run_prefix == RUN and not hit.verified and not hit.foreign_run
        has_id = cut >= body_start + 4 + 6
        assert hit.request_index == (1000 if has_id else None), cut
        assert hit.slot == (1 if cut >= body_start + 11 else None), cut


def test_too_short_head_fragments_follow_the_minimum(codec: MarkerCodec) -> None:
    text = "see " + codec.marker(3)[:5] + " end"  # sentinel + 2 body characters
    assert codec.scan(text) == []
    hits = MarkerCodec(RUN, min_fragment_body=2).scan(text)
    assert [(h.text, h.run_prefix, h.request_index) for h in hits] == [(SENTINEL + "K7", None, None)]


@pytest.mark.parametrize("lost", [1, 2, 3])
def test_tail_fragments_without_sentinel_are_attributed(codec: MarkerCodec, lost: int) -> None:
    marker = codec.marker(31337, 1)
    hits = codec.scan("page boundary>" + marker[lost:] + "<")
    assert len(hits) == 1
    hit = hits[0]
    assert hit.kind is HitKind.FRAGMENT
    assert hit.text == marker[len(SENTINEL) :]
    assert (hit.request_index, hit.slot, hit.verified) == (31337, 1, True)


def test_tail_fragment_needs_the_whole_owner_id(codec: MarkerCodec) -> None:
    marker = codec.marker(31337)
    assert codec.scan(marker[3:12] + " ") == []  # run prefix + 5 of 6 id characters
    assert codec.scan(marker[4:]) == []  # cut inside the run prefix: not attributable
    assert [h.request_index for h in codec.scan(marker[3:13] + " ")] == [31337]


def test_back_to_back_cut_markers_are_both_attributed(codec: MarkerCodec) -> None:
    own, other = codec.marker(5), codec.marker(900)
    text = own[:9] + other[3:]  # own head cut mid-id, then the other's body without sentinel
    hits = codec.scan(text)
    assert [(h.text, h.request_index) for h in hits] == [(own[:9], None), (other[3:], 900)]
    assert [h.request_index for h in codec.scan_others(text, owner_index=5)] == [900]


def test_a_mixed_marker_is_whole_but_unverified(codec: MarkerCodec) -> None:
    # A stale page swapped in mid-marker: the owner's first 12 characters, another's last 5.
    own, other = codec.marker(5), codec.marker(1000)
    mixed = own[:12] + other[12:]
    (hit,) = codec.scan(f"x {mixed} y")
    assert hit.kind is HitKind.WHOLE and not hit.verified
    assert hit.request_index == 8  # id "00000" + "8" from request 1000 ("0000Z8")
    assert codec.scan_others(f"x {mixed} y", owner_index=5) == [hit]


def test_scan_others_returns_only_what_cannot_be_the_owners(codec: MarkerCodec) -> None:
    owner, victim = 40, 41
    response = " ".join(
        [
            codec.marker(owner, 0),  # own head marker: fine
            codec.marker(owner, 1)[:12],  # own marker cut short: could be own, not a leak
            codec.marker(victim, 1),  # whole marker of another request: leak
            codec.marker(7)[:12],  # cut, but the id so far ("00000" + "7") is not the owner's
            encode_marker(OTHER_RUN, victim),  # another run: not attributed to this run
        ]
    )
    others = codec.scan_others(response, owner_index=owner)
    assert [(h.text, h.request_index, h.verified) for h in others] == [
        (codec.marker(victim, 1), victim, True),
        (codec.marker(7)[:12], None, False),
    ]
    assert codec.scan_others(response, owner_index=victim)[0].request_index == owner


def test_foreign_run_markers_are_reported_as_foreign(codec: MarkerCodec) -> None:
    foreign = encode_marker(OTHER_RUN, 12, 1)
    (hit,) = codec.scan("cached from last week: " + foreign)
    assert hit.foreign_run and hit.verified and hit.kind is HitKind.WHOLE
    assert (hit.run_prefix, hit.request_index, hit.slot) == (OTHER_RUN, 12, 1)
    assert codec.decode(foreign) == Marker(OTHER_RUN, 12, 1)
    assert codec.scan_others(foreign, owner_index=0) == []
    # The foreign run's own codec sees the same marker as one of its own.
    assert not MarkerCodec(OTHER_RUN).scan(foreign)[0].foreign_run


def test_markers_written_back_to_back_never_merge(codec: MarkerCodec) -> None:
    text = "".join(codec.marker(i) for i in range(100))
    hits = codec.scan(text)
    assert [h.request_index for h in hits] == list(range(100))
    assert all(h.verified and h.kind is HitKind.WHOLE for h in hits)


# --------------------------------------------------------------------- differential ----
# The scan is tuned (two regexes with a lookbehind, a memo of decoded heads, bit arithmetic on one
# base32 number); this reference is the plain reading of the format: character loops, the check
# hashed from its definition, no memo. They must agree hit for hit on random texts.

_CHECK_KEY = b"pdchaos/canary/v1"


def _reference_check_ok(body: str) -> bool:
    if len(body) != 14:
        return False
    digest = hashlib.blake2b(body[:11].encode(), key=_CHECK_KEY, digest_size=8).digest()
    value = int.from_bytes(digest, "big") % 32**3
    return body[11:] == "".join(ALPHABET[value // 32**k % 32] for k in (2, 1, 0))


def _reference_number(digits: str) -> int:
    value = 0
    for char in digits:
        value = value * 32 + ALPHABET.index(char)
    return value


def _reference_hit(run: str, offset: int, body: str, head: bool) -> tuple[object, ...]:
    prefix = body[:4] if len(body) >= 4 else None
    return (
        SENTINEL + body if head else body,
        offset,
        HitKind.WHOLE if head and len(body) == 14 else HitKind.FRAGMENT,
        body,
        prefix,
        _reference_number(body[4:10]) if len(body) >= 10 else None,
        _reference_number(body[10]) if len(body) >= 11 else None,
        _reference_check_ok(body),
        prefix is not None and prefix != run,
        offset + len(body) + (len(SENTINEL) if head else 0),
    )


def _reference_scan(text: str, run: str, min_body: int = 4) -> list[tuple[object, ...]]:
    """Heads: a sentinel and 1..14 body characters (at least `min_body`), cut where our prefix
    starts again unless the body verifies. Tails: our prefix and 6..10 more body characters, not
    inside a head, cut the same way, reported with the whole id."""

    def body_after(start: int, limit: int) -> str:
        end = start
        while end < len(text) and end - start < limit and text[end] in ALPHABET:
            end += 1
        return text[start:end]

    def cut_point(body: str) -> int:
        return -1 if _reference_check_ok(body) else body.find(run, 1)

    heads: list[tuple[object, ...]] = []
    spans: list[tuple[int, int]] = []
    at = text.find(SENTINEL)
    while at >= 0:
        body = body_after(at + 3, 14)
        if len(body) < min_body:
            at = text.find(SENTINEL, at + 1)
            continue
        next_at = text.find(SENTINEL, at + 3 + len(body))
        cut = cut_point(body)
        if cut > 0:
            body = body[:cut]
        if cut <= 0 or cut >= min_body:
            heads.append(_reference_hit(run, at, body, head=True))
            spans.append((at, at + 3 + len(body)))
        at = next_at
    tails: list[tuple[object, ...]] = []
    pos = 0
    while (at := text.find(run, pos)) >= 0:
        body = run + body_after(at + 4, 10)
        if len(body) < 10:
            pos = at + 1
            continue
        inside = [end for start, end in spans if start <= at < end]
        if inside:
            pos = inside[0]
            continue
        cut = cut_point(body)
        if cut > 0:
            body = body[:cut]
        pos = at + len(body)
        if len(body) >= 10:
            tails.append(_reference_hit(run, at, body, head=False))
    return sorted(heads + tails, key=lambda hit: hit[1])


def _random_text(rng: random.Random, own: MarkerCodec, other_run: str) -> str:
    markers = [own.marker(rng.randrange(50), rng.randrange(3)) for _ in range(4)]
    markers.append(encode_marker(other_run, rng.randrange(50), rng.randrange(2)))
    # ids that spell our run prefix: a verified body holding it twice must not be cut there
    twice = _reference_number(own.run_prefix + "00") + rng.randrange(1024)
    markers += [own.marker(twice, rng.randrange(2)), encode_marker(other_run, twice)]
    noise = "0123456789ABCDEFGHJKMNPQRSTVWXYZ" + "UL" + " \n.-" + "abc"
    parts = []
    for _ in range(rng.randrange(1, 14)):
        roll, marker = rng.random(), rng.choice(markers)
        if roll < 0.25:
            parts.append(marker)
        elif roll < 0.55:  # a page-cut piece: any slice of a marker
            start = rng.randrange(MARKER_WIDTH)
            parts.append(marker[start : rng.randrange(start, MARKER_WIDTH + 1)])
        elif roll < 0.65:  # a mixed marker: one request's head, another's tail
            cut = rng.randrange(MARKER_WIDTH)
            parts.append(marker[:cut] + rng.choice(markers)[cut:])
        elif roll < 0.75:
            parts.append(rng.choice([SENTINEL, own.run_prefix, own.run_prefix * 2, SENTINEL + own.run_prefix, "UUUL"]))
        else:
            parts.append("".join(rng.choice(noise) for _ in range(rng.randrange(0, 20))))
    return "".join(parts)


@pytest.mark.parametrize("min_body", [1, 2, 4, 5, 10, 14])
def test_scan_equals_a_plain_reference_on_random_texts(min_body: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(markers, "_KNOWN_HEADS_MAX", 16)  # the memo fills and is cleared many times
    rng = random.Random(min_body)
    codec = MarkerCodec(RUN, min_fragment_body=min_body)  # one codec for all texts: its memo carries over
    kinds: set[tuple[HitKind, bool, bool]] = set()
    skipped_own = 0
    for _ in range(1500):
        text = _random_text(rng, codec, OTHER_RUN)
        hits = codec.scan(text)
        assert [(*hit, hit.end) for hit in hits] == _reference_scan(text, RUN, min_body), text
        assert codec.scan(text) == hits and MarkerCodec(RUN, min_fragment_body=min_body).scan(text) == hits
        assert codec.scan_others(text, 7) == [
            h for h in hits if h.run_prefix == RUN and not h.could_be_owned_by(RUN, 7)
        ]
        # Leaving a request's own whole markers out changes nothing else, fragments of them included.
        owner = rng.randrange(50)
        own = [codec.marker(owner, slot) for slot in range(3)]
        without_own = [h for h in hits if not (h.kind is HitKind.WHOLE and h.text in own)]
        assert codec.scan(text, own) == without_own, text
        skipped_own += len(hits) - len(without_own)
        assert codec.scan_others(text, owner, own) == codec.scan_others(text, owner)
        kinds |= {(h.kind, h.verified, h.foreign_run) for h in hits}
        assert len(codec._known_heads) <= 16
    # the random texts reach every kind of hit: whole (verified or mixed), fragments, other runs
    assert {(HitKind.WHOLE, True, False), (HitKind.WHOLE, False, False), (HitKind.WHOLE, True, True)} <= kinds
    assert {(HitKind.FRAGMENT, True, False), (HitKind.FRAGMENT, False, False)} <= kinds
    assert skipped_own > 20  # own whole markers were really left out, many times


def test_hits_are_immutable_hashable_values(codec: MarkerCodec) -> None:
    (hit,) = codec.scan("x " + codec.marker(9) + " y")
    assert hash(hit) == hash(codec.scan("x " + codec.marker(9) + " y")[0])
    with pytest.raises(AttributeError):
        hit.offset = 0  # type: ignore[misc]
    assert repr(hit).startswith("MarkerHit(text='UULK7QX00000")
