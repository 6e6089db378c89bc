"""`report.json`: the machine-readable report (schema `pdchaos.report/1`).

Stable keys for tools: `verdict` (PASS | FAIL | INCONCLUSIVE), `exit_code`, `complete` (false:
the run stopped before it recorded a verdict, and this one was judged from its journal), `reasons`, `campaign`, `target`, `run`, `faults`, `oracles` (with every finding),
`matrix`, `gates`, `leaks`, `requests`, `latency` (seconds), `error_classes`, `environment`,
`problems`. Times are epoch seconds plus `*_offset_s` from the run's start.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from chaos.loadstats import Distribution
from chaos.verdict import Finding
from reports.model import RunReport
from reports.traffic import LatencyStats

SCHEMA = "pdchaos.report/1"


def report_json(report: RunReport) -> dict[str, Any]:
    t = report.traffic
    campaign = report.meta.get("campaign") if isinstance(report.meta.get("campaign"), dict) else None
    return {
        "schema": SCHEMA,
        "verdict": report.verdict_label,
        "exit_code": report.exit_code,
        "complete": report.complete,
        "reasons": report.reasons,
        "campaign": {"name": report.campaign_name, "seed": report.seed, "spec": campaign},
        "target": report.target,
        "run": {
            "dir": str(report.run_dir),
            "run_prefix": report.meta.get("run_prefix"),
            "started_at": report.started_at,
            "ended_at": report.ended_at,
            "phases": [{"name": p.name, "t": p.t, "offset_s": p.t - report.origin} for p in report.phases],
            "generator_saturated": report.run_verdict.generator_saturated,
        },
        "faults": [
            {
                "name": f.fault,
                "window": f.window_id,
                "label": f.label,
                "params": f.params,
                "start": f.start,
                "end": f.end,
                "start_offset_s": report.offset(f.start),
                "end_offset_s": report.offset(f.end),
                "duration_s": f.duration_s,
                "confirmed": f.confirmed,
                "confirm_evidence": f.confirm_evidence,
                "healed": f.end is not None and f.healed,
                "audit_clean": f.audit_clean,
                "leftovers": f.leftovers,
                "error": f.error,
                "provocation": f.provocation,
                "traffic": _latency(t.per_window.get(f.label, LatencyStats())),
            }
            for f in report.faults
        ],
        "oracles": [
            {
                "name": o.name,
                "verdict": o.verdict.value,
                "checked": o.checked,
                "evidence_count": len(o.findings),
                "notes": o.notes,
                "findings": [finding_json(f) for f in o.findings],
            }
            for o in report.oracles
        ],
        "matrix": [
            {
                "window": row.key,
                "fault": row.fault.fault if row.fault else None,
                "oracle": c.oracle,
                "verdict": c.verdict.value if c.verdict else None,
                "findings": len(c.findings),
                "why": c.why,
            }
            for row in report.matrix
            for c in row.cells
        ],
        "gates": [finding_json(g) for g in report.gates],
        "leaks": [
            {
                "request_id": leak.finding.request_id,
                "victim_request_id": leak.finding.victim_request_id,
                "marker": leak.marker,
                "kind": leak.kind,
                "excerpt": leak.excerpt,
                "window": leak.finding.window,
                "faults_active": leak.faults_active,
                "victim_faults_active": leak.victim_faults_active,
                "summary": leak.finding.summary,
            }
            for leak in report.leaks
        ],
        "requests": {
            **t.counts.to_json(),
            "endings": report.endings.to_json(),
            "by_phase": {k: v.to_json() for k, v in t.by_phase.items()},
            "by_user_kind": {k: v.to_json() for k, v in t.by_user_kind.items()},
        },
        "latency": {
            "overall": _latency(t.overall),
            "outside_faults": _latency(t.outside_faults),
            "under_faults": _latency(t.under_faults),
        },
        "error_classes": {"all": t.error_classes, "under_faults": t.error_classes_under_faults},
        "environment": report.environment,
        "problems": report.problems,
    }


def render_json(report: RunReport) -> str:
    return json.dumps(report_json(report), indent=2, default=str) + "\n"


def finding_json(f: Finding) -> dict[str, Any]:
    data = dataclasses.asdict(f)
    data["verdict"] = f.verdict.value
    return data


def _latency(s: LatencyStats) -> dict[str, Any]:
    return {
        "requests": s.counts.to_json(),
        "error_rate": s.error_rate,
        "ttft_s": _dist(s.ttft),
        "itl_s": _dist(s.itl),
        "e2e_s": _dist(s.e2e),
    }


def _dist(d: Distribution) -> dict[str, Any]:
    return {"count": d.count, "p50": d.p50, "p90": d.p90, "p99": d.p99, "max": d.max}
