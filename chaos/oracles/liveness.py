"""The liveness oracle: nothing hangs, and the engine is back where it started after the load.

Requests (bug class K8, docs/architecture.md): every request that was sent ends within
`settings.request_deadline_s` of `t_send`. No `t_end` at all, or a later one, is FAIL (a hang:
a transfer state machine with no terminal state, a reclaim that waits for a signal that never
comes). Not judged: requests never sent (`t_send` is None) and requests with no end because the
load stopped under them (`error_class == "load_stopped"`). A request the *client* gave up on
(`error_class == "timeout"`) before the deadline proves neither: INCONCLUSIVE (the load's request
timeout is shorter than the deadline, so a hang cannot be told from a slow answer).

Quiescence (pool accounting): the runner journals `probe/loads` snapshots of each worker's
`/v1/loads`, `{"role", "phase": "idle_before"|"after_drain", "data"}`. Every `after_drain`
snapshot must show, on that role,
* every `*_reqs` counter of `disaggregation`, `num_running_reqs` and `num_waiting_reqs` at 0;
* `num_used_tokens`, and `quarantined_tokens` where the engine reports it, no higher than in the
  latest `idle_before` snapshot of the same role (pages that never came back are a leak, bug class K8).
A breach is FAIL with the numbers. `data` may be one object or a list of per-rank objects (DP);
ranks are paired by position. No `after_drain` snapshot at all, or none of a role's baseline to
compare the token counts with, is INCONCLUSIVE with a note.

Idle moments (the same accounting while the run goes on): the runner also samples `/v1/loads`
during the load (phase "during"). A sample in which no request holds pages is an idle moment of
that role, as in a lull of the load (`load.stages` with 0 users): every request counter (and
`num_active_tokens`, a forward pass under way) is 0, except the queues whose requests have no
pages yet (`PAGE_FREE_QUEUES`: decode's preallocation queue, prefill's bootstrap queue; SGLang
allocates as a request leaves them, `srt/disaggregation/decode.py`), and the waiting count is no
more than theirs. So a decode whose pool leaked full, with requests queued for pages no request
holds, is idle here too. There the tokens in use, less those held back on purpose
(`quarantined_tokens`: a deferred release that is still waiting), must be no more than in
`idle_before`. An engine that counts its held-back requests only in `/metrics` (SGLang's deferred
decode-side release, PR #35049: the dialect's `held_back_metrics`) has them journaled beside the
sample as `held_back_reqs`; such a sample is not an idle moment, and after the drain an excess
with requests still held back is INCONCLUSIVE, not FAIL. An excess seen at two successive samples of the role, both idle
and by the same count, is FAIL: pages leaked, found tens of seconds before the drain. One sample
proves nothing: a request between two queues (in a forward pass) can hold pages for an instant.

An engine without `/v1/loads` (vLLM) is judged from the `/metrics` snapshots the runner journals
before the load and after the drain (`probe/metrics`, phases "before" and "after"), where they
carry vLLM's gauges: `vllm:num_requests_running` and `vllm:num_requests_waiting` must be 0, and
`vllm:kv_cache_usage_perc` (blocks held by requests; cached free blocks do not count) no higher
than before the load.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any, cast

from chaos.facts.endpoints import loads_ranks
from chaos.facts.prometheus import parse_prometheus_text
from chaos.journal import RequestRecord
from chaos.oracles.base import OracleContext
from chaos.verdict import Finding, OracleResult, Verdict

IDLE_BEFORE = "idle_before"
DURING = "during"
AFTER_DRAIN = "after_drain"
QUEUE_KEYS = ("num_running_reqs", "num_waiting_reqs")
TOKEN_KEYS = ("num_used_tokens", "quarantined_tokens")
ACTIVE_TOKENS = "num_active_tokens"
HELD_BACK = "held_back_reqs"  # the runner's reading of the dialect's held-back gauges, beside `data`
MAX_REQUEST_FINDINGS = 100
VLLM_QUEUES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
VLLM_USAGE = "vllm:kv_cache_usage_perc"


def _first(labels: list[str]) -> str | None:
    return labels[0] if labels else None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def queue_counts(rank: Mapping[str, Any]) -> dict[str, float]:
    """Every request-queue counter of one `/v1/loads` object (top level and `disaggregation`)."""
    counts: dict[str, float] = {}
    for key in QUEUE_KEYS:
        value = _number(rank.get(key))
        if value is not None:
            counts[key] = value
    disagg = rank.get("disaggregation")
    if isinstance(disagg, Mapping):
        for key, raw in disagg.items():
            value = _number(raw)
            if key.endswith("_reqs") and value is not None:
                counts[f"disaggregation.{key}"] = value
    queues = rank.get("queues")  # SGLang 0.5.23: waiting, grammar, paused, retracted, prealloc_ready
    if isinstance(queues, Mapping):
        for key, raw in queues.items():
            value = _number(raw)
            if value is not None:
                counts[f"queues.{key}"] = value
    return counts


# Requests in these queues hold no KV pages yet: pages are allocated as they leave the queue.
PAGE_FREE_QUEUES = ("disaggregation.decode_prealloc_queue_reqs", "disaggregation.prefill_bootstrap_queue_reqs")
WAITING = "num_waiting_reqs"  # SGLang counts every waiting queue in it, the page-free ones included


def holds_no_pages(rank: Mapping[str, Any]) -> bool:
    """No request of this rank holds pages: only the page-free queues are non-empty, and the
    waiting count is explained by them; no forward pass under way."""
    counts = queue_counts(rank)
    page_free = sum(counts.get(key, 0.0) for key in PAGE_FREE_QUEUES)
    holding = {key: n for key, n in counts.items() if key not in PAGE_FREE_QUEUES and key != WAITING}
    return not any(holding.values()) and counts.get(WAITING, 0.0) <= page_free and not _number(rank.get(ACTIVE_TOKENS))


def busy(rank: Mapping[str, Any]) -> bool:
    """A request in a queue, or tokens in a forward pass: a PD prefill does not count the request
    of its running forward as running (`num_running_reqs` 0), only its `num_active_tokens`."""
    return any(queue_counts(rank).values()) or bool(_number(rank.get(ACTIVE_TOKENS)))


class LivenessOracle:
    name = "liveness"

    def evaluate(self, ctx: OracleContext) -> OracleResult:
        findings: list[Finding] = []
        notes: list[str] = []
        checked = self._requests(ctx, findings, notes)
        checked += self._quiescence(ctx, findings, notes)
        checked += self._idle_moments(ctx, findings, notes)
        checked += self._wedged(ctx, findings)
        return OracleResult.from_findings(self.name, checked, findings, notes)

    def _wedged(self, ctx: OracleContext, findings: list[Finding]) -> int:
        """The runner's progress watchdog saw the target stop answering with requests queued."""
        checked = 0
        for t, data in ctx.timed_snapshots("wedged"):
            checked += 1
            # a Mapping or {}: mypy does not narrow a get() by the isinstance of the same get()
            queued = cast(Mapping[str, Any], data.get("queued") if isinstance(data.get("queued"), Mapping) else {})
            pools = []
            for role, loads in sorted((data.get("loads") or {}).items()):
                for rank in loads_ranks(loads):
                    used, total = _number(rank.get("num_used_tokens")), _number(rank.get("max_total_num_tokens"))
                    if used is not None and total:
                        pools.append(f"{role} pool {used:.0f}/{total:.0f} tokens in use ({100 * used / total:.0f} %)")
            findings.append(
                Finding(
                    self.name,
                    Verdict.FAIL,
                    f"the target stopped making progress: no request generated anything for {data.get('quiet_s')} s while "
                    f"requests were queued ({', '.join(f'{k} {v}' for k, v in sorted(queued.items()))})"
                    + (f"; {'; '.join(pools)}" if pools else "")
                    + ": requests that never complete (pages not returned, or a handoff with no end)",
                    evidence={**data, "t_snapshot": t},
                )
            )
        return checked

    # ------------------------------------------------------------------------------ requests ----

    def _requests(self, ctx: OracleContext, findings: list[Finding], notes: list[str]) -> int:
        deadline = ctx.settings.request_deadline_s
        checked = 0
        listed = 0
        skipped: Counter[str] = Counter()
        breaches: Counter[str] = Counter()
        for record in ctx.requests:
            if record.t_send is None:
                skipped["never sent"] += 1
                continue
            verdict, summary = self._judge_request(record, deadline)
            if verdict is None and summary:
                skipped[summary] += 1
                continue
            checked += 1
            if verdict is None:
                continue
            breaches[verdict.value] += 1
            if listed >= MAX_REQUEST_FINDINGS:
                continue
            listed += 1
            faults = ctx.windows_at(record.t_send)
            findings.append(
                Finding(
                    self.name,
                    verdict,
                    summary,
                    request_id=record.id,
                    window=_first(faults),
                    evidence={
                        "t_send": record.t_send,
                        "t_end": record.t_end,
                        "deadline_s": deadline,
                        "duration_s": None if record.t_end is None else round(record.t_end - record.t_send, 3),
                        "status": record.status,
                        "error_class": record.error_class,
                        "user_kind": record.user_kind,
                        "phase": record.phase,
                        "faults_active": faults,
                    },
                )
            )
        notes.append(
            f"requests: {checked} judged against a {deadline:g} s deadline"
            + "".join(f", {n} {v}" for v, n in sorted(breaches.items()))
        )
        if listed < sum(breaches.values()):
            notes.append(f"requests: {sum(breaches.values()) - listed} further breach(es) not listed")
        for why, count in sorted(skipped.items()):
            notes.append(f"requests: {count} not judged ({why})")
        return checked

    @staticmethod
    def _judge_request(record: RequestRecord, deadline: float) -> tuple[Verdict | None, str]:
        """(verdict, summary) of a breach; (None, "") when fine; (None, why) when not judged."""
        assert record.t_send is not None
        if record.t_end is None:
            if record.error_class == "load_stopped":
                return None, "cut off by the end of the load"
            return Verdict.FAIL, f"{record.id} never ended (no t_end recorded): a hang"
        duration = record.t_end - record.t_send
        if duration > deadline:
            return Verdict.FAIL, f"{record.id} took {duration:.1f} s, past the {deadline:g} s deadline: a hang"
        if record.error_class == "timeout":
            return Verdict.INCONCLUSIVE, (
                f"{record.id}: the client gave up after {duration:.1f} s, before the "
                f"{deadline:g} s deadline: a hang cannot be told from a slow answer"
            )
        return None, ""

    # ---------------------------------------------------------------------------- quiescence ----

    def _quiescence(self, ctx: OracleContext, findings: list[Finding], notes: list[str]) -> int:
        idle: dict[str, list[Mapping[str, Any]]] = {}
        checked = 0
        drained = 0
        for snapshot in ctx.snapshots("loads"):
            role, phase, ranks = snapshot.get("role"), snapshot.get("phase"), loads_ranks(snapshot.get("data"))
            if not isinstance(role, str) or not ranks:
                continue
            if phase == IDLE_BEFORE:
                idle[role] = list(ranks)
            elif phase == AFTER_DRAIN:
                drained += 1
                held = _number(snapshot.get(HELD_BACK)) or 0.0
                checked += self._judge_drain(ctx, role, ranks, idle.get(role), held, findings, notes)
        if drained == 0:
            judged = self._quiescence_from_metrics(ctx, findings, notes)
            if judged:
                return judged
            findings.append(
                Finding(
                    self.name,
                    Verdict.INCONCLUSIVE,
                    "no after-drain /v1/loads snapshot: queue drain and page return not verified",
                )
            )
            notes.append("quiescence: no probe/loads snapshot with phase after_drain")
        return checked

    def _quiescence_from_metrics(self, ctx: OracleContext, findings: list[Finding], notes: list[str]) -> int:
        """vLLM: queues from the after-drain gauges, KV usage against the before-load reading."""
        readings: dict[tuple[str, str], dict[str, float]] = {}
        for snapshot in ctx.snapshots("metrics"):
            role, phase, text = snapshot.get("role"), snapshot.get("phase"), snapshot.get("text")
            if not isinstance(role, str) or phase not in ("before", "after") or not isinstance(text, str):
                continue
            values: dict[str, float] = {}
            for sample in parse_prometheus_text(text):
                if sample.name in (*VLLM_QUEUES, VLLM_USAGE):
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
            if values:
                readings[(role, phase)] = values
        checked = 0
        for (role, phase), after in sorted(readings.items()):
            if phase != "after":
                continue
            stuck = {k: after[k] for k in VLLM_QUEUES if after.get(k)}
            checked += 1
            if stuck:
                findings.append(
                    Finding(
                        self.name,
                        Verdict.FAIL,
                        f"{role}: queues did not drain after the load: "
                        + ", ".join(f"{k}={v:g}" for k, v in sorted(stuck.items())),
                        evidence={"role": role, "stuck": stuck},
                    )
                )
            before = readings.get((role, "before"), {})
            now, was = after.get(VLLM_USAGE), before.get(VLLM_USAGE)
            if now is None or was is None:
                findings.append(
                    Finding(
                        self.name,
                        Verdict.INCONCLUSIVE,
                        f"{role}: no {VLLM_USAGE} before and after the load: KV block return not verified",
                    )
                )
                continue
            checked += 1
            if now > was:
                findings.append(
                    Finding(
                        self.name,
                        Verdict.FAIL,
                        f"{role}: {VLLM_USAGE} is {now:g} after the load drained, {was:g} before it: "
                        "KV blocks were not returned",
                        evidence={"role": role, "before": was, "after": now},
                    )
                )
            notes.append(
                f"quiescence: {role} after drain (/metrics): "
                + ", ".join(f"{k}={after.get(k, 0):g}" for k in (*VLLM_QUEUES, VLLM_USAGE))
                + f" (before: {VLLM_USAGE}={was:g})"
            )
        return checked

    def _judge_drain(
        self,
        ctx: OracleContext,
        role: str,
        ranks: list[Mapping[str, Any]],
        before: list[Mapping[str, Any]] | None,
        held: float,
        findings: list[Finding],
        notes: list[str],
    ) -> int:
        checked = 0
        for index, rank in enumerate(ranks):
            where = role if len(ranks) == 1 else f"{role} rank {index}"
            queues = queue_counts(rank)
            if not queues and not any(_number(rank.get(k)) is not None for k in TOKEN_KEYS):
                # A shape this oracle cannot read proves nothing: never a silent PASS.
                findings.append(
                    Finding(
                        self.name,
                        Verdict.INCONCLUSIVE,
                        f"{where}: the after-drain /v1/loads answer has no request or token counter this oracle reads "
                        f"(keys: {', '.join(sorted(map(str, rank))[:12]) or 'none'}): queue drain and page return not verified",
                        evidence={"role": role, "rank": index, "after_drain": dict(rank)},
                    )
                )
                continue
            if queues:
                checked += 1
            stuck = {k: v for k, v in queues.items() if v != 0}
            if stuck:
                findings.append(
                    Finding(
                        self.name,
                        Verdict.FAIL,
                        f"{where}: queues did not drain after the load: "
                        + ", ".join(f"{k}={v:g}" for k, v in sorted(stuck.items())),
                        evidence={"role": role, "rank": index, "stuck": stuck, "after_drain": dict(rank)},
                    )
                )
            base = before[index] if before is not None and index < len(before) else None
            if base is None:
                findings.append(
                    Finding(
                        self.name,
                        Verdict.INCONCLUSIVE,
                        f"{where}: no idle_before /v1/loads snapshot: used tokens after the load cannot be compared",
                        evidence={"role": role, "rank": index, "after_drain": dict(rank)},
                    )
                )
                continue
            for key in TOKEN_KEYS:
                now, was = _number(rank.get(key)), _number(base.get(key))
                if now is None:
                    continue
                if was is None:
                    notes.append(f"quiescence: {where} reports {key} only after the load: not compared")
                    continue
                checked += 1
                if now > was and held:
                    findings.append(
                        Finding(
                            self.name,
                            Verdict.INCONCLUSIVE,
                            f"{where}: {key} is {now:g} after the load drained, {was:g} before it, while the engine "
                            f"still holds {held:g} request(s) back on purpose (deferred KV release): page return not verified",
                            evidence={
                                "role": role,
                                "rank": index,
                                "key": key,
                                "idle_before": was,
                                "after_drain": now,
                                HELD_BACK: held,
                            },
                        )
                    )
                elif now > was:
                    findings.append(
                        Finding(
                            self.name,
                            Verdict.FAIL,
                            f"{where}: {key} is {now:g} after the load drained, {was:g} before it: "
                            f"{now - was:g} token(s) of KV pages leaked",
                            evidence={
                                "role": role,
                                "rank": index,
                                "key": key,
                                "idle_before": was,
                                "after_drain": now,
                                "leaked": now - was,
                                "max_total_num_tokens": rank.get("max_total_num_tokens"),
                            },
                        )
                    )
            notes.append(
                f"quiescence: {where} after drain: "
                + ", ".join(f"{k}={rank.get(k)}" for k in TOKEN_KEYS if k in rank)
                + (f" (before: {', '.join(f'{k}={base.get(k)}' for k in TOKEN_KEYS if k in base)})")
            )
        return checked

    # -------------------------------------------------------------------------- idle moments ----

    def _idle_moments(self, ctx: OracleContext, findings: list[Finding], notes: list[str]) -> int:
        """Pages still out at two successive idle samples of a role, mid-load: a leak (see above)."""
        baseline: dict[str, list[Mapping[str, Any]]] = {}
        previous: dict[
            tuple[str, int], tuple[float, float] | None
        ] = {}  # (role, rank) -> (t, excess) of the last sample
        idle_samples: Counter[str] = Counter()
        leaked: set[str] = set()
        for t, snapshot in ctx.timed_snapshots("loads"):
            role, phase, ranks = snapshot.get("role"), snapshot.get("phase"), loads_ranks(snapshot.get("data"))
            if not isinstance(role, str) or not ranks:
                continue
            if phase == IDLE_BEFORE:
                baseline[role] = list(ranks)
                continue
            if phase != DURING or role not in baseline:
                continue
            for index, rank in enumerate(ranks):
                key = (role, index)
                base = baseline[role][index] if index < len(baseline[role]) else None
                excess = None if _number(snapshot.get(HELD_BACK)) else _idle_excess(rank, base)
                if excess is not None:
                    idle_samples[role] += 1
                last, previous[key] = previous.get(key), None if excess is None else (t, excess)
                where = role if len(ranks) == 1 else f"{role} rank {index}"
                if excess is None or excess <= 0 or last is None or last[1] != excess or where in leaked:
                    continue
                leaked.add(where)
                findings.append(
                    Finding(
                        self.name,
                        Verdict.FAIL,
                        f"{where}: {excess:g} token(s) of KV pages still in use at two idle moments mid-load "
                        f"({t - last[0]:.1f} s apart, no request holding pages): pages leaked",
                        window=_first(ctx.windows_at(last[0])),
                        evidence={
                            "role": role,
                            "rank": index,
                            "leaked": excess,
                            "t_snapshot": last[0],
                            "t_confirmed": t,
                            "num_used_tokens": rank.get("num_used_tokens"),
                            "quarantined_tokens": rank.get("quarantined_tokens"),
                            "idle_before": None if base is None else base.get("num_used_tokens"),
                        },
                    )
                )
        if idle_samples:
            notes.append(
                "idle moments mid-load: "
                + ", ".join(f"{role} {n}" for role, n in sorted(idle_samples.items()))
                + (f"; pages still out at two of them on {', '.join(sorted(leaked))}" if leaked else "; no pages out")
            )
        return sum(idle_samples.values())


def _idle_excess(rank: Mapping[str, Any], base: Mapping[str, Any] | None) -> float | None:
    """Tokens in use beyond the idle baseline, net of quarantine; None when a request may hold
    pages (see `holds_no_pages`) or the numbers are missing."""
    if not queue_counts(rank) or not holds_no_pages(rank) or base is None:
        return None
    used, was = _number(rank.get("num_used_tokens")), _number(base.get("num_used_tokens"))
    if used is None or was is None:
        return None
    held, held_before = _number(rank.get("quarantined_tokens")) or 0.0, _number(base.get("quarantined_tokens")) or 0.0
    return (used - held) - (was - held_before)
