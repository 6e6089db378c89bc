"""The canary oracle: any response that carries another request's marker is a LEAK.

One linear scan per response finds every marker and fragment (chaos/markers.py). A marker
owned by another request of this run is attributed to that request, its victim, whatever the
victim's own outcome (aborted and failed requests are still sources). A verified marker of
another run means the engine served content left over from before this run: also a leak.

A whole marker that fails its check and differs from the request's own in a character or two,
where no request of the run has an id that starts like it, is the model miscopying its own marker
(`MarkerCodec.garbled_own`): not a leak, counted in the notes. Whether the reply is right is the
reference oracle's question.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from chaos.journal import RequestRecord
from chaos.markers import MarkerCodec, MarkerHit
from chaos.oracles.base import OracleContext
from chaos.verdict import Finding, OracleResult, Verdict

CONTEXT_CHARS = 40


def _excerpt(text: str, hit: MarkerHit) -> str:
    start = max(0, hit.offset - CONTEXT_CHARS)
    return text[start : hit.end + CONTEXT_CHARS]


class CanaryLeakOracle:
    name = "canary"

    def evaluate(self, ctx: OracleContext) -> OracleResult:
        codec = MarkerCodec(ctx.run_prefix)
        owners: dict[int, list[RequestRecord]] = defaultdict(list)
        for record in ctx.requests:
            owners[record.request_index].append(record)
        indices = sorted(owners)
        findings: list[Finding] = []
        garbled: list[str] = []
        scanned = 0
        for record in ctx.requests:
            if not record.response_text:
                continue
            scanned += 1
            for hit in codec.scan(record.response_text, own=record.markers):
                if own := codec.garbled_own(hit, record.request_index, indices):
                    garbled.append(f"{record.id} wrote {hit.text} for its own {own}")
                    continue
                finding = self._judge(ctx, codec, record, hit, owners)
                if finding is not None:
                    findings.append(finding)
        notes = []
        if garbled:
            notes.append(
                f"{len(garbled)} own marker(s) miscopied, not leaks (no request of the run has an id that starts "
                f"like them): {'; '.join(garbled[:3])}{' ...' if len(garbled) > 3 else ''}"
            )
        return OracleResult.from_findings(self.name, scanned, findings, notes)

    def _judge(
        self,
        ctx: OracleContext,
        codec: MarkerCodec,
        record: RequestRecord,
        hit: MarkerHit,
        owners: dict[int, list[RequestRecord]],
    ) -> Finding | None:
        evidence: dict[str, Any] = {
            "marker": hit.text,
            "kind": hit.kind.value,
            "offset": hit.offset,
            "verified": hit.verified,
            "excerpt": _excerpt(record.response_text, hit),
            "faults_active": ctx.windows_at(record.t_send),
        }
        if hit.foreign_run:
            if not hit.verified:  # a fragment of an unknown run cannot be told from chance text
                return None
            return Finding(
                self.name,
                Verdict.FAIL,
                f"response to {record.id} carries a marker of another run ({hit.run_prefix})",
                request_id=record.id,
                window=_first(evidence["faults_active"]),
                evidence=evidence,
            )
        if hit.could_be_owned_by(codec.run_prefix, record.request_index):
            return None
        victims = owners.get(hit.request_index, []) if hit.request_index is not None else []
        victim = victims[0] if victims else None
        if victim is not None:
            evidence["victim_faults_active"] = ctx.windows_at(victim.t_send)
            evidence["victim_outcome"] = victim.outcome.value
        who = (
            f"request {victim.id}"
            if victim
            else f"request index {hit.request_index} (not journaled)"
            if hit.request_index is not None
            else "another request (fragment too short to name it)"
        )
        return Finding(
            self.name,
            Verdict.FAIL,
            f"LEAK: response to {record.id} contains {hit.kind.value} marker of {who}",
            request_id=record.id,
            victim_request_id=victim.id if victim else None,
            window=_first(evidence["faults_active"]),
            evidence=evidence,
        )


def _first(labels: list[str]) -> str | None:
    return labels[0] if labels else None
