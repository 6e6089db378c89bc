"""The tenant probe: can one tenant see, through the prefix cache, what another tenant asked?

Bug class K9 (vLLM CVE-2025-46570). Requests are sent one at a time, with no load, each with a top-level
`cache_salt` (the tenant). Per round:

1. victim (salt A): a fresh secret prefix (about `prefix_tokens` tokens, unique to the round,
   carrying the round's markers) + the victim's question;
2. victim_repeat (salt A): the same prompt again: it must hit the cache (the positive control:
   a disabled cache would otherwise pass every isolation test);
3. attacker_guess (salt B): the victim's prefix + the attacker's question;
4. attacker_control (salt B): a prefix of the same shape and length never sent before + the same
   attacker question. Guess and control alternate which goes first, so warm-up or drift cannot
   favour either.

Every request is streamed (the TTFT is measured) and journaled as a RequestRecord with
`user_kind` and `phase` "tenant_probe" and its role in `actor`. The victim's two records and the
guess share the victim's request index (the guess's prompt carries the victim's markers, which it
may legitimately echo); the control has its own. Round r uses indices `index_base + 2r` (victim)
and `index_base + 2r + 1` (control): `tenant_indices` says which. Caches and the journal are not
flushed here. `chaos/oracles/tenants.py` judges the records.

A target that fails `GIVE_UP_AFTER_FAILURES` requests in a row (no 200 with a whole reply: a
wedged engine answers each only at its own timeout) is probed no further; the oracle judges what
came back.

The route is `/v1/completions` by default: SGLang and vLLM take `cache_salt` on the OpenAI routes,
and sglang-router 0.3.2 (the embedded stack's router) passes it through on `/v1/completions` but
drops it from `/generate` and `/v1/chat/completions` bodies. `route="generate"` is allowed when the
target speaks SGLang (`api == "sglang"`), to qualify that path on purpose.
"""

from __future__ import annotations

import random
import threading
import uuid

import httpx

from chaos.journal import Journal, Outcome, RequestRecord
from chaos.markers import MarkerCodec
from chaos.oracles.tenants import ATTACKER_CONTROL, ATTACKER_GUESS, TENANT_KIND, VICTIM, VICTIM_REPEAT
from loadprofiles.exchange import ROUTES, record_exchange, request_body
from loadprofiles.prompts import Prompt, estimate_tokens
from loadprofiles.recorder import Sent
from loadprofiles.sse import Api

TENANT_PHASE = "tenant_probe"
MAX_TOKENS = 4  # only the first token's time matters
GIVE_UP_AFTER_FAILURES = 3
VICTIM_QUESTION = "\nQuestion: which region had the largest support backlog this quarter?"
ATTACKER_QUESTION = "\nQuestion: summarise what the engineers on call wrote about incidents."
# One token each on BPE tokenizers and on the embedded engine's; none spells its "repeat" trigger.
_WORDS = (
    "the and for are but not you all any can had her was one our out day get has him his how man new now "
    "old see two way who boy did its let put say she too use act add age ago air art ask bad bag bed big "
    "box bus buy car cat cup cut dog dry eat egg end eye far fat few fit fly fun gas hat hit hot ice job "
    "key kid law lay leg lie lot low map mix net oil own pay pen pet pot red row run sea set sit six sky "
    "son sun tax tea ten tie top toy try war wet win"
).split()


def tenant_indices(index_base: int, rounds: int) -> range:
    """The request indices (markers) a probe of `rounds` rounds uses."""
    return range(index_base, index_base + 2 * rounds)


def secret_prefix(codec: MarkerCodec, index: int, prefix_tokens: int, salt: str) -> str:
    """A prefix of about `prefix_tokens` tokens, unique to `index` from its first token (its head
    marker) to its last (tail marker); the words are drawn from the tenant salt and the index."""
    head, tail = codec.marker(index, 0), codec.marker(index, 1)
    opening, closing = f"{head} Confidential note:", f" {tail}"
    words = max(0, prefix_tokens - estimate_tokens(opening) - estimate_tokens(closing))
    rng = random.Random(f"{codec.run_prefix}:{salt}:{index}")
    return opening + "".join(" " + rng.choice(_WORDS) for _ in range(words)) + closing


