"""The campaign: one YAML file that says what to qualify, how, and what counts as passing.

This module is the schema alone: every section's shape and the checks that need nothing else.
chaos/campaign_validation.py loads a campaign and checks it against the registries (faults,
oracles, load profiles, the embedded engine's settings and defects); every error names the field,
the bad value and the fix, and the CLI exits 2 without a traceback. `pdchaos schema` prints the
JSON Schema.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from chaos.durations import parse_duration
from chaos.errors import UsageError
from chaos.oracles.base import OracleSettings
from chaos.spec import Strict
from chaos.targets.spec import TargetSpec

Duration = float | int | str


@dataclass(frozen=True)
class KnownNames:
    """The validation context: names a field must be one of, which registries above the schema hold."""

    profiles: tuple[str, ...]  # load profiles (loadprofiles/profiles.py)


def _seconds(value: Duration, field: str) -> float:
    try:
        return parse_duration(value, field)
    except UsageError as exc:
        raise ValueError(str(exc).split(": ", 1)[-1]) from None


class StageSpec(Strict):
    until: Duration = Field(description="the stage lasts until this long after the load starts")
    users: int = Field(ge=0)

    @property
    def until_s(self) -> float:
        return _seconds(self.until, "load.stages.until")


class LoadSpec(Strict):
    profile: str = "mixed"
    users: int = Field(8, ge=1)
    actors: int = Field(1, ge=1)
    shape: Literal["steady", "ramp", "spike", "stages", "soak"] = "steady"
    duration: Duration = "60s"
    max_tokens: int = Field(32, ge=1)
    stages: list[StageSpec] = Field(default_factory=list, description="shape 'stages': users per stage (e.g. a lull)")

    @model_validator(mode="after")
    def _stages_fit(self) -> LoadSpec:
        if self.shape == "stages":
            if not self.stages:
                raise ValueError("shape 'stages' needs stages: [{until: 30s, users: 8}, ...]")
            ends = [s.until_s for s in self.stages]
            if ends != sorted(ends) or abs(ends[-1] - self.duration_s) > 1e-6:
                raise ValueError("stages must be in time order and the last must end at load.duration")
        return self

    @field_validator("duration")
    @classmethod
    def _duration(cls, v: Duration) -> Duration:
        _seconds(v, "duration")
        return v

    @field_validator("profile")
    @classmethod
    def _profile(cls, v: str, info: ValidationInfo) -> str:
        # Checked here, not after the schema, so that an unknown profile is listed with the other
        # field errors; the names come from the caller (chaos/campaign_validation.py).
        if isinstance(info.context, KnownNames) and v not in info.context.profiles:
            raise ValueError(f"unknown profile {v!r}; choose one of {', '.join(info.context.profiles)}")
        return v

    @property
    def duration_s(self) -> float:
        return _seconds(self.duration, "load.duration")


class ProbeSpec(Strict):
    count: int = Field(12, ge=1, le=1000, description="reference probes recorded alone, then replayed under faults")
    interval: Duration = Field("2s", description="replay one probe this often during load")
    timeout: Duration = Field(
        "20s", description="a replayed probe unanswered this long ends its round (a stuck target)"
    )

    @property
    def interval_s(self) -> float:
        return _seconds(self.interval, "probes.interval")

    @property
    def timeout_s(self) -> float:
        return _seconds(self.timeout, "probes.timeout")


class WindowSpec(Strict):
    fault: str
    at: Duration = Field(
        description="seconds after load start, in schedule time: the load's stages wait while an "
        "earlier window runs past its planned end"
    )
    duration: Duration
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("at", "duration")
    @classmethod
    def _positive(cls, v: Duration, info: Any) -> Duration:
        _seconds(v, info.field_name)
        return v

    @property
    def at_s(self) -> float:
        return _seconds(self.at, "at")

    @property
    def duration_s(self) -> float:
        return _seconds(self.duration, "duration")


class RandomSchedule(Strict):
    count: int = Field(3, ge=1)
    faults: list[str] = Field(min_length=1)
    min_duration: Duration = "3s"
    max_duration: Duration = "8s"
    gap: Duration = Field("5s", description="quiet time between windows, for aftershock probes")
    params: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per fault name")


class FaultSchedule(Strict):
    windows: list[WindowSpec] = Field(default_factory=list)
    random: RandomSchedule | None = None


class GateSpec(Strict):
    min_window_requests: int = Field(5, ge=0, description="fewer requests inside a fault window prove nothing")
    require_confirmed_faults: bool = True
    wedged_after_s: float = Field(
        20.0,
        ge=0,
        description="nothing generated this long with requests queued (outside fault windows "
        "and lulls) is a wedged target: the run stops faulting and judges; 0 turns the watchdog off",
    )


class OracleSpec(Strict):
    enabled: list[str] = Field(
        default_factory=lambda: [
            "canary",
            "reference",
            "status",
            "usage",
            "timing",
            "integrity",
            "liveness",
            "tenant_isolation",
        ]
    )
    reference_exact: bool = True
    reference_prefix_tokens: int = Field(8, ge=1)
    reference_max_mismatch_rate: float = Field(0.0, ge=0, le=1)
    request_deadline_s: float = Field(120.0, gt=0)
    drain_timeout_s: float = Field(30.0, gt=0)
    timing_tell_factor: float = Field(0.5, gt=0, le=1)
    pool_preflight: bool = Field(
        True,
        description="judge every worker's KV pool against its context length (the "
        "incident's configuration FAILs); false only for a campaign that builds that "
        "configuration on purpose, to see what each engine release does with it",
    )

    @property
    def past_deadline_s(self) -> float:
        """A client timeout for the suite's own long requests: past the liveness deadline, so a
        request it gives up on is a hang (the liveness oracle says so), not a doubt."""
        return self.request_deadline_s + 1.0

    def settings(self, gates: GateSpec) -> OracleSettings:
        return OracleSettings(
            reference_exact=self.reference_exact,
            reference_prefix_tokens=self.reference_prefix_tokens,
            reference_max_mismatch_rate=self.reference_max_mismatch_rate,
            request_deadline_s=self.request_deadline_s,
            drain_timeout_s=self.drain_timeout_s,
            timing_tell_factor=self.timing_tell_factor,
            min_window_requests=gates.min_window_requests,
        )


ReportFormat = Literal["html", "junit", "json", "markdown"]
REPORT_FORMATS: tuple[ReportFormat, ...] = ("html", "junit", "json", "markdown")


class ReportSpec(Strict):
    formats: list[ReportFormat] = Field(default_factory=lambda: list(REPORT_FORMATS))
    junit_inconclusive: Literal["failure", "skipped"] = Field(
        "failure",
        description="how junit.xml shows an INCONCLUSIVE verdict: a failure (a CI gate must not turn an "
        "unproven run green) or skipped",
    )


class Campaign(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="used in run directory names")
    description: str = ""
    seed: int = 0
    target: TargetSpec = Field(default_factory=TargetSpec)
    load: LoadSpec = Field(default_factory=LoadSpec)
    probes: ProbeSpec = Field(default_factory=ProbeSpec)
    faults: FaultSchedule = Field(default_factory=FaultSchedule)
    gates: GateSpec = Field(default_factory=GateSpec)
    oracles: OracleSpec = Field(default_factory=OracleSpec)
    report: ReportSpec = Field(default_factory=ReportSpec)

    def windows(self) -> list[WindowSpec]:
        """The fault schedule: explicit windows, then a seeded random one, in time order."""
        windows = list(self.faults.windows)
        spec = self.faults.random
        if spec is not None:
            rng = random.Random(self.seed)
            t = _seconds(spec.gap, "faults.random.gap")
            lo, hi = _seconds(spec.min_duration, "min_duration"), _seconds(spec.max_duration, "max_duration")
            for _ in range(spec.count):
                name = rng.choice(spec.faults)
                duration = round(rng.uniform(lo, hi), 1)
                windows.append(
                    WindowSpec(fault=name, at=round(t, 1), duration=duration, params=spec.params.get(name, {}))
                )
                t += duration + _seconds(spec.gap, "faults.random.gap")
        return sorted(windows, key=lambda w: w.at_s)


def json_schema() -> dict[str, Any]:
    return Campaign.model_json_schema()
