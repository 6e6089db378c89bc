"""The over-length canary: victim traffic with markers, then over-length probes that must be 4xx.

This is the behavioural check from the KV-leak incident (SGLang issue #30233): a prompt longer than
the KV pool (or the context) must come back as a 4xx, and nothing it returns may carry another
request's data. It works against any OpenAI-compatible endpoint (the router, an SGLang worker,
vLLM); `/generate` is probed too when the target is SGLang-shaped.

Flow (`run.py`, `run_canary`):

1. **Limits** (`target.py`). `discover_target` reads ``/v1/models`` and ``/server_info``
   (`discover_facts`); when the target states neither a context length nor a pool (an SGLang
   router does not), it reads the router's ``/workers`` list and asks each worker. ``--max-tokens-probe N`` stands in when nothing
   is reported.
2. **Plan.** One probe per size (`plan_thresholds`, loadprofiles/sizing.py): just over the pool (``max_total_num_tokens + 1``),
   just over the context (``context_length + 1``), inside the band ``[max_req_input_len,
   context_length)`` where only SGLang's scheduler check rejects (``validate_input_length``), and ``N+1``
   and ``2N`` for ``--max-tokens-probe N``; times each route, streaming and not. Every probe has its
   own marker index.
3. **Calibrate** (`sizing.py`, before any victim, so the probes' own calibration traffic is older than the
   victims' in the KV pool). A prompt is a head marker, ``k`` repetitions of `FILLER`, a tail marker
   and an instruction. Per route, two short requests with different ``k`` give the tokens per
   repetition from the server's own ``usage.prompt_tokens`` (``meta_info.prompt_tokens`` on
   ``/generate``), chat template included; per probe, one short request with that probe's exact
   markers gives its fixed part. So a probe is sized to the token. A route that answers 404/405 is
   skipped. Where a route reports no usage, sizes are estimates: `FILLER` is one token per
   repetition in common tokenizers and at least one in any we know, and over-length probes
   over-shoot by `ESTIMATE_MARGIN`; a narrow band cannot be hit without measuring, so that probe is
   SKIPPED.
4. **Victims.** `VICTIMS` concurrent requests over the routes, each with markers at the head, the tail
   and in between; half ask the model to repeat the prompt (which makes a leak visible).
5. **Probes**, one at a time, and the verdicts (`judging.py`, `judge_probe`); the report
   (`report.py`) and its text (`render.py`).

Verdicts. A probe PASSes when it was rejected with a 4xx and carries no foreign marker. Any marker
(or fragment) of another request of this run, or a verified marker of another run, in a probe's or
a victim's body is a FAIL. A 200, a 5xx, a 3xx or no answer at all is a FAIL. A 4xx that says
nothing about the prompt (401, 403, 404, 405, 408, 429) is INCONCLUSIVE, as is a 200 for a prompt
the server itself counted below the threshold (the probe undershot). Victims that do not get a 200
make the run INCONCLUSIVE (there is nothing to leak).

Every request goes through the suite's one exchange (loadprofiles/exchange.py), read by shape
(`reply.py`): what a reply says does not depend on the route it came from.

**Streaming rule** (`judge_stream`). A streamed probe is rejected when the HTTP status is 4xx, or when
the HTTP status is 200 and both hold:

* **no content was streamed**: no chunk carries a non-empty ``delta.content``,
  ``delta.reasoning_content``, ``delta.tool_calls``, ``choices[].text``, ``text`` or ``output_ids``
  (the empty ``role`` chunk chat streams open with is not content), and
* **the stream carries an error that says 4xx**: an ``error`` object whose ``code``,
  ``status_code`` or ``status`` is 400-499 (nested messages are searched too), an SGLang
  ``finish_reason`` ``{"type": "abort", "status_code": 4xx}``, or an error whose ``type`` is
  ``BadRequestError`` / ``invalid_request_error`` and has no numeric code. On ``/generate`` of an
  SGLang target, a code-less ``{"error": {"message": ...}}`` also counts: that is SGLang's
  ``ValueError`` path, which is its 400 mapping (``tokenizer_manager.py``, ``http_server.py``).

Anything else is a FAIL: content before or without the error, an in-stream 5xx, an abort without a
status (SGLang's plain abort, HTTP 200), or a stream that just ends.
"""
