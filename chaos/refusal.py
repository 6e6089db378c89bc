"""What a server's refusal says about the prompt: how many tokens it counted, and whether it names a
limit the prompt is at or over.

Engines word their refusals differently, so each wording is one row of `_FORMS`, with named groups
for the numbers it states: `prompt` (the prompt's tokens as the server counted them), `size` (what
it held against the limit when that is not the prompt alone) and `limit`. The rows are searched
anywhere in the text, so an error body, a router's wrapped message or a record's error detail can
be read as they are (tests/test_refusals.py holds every wording).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_FORMS: tuple[re.Pattern[str], ...] = (
    # SGLang's scheduler (`validate_input_length`) and tokenizer checks: "Input length (1021 tokens)
    # exceeds the maximum allowed length (1018 tokens)", "The input (2049 tokens) is longer than the
    # model's context length (2048 tokens)".
    re.compile(
        r"[Ii]nput(?: length)? \((?P<prompt>\d+) tokens\)(?: (?:exceeds|is longer than)[^()]*\((?P<limit>\d+) tokens\))?"
    ),
    # SGLang's tokenizer, input + max_new_tokens over the context: "You requested a total of 2100
    # tokens: 2050 tokens from the input messages and 50 tokens for the completion".
    re.compile(r"(?P<prompt>\d+) tokens from the input"),
    # vLLM: "maximum context length is 2048 tokens. However, you requested 2100 tokens (2092 in the
    # messages, 8 in the completion)".
    re.compile(r"\((?P<prompt>\d+) in the messages"),
    re.compile(r"maximum context length is (?P<limit>\d+) tokens\. However, you requested (?P<size>\d+) tokens"),
    # vLLM: "However, your request has 2100 input tokens".
    re.compile(r"request has (?P<prompt>\d+) input tokens"),
    # vLLM's input processor: "maximum context length is 2048 tokens. However, your prompt contains
    # (at least) 2100 input tokens", or "... 9000 characters (more than 8192 characters".
    re.compile(
        r"maximum context length is (?P<limit>\d+) tokens\. However, your prompt contains (?:at least )?(?P<prompt>\d+) input tokens"
    ),
    re.compile(r"prompt contains (?:at least )?(?P<prompt>\d+) input tokens"),
    re.compile(r"your prompt contains (?P<size>\d+) characters \(more than (?P<limit>\d+) characters"),
    # vLLM's renderer: "The decoder prompt (length 2100) is longer than the maximum model length of 2048".
    re.compile(r"prompt \(length (?P<prompt>\d+)\) is longer than the maximum model length of (?P<limit>\d+)"),
    re.compile(r"your prompt is (?P<prompt>\d+) tokens"),
)


@dataclass(frozen=True)
class Refusal:
    """What one refusal message states; None and False where it states nothing."""

    prompt_tokens: int | None = None  # the prompt's length, as the server counted it
    over_limit: bool = False  # it names a limit and a size at or over it


def read_refusal(message: str | None) -> Refusal:
    """The prompt size and the limit breach `message` states (the first wording that gives the
    prompt's count; over the limit when any wording says so)."""
    if not message:
        return Refusal()
    prompt: int | None = None
    over = False
    for form in _FORMS:
        match = form.search(message)
        if match is None:
            continue
        said = match.groupdict()
        if prompt is None and said.get("prompt"):
            prompt = int(said["prompt"])
        size = said.get("size") or said.get("prompt")
        if size and said.get("limit") and int(size) >= int(said["limit"]):
            over = True
    return Refusal(prompt, over)
