"""Pool-vs-context preflight: every prefill and decode node's KV pool must hold a whole context.

The incident this guards against (Cloudflare's GLM-5.3 report; SGLang #30233): a prefill pool of 681,280
tokens behind an advertised context of 1,048,576. Prompts between the two passed the tokenizer's
length check, were rejected by the scheduler, and the rejected request still went through the PD
handoff; decode then read KV pages it never received, which held other users' data.

Rules, per node:

* OK (`Verdict.PASS`) iff ``pool >= context length``;
* FAIL iff ``pool < context length``;
* UNKNOWN (`Verdict.INCONCLUSIVE`) when either value cannot be read. UNKNOWN is not OK: it
  exits 1, as a FAIL does.

A node's status is a `chaos.verdict.Verdict`; OK and UNKNOWN are only the names this check
prints for PASS and INCONCLUSIVE (`STATUS_LABELS`).

For a log, only the node's most recent start is judged; every start is reported. Over the ranks of
that start, the pool is the minimum and the context length the maximum. For a live worker, the pool
is the smallest of ``/server_info`` ``max_total_num_tokens`` and the metric
``sglang:max_total_num_tokens``; the context length is, in order of precedence, ``/v1/models``
``max_model_len``, the metric ``sglang:context_len``, then ``/server_info`` ``context_length``.

When ``max_req_input_len`` is known (``/server_info``), the row also carries the *band*: prompt
lengths from ``max_req_input_len`` up to ``context length - 1`` pass the tokenizer's check and are
rejected by the scheduler, which is the path that leaked in the incident.

Inputs arrive as a `PreflightInputs`; the CLI builds one from ``--log`` and ``--url``, and a
campaign target can build one from its endpoints and log paths (the seam for the campaign form).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from chaos import transport
from chaos.facts.endpoints import ModelsFacts, ServerInfoFacts, parse_models, parse_server_info
from chaos.facts.log_starts import LogStart, read_log
from chaos.facts.pool_metrics import PoolMetrics, read_pool_metrics
from chaos.verdict import Verdict

DEFAULT_TIMEOUT_S = 5.0
UNTAGGED_RANK = "(no prefix)"  # the scheduler of a TP=1 server prints no rank prefix


# What `pdchaos preflight` prints for each verdict: a node's pool is OK, too small, or unreadable.
STATUS_LABELS: dict[Verdict, str] = {Verdict.PASS: "OK", Verdict.FAIL: "FAIL", Verdict.INCONCLUSIVE: "UNKNOWN"}


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------


@dataclass
class StartSummary:
    """One start found in a node's log, with its own verdict; ``judged`` marks the most recent."""

    index: int
    first_lineno: int
    timestamp: str | None
    boundary: str
    ready: bool
    ranks: list[str]
    pool_tokens: int | None
    context_len: int | None
    kv_tokens: int | None
    status: Verdict
    reason: str
    judged: bool = False


@dataclass
class Band:
    """Prompt lengths (inclusive) that pass the tokenizer's check and fail the scheduler's."""

    min_tokens: int
    max_tokens: int

    @property
    def width(self) -> int:
        return self.max_tokens - self.min_tokens + 1


@dataclass
class PreflightRow:
    """The preflight result for one node."""

    name: str
    source: str  # "log" or "url"
    location: str  # the file path or the base URL
    status: Verdict
    reason: str
    role: str | None = None
    pool_tokens: int | None = None
    context_len: int | None = None
    max_req_input_len: int | None = None
    pool_source: str | None = None
    context_source: str | None = None
    band: Band | None = None
    starts: list[StartSummary] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        """pool / context length, when both are known."""
        if self.pool_tokens is None or not self.context_len:
            return None
        return self.pool_tokens / self.context_len

    @property
    def ok(self) -> bool:
        return self.status is Verdict.PASS

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["status"] = STATUS_LABELS[self.status]
        data["ratio"] = None if self.ratio is None else round(self.ratio, 4)
        for start in data["starts"]:
            start["status"] = STATUS_LABELS[start["status"]]
        return data


