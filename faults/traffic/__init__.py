"""Traffic faults: faults made by sending requests, not by breaking a process or a link.

- client_abort (`client_abort.py`): requests aborted at a chosen phase (queued, prefill, transfer,
  decode), by `/abort_request` with the request's `rid` on every worker, or by the client
  disconnecting.
- over_length_burst (`over_length.py`): prompts just over each limit the workers report, sized
  with the target's own token counts, sent at once.
- cache_flush (`cache_flush.py`): `POST /flush_cache` to the workers every interval during the window.

`source.py` is what every request-sending window shares (the provocations too, faults/provoke.py):
marker indices, rids, prompts and sizing; `exchange.py` is one request a fault sent, read through
the suite's one HTTP exchange (loadprofiles/exchange.py) and journaled as a `RequestRecord`.
Nothing here outlives the window: there is nothing to undo, so the undo plans are empty.
"""
