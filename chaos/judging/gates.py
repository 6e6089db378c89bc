"""Run-level gates: reasons the oracles' silence may prove nothing, read from the journal.

Each is an INCONCLUSIVE `Finding`: the run stopped early; planned fault windows never ran; a
window's fault was not confirmed, or saw too few requests in flight; a fault was never healed or
its heal left something; the load generator was saturated (it measured itself, not the target);
no load traffic was recorded.
"""

from __future__ import annotations

from pathlib import Path

from chaos.campaign import Campaign
from chaos.journal import EventKind, RequestRecord
from chaos.loadstats import LoadStats, generator_saturation
from chaos.oracles.base import OracleContext
from chaos.run_evidence import RunEvidence
from chaos.verdict import Finding, Verdict
from chaos.windows import FaultWindow
from faults.provoke import KIND_PROVOCATION
from faults.traffic.exchange import KIND_ABORT, KIND_OVER_LENGTH

# Besides the load, the traffic a window's fault acts on: its own provocation, and a traffic
# fault's own requests (the over-length prompts, the aborted ones); not its calibration.
EXPOSED_KINDS = (KIND_PROVOCATION, KIND_ABORT, KIND_OVER_LENGTH)


def run_gates(ctx: OracleContext, campaign: Campaign, evidence: RunEvidence, load_stats: LoadStats) -> list[Finding]:
    gates: list[Finding] = []
    stopped = evidence.stopped
    if stopped:
        gates.append(Finding("run", Verdict.INCONCLUSIVE, stopped))
    exposed = [r for r in ctx.requests if r.phase == "load" or r.user_kind in EXPOSED_KINDS]
    windows = ctx.windows
    planned = len(campaign.windows())
    if not stopped and len(windows) < planned:
        why = (
            "the target was wedged (see liveness)"
            if any(True for _ in ctx.snapshots("wedged"))
            else "the load ended first (lengthen load.duration or space the windows out)"
        )
        gates.append(
            Finding(
                "gate",
                Verdict.INCONCLUSIVE,
                f"{planned - len(windows)} of {planned} planned fault windows never ran: {why}",
            )
        )
    for window in windows:
        if campaign.gates.require_confirmed_faults and not window.confirmed:
            gates.append(
                Finding(
                    "gate",
                    Verdict.INCONCLUSIVE,
                    f"fault {window.label} was not confirmed: {window.confirm_evidence}",
                    window=window.label,
                )
            )
        inside = sum(1 for r in exposed if _overlaps(r, window))
        if inside < campaign.gates.min_window_requests:
            gates.append(
                Finding(
                    "gate",
                    Verdict.INCONCLUSIVE,
                    f"fault {window.label} saw {inside} requests in flight, fewer than {campaign.gates.min_window_requests}",
                    window=window.label,
                )
            )
    # A window's heal is journaled on every path the run survives: one without it died with the run.
    unhealed = [w.label for w in windows if w.start is not None and w.end is None]
    if unhealed:
        gates.append(
            Finding(
                "gate",
                Verdict.INCONCLUSIVE,
                f"fault(s) never healed: {', '.join(unhealed)} — "
                f"`pdchaos heal {Path(ctx.journal.path).parent}` undoes what they left",
            )
        )
    for event in ctx.journal.iter_events(kind=EventKind.FAULT):
        leftovers = event.data.get("leftovers") if event.data.get("step") == "audit" else None
        if leftovers:
            gates.append(Finding("gate", Verdict.INCONCLUSIVE, f"heal of {event.name} left: {'; '.join(leftovers)}"))
    if saturation := generator_saturation(evidence.generator_cpu, load_stats.send_lag_s):
        gates.append(
            Finding(
                "gate",
                Verdict.INCONCLUSIVE,
                f"the load generator was saturated ({saturation}): it measured itself, not the target",
            )
        )
    if not stopped and not load_stats.requests:
        gates.append(Finding("gate", Verdict.INCONCLUSIVE, "no load traffic was recorded"))
    return gates


def _overlaps(record: RequestRecord, window: FaultWindow) -> bool:
    """The request was in flight while the fault was active (a stalled peer blocks new sends)."""
    if record.t_send is None or window.start is None:
        return False
    end = record.t_end if record.t_end is not None else record.t_send
    return end >= window.start and (window.end is None or record.t_send <= window.end)
