"""One request a fault sent, as the client saw it, and its record in the journal.

Every generation request a fault (or a provocation) sends is a `RequestRecord` in the journal,
with canary markers of the run at its head and tail, so the oracles see it as a possible leak
source and victim. Its reply is read by the suite's one exchange (loadprofiles/exchange.py) and
judged by the load's rules (loadprofiles/recorder.py), so a fault's request ends the way a load
user's would.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

from chaos.journal import RequestRecord
from loadprofiles.exchange import ROUTES, perform_async, request_body
from loadprofiles.prompts import Prompt
from loadprofiles.recorder import Observed, Sent, build_record, judge
from loadprofiles.sse import DEFAULT_BODY_CAP, Api, ParsedResponse

PHASE = "fault"
# user_kind of what a fault sends: the aborted requests, the over-length prompts (judged by the
# status oracle), and the short requests that measure latency or token counts first.
KIND_ABORT = "fault_abort"
KIND_OVER_LENGTH = "over_length"
KIND_CALIBRATION = "fault_calibration"
ERROR_TEXT_CHARS = 300  # of a body that was no readable reply, as the error message


@dataclass(kw_only=True)
class Exchange(Observed):
    """One request a fault sent: what it sent, and (as `Observed`) what came back, filled in as
    it happens."""

    rid: str
    index: int
    prompt: str
    markers: list[str]
    user_kind: str
    actor: str
    max_tokens: int
    stream: bool
    route: Api = "generate"  # SGLang's /generate, or /v1/completions where the target speaks OpenAI only (vLLM)

    @property
    def endpoint(self) -> str:
        return ROUTES[self.route]

    def body(self) -> dict[str, Any]:
        prompt = Prompt.user(self.user_kind, self.prompt, tuple(self.markers))
        body = request_body(
            self.route,
            prompt,
            stream=self.stream,
            max_tokens=self.max_tokens,
            model=None,
            rid=self.rid if self.route == "generate" else None,
        )
        if self.route == "completions":
            body["ignore_eos"] = True  # decode runs to max_tokens: an abort has a decode to cut
        return body

    @property
    def reply(self) -> ParsedResponse:
        return self.parsed or ParsedResponse()

    @property
    def prompt_tokens(self) -> int | None:
        return self.reply.prompt_tokens

    @property
    def error_message(self) -> str | None:
        """The error the reply stated, or the start of a body that was no readable reply."""
        return self.reply.error_message or self.reply.raw_text[:ERROR_TEXT_CHARS] or None

    @property
    def finish_type(self) -> str | None:
        return self.reply.finish.reason if self.reply.finish else None

    @property
    def done(self) -> bool:
        """A stream's [DONE] arrived."""
        return self.reply.done

    @property
    def ttft(self) -> float | None:
        """Seconds to the first token: its text's arrival or, for a reply whose tokens all decoded
        to no text (a tiny model's empty deltas; usage still counts them), the reply's end, an
        upper bound. None when no token came."""
        if self.t_send is None:
            return None
        times = self.reply.token_times
        if times:
            return times[0] - self.t_send
        if self.status == 200 and (self.reply.completion_tokens or 0) > 0 and self.t_end is not None:
            return self.t_end - self.t_send
        return None

    def ended_normally(self) -> bool:
        return self.status == 200 and self.finish_type not in (None, "abort") and self.client_closed is None

    def record(self) -> RequestRecord:
        sent = Sent(
            id=self.rid,
            request_index=self.index,
            phase=PHASE,
            user_kind=self.user_kind,
            actor=self.actor,
            endpoint=self.endpoint,
            stream=self.stream,
            markers=tuple(self.markers),
            prompt=self.prompt,
            max_tokens=self.max_tokens,
            planned_send=None,
        )
        return build_record(sent, self, judge(self))


async def send(client: httpx.AsyncClient, url: str, ex: Exchange, first_token: asyncio.Event | None = None) -> Exchange:
    """Send `ex` to the target at `url` and read the reply into it; a cancel (our disconnect)
    closes the connection. `first_token` is set when the first token arrives."""
    await perform_async(
        client, url + ex.endpoint, ex.body(), api=ex.route, obs=ex, cap=DEFAULT_BODY_CAP, first_token=first_token
    )
    return ex
