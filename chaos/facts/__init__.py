"""Typed readers of the facts an SGLang worker publishes about itself.

Three sources, read the same way by the preflight check, the target adapters and the oracles:

* **Node logs.** `log_records` takes a log apart into records (timestamp, rank prefix, message),
  `log_facts` recognises the fact lines among their messages (the scheduler's startup line, the
  memory pool's ``KV Cache is allocated`` line, the ``server_args=`` banner, the ready line), and
  `log_starts` splits a log into *starts* (launches of the server) and collects, per start, per
  rank, the facts.
* **HTTP.** ``/server_info``, ``/v1/models`` and the per-rank objects of ``/v1/loads``
  (`endpoints`).
* **Prometheus text** from ``/metrics``: `prometheus`, a small general parser that other modules
  reuse, and `pool_metrics` for the pool constants.

Every numeric fact is ``int | None``; None means UNKNOWN. A reader never guesses: a value that is
absent, null, NaN, fractional or otherwise not a plain integer is None (`values`).
"""
