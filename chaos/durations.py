"""Human durations ("90", "45s", "2m", "1h30m", "250ms") to seconds, with errors that say the fix."""

from __future__ import annotations

import re

from chaos.errors import UsageError

_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str | float | int, field: str = "duration") -> float:
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        seconds = float(text)
    else:
        raw = str(text).strip().lower()
        if re.fullmatch(r"\d+(?:\.\d+)?", raw):
            seconds = float(raw)
        else:
            parts = _PART.findall(raw)
            if not parts or "".join(n + u for n, u in parts) != raw:
                raise UsageError(f"{field}: {text!r} is not a duration; write e.g. 90, 45s, 2m or 1h30m")
            seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
    if seconds <= 0:
        raise UsageError(f"{field}: {text!r} must be positive")
    return seconds
