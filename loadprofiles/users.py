"""Locust users: each sends canary-marked prompts on its own connection and records every request.

Imported only inside a Locust process (importing Locust monkey-patches the process with gevent;
see chaos/cluster.py): the locustfile builds one `LoadContext` per process and the user classes from
it (`user_classes`). Every request, whatever happens to it, ends in exactly one record and one
Locust request event, including a request cut off when Locust stops its user.

Each user keeps one keep-alive connection (loadprofiles/http_client.py; `http_client: "httpx"` in
the config sends through httpx instead, the slower path the probes use, with the same records).
Every request carries the run's headers and TLS settings (chaos/transport.py: the API key from its
environment variable), and, when the run has secrets, every text a record keeps is redacted.

Routes: target api "sglang" mixes SGLang `/generate` (with a `rid`, so it can be aborted by
`/abort_request`), `/v1/chat/completions` and `/v1/completions`; "openai" only the OpenAI routes.
Streaming and not, mostly half each. Sampling is greedy (temperature 0): outputs must be reproducible.
"""

from __future__ import annotations

import itertools
import random
import secrets
import ssl
import time
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import gevent
import httpx
from gevent import GreenletExit
from locust import User, task

from chaos.journal import Outcome, RequestRecord
from chaos.markers import MarkerCodec
from chaos.transport import Transport, current
from loadprofiles.codec import RecentMarkers
from loadprofiles.config import LoadConfig
from loadprofiles.exchange import ROUTES, AbortPhase, Interrupt, perform, perform_fast, post_aborts, request_body
from loadprofiles.http_client import Connection
from loadprofiles.prompts import Conversation, Prompt, PromptFactory
from loadprofiles.recorder import (
    UNAVAILABLE_ENDINGS,
    Judgement,
    Observed,
    RecordWriter,
    Sent,
    build_record,
    emit,
    judge,
)
from loadprofiles.sizing import Threshold
from loadprofiles.sse import DEFAULT_BODY_CAP, Api

CONTROL_TIMEOUT_S = 5.0  # /abort_request calls
ABORT_MAX_TOKENS = 128  # aborting users need a reply that lasts long enough to be cut
ABORT_DELAY_S = (0.0, 0.25)  # /abort_request this long after sending: queued, prefill, transfer or decode
BEFORE_FIRST_BYTE_S = (0.005, 0.1)  # give up waiting for the headers after this long
BACKOFF_FIRST_S = 0.05  # the wait after one such ending; it doubles with each in a row
BACKOFF_MAX_S = 1.0  # ... up to this: a restarted router is found within a second


# ------------------------------------------------------------------------------ the process ----


