"""Named load profiles: a user mix (weights by user kind) and the defaults that go with it."""

from __future__ import annotations

from dataclasses import dataclass, field

from loadprofiles.config import USER_KINDS


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    mix: dict[str, float] = field(default_factory=dict)
    max_tokens: int = 32


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            "canary-chat", "short and medium prompts with canary markers; half ask to repeat", {"canary_chat": 1.0}
        ),
        Profile(
            "prefix-sharing",
            "agent traffic: a long shared system prefix and growing conversations",
            {"prefix_sharing": 3.0, "canary_chat": 1.0},
        ),
        Profile("long-context", "prompts near the target's context length", {"long_context": 1.0, "canary_chat": 1.0}),
        Profile(
            "over-length",
            "prompts at and across every length threshold the target reports",
            {"over_length": 1.0, "canary_chat": 2.0},
        ),
        Profile(
            "aborting",
            "clients that disconnect or abort by rid at chosen phases",
            {"aborting": 1.0, "canary_chat": 2.0},
        ),
        Profile(
            "mixed",
            "every user kind: what a qualification run drives",
            {"canary_chat": 4.0, "prefix_sharing": 2.0, "long_context": 1.0, "over_length": 1.0, "aborting": 1.0},
        ),
    )
}

assert all(kind in USER_KINDS for p in PROFILES.values() for kind in p.mix), "a profile names an unknown user kind"
