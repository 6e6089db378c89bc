"""The engine-integrity oracle: what the engine itself says about corruption and failed transfers.

Logs (`ctx.logs`, role -> text) are scanned line by line (SGLang's lines: docs/real-sglang.md):

* **Corruption signals** are FAIL, each with its line, role, bootstrap room and the request when
  the line names a `rid` the journal knows: `kv_canary violation`, `Context corruption detected`
  (decode's metadata-room check), `KV checksum mismatch` (PR #39500-style transfer checksum; the
  embedded engine logs `KV checksum mismatch for bootstrap_room=R`), `Metadata corruption
  detected`, and vLLM's `Potentially invalid KV blocks for unrecognized request ... were
  retrieved by a decode worker` (prefill had freed a request's blocks when its KV lease expired,
  and a decode read them afterwards: a read after free, bug class K1 in docs/architecture.md). An
  engine that detects corruption and aborts the request has still had its KV
  overwritten: the run must not pass. One finding per (role, signal, room); repeats are counted.
* **Transfer-failure signals** (`KVTransferError(bootstrap_room=`, `Failed to send kv chunk`,
  `Failed to get kvcache from prefill instance`, `Lost connection with prefill instance`, the
  `timed out after ... in KVPoll.*` and Mooncake `... transfer timeout` lines; vLLM's `NIXL
  transfer failure`, `Failing N request(s) due to KV load failure` and `Releasing expired KV
  blocks`) are the expected
  consequence of transfer faults: never FAIL, never INCONCLUSIVE. They are reported in the notes
  with counts per role and signal, and how many fell inside a fault window (including its
  aftershock). Failures outside every window are called out as unexplained in a note: on a
  fault-free run they are spurious aborts (as in SGLang PR #27374) worth a look, but
  the client-visible consequence (a 5xx, a hang) is for the status and liveness oracles to judge.

A log line's time is its `[YYYY-mm-dd HH:MM:SS ...]` header in local time with one-second
resolution, so a line counts as inside a window when [t, t + 1) overlaps it.

Metrics: the runner's `probe/metrics` snapshots (`{"role", "phase": "before"|"after", "text"}`)
give the increase of `sglang:num_transfer_failed_reqs_total` and
`sglang:num_bootstrap_failed_reqs_total` per role over the run, reported in the notes.

With neither logs nor metric snapshots the oracle has checked nothing: INCONCLUSIVE.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime

from chaos.facts.log_records import LogLine, iter_log_records
from chaos.facts.prometheus import Sample, find_samples, parse_prometheus_text
from chaos.oracles.base import OracleContext
from chaos.verdict import Finding, OracleResult, Verdict
from chaos.windows import AFTERSHOCK_S, FaultWindow

# Checked in order: the first that matches classifies the line.
CORRUPTION_SIGNALS: tuple[tuple[str, str], ...] = (
    ("kv_canary_violation", "kv_canary violation"),
    ("context_corruption", "Context corruption detected"),
    ("metadata_corruption", "Metadata corruption detected"),
    ("kv_checksum_mismatch", "KV checksum mismatch"),
    ("stale_kv_read", "Potentially invalid KV blocks"),
)
TRANSFER_SIGNALS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("kv_transfer_error", re.compile(r"KVTransferError\(bootstrap_room=")),
    ("send_kv_chunk_failed", re.compile(r"Failed to send kv chunk")),
    ("get_kvcache_failed", re.compile(r"Failed to get kvcache from prefill instance")),
    ("lost_prefill_connection", re.compile(r"Lost connection with prefill instance")),
    ("poll_timeout", re.compile(r"timed out after [\d.]+s in KVPoll\.")),
    ("transfer_timeout", re.compile(r"[Tt]ransfer timeout")),
    ("nixl_transfer_failure", re.compile(r"NIXL transfer failure")),
    ("kv_load_failure", re.compile(r"Failing \d+ request\(s\) due to KV load failure")),
    ("kv_lease_expired", re.compile(r"Releasing expired KV blocks")),
)
FAILED_COUNTERS = (
    "sglang:num_transfer_failed_reqs_total",
    "sglang:num_bootstrap_failed_reqs_total",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:nixl_num_kv_expired_reqs_total",
)
_VLLM_REQUEST = re.compile(r"unrecognized request (\S+) were retrieved")
_ROOM = re.compile(r"bootstrap_room[=:]\s*(\d+)")
_RID = re.compile(r"\brid[=:]\s*'?([A-Za-z0-9_.:\-]+)")
_REQUEST = re.compile(
    r"\bRequest\s+([A-Za-z0-9_.:\-]+)\s+\(bootstrap_room"
)  # "Context corruption detected: Request X (bootstrap_room=A)"
_TS_FORMATS = ("%Y-%m-%d %H:%M:%S.%f", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S.%f", "%Y-%m-%dT%H:%M:%S")
MAX_EXAMPLES = 3
LINE_CHARS = 400


def log_time(timestamp: str | None) -> float | None:
    """Epoch seconds of a log header timestamp (local time), or None."""
    if not timestamp:
        return None
    text = timestamp.replace(",", ".")
    for fmt in _TS_FORMATS:
        try:
            return datetime.strptime(text, fmt).timestamp()
        except ValueError:
            continue
    return None


def windows_overlapping(windows: list[FaultWindow], t: float | None, width_s: float = 1.0) -> list[str]:
    """Windows (with aftershock) that overlap [t, t + width): a log line's second."""
    if t is None:
        return []
    return [
        w.label
        for w in windows
        if w.start is not None and w.start < t + width_s and (w.end is None or t <= w.end + AFTERSHOCK_S)
    ]