NodeFacts = PreflightRow  # the name other modules may prefer when they only read the facts


@dataclass
class PreflightInputs:
    """What to check: ``(name, path)`` log files and ``(name, url)`` live workers."""

    logs: list[tuple[str, Path]] = field(default_factory=list)
    urls: list[tuple[str, str]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.logs and not self.urls


@dataclass
class PreflightReport:
    rows: list[PreflightRow]

    def count(self, status: Verdict) -> int:
        return sum(1 for row in self.rows if row.status is status)

    @property
    def ok(self) -> bool:
        """True only when there is at least one node and every node is OK."""
        return bool(self.rows) and all(row.ok for row in self.rows)

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def summary_line(self) -> str:
        total = len(self.rows)
        counts = (
            f"{self.count(Verdict.PASS)} OK, {self.count(Verdict.FAIL)} FAIL, "
            f"{self.count(Verdict.INCONCLUSIVE)} UNKNOWN"
        )
        noun = "node" if total == 1 else "nodes"
        verdict = "PASS: every node's KV pool holds a full context" if self.ok else "NOT OK"
        return f"preflight: {total} {noun}: {counts}. {verdict} (exit {self.exit_code})"

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "summary": {
                "total": len(self.rows),
                "ok": self.count(Verdict.PASS),
                "fail": self.count(Verdict.FAIL),
                "unknown": self.count(Verdict.INCONCLUSIVE),
            },
            "nodes": [row.to_dict() for row in self.rows],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# --------------------------------------------------------------------------------------------------
# The rule
# --------------------------------------------------------------------------------------------------


def judge_pool(pool_tokens: int | None, context_len: int | None) -> tuple[Verdict, str]:
    """Apply the rule to one pair of readings; return the status and a one-line reason."""
    if pool_tokens is None and context_len is None:
        return Verdict.INCONCLUSIVE, "neither the KV pool size nor the context length could be read"
    if pool_tokens is None:
        return Verdict.INCONCLUSIVE, "the KV pool size could not be read"
    if context_len is None:
        return Verdict.INCONCLUSIVE, "the context length could not be read"
    if pool_tokens <= 0 or context_len <= 0:
        return Verdict.INCONCLUSIVE, (f"implausible readings (pool {pool_tokens}, context {context_len}); not judged")
    if pool_tokens >= context_len:
        return Verdict.PASS, f"pool {pool_tokens:,} >= context {context_len:,}"
    gap = context_len - pool_tokens
    return Verdict.FAIL, (
        f"pool {pool_tokens:,} < context {context_len:,}: prompts longer than the pool "
        f"({gap:,} tokens, {gap / context_len:.0%} of the window) have no KV behind them; "
        f"lower --context-length to <= {pool_tokens:,} or give the pool more memory"
    )


def compute_band(max_req_input_len: int | None, context_len: int | None) -> Band | None:
    """The prompt lengths that pass the tokenizer (< context) and fail the scheduler (>= limit)."""
    if max_req_input_len is None or context_len is None:
        return None
    if max_req_input_len > context_len - 1:
        return None
    return Band(min_tokens=max_req_input_len, max_tokens=context_len - 1)


# --------------------------------------------------------------------------------------------------
# Logs
# --------------------------------------------------------------------------------------------------


def _summarise_start(start: LogStart) -> StartSummary:
    pool, context = start.pool_tokens, start.context_len
    if not start.startup_ranks:
        status = Verdict.INCONCLUSIVE
        if start.kv_tokens is not None:
            reason = (
                f"no scheduler startup line (max_total_num_tokens=..., context_len=...); the KV "
                f"pool was allocated (#tokens {start.kv_tokens:,}) but the context length is "
                f"not logged without it: the start crashed before the line, or the log level "
                f"hides INFO"
            )
        else:
            reason = (
                "no scheduler startup line (max_total_num_tokens=..., context_len=...): only TP0 "
                "prints it, so a non-zero node of a multi-node launch, a crashed start or a log "
                "level above INFO has none"
            )
    else:
        status, reason = judge_pool(pool, context)
        unreadable = [
            facts.rank or UNTAGGED_RANK
            for facts in start.startup_ranks
            if facts.startup and (facts.startup.max_total_num_tokens is None or facts.startup.context_len is None)
        ]
        if unreadable:
            reason = f"startup line of rank {', '.join(unreadable)} has an unreadable value"
            status = Verdict.INCONCLUSIVE
    return StartSummary(
        index=start.index,
        first_lineno=start.first_lineno,
        timestamp=start.timestamp,
        boundary=start.boundary,
        ready=start.ready,
        ranks=[facts.rank or UNTAGGED_RANK for facts in start.startup_ranks],
        pool_tokens=pool,
        context_len=context,
        kv_tokens=start.kv_tokens,
        status=status,
        reason=reason,
    )


def check_log_starts(starts: Sequence[LogStart], name: str, location: str) -> PreflightRow:
    """Judge a node from its parsed log: the most recent start decides; every start is listed."""
    summaries = [_summarise_start(start) for start in starts]
    if not summaries:
        return PreflightRow(
            name=name,
            source="log",
            location=location,
            status=Verdict.INCONCLUSIVE,
            reason="no SGLang start found (no server_args banner, startup, KV or ready line)",
        )
    judged_start, judged = starts[-1], summaries[-1]
    judged.judged = True
    row = PreflightRow(
        name=name,
        source="log",
        location=location,
        status=judged.status,
        reason=judged.reason,
        role=judged_start.role,
        pool_tokens=judged.pool_tokens,
        context_len=judged.context_len,
        pool_source="log: max_total_num_tokens" if judged.pool_tokens is not None else None,
        context_source="log: context_len" if judged.context_len is not None else None,
        starts=summaries,
    )
    if len(summaries) > 1:
        row.reason = f"start #{judged.index} of {len(summaries)}: {row.reason}"
        earlier = {summary.status for summary in summaries[:-1]}
        if earlier != {judged.status}:
            row.notes.append(
                "earlier starts: "
                + ", ".join(f"#{s.index} {STATUS_LABELS[s.status]}" for s in summaries[:-1])
                + "; only the most recent start is judged"
            )
    if not judged.ready:
        row.notes.append(
            f"start #{judged.index} never logged 'The server is fired up and ready to roll!' "
            "(still starting, crashed, or the log was cut)"
        )
    if judged.kv_tokens is not None and judged.pool_tokens is not None and judged.kv_tokens < judged.pool_tokens:
        row.notes.append(
            f"a KV pool of #tokens {judged.kv_tokens:,} was allocated, below "
            f"max_total_num_tokens {judged.pool_tokens:,} (hybrid or draft pool?)"
        )
    return row


def check_log(path: str | Path, name: str | None = None) -> PreflightRow:
    """Read a node's log file and judge its most recent start."""
    path = Path(path)
    return check_log_starts(read_log(path), name=name or str(path), location=str(path))


# --------------------------------------------------------------------------------------------------
# Live workers
# --------------------------------------------------------------------------------------------------


@dataclass
class UrlFacts:
    """What a live worker said, endpoint by endpoint; an endpoint that failed has an error."""

    url: str
    reachable: bool = True
    server_info: ServerInfoFacts | None = None
    models: ModelsFacts | None = None
    metrics: PoolMetrics | None = None
    errors: dict[str, str] = field(default_factory=dict)


def _endpoint(base: str, path: str) -> str:
    return base.rstrip("/") + path


def _describe_transport_error(exc: httpx.HTTPError) -> str:
    detail = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {detail}"


def fetch_url_facts(url: str, *, timeout: float = DEFAULT_TIMEOUT_S, client: httpx.Client | None = None) -> UrlFacts:
    """GET ``/server_info`` (falling back to ``/get_server_info``), ``/v1/models`` and ``/metrics``.

    Proxies from the environment are not used: the check talks to the workers directly. When the
    first request cannot connect, the worker is unreachable and the others are not tried.
    """
    facts = UrlFacts(url=url)
    own_client = client is None
    http = client or transport.client(timeout=timeout, trust_env=False, follow_redirects=True)
    try:

        def get(path: str) -> httpx.Response | None:
            try:
                response = http.get(_endpoint(url, path))
            except httpx.HTTPError as exc:
                facts.errors[path] = _describe_transport_error(exc)
                if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                    facts.reachable = False
                return None
            if response.status_code != 200:
                facts.errors[path] = f"HTTP {response.status_code}"
                return None
            return response

        def get_json(path: str) -> Any:
            response = get(path)
            if response is None:
                return None
            try:
                return response.json()
            except ValueError:
                facts.errors[path] = "response is not JSON"
                return None

        info = get_json("/server_info")
        if info is None and facts.reachable and facts.errors.get("/server_info") == "HTTP 404":
            info = get_json("/get_server_info")
        if not facts.reachable:
            return facts
        if info is not None:
            facts.server_info = parse_server_info(info)
        models = get_json("/v1/models")
        if models is not None:
            facts.models = parse_models(models)
        metrics = get("/metrics")
        if metrics is not None:
            facts.metrics = read_pool_metrics(metrics.text)
    finally:
        if own_client:
            http.close()
    return facts


def check_url_facts(facts: UrlFacts, name: str | None = None) -> PreflightRow:
    """Judge a live worker from what it said (pure: no I/O)."""
    name = name or facts.url
    if not facts.reachable:
        error = next(iter(facts.errors.values()), "no response")
        return PreflightRow(
            name=name,
            source="url",
            location=facts.url,
            status=Verdict.INCONCLUSIVE,
            reason=f"cannot reach {facts.url}: {error}",
        )
    info, models, metrics = facts.server_info, facts.models, facts.metrics
    notes = [f"{path}: {error}" for path, error in facts.errors.items()]

    pool_readings: list[tuple[str, int]] = []
    if info is not None and info.max_total_num_tokens is not None:
        pool_readings.append(("/server_info max_total_num_tokens", info.max_total_num_tokens))
    if metrics is not None and metrics.max_total_num_tokens is not None:
        pool_readings.append(
            ("/metrics pool (sglang:max_total_num_tokens or vllm:cache_config_info)", metrics.max_total_num_tokens)
        )
    pool_source, pool = min(pool_readings, key=lambda item: item[1]) if pool_readings else (None, None)
    if len({value for _, value in pool_readings}) > 1:
        notes.append(
            "pool readings disagree: "
            + ", ".join(f"{source} = {value:,}" for source, value in pool_readings)
            + "; the smallest is judged"
        )

    context_readings: list[tuple[str, int]] = []
    if models is not None and models.max_model_len is not None:
        context_readings.append(("/v1/models max_model_len", models.max_model_len))
    if metrics is not None and metrics.context_len is not None:
        context_readings.append(("metric sglang:context_len", metrics.context_len))
    if info is not None and info.context_length is not None:
        context_readings.append(("/server_info context_length", info.context_length))
    context_source, context = context_readings[0] if context_readings else (None, None)
    if len({value for _, value in context_readings}) > 1:
        notes.append(
            "context readings disagree: "
            + ", ".join(f"{source} = {value:,}" for source, value in context_readings)
            + f"; {context_source} takes precedence"
        )

    status, reason = judge_pool(pool, context)
    if status is Verdict.INCONCLUSIVE and facts.errors:
        reason += " (" + "; ".join(f"{path}: {error}" for path, error in facts.errors.items()) + ")"
    role = None
    if info is not None and info.disaggregation_mode:
        role = "unified" if info.disaggregation_mode == "null" else info.disaggregation_mode
    elif metrics is not None and metrics.engine_types:
        role = ",".join(metrics.engine_types)
    max_req_input_len = info.max_req_input_len if info is not None else None
    return PreflightRow(
        name=name,
        source="url",
        location=facts.url,
        status=status,
        reason=reason,
        role=role,
        pool_tokens=pool,
        context_len=context,
        max_req_input_len=max_req_input_len,
        pool_source=pool_source,
        context_source=context_source,
        band=compute_band(max_req_input_len, context),
        notes=notes,
    )


def check_url(
    url: str,
    name: str | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    client: httpx.Client | None = None,
) -> PreflightRow:
    """Fetch a live worker's facts and judge them."""
    return check_url_facts(fetch_url_facts(url, timeout=timeout, client=client), name)


# --------------------------------------------------------------------------------------------------
# All nodes
# --------------------------------------------------------------------------------------------------


def run_preflight(inputs: PreflightInputs, *, timeout: float = DEFAULT_TIMEOUT_S) -> PreflightReport:
    """Check every node: logs in the order given, then URLs (fetched concurrently)."""
    rows = [check_log(path, name) for name, path in inputs.logs]
    if inputs.urls:
        with ThreadPoolExecutor(max_workers=min(8, len(inputs.urls))) as pool:
            rows.extend(pool.map(lambda item: check_url(item[1], item[0], timeout=timeout), inputs.urls))
    return PreflightReport(rows=rows)


# --------------------------------------------------------------------------------------------------
# Text output
# --------------------------------------------------------------------------------------------------


def _fmt_int(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def _fmt_ratio(value: float | None) -> str:
    return "?" if value is None else f"{value:.2f}"


def _align(rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(widths[i]) if i in right else cell.ljust(widths[i]) for i, cell in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
    return lines


def format_report(report: PreflightReport) -> str:
    """The plain-text table, per-node details (starts, band, notes) and the summary line."""
    header = ["NODE", "SOURCE", "ROLE", "POOL", "CONTEXT", "RATIO", "MAX_INPUT", "STATUS", "REASON"]
    table = [header] + [
        [
            row.name,
            row.source,
            row.role or "?",
            _fmt_int(row.pool_tokens),
            _fmt_int(row.context_len),
            _fmt_ratio(row.ratio),
            "-" if row.max_req_input_len is None else f"{row.max_req_input_len:,}",
            STATUS_LABELS[row.status],
            row.reason,
        ]
        for row in report.rows
    ]
    lines = _align(table, right={3, 4, 5, 6})

    details: list[str] = []
    for row in report.rows:
        extra: list[str] = []
        if row.band is not None:
            extra.append(
                f"band: prompts of {row.band.min_tokens:,}..{row.band.max_tokens:,} tokens "
                f"({row.band.width:,} lengths) pass the tokenizer and are rejected by the "
                f"scheduler: the incident's trigger"
            )
        if row.source == "url" and (row.pool_source or row.context_source):
            extra.append(f"sources: pool from {row.pool_source or '?'}, context from {row.context_source or '?'}")
        if row.starts:
            start_rows = [
                [
                    ("* " if start.judged else "  ") + f"#{start.index}",
                    f"line {start.first_lineno}",
                    start.timestamp or "-",
                    start.boundary,
                    "ready" if start.ready else "not ready",
                    f"ranks {', '.join(start.ranks) or 'none'}",
                    f"pool {_fmt_int(start.pool_tokens)}",
                    f"context {_fmt_int(start.context_len)}",
                    STATUS_LABELS[start.status],
                    "(judged)" if start.judged else "",
                ]
                for start in row.starts
            ]
            extra.append(f"starts ({len(row.starts)}):")
            extra.extend("  " + line for line in _align(start_rows, right=set()))
        extra.extend(f"note: {note}" for note in row.notes)
        if extra:
            details.append(f"{row.name}:")
            details.extend("  " + line for line in extra)
    out = lines
    if details:
        out = out + [""] + details
    return "\n".join(out + ["", report.summary_line()]) + "\n"
