"""The reference oracle: a probe's greedy output under load and faults equals its isolated baseline.

The runner sends each probe prompt alone, with no load (`phase == "baseline"`), and replays the
same prompt, under the same `request_index`, during load and after faults. A replay that came
back 200 and finished must reproduce the baseline:

* exactly, when `settings.reference_exact` (the embedded engine, engines in a deterministic mode);
* else on the first `settings.reference_prefix_tokens` whitespace tokens (real engines drift by an
  ULP here and there and may diverge late; e.g. TensorRT-LLM #15503).

Mismatches are then counted against the replays checked: the run FAILs when the mismatch rate is
above `settings.reference_max_mismatch_rate` (0 on the embedded engine; for a real engine, the rate
measured on clean runs). A tolerated mismatch is reported in the notes, never silently dropped.

A replay that ended early with a 200 (an in-band abort, a stream cut short) is still held to the
reference as far as it got: its text must be a prefix of the reference. A replay that failed
(not 200) is no mismatch (the status, liveness and integrity oracles judge it) and is not counted
as checked.

What cannot be judged is INCONCLUSIVE, per probe: no baseline, or no 200 baseline. Repeated
baselines of one probe that disagree are INCONCLUSIVE (docs/architecture.md, "Decisions": the clean baseline did
not reproduce) unless the campaign asserts exact determinism: then they are a FAIL, since an
isolated greedy request that changes read KV it did not write (bug class K2, e.g. vLLM #31210).
Baselines sent with a different `max_tokens` than a replay are compared on their common part:
the shorter output must be a prefix of the longer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from chaos.journal import Outcome, RequestRecord
from chaos.oracles.base import PROBE_KIND, OracleContext, OracleSettings
from chaos.verdict import Finding, OracleResult, Verdict

BASELINE_PHASE = "baseline"
EXCERPT_CHARS = 120
MAX_FINDINGS_PER_PROBE = 10  # a probe that always mismatches says so once per replay, up to this


@dataclass(frozen=True)
class Comparison:
    matches: bool
    divergence: int | None = None  # char offset (exact) or token index (prefix mode) of the first difference
    compared: str = ""  # what was compared, for the evidence


def compare(
    reference: str, candidate: str, settings: OracleSettings, *, partial: bool = False, prefix_ok: bool = False
) -> Comparison:
    """Does `candidate` reproduce `reference` under the settings?

    `partial`: the candidate ended early, so only what it has must agree (it is a prefix).
    `prefix_ok`: the two were generated with different token limits, so the shorter one must be a
    prefix of the longer one.
    """
    if settings.reference_exact:
        if partial:
            return _exact_prefix(reference, candidate, "candidate is a prefix of the reference")
        if prefix_ok:
            short, long_ = sorted((reference, candidate), key=len)
            result = _exact_prefix(long_, short, "the shorter output is a prefix of the longer")
            return result
        if reference == candidate:
            return Comparison(True, compared="exact text")
        return Comparison(False, _first_difference(reference, candidate), "exact text")
    limit = settings.reference_prefix_tokens
    ref_tokens = reference.split()[:limit]
    cand_tokens = candidate.split()
    if partial:
        # The last token of a cut-off text may itself be cut: compare only the whole ones.
        cand_tokens = cand_tokens[: max(0, len(cand_tokens) - 1)]
    cand_tokens = cand_tokens[:limit]
    what = f"first {limit} whitespace tokens"
    if partial or prefix_ok:
        n = min(len(ref_tokens), len(cand_tokens))
        ref_tokens, cand_tokens = ref_tokens[:n], cand_tokens[:n]
    if ref_tokens == cand_tokens:
        return Comparison(True, compared=what)
    return Comparison(False, _first_difference(ref_tokens, cand_tokens), what)


def _exact_prefix(full: str, prefix: str, what: str) -> Comparison:
    if full.startswith(prefix):
        return Comparison(True, compared=what)
    return Comparison(False, _first_difference(full, prefix), what)


def _first_difference(a: str | list[str], b: str | list[str]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _excerpt(text: str, at: int | None) -> str:
    start = max(0, (at or 0) - EXCERPT_CHARS // 4)
    return text[start : start + EXCERPT_CHARS]


def _is_complete(record: RequestRecord) -> bool:
    return record.status == 200 and record.outcome is Outcome.OK and record.finish_reason != "abort"


def _first(labels: list[str]) -> str | None:
    return labels[0] if labels else None


class ReferenceOracle:
    name = "reference"

    def evaluate(self, ctx: OracleContext) -> OracleResult:
        settings = ctx.settings
        probes: dict[int, list[RequestRecord]] = defaultdict(list)
        for record in ctx.requests:
            if record.user_kind == PROBE_KIND:
                probes[record.request_index].append(record)
        findings: list[Finding] = []
        notes: list[str] = []
        checked = mismatched = partial_checked = 0
        mismatches: list[Finding] = []
        for index in sorted(probes):
            records = probes[index]
            baselines = [r for r in records if r.phase == BASELINE_PHASE]
            replays = [r for r in records if r.phase != BASELINE_PHASE]
            reference, problem = self._reference(index, baselines, settings)
            if reference is None:
                assert problem is not None
                findings.append(problem)
                continue
            per_probe = 0
            for replay in replays:
                if replay.status != 200:
                    continue  # failed: judged by the status/liveness/integrity oracles
                complete = _is_complete(replay)
                if not complete and not replay.response_text:
                    continue  # ended before any text: nothing to compare
                prefix_ok = replay.max_tokens != reference.max_tokens
                result = compare(
                    reference.response_text, replay.response_text, settings, partial=not complete, prefix_ok=prefix_ok
                )
                checked += 1
                partial_checked += 0 if complete else 1
                if result.matches:
                    continue
                mismatched += 1
                if per_probe >= MAX_FINDINGS_PER_PROBE:
                    continue
                per_probe += 1
                faults = ctx.windows_at(replay.t_send)
                mismatches.append(
                    Finding(
                        self.name,
                        Verdict.FAIL,
                        f"probe {index}: {'partial ' if not complete else ''}response to {replay.id} differs from its "
                        f"isolated reference {reference.id} ({result.compared}, first difference at {result.divergence})",
                        request_id=replay.id,
                        window=_first(faults),
                        evidence={
                            "probe": index,
                            "reference_id": reference.id,
                            "phase": replay.phase,
                            "compared": result.compared,
                            "divergence": result.divergence,
                            "expected": _excerpt(reference.response_text, result.divergence),
                            "got": _excerpt(replay.response_text, result.divergence),
                            "finish_reason": replay.finish_reason,
                            "faults_active": faults,
                        },
                    )
                )
        rate = mismatched / checked if checked else 0.0
        tolerance = settings.reference_max_mismatch_rate
        mode = "exact" if settings.reference_exact else f"first {settings.reference_prefix_tokens} whitespace tokens"
        notes.append(
            f"compared {checked} replay(s) of {len(probes)} probe(s) ({partial_checked} partial) by {mode}; "
            f"{mismatched} mismatch(es), rate {rate:.4f}, allowed {tolerance:.4f}"
        )
        if tolerance > 0:
            notes.append(
                f"mismatch tolerance {tolerance:.4f} is a calibrated allowance for numeric drift "
                "(measured on clean runs of this engine)"
            )
        if mismatched and rate <= tolerance:
            notes.append(
                f"{mismatched} mismatch(es) tolerated: rate {rate:.4f} <= {tolerance:.4f}; "
                f"first: {mismatches[0].summary}"
            )
        elif mismatched:
            findings.extend(mismatches)
        return OracleResult.from_findings(self.name, checked, findings, notes)

    def _reference(
        self, index: int, baselines: list[RequestRecord], settings: OracleSettings
    ) -> tuple[RequestRecord | None, Finding | None]:
        """The probe's reference record, or why there is none (an INCONCLUSIVE finding)."""
        if not baselines:
            return None, Finding(
                self.name, Verdict.INCONCLUSIVE, f"probe {index}: no baseline was recorded", evidence={"probe": index}
            )
        good = [b for b in baselines if _is_complete(b)]
        if not good:
            first = baselines[0]
            return None, Finding(
                self.name,
                Verdict.INCONCLUSIVE,
                f"probe {index}: baseline {first.id} did not succeed (status {first.status}, finish {first.finish_reason})",
                request_id=first.id,
                evidence={"probe": index, "statuses": [b.status for b in baselines], "error_class": first.error_class},
            )
        reference = good[0]
        for other in good[1:]:
            result = compare(
                reference.response_text,
                other.response_text,
                settings,
                prefix_ok=other.max_tokens != reference.max_tokens,
            )
            if not result.matches:
                # Where the campaign asserts determinism (the embedded engine, deterministic mode),
                # an isolated greedy request that changes between two sends read KV it did not
                # write: that is a finding. Elsewhere it only means the baseline proves nothing.
                verdict = Verdict.FAIL if settings.reference_exact else Verdict.INCONCLUSIVE
                return None, Finding(
                    self.name,
                    verdict,
                    f"probe {index}: baseline did not reproduce ({reference.id} vs {other.id}, "
                    f"{result.compared}, first difference at {result.divergence})",
                    request_id=other.id,
                    evidence={
                        "probe": index,
                        "reference_id": reference.id,
                        "expected": _excerpt(reference.response_text, result.divergence),
                        "got": _excerpt(other.response_text, result.divergence),
                    },
                )
        return reference, None