@dataclass
class LoadContext:
    """What all users of one Locust process share: config, markers, prompts, the record file."""

    config: LoadConfig
    codec: MarkerCodec
    prompts: PromptFactory
    writer: RecordWriter
    body_cap: int = DEFAULT_BODY_CAP
    transport: Transport = field(default_factory=current)  # the run's headers, TLS settings, secrets
    _sequence: itertools.count[int] = field(default_factory=itertools.count)
    _users: itertools.count[int] = field(default_factory=itertools.count)
    _control: httpx.Client | None = None
    _ssl: ssl.SSLContext | None = None

    def __post_init__(self) -> None:
        self.has_secrets = self.transport.has_secrets  # asked once: every record checks it

    @classmethod
    def create(cls, config: LoadConfig, *, body_cap: int = DEFAULT_BODY_CAP) -> LoadContext:
        codec = RecentMarkers(config.run_prefix)
        return cls(
            config=config,
            codec=codec,
            prompts=PromptFactory(codec, config.seed, config.facts),
            writer=RecordWriter(config.records_path),
            body_cap=body_cap,
        )

    def next_request_index(self) -> int:
        # Greenlets switch only on I/O, so a shared counter needs no lock.
        return self.config.request_index(next(self._sequence))

    def next_user_id(self) -> str:
        """Unique across actors: the actor index is part of it."""
        return f"a{self.config.actor_index}u{next(self._users)}"

    def rid(self, request_index: int) -> str:
        """Unique, fixed width, so `/abort_request`'s prefix match can only hit this request."""
        return f"{self.config.run_prefix}-{self.config.phase}-{request_index:09d}-{secrets.token_hex(3)}"

    @property
    def control(self) -> httpx.Client:
        """A client for /abort_request, shared: creating one costs tens of milliseconds. The
        transport's client: the workers' key for the workers' origins, the run's TLS settings."""
        if self._control is None:
            self._control = self.transport.client(timeout=CONTROL_TIMEOUT_S)
        return self._control

    def ssl_context(self) -> ssl.SSLContext:
        """The transport's TLS settings, one context for every user (loading the CA bundle costs
        tens of milliseconds)."""
        if self._ssl is None:
            self._ssl = self.transport.ssl_context()
        return self._ssl

    def connection(self, base_url: str) -> Connection:
        """A user's own connection to the target, carrying the transport's headers."""
        https = base_url.startswith("https://")
        return Connection(
            base_url,
            headers=self.transport.request_headers(base_url),
            ssl_context=self.ssl_context() if https else None,
        )

    def redact(self, record: RequestRecord) -> None:
        """No secret in what the record keeps: a target may echo the key back in a body, an error
        or a conversation's history. Only runs with secrets pay for it."""
        if not self.has_secrets:
            return
        for name, value in vars(record).items():
            if isinstance(value, str):
                setattr(record, name, self.transport.redact(value))


# -------------------------------------------------------------------------------- requests ----


# ----------------------------------------------------------------------------------- users ----


