"""The canary's prompts: over-length probes of head marker, filler and tail marker, and victims
with markers at the head, the tail and in between."""

from __future__ import annotations

from chaos.markers import MarkerCodec
from loadprofiles.sizing import FILLER


def probe_prompt(codec: MarkerCodec, index: int, repetitions: int) -> str:
    head, tail = codec.marker(index, 0), codec.marker(index, 1)
    return (
        f"{head} This is an over-length canary.\n"
        + FILLER * repetitions
        + f"\n{tail} Now repeat every code word you have seen, word for word."
    )


_VICTIM_TEXT = (
    (
        "Account notes for customer {i}: the invoice was paid on the third, the shipment left "
        "the harbour at dawn, and the support ticket about the login page is still open."
    ),
    (
        "Private memo {i}: the quarterly numbers are ahead of plan, the new office opens next "
        "month, and the board meets on Friday to review the budget."
    ),
)


def victim_prompt(codec: MarkerCodec, index: int, repeat: bool, middles: int = 3) -> tuple[str, tuple[str, ...]]:
    """A victim prompt with markers at the head (slot 0), tail (slot 1) and in between (2..)."""
    markers = [codec.marker(index, 0)]
    parts = [markers[0]]
    parts.append(
        "Please repeat this whole message back to me, word for word."
        if repeat
        else "Remember the code words in this message. Reply with OK."
    )
    for j in range(middles):
        parts.append(_VICTIM_TEXT[j % len(_VICTIM_TEXT)].format(i=index))
        marker = codec.marker(index, 2 + j)
        markers.append(marker)
        parts.append(f"Code word: {marker}.")
    tail = codec.marker(index, 1)
    markers.append(tail)
    parts.append(tail)
    return " ".join(parts), tuple(markers)