def send_tenant_request(
    client: httpx.Client,
    base_url: str,
    *,
    route: Api,
    text: str,
    salt: str,
    index: int,
    markers: tuple[str, str],
    role: str,
    model: str,
    timeout_s: float,
) -> RequestRecord:
    """One streamed request under `salt`, as a tenant-probe record (never raises on HTTP trouble)."""
    body = request_body(
        route, Prompt.user(TENANT_KIND, text, markers), stream=True, max_tokens=MAX_TOKENS, model=model, rid=None
    )
    body["cache_salt"] = salt
    sent = Sent(
        id=f"tenant-{index}-{role}-{uuid.uuid4().hex[:8]}",
        request_index=index,
        phase=TENANT_PHASE,
        user_kind=TENANT_KIND,
        actor=role,
        endpoint=ROUTES[route],
        stream=True,
        markers=markers,
        prompt=text,
        max_tokens=MAX_TOKENS,
        planned_send=None,
    )
    return record_exchange(client, base_url, route, body, sent, timeout_s=timeout_s)


def run_tenant_probe(
    client: httpx.Client,
    base_url: str,
    journal: Journal,
    codec: MarkerCodec,
    index_base: int,
    api: str,
    rounds: int = 12,
    prefix_tokens: int = 512,
    *,
    route: Api = "completions",
    model: str = "default",
    timeout_s: float = 60.0,
    stop: threading.Event | None = None,
) -> None:
    """Send the probe's `4 * rounds` requests one at a time and journal each (module docstring)."""
    if rounds < 1:
        raise ValueError("rounds must be >= 1")
    if route == "generate" and api != "sglang":
        raise ValueError(f"route 'generate' needs an SGLang target, not api={api!r}")
    base_url = base_url.rstrip("/")
    tag = uuid.uuid4().hex[:12]  # fresh tenants for every probe: nothing carries over between runs
    victim_salt, attacker_salt = f"pdchaos-{tag}-victim", f"pdchaos-{tag}-attacker"
    failed_in_a_row = 0
    for r in range(rounds):
        victim_index, control_index = index_base + 2 * r, index_base + 2 * r + 1
        secret = secret_prefix(codec, victim_index, prefix_tokens, victim_salt)
        control = secret_prefix(codec, control_index, prefix_tokens, attacker_salt)
        victim_markers = (codec.marker(victim_index, 0), codec.marker(victim_index, 1))
        control_markers = (codec.marker(control_index, 0), codec.marker(control_index, 1))
        attacker = [
            (ATTACKER_GUESS, secret + ATTACKER_QUESTION, victim_index, victim_markers),
            (ATTACKER_CONTROL, control + ATTACKER_QUESTION, control_index, control_markers),
        ]
        if r % 2:
            attacker.reverse()
        plan = [
            (VICTIM, secret + VICTIM_QUESTION, victim_index, victim_markers, victim_salt),
            (VICTIM_REPEAT, secret + VICTIM_QUESTION, victim_index, victim_markers, victim_salt),
            *[(role, text, index, markers, attacker_salt) for role, text, index, markers in attacker],
        ]
        for role, text, index, markers, salt in plan:
            if stop is not None and stop.is_set():
                return
            record = send_tenant_request(
                client,
                base_url,
                route=route,
                text=text,
                salt=salt,
                index=index,
                markers=markers,
                role=role,
                model=model,
                timeout_s=timeout_s,
            )
            journal.append_request(record)
            failed_in_a_row = 0 if record.status == 200 and record.outcome is Outcome.OK else failed_in_a_row + 1
            if failed_in_a_row >= GIVE_UP_AFTER_FAILURES:
                return  # a target that answers none of it cannot be probed: judged from what came back