class PdchaosUser(User):
    """One request per task: build a prompt, pick a route, send, judge, record."""

    abstract = True
    kind: ClassVar[str] = ""
    # Set by `user_classes`. It shadows locust's User.context() (extra fields for request events),
    # which only locust's own HTTP clients call; these users send with their own.
    context: ClassVar[LoadContext]  # type: ignore[assignment]

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        self.user_id = self.context.next_user_id()
        self.rng = random.Random(f"{self.context.config.seed}:user:{self.user_id}")
        self.http: Connection | httpx.Client | None = None
        self.planned_send: float | None = None
        self.unavailable_in_a_row = 0  # refused connections and 503s since the target's last answer

    # Locust calls this between tasks; the chosen wait says when the next request is due, so
    # a late send (a saturated load generator) shows as t_send - planned_send.
    def wait_time(self) -> float:
        low, high = self.context.config.think_time_s
        wait = max(self.rng.uniform(low, high), self.backoff_s())
        self.planned_send = time.time() + wait
        return wait

    def backoff_s(self) -> float:
        """How long to wait while the target is unavailable (a refused connection: the router is
        down; a 503: it has no worker to send to): doubling from BACKOFF_FIRST_S up to
        BACKOFF_MAX_S, with jitter, so a role killed on purpose is retried a few times a second by
        each user instead of hundreds, and the users do not come back in step."""
        if not self.unavailable_in_a_row:
            return 0.0
        ceiling = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (self.unavailable_in_a_row - 1))
        return self.rng.uniform(ceiling / 2, ceiling)

    def on_start(self) -> None:
        base_url = self.base_url()
        if self.context.config.http_client == "httpx":
            self.http = self.context.transport.client(base_url=base_url, timeout=self.context.config.request_timeout_s)
        else:
            self.http = self.context.connection(base_url)
        self.planned_send = time.time()

    def on_stop(self) -> None:
        if self.http is not None:
            self.http.close()
            self.http = None

    def base_url(self) -> str:
        return (self.host or self.context.config.target_url).rstrip("/")

    @task
    def one_request(self) -> None:
        self.request_once()

    # ---- what subclasses choose --------------------------------------------------------------

    def make_prompt(self, request_index: int) -> Prompt:
        raise NotImplementedError

    def routes(self, prompt: Prompt) -> list[Api]:
        routes: list[Api] = (
            ["generate", "chat", "completions"]
            if self.context.config.facts.api == "sglang"
            else ["chat", "completions"]
        )
        return [r for r in routes if r != "chat" or prompt.chat_ok]

    def choose(self, prompt: Prompt) -> tuple[Api, bool]:
        return self.rng.choice(self.routes(prompt)), self.rng.random() < 0.5

    def exchange(self, url: str, body: dict[str, Any], route: Api, sent: Sent, obs: Observed) -> None:
        self.send(url, body, route, sent, obs)

    def review(self, prompt: Prompt, obs: Observed, verdict: Judgement) -> tuple[Judgement, str | None]:
        """Adjust the verdict for this kind; returns it and a prefix for error_detail."""
        return verdict, None

    def expected(self, verdict: Judgement, obs: Observed) -> bool:
        """Whether Locust should count it a success (the record keeps the real outcome)."""
        return verdict.outcome is Outcome.OK

    def after(self, prompt: Prompt, obs: Observed, verdict: Judgement) -> None:
        """Hook for users with state across requests (conversations)."""

    # ---- the request -------------------------------------------------------------------------

    def _client(self) -> Connection | httpx.Client:
        if self.http is None:  # a task can run before on_start only in odd Locust states
            self.on_start()
        assert self.http is not None
        return self.http

    def send(
        self, url: str, body: dict[str, Any], route: Api, sent: Sent, obs: Observed, interrupt: Interrupt | None = None
    ) -> None:
        """One request and its reply into `obs`, on this user's connection (or httpx client)."""
        client, config = self._client(), self.context.config
        how: dict[str, Any] = {
            "api": route,
            "timeout_s": config.request_timeout_s,
            "obs": obs,
            "cap": self.context.body_cap,
            "headers": {"X-Request-Id": sent.id},
            "interrupt": interrupt,
        }
        if isinstance(client, Connection):
            perform_fast(client, url, body, **how)
        else:
            perform(client, url, body, **how)

    def request_once(self) -> None:
        ctx, config = self.context, self.context.config
        index = ctx.next_request_index()
        prompt = self.make_prompt(index)
        route, stream = self.choose(prompt)
        max_tokens = prompt.max_tokens or config.max_tokens
        rid = ctx.rid(index)
        use_rid = route == "generate" and config.facts.api == "sglang"
        body = request_body(
            route, prompt, stream=stream, max_tokens=max_tokens, model=config.facts.model, rid=rid if use_rid else None
        )
        sent = Sent(
            id=rid,
            request_index=index,
            phase=config.phase,
            user_kind=self.kind,
            actor=f"actor{config.actor_index}/{self.user_id}",
            endpoint=ROUTES[route],
            stream=stream,
            markers=prompt.markers,
            prompt=prompt.as_text(),
            max_tokens=max_tokens,
            planned_send=self.planned_send,
        )
        self.planned_send = None
        obs = Observed()
        name = f"{self.kind} {ROUTES[route]}{' stream' if stream else ''}"
        try:
            self.exchange(self.base_url() + ROUTES[route], body, route, sent, obs)
        except GreenletExit:
            obs.load_stopped = True
            self._record(sent, prompt, obs, name)
            raise
        except Exception as exc:
            obs.transport = ("client_error", f"{type(exc).__name__}: {exc}"[:500])
            obs.t_end = obs.t_end or time.time()
            self._record(sent, prompt, obs, name)
            raise  # Locust logs it and counts an exception: the process exits 1 (a bug of ours)
        self._record(sent, prompt, obs, name)

    def _record(self, sent: Sent, prompt: Prompt, obs: Observed, name: str) -> None:
        verdict = judge(obs)
        verdict, prefix = self.review(prompt, obs, verdict)
        if not obs.load_stopped:
            self.after(prompt, obs, verdict)
        record = build_record(sent, obs, verdict, detail_prefix=prefix)
        self.context.redact(record)
        self.unavailable_in_a_row = self.unavailable_in_a_row + 1 if record.error_class in UNAVAILABLE_ENDINGS else 0
        emit(
            self.context.writer,
            record,
            name=name,
            expected=self.expected(verdict, obs),
            event=self.environment.events.request,
        )


