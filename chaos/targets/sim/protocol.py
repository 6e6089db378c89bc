"""SGLang's worker API shapes: request parsing and validation, finish reasons, error bodies.

Everything here follows SGLang's `srt/entrypoints/http_server.py` and `srt/managers/`
(`io_struct.py`, `tokenizer_manager.py`, `schedule_batch.py`) so that clients, the real router
and our own readers see the same JSON from the embedded engine as from SGLang.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Literal

from chaos.targets.sim.model import Sampling
from chaos.targets.sim.tokenizer import EOS_ID, tokenize

Api = Literal["generate", "chat", "completions"]


class BadRequest(Exception):
    """A request SGLang answers with 400 before it reaches the scheduler."""


@dataclass(frozen=True)
class Finish:
    """SGLang's finish reasons (`managers/schedule_batch.py`)."""

    type: Literal["length", "stop", "abort"]
    length: int = 0
    matched: int | str | None = None
    message: str = ""
    status_code: int | None = None
    err_type: str | None = None

    def to_json(self) -> dict[str, Any]:
        if self.type == "length":
            return {"type": "length", "length": self.length}
        if self.type == "stop":
            return {"type": "stop", "matched": self.matched}
        return {
            "type": "abort",
            "message": self.message,
            "status_code": self.status_code,
            "err_type": self.err_type,
        }

    @property
    def openai_reason(self) -> str:
        return self.type


def kv_transfer_error(room: int, reason: str) -> str:
    """The text SGLang's transfer and bootstrap failures end with."""
    return f"KVTransferError(bootstrap_room={room}): {reason}"


def abort(message: str, status_code: int | None = None, err_type: str | None = None) -> Finish:
    return Finish(type="abort", message=message, status_code=status_code, err_type=err_type)


@dataclass(frozen=True)
class GenerateInput:
    """One generation request as the scheduler sees it, whichever route it came in on."""

    api: Api
    input_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    stream: bool
    rid: str | None = None
    stop: tuple[str, ...] = ()
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    model: str | None = None
    include_usage: bool = False
    lora_path: str | None = None  # an adapter changes the KV, so it is part of the cache key
    cache_salt: str | None = None  # a tenant's salt: prefixes are shared only within one salt
    extra: dict[str, Any] = field(default_factory=dict)


def decode_json_body(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"Request body is not valid UTF-8: {exc}") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"Invalid JSON in request body: {exc.msg} (line {exc.lineno} column {exc.colno})") from None
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object")
    return body


def _get(body: dict[str, Any], key: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    # bool is an int in Python; a JSON true is not a valid token count.
    if isinstance(value, bool) and bool not in kinds:
        raise BadRequest(f"Field '{key}' must be {_kind_names(kinds)}, got a boolean")
    if not isinstance(value, kinds):
        raise BadRequest(f"Field '{key}' must be {_kind_names(kinds)}, got {type(value).__name__}")
    return value


def _kind_names(kinds: tuple[type, ...]) -> str:
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "a boolean",
        list: "a list",
        dict: "an object",
    }
    return " or ".join(names.get(kind, kind.__name__) for kind in kinds)


def _sampling(params: dict[str, Any]) -> Sampling:
    temperature = float(_get(params, "temperature", (int, float), 1.0))
    if temperature < 0:
        raise BadRequest(f"temperature must be non-negative, got {temperature}")
    seed = _get(params, "sampling_seed", (int,), None)
    if seed is None:
        seed = _get(params, "seed", (int,), None)
    if seed is None:
        seed = random.getrandbits(63)
    return Sampling(temperature=temperature, seed=seed, ignore_eos=bool(_get(params, "ignore_eos", (bool,), False)))


def _max_new_tokens(value: Any, key: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"Field '{key}' must be an integer, got {type(value).__name__}")
    if value < 0:
        raise BadRequest(f"{key} must be at least 0, got {value}.")
    return value


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise BadRequest("Field 'stop' must be a string or a list of strings")


ROOM_LIMIT = 2**64  # the transfer frame carries the room as an unsigned 64-bit number


def _isolation(body: dict[str, Any]) -> dict[str, Any]:
    return {"lora_path": _get(body, "lora_path", (str,)), "cache_salt": _get(body, "cache_salt", (str,))}


def _bootstrap(body: dict[str, Any]) -> dict[str, Any]:
    room = _get(body, "bootstrap_room", (int,))
    if room is not None and not 0 <= room < ROOM_LIMIT:
        raise BadRequest(f"bootstrap_room must be in [0, 2**64), got {room}")
    return {
        "bootstrap_host": _get(body, "bootstrap_host", (str,)),
        "bootstrap_port": _get(body, "bootstrap_port", (int,)),
        "bootstrap_room": room,
    }


