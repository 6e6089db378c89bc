"""The campaign: one YAML file that says what to qualify, how, and what counts as passing.

Validated as a whole before anything starts; every error names the field, the bad value and the
fix, and the CLI exits 2 without a traceback. `pdchaos schema` prints the JSON Schema.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from chaos.durations import parse_duration
from chaos.errors import UsageError
from chaos.oracles.base import OracleSettings
from chaos.spec import Strict
from chaos.targets.sglang.spec import SGLangSpec
from chaos.targets.vllm.spec import VllmSpec


Duration = float | int | str


def _seconds(value: Duration, field: str) -> float:
    try:
        return parse_duration(value, field)
    except UsageError as exc:
        raise ValueError(str(exc).split(": ", 1)[-1]) from None


class RouterSpec(Strict):
    retries: bool = Field(False, description="keep the router's 5xx retries (they hide transfer faults)")
    circuit_breaker: bool = False
    health_check_interval_s: int = Field(5, ge=1)


class SimSpec(Strict):
    """Settings of the embedded engine (both workers unless a role override says otherwise)."""

    page_size: int = Field(16, ge=1)
    context_length: int = Field(4096, ge=64)
    max_total_tokens: int | None = Field(None, ge=64, description="pool size in tokens (default: from the memory fraction)")
    mem_fraction_static: float = Field(0.88, gt=0, lt=1)
    prefill_tokens_per_s: float = Field(10000.0, gt=0, description="prefill speed; TTFT grows with prompt length")
    decode_step_ms: float = Field(4.0, gt=0)
    transfer_tokens_per_s: float = Field(100000.0, gt=0)
    waiting_timeout_s: float = Field(4.0, gt=0, description="SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
    bootstrap_timeout_s: float = Field(6.0, gt=0, description="SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT")
    heartbeat_interval_s: float = Field(5.0, ge=2)
    kv_checksum: bool = False
    proxied_links: bool = Field(False, description="put fault proxies on router->worker and KV transfer links")
    defects: list[str] = Field(default_factory=list, description="defect switches to turn on (pdchaos sim defects)")
    prefill: dict[str, Any] = Field(default_factory=dict, description="settings for prefill only")
    decode: dict[str, Any] = Field(default_factory=dict, description="settings for decode only")
    router: RouterSpec = Field(default_factory=RouterSpec)


class AttachedProcess(Strict):
    """attach: a process of the deployment the suite may signal and whose log it may read."""

    role: Literal["prefill", "decode", "router"]
    pid: int | None = Field(None, ge=1, description="its process group is signalled (start each server with setsid)")
    log: str | None = Field(None, description="path of its log file (for confirmations and the integrity oracle)")


class TargetSpec(Strict):
    kind: Literal["sim", "attach", "sglang", "vllm"] = "sim"
    sim: SimSpec = Field(default_factory=SimSpec)
    sglang: SGLangSpec | None = Field(None, description="kind 'sglang': launch a real SGLang PD deployment")
    vllm: VllmSpec = Field(default_factory=VllmSpec, description="kind 'vllm': launch the vLLM CPU PD pair")
    url: str | None = Field(None, description="attach: the router (or server) URL")
    workers: list[str] = Field(default_factory=list, description="attach: worker URLs (abort, loads, metrics)")
    processes: list[AttachedProcess] = Field(default_factory=list, description="attach: processes the suite may act on")

    @model_validator(mode="after")
    def _kind_has_its_section(self) -> TargetSpec:
        if self.kind == "sglang" and self.sglang is None:
            raise ValueError("kind 'sglang' needs a sglang section, at least sglang: {model_path: /models/...}")
        if self.kind == "attach":
            if not self.url:
                raise ValueError("kind 'attach' needs url: the router or server to qualify, e.g. http://127.0.0.1:30000")
            if not self.url.startswith(("http://", "https://")):
                raise ValueError(f"url {self.url!r} must start with http:// or https://")
        return self


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
    def _profile(cls, v: str) -> str:
        from loadprofiles.profiles import PROFILES

        if v not in PROFILES:
            raise ValueError(f"unknown profile {v!r}; choose one of {', '.join(PROFILES)}")
        return v

    @property
    def duration_s(self) -> float:
        return _seconds(self.duration, "load.duration")


class ProbeSpec(Strict):
    count: int = Field(12, ge=1, le=1000, description="reference probes recorded alone, then replayed under faults")
    interval: Duration = Field("2s", description="replay one probe this often during load")
    timeout: Duration = Field("20s", description="a replayed probe unanswered this long ends its round (a stuck target)")

    @property
    def interval_s(self) -> float:
        return _seconds(self.interval, "probes.interval")

    @property
    def timeout_s(self) -> float:
        return _seconds(self.timeout, "probes.timeout")


class WindowSpec(Strict):
    fault: str
    at: Duration = Field(description="seconds after load start, in schedule time: the load's stages wait while an "
                                     "earlier window runs past its planned end")
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
    wedged_after_s: float = Field(20.0, ge=0, description="nothing generated this long with requests queued (outside fault windows "
                                  "and lulls) is a wedged target: the run stops faulting and judges; 0 turns the watchdog off")


class OracleSpec(Strict):
    enabled: list[str] = Field(default_factory=lambda: ["canary", "reference", "status", "usage", "timing", "integrity",
                                                        "liveness", "tenant_isolation"])
    reference_exact: bool = True
    reference_prefix_tokens: int = Field(8, ge=1)
    reference_max_mismatch_rate: float = Field(0.0, ge=0, le=1)
    request_deadline_s: float = Field(120.0, gt=0)
    drain_timeout_s: float = Field(30.0, gt=0)
    timing_tell_factor: float = Field(0.5, gt=0, le=1)
    pool_preflight: bool = Field(True, description="judge every worker's KV pool against its context length (the "
                                 "incident's configuration FAILs); false only for a campaign that builds that "
                                 "configuration on purpose, to see what each engine release does with it")

    def settings(self, gates: GateSpec) -> OracleSettings:
        return OracleSettings(
            reference_exact=self.reference_exact, reference_prefix_tokens=self.reference_prefix_tokens,
            reference_max_mismatch_rate=self.reference_max_mismatch_rate, request_deadline_s=self.request_deadline_s,
            drain_timeout_s=self.drain_timeout_s, timing_tell_factor=self.timing_tell_factor,
            min_window_requests=gates.min_window_requests,
        )


class ReportSpec(Strict):
    formats: list[Literal["html", "junit", "json", "markdown"]] = Field(default_factory=lambda: ["html", "junit", "json", "markdown"])
    junit_inconclusive: Literal["failure", "skipped"] = Field(
        "failure", description="how junit.xml shows an INCONCLUSIVE verdict: a failure (a CI gate must not turn an "
        "unproven run green) or skipped")


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
                windows.append(WindowSpec(fault=name, at=round(t, 1), duration=duration, params=spec.params.get(name, {})))
                t += duration + _seconds(spec.gap, "faults.random.gap")
        return sorted(windows, key=lambda w: w.at_s)


def _location(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "campaign"


def _format(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        loc = tuple(p for p in item["loc"] if not (isinstance(p, str) and p.startswith(("function-", "tagged-union"))))
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            message = "unknown field; check its spelling (pdchaos schema lists every field)"
        elif item["type"] == "missing":
            message = "required field is missing"
        value = item.get("input")
        shown = "" if item["type"] in ("missing", "extra_forbidden") or isinstance(value, dict) else f" (got {value!r})"
        lines.append(f"{_location(loc)}: {message}{shown}")
    return "\n  ".join(lines)


def validate_semantics(campaign: Campaign) -> None:
    """Checks that span fields: fault names and parameters, oracle names, windows inside the load."""
    from chaos.oracles.registry import ALL_ORACLES
    from faults.registry import FAULTS, build_fault

    problems = []
    for i, window in enumerate(campaign.faults.windows):
        where = f"faults.windows[{i}]"
        try:
            build_fault(window.fault, window.params, f"{where}.params" if window.fault in FAULTS else f"{where}.fault")
        except UsageError as exc:
            problems.append(str(exc))
        if window.at_s + window.duration_s > campaign.load.duration_s:
            problems.append(f"{where}: ends at {window.at_s + window.duration_s:.0f}s, after the load ({campaign.load.duration_s:.0f}s); "
                            "shorten it or lengthen load.duration")
    if campaign.faults.random is not None:
        for name in campaign.faults.random.faults:
            if name not in FAULTS:
                problems.append(f"faults.random.faults: unknown fault {name!r}; known: {', '.join(sorted(FAULTS))}")
    from chaos.targets.sim.defects import DEFECTS

    import dataclasses

    from chaos.targets.sim.settings import WorkerSettings

    known = {f.name for f in dataclasses.fields(WorkerSettings)} - {"role", "host", "port", "bootstrap_port"}
    for role in ("prefill", "decode"):
        overrides = getattr(campaign.target.sim, role)
        unknown = sorted(set(overrides) - known)
        if unknown:
            problems.append(f"target.sim.{role}: unknown setting(s) {', '.join(unknown)}; settable: {', '.join(sorted(known))}")
            continue
        try:
            dataclasses.replace(WorkerSettings(), **overrides)
        except (TypeError, ValueError) as exc:
            problems.append(f"target.sim.{role}: {exc}")
    for name in campaign.target.sim.defects:
        if name not in DEFECTS:
            problems.append(f"target.sim.defects: unknown defect {name!r}; known: {', '.join(DEFECTS)} (pdchaos sim defects)")
    kind = campaign.target.kind
    for i, window in enumerate(campaign.windows()):
        if window.fault in FAULTS and kind not in FAULTS[window.fault].targets:
            why = ("needs a target pdchaos launched (it restarts or reconfigures what it acts on)"
                   if kind == "attach" else f"does not apply to a {kind} target")
            problems.append(f"faults: {window.fault!r} (window {i}) {why}; it applies to: "
                            f"{', '.join(sorted(FAULTS[window.fault].targets))}. Drop the window or change target.kind")
    problems.extend(_engine_consistency(campaign))
    if kind == "attach":
        given = {p.role for p in campaign.target.processes if p.pid is not None}
        for i, window in enumerate(campaign.windows()):
            fault = FAULTS.get(window.fault)
            role = window.params.get("role", "prefill")
            if fault is not None and fault.signals_processes and "attach" in fault.targets and role not in given:
                problems.append(f"faults: {window.fault!r} (window {i}) signals the {role} process group, and target.processes "
                                f"gives no {role} pid; add {{role: {role}, pid: PID, log: PATH}} (start the server with setsid)")
    for name in campaign.oracles.enabled:
        if name not in ALL_ORACLES:
            problems.append(f"oracles.enabled: unknown oracle {name!r}; known: {', '.join(sorted(ALL_ORACLES))}")
    if problems:
        raise UsageError("invalid campaign:\n  " + "\n  ".join(problems))


SGLANG_DEFAULT_TIMEOUT_S = 300.0  # SGLANG_DISAGGREGATION_{BOOTSTRAP,WAITING}_TIMEOUT when unset


def _engine_consistency(campaign: Campaign) -> list[str]:
    """Settings that make a check impossible to pass or a fault impossible to confirm."""
    problems: list[str] = []
    target = campaign.target
    if target.kind == "sglang" and target.sglang is not None:
        if campaign.oracles.reference_exact and not target.sglang.deterministic:
            problems.append("oracles.reference_exact: true needs target.sglang.deterministic: true "
                            "(--enable-deterministic-inference); without it batching changes greedy outputs and the baseline "
                            "cannot reproduce. Turn deterministic on, or set reference_exact: false")
        timeouts = [t if t is not None else SGLANG_DEFAULT_TIMEOUT_S
                    for t in (target.sglang.waiting_timeout_s, target.sglang.bootstrap_timeout_s)]
    elif target.kind == "sim":
        timeouts = [target.sim.waiting_timeout_s, target.sim.bootstrap_timeout_s]
    else:
        return problems
    shortest = min(timeouts)
    for i, window in enumerate(campaign.windows()):
        if window.fault == "transfer_stall" and window.duration_s <= shortest:
            problems.append(f"faults: transfer_stall (window {i}) lasts {window.duration_s:g}s, no longer than the peer's "
                            f"shortest transfer timeout ({shortest:g}s): nothing can time out, so it can never be confirmed. "
                            "Lengthen the window or shorten the timeouts")
    return problems


def parse_campaign(data: Any, source: str = "campaign") -> Campaign:
    if not isinstance(data, dict):
        raise UsageError(f"{source}: a campaign is a YAML mapping with at least `name:`; got {type(data).__name__}")
    try:
        campaign = Campaign.model_validate(data)
    except ValidationError as exc:
        raise UsageError(f"invalid campaign {source}:\n  {_format(exc)}") from None
    validate_semantics(campaign)
    return campaign


def load_campaign(path: Path) -> Campaign:
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read campaign {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise UsageError(f"{path} is not valid YAML: {exc}") from None
    return parse_campaign(data, str(path))


def json_schema() -> dict[str, Any]:
    return Campaign.model_json_schema()
