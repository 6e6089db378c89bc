"""The fault proxy's counters: what each fault actually did to traffic, the evidence a fault
window is confirmed with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class ProxyStats:
    """What the proxy did. `affected` counts connections a fault actually touched."""

    accepted: int = 0
    active: int = 0
    affected: int = 0
    refused: int = 0
    connect_failures: int = 0
    bytes_up: int = 0  # forwarded client->server
    bytes_down: int = 0  # forwarded server->client
    discarded_bytes: int = 0
    blackholed: int = 0  # connections
    resets: int = 0
    truncations: int = 0
    delayed_chunks: int = 0
    throttled_bytes: int = 0
    sliced_chunks: int = 0

    @property
    def confirmed(self) -> bool:
        """Whether any fault touched traffic; False makes the fault window INCONCLUSIVE."""
        return self.affected > 0

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "confirmed": self.confirmed}

    def since(self, before: ProxyStats) -> ProxyStats:
        """Counters accumulated after the snapshot `before` (`active` stays a current value)."""
        delta = {f.name: getattr(self, f.name) - getattr(before, f.name) for f in dataclasses.fields(self)}
        return ProxyStats(**{**delta, "active": self.active})
