"""The pool preflight's journaled report as an oracle result: every worker's KV pool must hold its
context length (the incident's check, `chaos/preflight.py`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chaos.preflight import STATUS_LABELS
from chaos.verdict import Finding, OracleResult, Verdict

NAME = "pool_preflight"
_VERDICT_OF_STATUS = {label: verdict for verdict, label in STATUS_LABELS.items()}


def pool_preflight_result(report: Mapping[str, Any] | None) -> OracleResult:
    """FAIL for a node whose pool is smaller than its context, INCONCLUSIVE for one unread."""
    if report is None:
        return OracleResult(
            NAME, Verdict.INCONCLUSIVE, notes=["the pool preflight never ran: the run stopped before it"]
        )
    nodes = list(report.get("nodes") or [])
    if not nodes:
        return OracleResult(NAME, Verdict.INCONCLUSIVE, notes=["no worker URLs to read"])
    findings = []
    for node in nodes:
        status = str(node.get("status"))
        verdict = _VERDICT_OF_STATUS.get(status, Verdict.INCONCLUSIVE)
        if verdict is not Verdict.PASS:
            findings.append(
                Finding(
                    NAME,
                    verdict,
                    f"{node.get('name')}: pool {node.get('pool_tokens')} vs context "
                    f"{node.get('context_len')}: {status} ({node.get('reason')})",
                )
            )
    return OracleResult.from_findings(NAME, len(nodes), findings)
