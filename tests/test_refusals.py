"""Refusals that state a prompt's size: every message form the suite reads, and what each must say.

Each row is a refusal as an engine words it, the prompt length it states (None: it states none, or
states characters, not tokens), and whether it states a size at or over a limit it names.
"""

from __future__ import annotations

import pytest

from chaos.refusal import read_refusal

SGLANG_SCHEDULER = "Input length (1021 tokens) exceeds the maximum allowed length (1018 tokens). Use a shorter input or enable --allow-auto-truncate."
SGLANG_TOKENIZER = "The input (2049 tokens) is longer than the model's context length (2048 tokens)."
SGLANG_WITH_COMPLETION = (
    "Requested token count exceeds the model's maximum context length of 2048 tokens. You requested a total of "
    "2100 tokens: 2050 tokens from the input messages and 50 tokens for the completion. Please reduce the "
    "number of tokens in the input messages or the completion to fit within the limit."
)
ROUTER_WRAPPED = (
    'Prefill server error (400 Bad Request): {"error":{"message":"Input length (1021 tokens) exceeds the '
    "maximum allowed length (1018 tokens). Use a shorter input"
)
VLLM_REQUESTED = (
    "This model's maximum context length is 2048 tokens. However, you requested 2100 tokens (2092 in the "
    "messages, 8 in the completion). Please reduce the length of the messages or completion."
)
VLLM_REQUEST_HAS = (
    "This model's maximum context length is 2048 tokens. However, your request has 2100 input tokens. "
    "Please reduce the length of the input messages."
)
VLLM_AT_LEAST = (
    "This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 input tokens."
)
VLLM_PROMPT_CONTAINS = (
    "This model's maximum context length is 2048 tokens. However, your prompt contains 2100 input tokens, which"
)
VLLM_CHARACTERS = "This model's maximum context length is 2048 tokens. However, your prompt contains 9000 characters (more than 8192 characters"
VLLM_DECODER = "The decoder prompt (length 2100) is longer than the maximum model length of 2048. Make sure"
PROMPT_IS = "The maximum context length is 2048, but your prompt is 2100 tokens."

# (message, the prompt tokens it states, whether it states a size at or over a limit it names)
FORMS = [
    (SGLANG_SCHEDULER, 1021, True),
    (SGLANG_TOKENIZER, 2049, True),
    (f"HTTP 400: {SGLANG_TOKENIZER}", 2049, True),
    (ROUTER_WRAPPED, 1021, True),
    ("Input length (900 tokens) exceeds the maximum allowed length (1018 tokens).", 900, False),
    (SGLANG_WITH_COMPLETION, 2050, False),
    (VLLM_REQUESTED, 2092, True),
    (VLLM_REQUEST_HAS, 2100, False),
    (VLLM_AT_LEAST, 2049, True),
    (PROMPT_IS, 2100, False),
    (VLLM_PROMPT_CONTAINS, 2100, True),
    (VLLM_CHARACTERS, None, True),
    (VLLM_DECODER, 2100, True),
    ("invalid sampling parameters", None, False),
    ("", None, False),
]


@pytest.mark.parametrize(("message", "tokens", "over"), FORMS, ids=[f"form-{i}" for i in range(len(FORMS))])
def test_each_wording_states_the_prompt_size_and_the_breach(message: str, tokens: int | None, over: bool) -> None:
    refusal = read_refusal(message)
    assert (refusal.prompt_tokens, refusal.over_limit) == (tokens, over)


def test_no_message_states_nothing() -> None:
    assert read_refusal(None) == read_refusal("") == read_refusal("invalid sampling parameters")
    assert read_refusal(None).prompt_tokens is None and not read_refusal(None).over_limit