def parse_generate(body: dict[str, Any], default_max_new_tokens: int) -> GenerateInput:
    """`/generate`: `text` or `input_ids`, `sampling_params`, `stream`, `rid`, bootstrap fields."""
    text = body.get("text")
    input_ids = body.get("input_ids")
    if text is not None and input_ids is not None:
        raise BadRequest("Either text or input_ids should be provided, not both.")
    if isinstance(text, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)):
        raise BadRequest("Batch requests are not supported by the embedded engine; send one prompt per request.")
    if text is not None:
        if not isinstance(text, str):
            raise BadRequest(f"Field 'text' must be a string, got {type(text).__name__}")
        ids = tokenize(text)
    elif input_ids is not None:
        if not isinstance(input_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= EOS_ID for t in input_ids
        ):
            raise BadRequest(f"Field 'input_ids' must be a list of token ids in [0, {EOS_ID}]")
        ids = list(input_ids)
    else:
        raise BadRequest("Either text or input_ids should be provided.")
    params = _get(body, "sampling_params", (dict,), {})
    rid = _get(body, "rid", (str,))
    return GenerateInput(
        api="generate",
        input_ids=ids,
        max_new_tokens=_max_new_tokens(params.get("max_new_tokens"), "max_new_tokens", default_max_new_tokens),
        sampling=_sampling(params),
        stream=bool(_get(body, "stream", (bool,), False)),
        rid=rid,
        stop=_stop(params.get("stop")),
        **_bootstrap(body),
        **_isolation(body),
    )


CHAT_TEMPLATE_ROLES = ("system", "user", "assistant", "tool")


def render_chat(messages: Any) -> str:
    """The toy model's chat template: one `role: content` line per message, then `assistant:`."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("Field 'messages' must be a non-empty list")
    lines: list[str] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{index}] must be an object")
        role = message.get("role")
        if role not in CHAT_TEMPLATE_ROLES:
            raise BadRequest(f"messages[{index}].role must be one of {', '.join(CHAT_TEMPLATE_ROLES)}")
        content = message.get("content", "")
        if isinstance(content, list):  # OpenAI content parts: keep the text parts
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if not isinstance(content, str):
            raise BadRequest(f"messages[{index}].content must be a string")
        lines.append(f"{role}: {content}\n")
    lines.append("assistant:")
    return "".join(lines)


def parse_openai(api: Api, body: dict[str, Any], default_max_new_tokens: int) -> GenerateInput:
    """`/v1/chat/completions` and `/v1/completions`, including the router's rewritten fields."""
    if api == "chat":
        prompt = render_chat(body.get("messages"))
    else:
        raw_prompt = body.get("prompt")
        if isinstance(raw_prompt, list):
            if len(raw_prompt) != 1 or not isinstance(raw_prompt[0], str):
                raise BadRequest("Field 'prompt' must be a string (or a list of one string)")
            raw_prompt = raw_prompt[0]
        if not isinstance(raw_prompt, str):
            raise BadRequest("Field 'prompt' must be a string")
        prompt = raw_prompt
    limit_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stream_options = _get(body, "stream_options", (dict,), {})
    rid = _get(body, "rid", (str,))
    return GenerateInput(
        api=api,
        input_ids=tokenize(prompt),
        max_new_tokens=_max_new_tokens(body.get(limit_key), limit_key, default_max_new_tokens),
        sampling=_sampling(body),
        stream=bool(_get(body, "stream", (bool,), False)),
        rid=rid,
        stop=_stop(body.get("stop")),
        model=_get(body, "model", (str,)),
        include_usage=bool(stream_options.get("include_usage", False)),
        **_bootstrap(body),
        **_isolation(body),
    )


def generate_error_body(message: str) -> dict[str, Any]:
    """`/generate` 400: `{"error": {"message": ...}}` (`http_server._create_error_response`)."""
    return {"error": {"message": message}}


def openai_error_body(message: str, status: int) -> dict[str, Any]:
    """OpenAI routes: `create_error_response`; 5xx aborts use the same shape with type "500"."""
    err_type = "BadRequestError" if status == 400 else str(status)
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": status}


def server_error_body(message: str, status: int) -> dict[str, Any]:
    """A 500/503 abort on `/generate` (the custom HTTPException handler's shape)."""
    return {"object": "error", "message": message, "type": str(status), "param": None, "code": status}
