"""Response-contract oracles: the status and finish reason (K7 status), and the usage counts.

A 200 with a fluent answer is not success (README.md). These oracles hold every response to the
contract a client relies on (bug class K7, docs/architecture.md; SGLang's http_server.py):

Status contract (`status`):
* an over-length prompt (`user_kind == "over_length"`) must be rejected with a 4xx about the prompt
  (not 401, 403, 404, 405, 408 or 429, which are not judged: `chaos/http_status.py`), or, on a stream
  that had already answered 200, with an in-band abort that produced no tokens. A 200 that finished
  normally is FAIL (the #30233 incident: decode generated from KV it never received), unless the
  load user found our prompt was in fact under the limit (anomaly `over_length_missed`) or the
  target reports no limit (`over_length_unverified`): those are not judged. A 5xx is FAIL: the
  server failed at what is a client error. Exception: a 502/503/504 overlapping a fault window is the
  router losing its worker (a kill, a partition), not an answer to the prompt; it is not judged.
* any other request whose prompt the target itself counted (`prompt_tokens`) over the
  deployment's input limit (meta `limits`: `max_req_input_len`, else the context length) must not
  be answered 200 as served either: the same rule (`over_length_accepted`), for the load prompts
  that happen to cross a limit (on SGLang 0.5.19, load prompts over prefill's limit came back 200
  `length` from a one-token stub).
* a 200 whose finish reason is `length` must carry `max_tokens` completion tokens: fewer is a
  failure reported as success (K7, SGLang #33507: an abort mid-transfer came back as 200
  `length`). For an `aborting` request the finding says so. Needs `completion_tokens` and
  `max_tokens`; a record without them (a stream without usage) is not judged. A `length` finish
  also means the context window was reached: SGLang caps `max_new_tokens` at `context_len - 2 -
  prompt` (`python/sglang/srt/managers/scheduler.py`), so a reply whose prompt and completion fill
  the context to within `CONTEXT_RESERVE` tokens is consistent (the context length is the run's
  `limits` meta). Where the context length is unknown, a short `length` is INCONCLUSIVE, except
  for an aborting user's request.

Usage contract (`usage`), over 200 responses; a missing count (None) is not checked:
* counts are non-negative; `cached_tokens <= prompt_tokens`;
* `completion_tokens <= max_tokens`;
* `completion_tokens == 0` only with an empty text (non-empty text needs at least one token);
* the same prompt text on the same endpoint has the same `prompt_tokens` everywhere in the run:
  the baseline's count when there is one, else the most common count;
* for a probe, the same output text has the same `completion_tokens` (aborted replies aside: their
  count may include tokens never delivered).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable

from chaos.http_status import rejects_the_prompt
from chaos.journal import RequestRecord
from chaos.oracles.base import PROBE_KIND, OracleContext
from chaos.verdict import Finding, OracleResult, Verdict

OVER_LENGTH_KIND = "over_length"
ABORTING_KIND = "aborting"
CONTEXT_RESERVE = 2  # tokens SGLang keeps free at the end of the context window
BASELINE_PHASE = "baseline"
ROUTER_LOST_WORKER = (502, 503, 504)  # the router lost, or has no healthy, worker
MAX_FINDINGS_PER_RULE = 50


def _input_limit(limits: dict[str, object]) -> int | None:
    """The longest prompt the deployment admits, in tokens, from the limits the run discovered
    (the least over its workers): SGLang's `max_req_input_len`, else one under the context."""
    for key, slack in (("max_req_input_len", 0), ("context_length", 1)):
        value = limits.get(key)
        if isinstance(value, int) and value > slack:
            return value - slack
    return None


def _first(labels: list[str]) -> str | None:
    return labels[0] if labels else None


def _anomalies(record: RequestRecord) -> str:
    return record.anomaly or ""


