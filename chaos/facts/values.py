"""Plain values out of whatever a log line, a JSON body or a metric gave: None when unsure."""

from __future__ import annotations

import math
import re
from typing import Any

_INT_TEXT = re.compile(r"[+-]?\d+")


def to_int(value: Any) -> int | None:
    """A plain integer, or None when the value is absent or not exactly an integer.

    Accepts ints, integral finite floats (Prometheus gauges arrive as ``681280.0``) and strings of
    digits. Rejects bools, NaN, infinities, fractions and anything else, since those are not a
    reading of a token count.
    """
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        return None
    if isinstance(value, str):
        text = value.strip()
        if _INT_TEXT.fullmatch(text):
            return int(text)
        return None
    return None


def to_float(text: str | None) -> float | None:
    """A finite float, or None when the text is absent or not one."""
    if text is None:
        return None
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None