@dataclass
class TransferTally:
    count: int = 0
    in_window: int = 0
    untimed: int = 0
    examples: list[str] | None = None

    def add(self, line: str, timed: bool, inside: bool) -> None:
        self.count += 1
        self.untimed += not timed
        self.in_window += inside
        if self.examples is None:
            self.examples = []
        if not inside and len(self.examples) < MAX_EXAMPLES:
            self.examples.append(line[:200])


class EngineIntegrityOracle:
    name = "integrity"

    def evaluate(self, ctx: OracleContext) -> OracleResult:
        known_ids = {r.id for r in ctx.requests}
        findings: list[Finding] = []
        seen_corruption: dict[tuple[str, str, str], Finding] = {}
        repeats: Counter[tuple[str, str, str]] = Counter()
        tallies: dict[tuple[str, str], TransferTally] = defaultdict(TransferTally)
        lines_scanned = 0
        for role, text in sorted(ctx.logs.items()):
            for record in iter_log_records(text.splitlines()):
                lines_scanned += 1
                self._scan_line(ctx, role, record, known_ids, findings, seen_corruption, repeats, tallies)
        for key, finding in seen_corruption.items():
            if repeats[key] > 1:
                finding.evidence["occurrences"] = repeats[key]
        notes = [
            f"scanned {lines_scanned} log line(s) of {len(ctx.logs)} role(s): {', '.join(sorted(ctx.logs)) or 'none'}"
        ]
        notes.extend(self._transfer_notes(ctx, tallies))
        metric_notes, metric_checks = self._metric_notes(ctx)
        notes.extend(metric_notes)
        return OracleResult.from_findings(self.name, lines_scanned + metric_checks, findings, notes)

    def _scan_line(
        self,
        ctx: OracleContext,
        role: str,
        line: LogLine,
        known_ids: set[str],
        findings: list[Finding],
        seen: dict[tuple[str, str, str], Finding],
        repeats: Counter[tuple[str, str, str]],
        tallies: dict[tuple[str, str], TransferTally],
    ) -> None:
        message = line.message
        t = log_time(line.timestamp)
        faults = windows_overlapping(ctx.windows, t)
        for signal, needle in CORRUPTION_SIGNALS:
            if needle not in message:
                continue
            room_match = _ROOM.search(message)
            room = room_match.group(1) if room_match else f"line{line.lineno}"
            key = (role, signal, room)
            repeats[key] += 1
            if key in seen:
                return
            rid = self._request_id(message, known_ids)
            finding = Finding(
                self.name,
                Verdict.FAIL,
                f"{role} log reports corruption ({signal}): {message[:160]}",
                request_id=rid,
                window=faults[0] if faults else None,
                evidence={
                    "role": role,
                    "signal": signal,
                    "line": message[:LINE_CHARS],
                    "lineno": line.lineno,
                    "timestamp": line.timestamp,
                    "bootstrap_room": room_match.group(1) if room_match else None,
                    "faults_active": faults,
                },
            )
            seen[key] = finding
            findings.append(finding)
            return
        for signal, pattern in TRANSFER_SIGNALS:
            if pattern.search(message):
                tallies[(role, signal)].add(message, timed=t is not None, inside=bool(faults))
                return

    @staticmethod
    def _request_id(message: str, known_ids: set[str]) -> str | None:
        match = _RID.search(message) or _REQUEST.search(message) or _VLLM_REQUEST.search(message)
        if match is None:
            return None
        rid = match.group(1)
        if rid in known_ids:
            return rid
        # SGLang matches rids by prefix; a worker may log a longer, derived id.
        candidates = [i for i in known_ids if rid.startswith(i) or i.startswith(rid)]
        return candidates[0] if len(candidates) == 1 else None

    @staticmethod
    def _transfer_notes(ctx: OracleContext, tallies: dict[tuple[str, str], TransferTally]) -> list[str]:
        if not tallies:
            return ["no transfer-failure signals in the logs"]
        notes = []
        unexplained = 0
        for (role, signal), tally in sorted(tallies.items()):
            outside = tally.count - tally.in_window
            unexplained += outside
            notes.append(
                f"transfer failures: {role} {signal} x{tally.count}, {tally.in_window} inside a fault window"
                + (f", {tally.untimed} without a timestamp" if tally.untimed else "")
            )
        if unexplained:
            example = next((t.examples[0] for t in tallies.values() if t.examples), "")
            where = "no fault window was opened in this run" if not ctx.windows else "outside every fault window"
            notes.append(
                f"unexplained: {unexplained} transfer-failure line(s) {where}"
                f" (not a FAIL: spurious aborts; e.g. {example!r})"
            )
        return notes

    @staticmethod
    def _metric_notes(ctx: OracleContext) -> tuple[list[str], int]:
        snapshots: dict[tuple[str, str], str] = {}
        for data in ctx.snapshots("metrics"):
            role, phase, text = data.get("role"), data.get("phase"), data.get("text")
            if not (isinstance(role, str) and phase in ("before", "after") and isinstance(text, str)):
                continue
            if phase == "after" or (role, phase) not in snapshots:  # the first before, the last after
                snapshots[(role, phase)] = text
        notes: list[str] = []
        checks = 0
        for role in sorted({role for role, _ in snapshots}):
            before, after = snapshots.get((role, "before")), snapshots.get((role, "after"))
            if before is None or after is None:
                notes.append(f"metrics: {role} has no {'before' if before is None else 'after'} snapshot")
                continue
            checks += 1
            old, new = parse_prometheus_text(before), parse_prometheus_text(after)
            parts = []
            unexplained = False
            for name in FAILED_COUNTERS:
                was, now = _total(old, name), _total(new, name)
                if now is None:
                    continue
                short = name.split(":", 1)[1]
                if was is not None and now < was:  # the process restarted: the counter began again
                    parts.append(f"{short} reset ({was:g} -> {now:g}; at least +{now:g} since the restart)")
                    increase = now
                else:
                    increase = now - (was or 0.0)
                    parts.append(f"{short} +{increase:g}")
                unexplained = unexplained or (increase > 0 and not ctx.windows)
            notes.append(
                f"metrics: {role}: "
                + (", ".join(parts) if parts else "no failed-transfer counters exposed")
                + (" (unexplained: no fault window in this run)" if unexplained else "")
            )
        return notes, checks


def _total(samples: list[Sample], name: str) -> float | None:
    found = find_samples(samples, name)
    return sum(s.value for s in found) if found else None