class _Collector:
    """Findings, capped per rule so one systematic breach does not bury the report."""

    def __init__(self, oracle: str, ctx: OracleContext) -> None:
        self.oracle, self.ctx = oracle, ctx
        self.findings: list[Finding] = []
        self.counts: Counter[str] = Counter()

    def add(self, rule: str, verdict: Verdict, record: RequestRecord, summary: str, **evidence: object) -> None:
        self.counts[rule] += 1
        if self.counts[rule] > MAX_FINDINGS_PER_RULE:
            return
        faults = self.ctx.windows_at(record.t_send)
        self.findings.append(
            Finding(
                self.oracle,
                verdict,
                summary,
                request_id=record.id,
                window=_first(faults),
                evidence={
                    "rule": rule,
                    "user_kind": record.user_kind,
                    "phase": record.phase,
                    "endpoint": record.endpoint,
                    "status": record.status,
                    "finish_reason": record.finish_reason,
                    **evidence,
                    "faults_active": faults,
                },
            )
        )

    def notes(self) -> list[str]:
        return [
            f"{rule}: {count} breach(es), {count - MAX_FINDINGS_PER_RULE} not listed"
            for rule, count in sorted(self.counts.items())
            if count > MAX_FINDINGS_PER_RULE
        ]


class StatusContractOracle:
    name = "status"

    def evaluate(self, ctx: OracleContext) -> OracleResult:
        out = _Collector(self.name, ctx)
        notes: list[str] = []
        checked = 0
        not_judged: Counter[str] = Counter()
        context = ctx.limits.get("context_length")
        input_limit = _input_limit(ctx.limits)
        for record in ctx.requests:
            judged = False
            failed_over_length = False
            if record.user_kind == OVER_LENGTH_KIND:
                result = self._over_length(ctx, record, out)
                if result in ("pass", "fail"):
                    judged = True
                    failed_over_length = result == "fail"
                elif result:
                    not_judged[result] += 1
            elif input_limit is not None and record.prompt_tokens is not None and record.prompt_tokens > input_limit:
                judged = True
                failed_over_length = self._served_over_the_limit(record, input_limit, out)
            if not failed_over_length and self._short_length(record, context, out):
                judged = True
            checked += judged
        for why, count in sorted(not_judged.items()):
            notes.append(f"over_length: {count} request(s) not judged ({why})")
        notes.extend(out.notes())
        return OracleResult.from_findings(self.name, checked, out.findings, notes)

    def _over_length(self, ctx: OracleContext, record: RequestRecord, out: _Collector) -> str:
        """'pass', 'fail', or why the request was not judged ('' when there was no answer)."""
        status = record.status
        if status is None:
            return ""  # no answer: the liveness oracle judges it
        if 400 <= status < 500:
            return "pass" if rejects_the_prompt(status) else f"HTTP {status} says nothing about the prompt's length"
        if status >= 500:
            if status in ROUTER_LOST_WORKER and ctx.windows_during(record.t_send, record.t_end):
                return f"HTTP {status} while a fault was active"
            out.add(
                "over_length_5xx",
                Verdict.FAIL,
                record,
                f"over-length prompt {record.id} got HTTP {status}; a rejection must be a 4xx",
                error_detail=(record.error_detail or "")[:300],
            )
            return "fail"
        if status != 200:
            return f"HTTP {status}"
        anomaly = _anomalies(record)
        if record.finish_reason == "abort":
            if record.completion_tokens or record.response_text:
                out.add(
                    "over_length_tokens",
                    Verdict.FAIL,
                    record,
                    f"over-length prompt {record.id} was aborted in-band but produced "
                    f"{record.completion_tokens} token(s) first",
                    text_excerpt=record.response_text[:120],
                )
                return "fail"
            return "pass"
        if "over_length_accepted" not in anomaly:
            if "over_length_missed" in anomaly:
                return "the prompt was under the limit after all (over_length_missed)"
            if "over_length_unverified" in anomaly:
                return "the target reports no limit (over_length_unverified)"
        out.add(
            "over_length_accepted",
            Verdict.FAIL,
            record,
            f"over-length prompt {record.id} was answered 200 (finish {record.finish_reason}, "
            f"{record.completion_tokens} token(s)) instead of a 4xx",
            prompt_tokens=record.prompt_tokens,
            completion_tokens=record.completion_tokens,
            anomaly=anomaly[:300],
            text_excerpt=record.response_text[:120],
        )
        return "fail"

    def _served_over_the_limit(self, record: RequestRecord, limit: int, out: _Collector) -> bool:
        """Any other request whose prompt the target itself counted over the deployment's input
        limit must not be served either (SGLang 0.5.19 answered load prompts over prefill's limit
        200 `length` from a one-token stub, docs/sglang-cpu-tier.md). True when it FAILed."""
        if record.status != 200 or (
            record.finish_reason == "abort" and not record.completion_tokens and not record.response_text
        ):
            return False  # refused (any status: a 5xx here is the errors' business), or aborted unserved
        out.add(
            "over_length_accepted",
            Verdict.FAIL,
            record,
            f"{record.user_kind} prompt {record.id} of {record.prompt_tokens} token(s), over the deployment's "
            f"input limit of {limit}, was answered 200 (finish {record.finish_reason}, "
            f"{record.completion_tokens} token(s)) instead of a 4xx",
            prompt_tokens=record.prompt_tokens,
            input_limit=limit,
            completion_tokens=record.completion_tokens,
            text_excerpt=record.response_text[:120],
        )
        return True

    def _short_length(self, record: RequestRecord, context: int | None, out: _Collector) -> bool:
        """Judge 'a 200 `length` carries max_tokens tokens, or fills the context'; True when the
        record could be judged."""
        if record.status != 200 or record.finish_reason != "length":
            return False
        if record.completion_tokens is None or record.max_tokens is None:
            return False
        if record.completion_tokens >= record.max_tokens:
            return True
        if (
            context
            and record.prompt_tokens is not None
            and record.prompt_tokens + record.completion_tokens >= context - CONTEXT_RESERVE
        ):
            return True  # the context window was reached before max_tokens
        aborted = record.user_kind == ABORTING_KIND
        what = (
            "an aborted request was reported as a success"
            if aborted
            else "a short output was reported as reaching the token limit"
        )
        # Without the context length, a short `length` may be the window reached: unproven
        # (an aborting user's reply is short of max_tokens because it was aborted, whatever the window).
        unproven = not context and not aborted
        out.add(
            "length_short",
            Verdict.INCONCLUSIVE if unproven else Verdict.FAIL,
            record,
            f"{what}: {record.id} answered 200 finish 'length' with {record.completion_tokens} of "
            f"{record.max_tokens} token(s)"
            + (" (the context length is unknown: it may have filled the window)" if unproven else ""),
            completion_tokens=record.completion_tokens,
            max_tokens=record.max_tokens,
            error_class=record.error_class,
            text_excerpt=record.response_text[:120],
        )
        return True


