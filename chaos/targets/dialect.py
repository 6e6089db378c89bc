"""How an engine says what a fault needs to know: its limits, failed transfers, aborts, cache reset.

Faults and the runner read a target through its dialect instead of hard-coding one engine's metric
names and log lines, so the same fault confirms itself on SGLang (and the embedded engine, which
speaks SGLang's formats) and on vLLM. Every target names its dialect in its `dialect` attribute
(`chaos.targets.base.Target`); one attached by URL is read as SGLang when it speaks SGLang's
endpoints (`speaks_sglang`), else as a plain OpenAI-compatible server (`OPENAI`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import httpx

from chaos import transport
from chaos.facts.prometheus import Sample, parse_prometheus_text
from chaos.limits import WorkerLimits

TIMEOUT_S = 3.0


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def get_json(url: str, timeout_s: float = TIMEOUT_S) -> Any:
    """The JSON body of a 200 answer, else None (unreachable, other status, not JSON)."""
    try:
        response = transport.get(url, timeout=timeout_s, trust_env=False)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def metric_samples(url: str) -> list[Sample] | None:
    """Every sample at `url`/metrics; None when unreachable or not 200."""
    try:
        response = transport.get(f"{url}/metrics", timeout=TIMEOUT_S, trust_env=False)
    except httpx.HTTPError:
        return None
    return parse_prometheus_text(response.text) if response.status_code == 200 else None


def metric_sum(url: str, names: tuple[str, ...]) -> float | None:
    """Sum of the named metrics over all their label sets at `url`/metrics; None when none is there."""
    values = [s.value for s in metric_samples(url) or [] if s.name in names]
    return sum(values) if values else None


def models_max_len(url: str) -> int | None:
    """`max_model_len` of the first model card at /v1/models (SGLang and vLLM both give it)."""
    payload = get_json(f"{url}/v1/models")
    cards = payload.get("data", []) if isinstance(payload, dict) else []
    return next((n for c in cards if isinstance(c, dict) and (n := _int(c.get("max_model_len"))) is not None), None)


class EngineDialect:
    """SGLang's formats (docs/real-sglang.md); other engines subclass and override what differs."""

    name = "sglang"
    # Counters a worker keeps of KV transfers that failed (on either side of the handoff).
    transfer_failure_metrics: tuple[str, ...] = (
        "sglang:num_transfer_failed_reqs_total",
        "sglang:num_bootstrap_failed_reqs_total",
    )
    # A line in a worker's log saying its peer did not deliver or answer in time.
    transfer_timeout_log = r"timed out after [0-9.]+s in KVPoll\.|Lost connection with prefill instance"
    aborted_metrics: tuple[str, ...] = ("sglang:num_aborted_requests_total",)
    flush_cache_path: str | None = "/flush_cache"  # POST; empties the prefix cache when idle
    abort_path: str | None = "/abort_request"  # POST {"rid": ...}
    server_info_path: str | None = "/server_info"  # GET: versions, flags and limits
    request_api = "sglang"  # how faults send requests: SGLang's /generate, or "openai" (/v1/completions)
    aborted_log: str | None = None  # a log line per aborted request, where no counter says it
    # Requests whose KV pages the engine holds back on purpose after a failed transfer, until the
    # peer confirms the transfer drained (or a timeout): SGLang's deferred decode-side release
    # (PR #35049, on by default in 0.5.23, SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE). Real
    # SGLang counts them only here, in requests, not in /v1/loads: an idle moment with such
    # requests is not a leak (docs/sglang-cpu-tier.md).
    held_back_metrics: tuple[str, ...] = ("sglang:num_decode_deferred_kv_release_reqs",)

    def limits(self, url: str) -> WorkerLimits:
        info = get_json(f"{url}/server_info")
        info = info if isinstance(info, dict) else {}
        context = _int(info.get("context_length"))
        return WorkerLimits(
            _int(info.get("max_total_num_tokens")),
            context if context is not None else models_max_len(url),
            _int(info.get("max_req_input_len")),
        )

    def transfer_failures(self, url: str) -> float | None:
        return metric_sum(url, self.transfer_failure_metrics)

    def aborted(self, url: str) -> float | None:
        return metric_sum(url, self.aborted_metrics)


SGLANG = EngineDialect()


class OpenAIDialect(EngineDialect):
    """An attached server that speaks only the OpenAI routes (no /generate, /server_info,
    /abort_request or /flush_cache): faults send /v1/completions and abort by disconnecting."""

    name = "openai"
    request_api = "openai"
    transfer_failure_metrics = ()
    aborted_metrics = ()
    held_back_metrics = ()
    flush_cache_path = None
    abort_path = None
    server_info_path = None

    def limits(self, url: str) -> WorkerLimits:
        return WorkerLimits(None, models_max_len(url), None)


OPENAI = OpenAIDialect()


def speaks_sglang(urls: Iterable[str]) -> bool:
    """Whether any of the URLs is an SGLang server or router: it states /server_info (or the older
    /get_server_info), or lists its workers at /workers (the router)."""
    for url in urls:
        for path in ("/server_info", "/get_server_info", "/workers"):
            try:
                if transport.get(f"{url}{path}", timeout=TIMEOUT_S).status_code == 200:
                    return True
            except httpx.HTTPError:
                continue
    return False
