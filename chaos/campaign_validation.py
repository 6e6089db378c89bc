"""Loading a campaign: the schema (chaos/campaign.py), then what only the registries can tell.

Fault names and parameters (faults/registry.py), oracle names (chaos/oracles/registry.py), load
profiles (loadprofiles/profiles.py), the embedded engine's settings and defects (its own section
says, chaos/targets/sim/spec.py), windows inside the load, faults that apply to the target kind,
and settings that would make a check impossible to pass. Every error names the field, the bad
value and the fix; the CLI turns the UsageError into exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from chaos.campaign import Campaign, KnownNames
from chaos.errors import UsageError
from chaos.oracles.registry import ALL_ORACLES
from faults.registry import FAULTS, build_fault
from loadprofiles.profiles import PROFILES


def _location(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "campaign"


CREDENTIAL_FIELDS = frozenset({"api_key_env", "worker_api_key_env", "header_env", "headers"})


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
        hidden = item["type"] in ("missing", "extra_forbidden") or isinstance(value, dict)
        # a credential field's value may be the key itself, pasted by mistake: never echo it
        hidden = hidden or bool(set(map(str, loc)) & CREDENTIAL_FIELDS)
        shown = "" if hidden else f" (got {value!r})"
        lines.append(f"{_location(loc)}: {message}{shown}")
    return "\n  ".join(lines)


def validate_semantics(campaign: Campaign) -> None:
    """Checks that span fields: fault names and parameters, oracle names, windows inside the load."""
    problems = []
    for i, window in enumerate(campaign.faults.windows):
        where = f"faults.windows[{i}]"
        try:
            build_fault(window.fault, window.params, f"{where}.params" if window.fault in FAULTS else f"{where}.fault")
        except UsageError as exc:
            problems.append(str(exc))
        if window.at_s + window.duration_s > campaign.load.duration_s:
            problems.append(
                f"{where}: ends at {window.at_s + window.duration_s:.0f}s, after the load ({campaign.load.duration_s:.0f}s); "
                "shorten it or lengthen load.duration"
            )
    if campaign.faults.random is not None:
        for name in campaign.faults.random.faults:
            if name not in FAULTS:
                problems.append(f"faults.random.faults: unknown fault {name!r}; known: {', '.join(sorted(FAULTS))}")
    problems.extend(campaign.target.sim.problems("target.sim"))
    kind = campaign.target.kind
    for i, window in enumerate(campaign.windows()):
        if window.fault in FAULTS and kind not in FAULTS[window.fault].targets:
            why = (
                "needs a target pdchaos launched (it restarts or reconfigures what it acts on)"
                if kind == "attach"
                else f"does not apply to a {kind} target"
            )
            problems.append(
                f"faults: {window.fault!r} (window {i}) {why}; it applies to: "
                f"{', '.join(sorted(FAULTS[window.fault].targets))}. Drop the window or change target.kind"
            )
    problems.extend(_engine_consistency(campaign))
    if kind == "attach":
        given = {p.role for p in campaign.target.processes if p.pid is not None}
        for i, window in enumerate(campaign.windows()):
            fault = FAULTS.get(window.fault)
            role = window.params.get("role", "prefill")
            if fault is not None and fault.signals_processes and "attach" in fault.targets and role not in given:
                problems.append(
                    f"faults: {window.fault!r} (window {i}) signals the {role} process group, and target.processes "
                    f"gives no {role} pid; add {{role: {role}, pid: PID, log: PATH}} (start the server with setsid)"
                )
    for name in campaign.oracles.enabled:
        if name not in ALL_ORACLES:
            problems.append(f"oracles.enabled: unknown oracle {name!r}; known: {', '.join(sorted(ALL_ORACLES))}")
    if problems:
        raise UsageError("invalid campaign:\n  " + "\n  ".join(problems))


def _engine_consistency(campaign: Campaign) -> list[str]:
    """Settings that make a check impossible to pass or a fault impossible to confirm."""
    problems: list[str] = []
    target = campaign.target
    if target.kind == "sglang" and target.sglang is not None:
        if campaign.oracles.reference_exact and not target.sglang.deterministic:
            problems.append(
                "oracles.reference_exact: true needs target.sglang.deterministic: true "
                "(--enable-deterministic-inference); without it batching changes greedy outputs and the baseline "
                "cannot reproduce. Turn deterministic on, or set reference_exact: false"
            )
        shortest = target.sglang.shortest_transfer_timeout_s
    elif target.kind == "sim":
        shortest = target.sim.shortest_transfer_timeout_s
    else:
        return problems
    for i, window in enumerate(campaign.windows()):
        if window.fault == "transfer_stall" and window.duration_s <= shortest:
            problems.append(
                f"faults: transfer_stall (window {i}) lasts {window.duration_s:g}s, no longer than the peer's "
                f"shortest transfer timeout ({shortest:g}s): nothing can time out, so it can never be confirmed. "
                "Lengthen the window or shorten the timeouts"
            )
    return problems


def parse_campaign(data: Any, source: str = "campaign") -> Campaign:
    if not isinstance(data, dict):
        raise UsageError(f"{source}: a campaign is a YAML mapping with at least `name:`; got {type(data).__name__}")
    try:
        campaign = Campaign.model_validate(data, context=KnownNames(profiles=tuple(PROFILES)))
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
