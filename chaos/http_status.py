"""What an HTTP status says about the prompt a server was sent.

A 4xx is a rejection of the prompt only when the server looked at the prompt: a missing route
(404, 405), missing credentials (401, 403), a timeout (408) or a rate limit (429) says nothing
about its length, so none of them may pass for an over-length prompt correctly refused (a plain
OpenAI-compatible server without SGLang's `/generate` answers every such prompt 404).
"""

from __future__ import annotations

NOT_ABOUT_THE_PROMPT_4XX = frozenset({401, 403, 404, 405, 408, 429})


def rejects_the_prompt(status: int | None) -> bool:
    """A 4xx that is the server's answer to the prompt itself (400, 413, 422, ...)."""
    return status is not None and 400 <= status < 500 and status not in NOT_ABOUT_THE_PROMPT_4XX