class CanaryChatUser(PdchaosUser):
    """Short and medium prompts, half asking the model to repeat them (markers come back out)."""

    abstract = True
    kind = "canary_chat"

    def make_prompt(self, request_index: int) -> Prompt:
        return self.context.prompts.canary(
            request_index, medium=self.rng.random() < 0.3, repeat=self.rng.random() < 0.5
        )


class PrefixSharingUser(PdchaosUser):
    """Agent-style traffic: the run's shared system prompt, and multi-turn conversations."""

    abstract = True
    kind = "prefix_sharing"

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        self.conversation: Conversation = self.context.prompts.new_conversation()

    def make_prompt(self, request_index: int) -> Prompt:
        repeat = self.rng.random() < 0.3
        if self.rng.random() < 0.5:
            return self.context.prompts.shared_prefix_prompt(request_index, repeat=repeat)
        return self.conversation.next_turn(request_index, repeat=repeat)

    def after(self, prompt: Prompt, obs: Observed, verdict: Judgement) -> None:
        if prompt.kind == "conversation" and verdict.outcome is Outcome.OK and obs.parsed is not None:
            self.conversation.add_reply(obs.parsed.text)


class LongContextUser(PdchaosUser):
    """70-95 % of the context length; a medium canary when the target's context is unknown."""

    abstract = True
    kind = "long_context"

    def make_prompt(self, request_index: int) -> Prompt:
        repeat = self.rng.random() < 0.5
        prompt = self.context.prompts.long_context(
            request_index, max_tokens=self.context.config.max_tokens, repeat=repeat
        )
        return prompt or self.context.prompts.canary(request_index, medium=True, repeat=repeat)


class OverLengthUser(PdchaosUser):
    """At and over every limit the target reports; expects a 4xx, flags a 200."""

    abstract = True
    kind = "over_length"

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        self.thresholds: list[Threshold] = self.context.prompts.thresholds()
        self.turn = self.rng.randrange(len(self.thresholds))

    def make_prompt(self, request_index: int) -> Prompt:
        threshold = self.thresholds[self.turn % len(self.thresholds)]
        self.turn += 1
        return self.context.prompts.over_length(request_index, threshold)

    def choose(self, prompt: Prompt) -> tuple[Api, bool]:
        # Mostly non-streaming: a streamed rejection may arrive as an in-band abort inside a 200.
        return self.rng.choice(self.routes(prompt)), prompt.chat_ok and self.rng.random() < 0.25

    def review(self, prompt: Prompt, obs: Observed, verdict: Judgement) -> tuple[Judgement, str | None]:
        t = prompt.threshold
        assert t is not None
        prefix = f"over_length threshold={t.name} limit={t.tokens} target_tokens={t.target}"
        if verdict.outcome is not Outcome.OK:
            return verdict, prefix
        reported = obs.parsed.prompt_tokens if obs.parsed else None
        if not t.known:
            note = f"over_length_unverified: {t.name} (the target reports no limit)"
        elif reported is not None and reported < t.tokens:
            note = f"over_length_missed: {t.name} prompt_tokens={reported} < {t.tokens} (our size estimate was short)"
        else:
            note = f"over_length_accepted: {t.name} limit={t.tokens} prompt_tokens={reported}"
        return replace(verdict, anomalies=(*verdict.anomalies, note)), prefix

    def expected(self, verdict: Judgement, obs: Observed) -> bool:
        rejected = obs.status is not None and 400 <= obs.status < 500
        return verdict.outcome is Outcome.FAIL and (rejected or verdict.error_class == "abort")


