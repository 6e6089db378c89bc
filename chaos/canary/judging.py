"""The canary's verdicts: foreign markers in a reply, the streaming rule, and each probe's verdict
(the rules are in chaos/canary/__init__.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chaos.canary.reply import Reply, short_message
from chaos.canary.sizing import ProbeSpec
from chaos.http_status import rejects_the_prompt
from chaos.markers import MarkerCodec, MarkerHit
from chaos.verdict import Verdict


@dataclass(frozen=True)
class Leak:
    """A marker (or fragment) in a reply that belongs to some other request."""

    text: str
    offset: int
    kind: str  # "whole" or "fragment"
    owner: str  # "victim v3", "probe p5", "request 17 of this run", "run K7QX (another run)"
    verified: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "offset": self.offset,
            "kind": self.kind,
            "owner": self.owner,
            "verified": self.verified,
        }


def find_leaks(
    codec: MarkerCodec, texts: Sequence[str], owner_index: int, names: Mapping[int, str]
) -> tuple[Leak, ...]:
    """Markers and fragments in `texts` that are not `owner_index`'s own (deduplicated).

    `names` names every request of the run by index (its keys are all the run's requests)."""
    found: dict[tuple[str, str], Leak] = {}
    indices = sorted(names)
    for text in texts:
        if not text:
            continue
        for hit in codec.scan(text):
            if codec.garbled_own(hit, owner_index, indices):
                continue  # its own marker miscopied (MarkerCodec.garbled_own): not another request's
            owner = _foreign_owner(codec, hit, owner_index, names)
            if owner is not None:
                found.setdefault(
                    (hit.text, owner),
                    Leak(
                        text=hit.text,
                        offset=hit.offset,
                        kind=hit.kind.value,
                        owner=owner,
                        verified=hit.verified,
                    ),
                )
    return tuple(found.values())


def _foreign_owner(codec: MarkerCodec, hit: MarkerHit, owner_index: int, names: Mapping[int, str]) -> str | None:
    if hit.run_prefix == codec.run_prefix:
        if hit.could_be_owned_by(codec.run_prefix, owner_index):
            return None
        if hit.request_index is None:
            return "another request of this run (fragment cut before its id)"
        return names.get(hit.request_index, f"request {hit.request_index} of this run")
    if hit.foreign_run and hit.verified:
        return f"run {hit.run_prefix} (another run)"
    return None  # an unverifiable fragment of some other run: too weak to call


def leak_reason(leaks: Sequence[Leak]) -> str:
    owners = sorted({leak.owner for leak in leaks})
    shown = ", ".join(f"{leak.text} ({leak.kind})" for leak in leaks[:3])
    more = f" and {len(leaks) - 3} more" if len(leaks) > 3 else ""
    return f"LEAK: markers of {', '.join(owners)}: {shown}{more}"


def judge_stream(reply: Reply, route: str, api: str) -> tuple[int | None, str]:
    """The streaming rule (module docstring): (the 4xx that counts as rejection or None, why)."""
    if reply.content_streamed:
        what = f"in-stream error {reply.stream_error_status or '(no status)'}" if reply.stream_error else "no error"
        return None, f"streamed {len(reply.content)} chars of output ({what}): accepted"
    if not reply.stream_error:
        return None, "HTTP 200 stream ended with neither content nor an error"
    status = reply.stream_error_status
    if status is None and route == "generate" and api == "sglang":
        status = 400  # SGLang's /generate stream turns its 400 (ValueError) into a code-less error
    if status is None:
        return None, f"in-stream error with no status: {reply.stream_error_message[:120]!r}"
    if 400 <= status < 500:
        return status, f"rejected in-stream ({status}) before any content"
    return None, f"in-stream error {status} (must be a 4xx)"


def judge_probe(spec: ProbeSpec, reply: Reply, leaks: Sequence[Leak], api: str) -> tuple[Verdict, str, int | None]:
    """(verdict, reason, the 4xx that counted as rejection)."""
    threshold = spec.threshold
    if reply.http_status is None:
        base: tuple[Verdict, str, int | None] = (Verdict.FAIL, f"no HTTP answer ({reply.transport_error})", None)
    elif 400 <= reply.http_status < 500:
        if not rejects_the_prompt(reply.http_status):
            base = (Verdict.INCONCLUSIVE, f"{reply.http_status} says nothing about the prompt's length", None)
        else:
            message = short_message(reply.body)
            base = (
                Verdict.PASS,
                f"rejected {reply.http_status}" + (f": {message}" if message else ""),
                reply.http_status,
            )
    elif reply.http_status == 200 and spec.stream:
        rejected, why = judge_stream(reply, spec.route, api)
        base = (Verdict.PASS, why, rejected) if rejected is not None else (Verdict.FAIL, why, None)
    elif reply.http_status == 200:
        base = (Verdict.FAIL, f"accepted with 200 ({len(reply.content)} chars of output)", None)
    elif reply.http_status >= 500:
        base = (Verdict.FAIL, f"server error {reply.http_status} (an over-length prompt must get a 4xx)", None)
    else:
        base = (Verdict.FAIL, f"unexpected status {reply.http_status} (must be a 4xx)", None)
    if leaks:
        return Verdict.FAIL, leak_reason(leaks) + f"; {base[1]}", base[2]
    verdict, reason, rejected = base
    if (
        verdict is Verdict.FAIL
        and reply.http_status == 200
        and reply.prompt_tokens is not None
        and reply.prompt_tokens < threshold.tokens
    ):
        undershot = (
            f"probe undershot: the server counted {reply.prompt_tokens} tokens, below {threshold.tokens}; {reason}"
        )
        return Verdict.INCONCLUSIVE, undershot, None
    return verdict, reason, rejected
