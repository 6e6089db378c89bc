"""What a Locust process needs to know, handed over as JSON in one environment variable.

The driver (chaos/cluster.py) builds a `LoadConfig` per load actor; the locustfile reads it back
with `LoadConfig.from_env()`. Records go to `records_path` as JSON lines, one
`chaos.journal.RequestRecord` each, which the actor streams back to the driver.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from chaos.targets.discovery import TargetFacts

CONFIG_ENV = "PDCHAOS_LOAD_CONFIG"

UserKind = Literal["canary_chat", "prefix_sharing", "long_context", "over_length", "aborting"]
USER_KINDS: tuple[UserKind, ...] = ("canary_chat", "prefix_sharing", "long_context", "over_length", "aborting")
ShapeKind = Literal["steady", "ramp", "spike", "stages", "soak"]
HttpClient = Literal["fast", "httpx"]


@dataclass(frozen=True)
class Stage:
    until_s: float  # stage ends this many seconds after the start
    users: int
    spawn_rate: float


@dataclass(frozen=True)
class ShapeSpec:
    kind: ShapeKind = "steady"
    duration_s: float = 30.0
    users: int = 8
    spawn_rate: float = 8.0
    stages: tuple[Stage, ...] = ()  # for "stages"; other kinds derive theirs from users/duration


@dataclass(frozen=True)
class LoadConfig:
    run_prefix: str
    target_url: str
    records_path: str
    actor_index: int = 0
    actor_count: int = 1
    facts: TargetFacts = field(default_factory=TargetFacts)
    mix: dict[str, float] = field(default_factory=lambda: {"canary_chat": 1.0})
    shape: ShapeSpec = field(default_factory=ShapeSpec)
    max_tokens: int = 32
    request_timeout_s: float = 60.0
    think_time_s: tuple[float, float] = (0.0, 0.05)
    seed: int = 0
    phase: str = "load"
    index_base: int = 0  # request indices below it are reserved (the runner's probes)
    clock_path: str | None = None  # the schedule clock's state, written by the actor (loadprofiles/clock.py)
    # How the users send: "fast", each on its own lean connection (loadprofiles/http_client.py), or
    # "httpx", the slower client the runner's probes use; the records are the same.
    http_client: HttpClient = "fast"

    def request_index(self, local_sequence: int) -> int:
        """Indices interleave across actors, so markers are unique in the whole run."""
        return self.index_base + local_sequence * self.actor_count + self.actor_index

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LoadConfig:
        data: dict[str, Any] = json.loads(text)
        shape = data.get("shape", {})
        shape["stages"] = tuple(Stage(**s) for s in shape.get("stages", ()))
        data["shape"] = ShapeSpec(**shape)
        facts = data.get("facts", {})
        facts["abort_urls"] = tuple(facts.get("abort_urls", ()))
        data["facts"] = TargetFacts(**facts)
        data["think_time_s"] = tuple(data.get("think_time_s", (0.0, 0.05)))
        return cls(**data)

    @classmethod
    def from_env(cls) -> LoadConfig:
        raw = os.environ.get(CONFIG_ENV)
        if not raw:
            raise RuntimeError(f"{CONFIG_ENV} is not set: this locustfile is started by pdchaos")
        return cls.from_json(raw)