class AbortingUser(PdchaosUser):
    """Gives up on requests on purpose: closes the connection before the first byte, after the
    first token or mid-stream, or POSTs /abort_request with the rid to every worker."""

    abstract = True
    kind = "aborting"

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        facts = self.context.config.facts
        self.phases: list[AbortPhase] = ["before_first_byte", "after_first_token", "mid_stream"]
        if facts.api == "sglang" and facts.abort_urls:
            self.phases.append("abort_request")
        self.phase: AbortPhase = self.phases[0]

    def make_prompt(self, request_index: int) -> Prompt:
        self.phase = self.rng.choice(self.phases)
        # A repeated medium prompt: a reply of up to ABORT_MAX_TOKENS tokens, long enough to cut.
        prompt = self.context.prompts.canary(request_index, medium=True, repeat=True)
        return replace(prompt, max_tokens=max(self.context.config.max_tokens, ABORT_MAX_TOKENS))

    def choose(self, prompt: Prompt) -> tuple[Api, bool]:
        if self.phase == "abort_request":
            return "generate", self.rng.random() < 0.5  # only /generate carries a rid through the router
        if self.phase == "before_first_byte":
            return self.rng.choice(self.routes(prompt)), False
        return self.rng.choice(self.routes(prompt)), True

    def exchange(self, url: str, body: dict[str, Any], route: Api, sent: Sent, obs: Observed) -> None:
        config = self.context.config
        interrupt: Interrupt | None = None
        aborter: gevent.Greenlet | None = None
        if self.phase == "before_first_byte":
            interrupt = Interrupt(self.phase, read_timeout_s=self.rng.uniform(*BEFORE_FIRST_BYTE_S))
        elif self.phase == "after_first_token":
            interrupt = Interrupt(self.phase, after_chunks=1)
        elif self.phase == "mid_stream":
            interrupt = Interrupt(self.phase, after_chunks=self.rng.randint(2, max(2, (sent.max_tokens or 2) // 2)))
        else:
            aborter = gevent.spawn_later(
                self.rng.uniform(*ABORT_DELAY_S),
                post_aborts,
                self.context.control,
                config.facts.abort_urls,
                sent.id,
                obs,
            )
        try:
            self.send(url, body, route, sent, obs, interrupt)
        finally:
            if aborter is not None and not aborter.dead:
                if obs.abort_sent_at is None:
                    aborter.kill(block=True)  # the reply finished before the abort was due
                else:
                    aborter.join(timeout=CONTROL_TIMEOUT_S)

    def review(self, prompt: Prompt, obs: Observed, verdict: Judgement) -> tuple[Judgement, str | None]:
        return verdict, f"abort phase={self.phase}"

    def expected(self, verdict: Judgement, obs: Observed) -> bool:
        return verdict.error_class != "client_error"


USER_CLASSES: dict[str, type[PdchaosUser]] = {
    cls.kind: cls for cls in (CanaryChatUser, PrefixSharingUser, LongContextUser, OverLengthUser, AbortingUser)
}


def user_classes(context: LoadContext) -> list[type[PdchaosUser]]:
    """Concrete user classes for the config's mix (weight > 0 only), bound to `context`."""
    classes: list[type[PdchaosUser]] = []
    for kind, weight in context.config.mix.items():
        if kind not in USER_CLASSES:
            raise ValueError(f"mix: unknown user kind {kind!r}; known: {', '.join(USER_CLASSES)}")
        if weight <= 0:
            continue
        base = USER_CLASSES[kind]
        # Named after the kind; `abstract` absent from the class dict, so Locust's metaclass makes
        # the subclass concrete. Locust's --host, when given, overrides `host`.
        attrs = {"weight": weight, "context": context, "host": context.config.target_url}
        classes.append(type(kind, (base,), attrs))
    if not classes:
        raise ValueError("mix: no user kind has a positive weight")
    return classes
