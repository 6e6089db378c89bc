"""The fault proxy's fault state: what happens to each direction of an affected connection
(`StreamFaults`) and which connections are affected (`FaultSpec`), validated so that an error
names the JSON field."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Direction = Literal["upstream", "downstream"]
DIRECTIONS: tuple[Direction, Direction] = ("upstream", "downstream")


class FaultSpecError(ValueError):
    """A fault spec that cannot be applied; the message names the field."""


def _check_number(
    where: str, value: Any, *, minimum: float = 0.0, integer: bool = False, optional: bool = False
) -> None:
    if value is None and optional:
        return
    # bool is an int in Python; `"latency_ms": true` in JSON is a mistake, not 1 ms.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        kind = "an integer" if integer else "a number"
        raise FaultSpecError(f"{where} must be {kind}{' or null' if optional else ''}, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise FaultSpecError(f"{where} must be a finite number >= {minimum:g}, got {value!r}")


def _check_bool(where: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise FaultSpecError(f"{where} must be true or false, got {value!r}")


def _reject_unknown(where: str, data: Mapping[str, Any], known: set[str]) -> None:
    if not isinstance(data, Mapping):
        raise FaultSpecError(f"{where or 'fault spec'} must be an object, got {type(data).__name__}")
    unknown = sorted(set(data) - known)
    if unknown:
        raise FaultSpecError(
            f"unknown field(s) {', '.join(f'{where}{k}' for k in unknown)}; known: {', '.join(sorted(known))}"
        )


@dataclass(frozen=True)
class StreamFaults:
    """What happens to one direction of an affected connection.

    - latency_ms, jitter_ms: each chunk is held latency +- uniform(jitter) ms (never below 0);
      chunks never overtake each other, so jitter cannot reorder the byte stream.
    - bandwidth_bytes_per_s: pace writes to this rate (None = unlimited).
    - blackhole: read and discard, forward nothing, keep the connection open. Sticky per
      connection: resuming after bytes were dropped would splice a stream with a hole in it.
    - reset: close both sides with a TCP RST (SO_LINGER 0) at the next chunk.
    - truncate_after_bytes: forward this many bytes of the connection's direction, counted from its
      start, then close both sides (FIN; RST when `reset` is also set).
    - slice_bytes, slice_delay_ms: split writes into pieces of at most slice_bytes, each written
      after a pause of slice_delay_ms (exercises a receiver's partial-read handling).
    """

    latency_ms: float = 0.0
    jitter_ms: float = 0.0
    bandwidth_bytes_per_s: float | None = None
    blackhole: bool = False
    reset: bool = False
    truncate_after_bytes: int | None = None
    slice_bytes: int | None = None
    slice_delay_ms: float = 0.0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, where: str = "") -> None:
        _check_number(f"{where}latency_ms", self.latency_ms)
        _check_number(f"{where}jitter_ms", self.jitter_ms)
        _check_number(f"{where}bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, minimum=1, optional=True)
        _check_bool(f"{where}blackhole", self.blackhole)
        _check_bool(f"{where}reset", self.reset)
        _check_number(f"{where}truncate_after_bytes", self.truncate_after_bytes, integer=True, optional=True)
        _check_number(f"{where}slice_bytes", self.slice_bytes, minimum=1, integer=True, optional=True)
        _check_number(f"{where}slice_delay_ms", self.slice_delay_ms)
        if self.slice_delay_ms and self.slice_bytes is None:
            raise FaultSpecError(f"{where}slice_delay_ms needs {where}slice_bytes")

    @property
    def active(self) -> bool:
        return self != NO_FAULTS

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "") -> StreamFaults:
        _reject_unknown(where, data, {f.name for f in dataclasses.fields(cls)})
        # Built without __init__ so a bad value is reported with its JSON path ("upstream.").
        spec = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            object.__setattr__(spec, f.name, data.get(f.name, f.default))
        spec.validate(where)
        return spec

    def to_dict(self) -> dict[str, Any]:
        """Only the fields that differ from a clean link: {} means no fault."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}


NO_FAULTS = StreamFaults()


@dataclass(frozen=True)
class FaultSpec:
    """The proxy's whole fault state. `FaultSpec()` is a clean link.

    `probability` and `seed` pick which connections are affected (see the module docstring);
    `refuse` closes affected new connections at once with a RST, a partition at connection level.
    """

    upstream: StreamFaults = NO_FAULTS
    downstream: StreamFaults = NO_FAULTS
    probability: float = 1.0
    seed: int = 0
    refuse: bool = False

    def __post_init__(self) -> None:
        for name in DIRECTIONS:
            if not isinstance(getattr(self, name), StreamFaults):
                raise FaultSpecError(f"{name} must be StreamFaults, got {type(getattr(self, name)).__name__}")
        _check_number("probability", self.probability)
        if self.probability > 1:
            raise FaultSpecError(f"probability must be in [0, 1], got {self.probability!r}")
        _check_number("seed", self.seed, minimum=-(2**63), integer=True)
        _check_bool("refuse", self.refuse)

    @classmethod
    def both(cls, *, probability: float = 1.0, seed: int = 0, refuse: bool = False, **stream: Any) -> FaultSpec:
        """The same StreamFaults on both directions: `FaultSpec.both(latency_ms=50)`."""
        faults = StreamFaults(**stream)
        return cls(faults, faults, probability, seed, refuse)

    def stream(self, direction: Direction) -> StreamFaults:
        return self.upstream if direction == "upstream" else self.downstream

    @property
    def active(self) -> bool:
        return self.refuse or self.upstream.active or self.downstream.active

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FaultSpec:
        """JSON form: {"upstream": {...}, "downstream": {...}} or {"both": {...}}, plus
        "probability", "seed", "refuse". Unknown keys are errors, not silently ignored faults."""
        _reject_unknown("", data, {"upstream", "downstream", "both", "probability", "seed", "refuse"})
        if "both" in data and ("upstream" in data or "downstream" in data):
            raise FaultSpecError("give either 'both' or 'upstream'/'downstream', not both")
        streams = {
            d: StreamFaults.from_dict(data.get("both", data.get(d, {})), f"{'both' if 'both' in data else d}.")
            for d in DIRECTIONS
        }
        return cls(
            streams["upstream"],
            streams["downstream"],
            data.get("probability", 1.0),
            data.get("seed", 0),
            data.get("refuse", False),
        )

    def to_dict(self) -> dict[str, Any]:
        """Sparse, like StreamFaults.to_dict; a spec that injects nothing is {}, which is what
        `pdchaos heal`'s audit reads as "no faults left" (faults/undo.py)."""
        if not self.active:
            return {}
        out: dict[str, Any] = {d: self.stream(d).to_dict() for d in DIRECTIONS if self.stream(d).active}
        defaults = {"probability": 1.0, "seed": 0, "refuse": False}
        out.update({k: getattr(self, k) for k, v in defaults.items() if getattr(self, k) != v})
        return out


def as_spec(faults: FaultSpec | Mapping[str, Any] | None) -> FaultSpec:
    if faults is None:
        return FaultSpec()
    if isinstance(faults, FaultSpec):
        return faults
    return FaultSpec.from_dict(faults)