class UsageContractOracle:
    name = "usage"

    def evaluate(self, ctx: OracleContext) -> OracleResult:
        out = _Collector(self.name, ctx)
        answered = [r for r in ctx.requests if r.status == 200]
        judged: set[str] = set()
        for record in answered:
            if self._counts(record, out):
                judged.add(record.id)
        judged |= self._prompt_tokens_agree(answered, out)
        judged |= self._completion_tokens_agree(answered, out)
        notes = out.notes()
        without = sum(1 for r in answered if r.prompt_tokens is None and r.completion_tokens is None)
        if without:
            notes.append(f"{without} 200 response(s) carried no usage (streams without usage): not checked")
        return OracleResult.from_findings(self.name, len(judged), out.findings, notes)

    def _counts(self, record: RequestRecord, out: _Collector) -> bool:
        prompt, completion, cached = record.prompt_tokens, record.completion_tokens, record.cached_tokens
        if prompt is None and completion is None and cached is None:
            return False
        for field_name, value in (
            ("prompt_tokens", prompt),
            ("completion_tokens", completion),
            ("cached_tokens", cached),
        ):
            if value is not None and value < 0:
                out.add(
                    "negative", Verdict.FAIL, record, f"{record.id} reports {field_name}={value}", **{field_name: value}
                )
        if cached is not None and prompt is not None and cached > prompt:
            out.add(
                "cached_over_prompt",
                Verdict.FAIL,
                record,
                f"{record.id} reports cached_tokens={cached} > prompt_tokens={prompt}",
                cached_tokens=cached,
                prompt_tokens=prompt,
            )
        if completion is not None and record.max_tokens is not None and completion > record.max_tokens:
            out.add(
                "completion_over_limit",
                Verdict.FAIL,
                record,
                f"{record.id} reports completion_tokens={completion} > max_tokens={record.max_tokens}",
                completion_tokens=completion,
                max_tokens=record.max_tokens,
            )
        if completion == 0 and record.response_text:
            out.add(
                "text_without_tokens",
                Verdict.FAIL,
                record,
                f"{record.id} reports completion_tokens=0 but returned {len(record.response_text)} char(s) of text",
                text_excerpt=record.response_text[:120],
            )
        return True

    def _prompt_tokens_agree(self, records: Iterable[RequestRecord], out: _Collector) -> set[str]:
        groups: dict[tuple[str, str], list[RequestRecord]] = defaultdict(list)
        for record in records:
            if record.prompt and record.prompt_tokens is not None:
                groups[(record.endpoint, record.prompt)].append(record)
        judged: set[str] = set()
        for (endpoint, _), group in groups.items():
            if len(group) < 2:
                continue
            judged.update(r.id for r in group)
            expected, source = self._expected_prompt_tokens(group)
            spread = dict(Counter(r.prompt_tokens for r in group))
            for record in group:
                if record.prompt_tokens != expected:
                    out.add(
                        "prompt_tokens_inconsistent",
                        Verdict.FAIL,
                        record,
                        f"{record.id} reports prompt_tokens={record.prompt_tokens} for a prompt that counts "
                        f"{expected} ({source}) on {endpoint}",
                        prompt_tokens=record.prompt_tokens,
                        expected=expected,
                        expected_from=source,
                        counts_seen=spread,
                        prompt_chars=record.prompt_chars,
                    )
        return judged

    @staticmethod
    def _expected_prompt_tokens(group: list[RequestRecord]) -> tuple[int | None, str]:
        for record in group:
            if record.phase == BASELINE_PHASE:
                return record.prompt_tokens, f"baseline {record.id}"
        value, _ = Counter(r.prompt_tokens for r in group).most_common(1)[0]
        return value, "the most common count"

    def _completion_tokens_agree(self, records: Iterable[RequestRecord], out: _Collector) -> set[str]:
        groups: dict[tuple[int, str], list[RequestRecord]] = defaultdict(list)
        for record in records:
            # An aborted reply's count may include undelivered tokens; a stream that never ended (the
            # client gave up) has no final count, and its last tokens may carry no text.
            finished = record.finish_reason not in (None, "abort")
            if (
                record.user_kind == PROBE_KIND
                and finished
                and record.response_text
                and record.completion_tokens is not None
            ):
                groups[(record.request_index, record.response_text)].append(record)
        judged: set[str] = set()
        for (index, _), group in groups.items():
            if len(group) < 2:
                continue
            judged.update(r.id for r in group)
            counts = Counter(r.completion_tokens for r in group)
            if len(counts) == 1:
                continue
            expected = next(
                (r.completion_tokens for r in group if r.phase == BASELINE_PHASE), counts.most_common(1)[0][0]
            )
            for record in group:
                if record.completion_tokens != expected:
                    out.add(
                        "completion_tokens_inconsistent",
                        Verdict.FAIL,
                        record,
                        f"probe {index}: {record.id} reports completion_tokens={record.completion_tokens} for "
                        f"the same text that counts {expected} elsewhere",
                        completion_tokens=record.completion_tokens,
                        expected=expected,
                        counts_seen=dict(counts),
                    )
        return judged
