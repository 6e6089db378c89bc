"""SGLang's worker API shapes in the embedded engine: request parsing, finish reasons, errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from chaos.targets.sim.engine import Engine
from chaos.targets.sim.protocol import (
    BadRequest,
    Finish,
    GenerateInput,
    abort,
    decode_json_body,
    generate_error_body,
    kv_transfer_error,
    openai_error_body,
    parse_generate,
    parse_openai,
    render_chat,
    server_error_body,
)
from chaos.targets.sim.settings import WorkerSettings
from chaos.targets.sim.tokenizer import EOS_ID, tokenize

DEFAULT_MAX = 128

# The bodies the real sglang-router 0.3.2 sent to both workers (logged by stub workers).
ROUTER_GENERATE = b"""{"text": "Hello world", "model": null, "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
 "return_text_in_logprobs": false, "stream": false, "log_metrics": true, "return_hidden_states": false,
 "background": false, "no_logs": false, "return_bytes": false, "return_entropy": false,
 "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 4642423220847530966}"""

ROUTER_CHAT = b"""{"messages": [{"role": "user", "content": "hi"}], "model": "stub-model", "logprobs": false, "max_completion_tokens": 8,
 "stream": false, "no_stop_trim": false, "ignore_eos": false, "continue_final_message": false, "skip_special_tokens": true,
 "separate_reasoning": true, "stream_reasoning": true, "return_hidden_states": false,
 "bootstrap_host": "127.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 8297939198455838323}"""

ROUTER_COMPLETIONS = b"""{"model": "stub-model", "prompt": "Once upon a time", "max_tokens": 16, "stream": false, "echo": false,
 "no_stop_trim": false, "ignore_eos": false, "skip_special_tokens": true, "return_hidden_states": false,
 "bootstrap_host": "127.0.0.1", "bootstrap_port": null, "bootstrap_room": 1}"""


# ------------------------------------------------------------------------- router bodies ----


def test_router_generate_body() -> None:
    inp = parse_generate(decode_json_body(ROUTER_GENERATE), DEFAULT_MAX)
    assert isinstance(inp, GenerateInput)
    assert inp.api == "generate"
    assert inp.input_ids == tokenize("Hello world")
    assert inp.max_new_tokens == 4
    assert inp.sampling.temperature == 0.0
    assert inp.sampling.ignore_eos is False
    assert inp.stream is False
    assert inp.rid is None
    assert inp.stop == ()
    assert (inp.bootstrap_host, inp.bootstrap_port, inp.bootstrap_room) == ("127.0.0.1", 8998, 4642423220847530966)


def test_router_chat_body() -> None:
    inp = parse_openai("chat", decode_json_body(ROUTER_CHAT), DEFAULT_MAX)
    assert inp.api == "chat"
    assert inp.input_ids == tokenize("user: hi\nassistant:")
    assert inp.max_new_tokens == 8  # the router rewrote max_tokens to max_completion_tokens
    assert inp.model == "stub-model"
    assert inp.stream is False
    assert inp.include_usage is False
    assert inp.sampling.ignore_eos is False
    assert inp.sampling.temperature == 1.0  # OpenAI default when absent
    assert (inp.bootstrap_host, inp.bootstrap_port, inp.bootstrap_room) == ("127.0.0.1", 8998, 8297939198455838323)


def test_router_completions_body() -> None:
    inp = parse_openai("completions", decode_json_body(ROUTER_COMPLETIONS), DEFAULT_MAX)
    assert inp.api == "completions"
    assert inp.input_ids == tokenize("Once upon a time")
    assert inp.max_new_tokens == 16
    assert inp.bootstrap_port is None
    assert inp.bootstrap_room == 1


def test_generate_fields() -> None:
    inp = parse_generate(
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {
                "max_new_tokens": 0,
                "temperature": 0.5,
                "sampling_seed": 42,
                "ignore_eos": True,
                "stop": ["\n", "END"],
            },
            "stream": True,
            "rid": "req-1",
        },
        DEFAULT_MAX,
    )
    assert inp.input_ids == [1, 2, 3]
    assert inp.max_new_tokens == 0
    assert (inp.sampling.temperature, inp.sampling.seed, inp.sampling.ignore_eos) == (0.5, 42, True)
    assert inp.stop == ("\n", "END")
    assert inp.stream is True and inp.rid == "req-1"
    assert inp.bootstrap_room is None
    assert parse_generate({"text": "x", "sampling_params": {"stop": "END"}}, 7).stop == ("END",)
    assert parse_generate({"text": "x"}, 7).max_new_tokens == 7
    assert parse_generate({"text": "x", "sampling_params": {"seed": 9}}, 7).sampling.seed == 9
    assert parse_generate({"text": "", "input_ids": None}, 7).input_ids == []


def test_openai_fields() -> None:
    inp = parse_openai(
        "chat",
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "image_url"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_tokens": 5,
            "max_completion_tokens": None,
            "stream": True,
            "stream_options": {"include_usage": True},
            "seed": 3,
            "temperature": 0,
            "stop": ["x"],
            "rid": "abc",
        },
        DEFAULT_MAX,
    )
    assert inp.input_ids == tokenize("system: be brief\nuser: ab\nassistant:")
    assert inp.max_new_tokens == 5
    assert inp.stream and inp.include_usage
    assert (inp.sampling.seed, inp.sampling.temperature) == (3, 0.0)
    assert inp.stop == ("x",) and inp.rid == "abc"
    both = parse_openai("completions", {"prompt": ["p"], "max_tokens": 5, "max_completion_tokens": 9}, DEFAULT_MAX)
    assert both.max_new_tokens == 9  # max_completion_tokens wins
    assert both.input_ids == tokenize("p")
    assert parse_openai("completions", {"prompt": "p"}, 33).max_new_tokens == 33


def test_render_chat() -> None:
    assert render_chat([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
    assert render_chat([{"role": "assistant"}]) == "assistant: \nassistant:"


# --------------------------------------------------------------------------- bad input ----


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b'{"text": "hi"', id="truncated"),
        pytest.param(b"{'text': 'hi'}", id="single-quotes"),
        pytest.param(b"", id="empty"),
        pytest.param(b'{"text": "hi"} trailing', id="trailing-garbage"),
        pytest.param(b'\xff\xfe{"text": "hi"}', id="bad-utf8-prefix"),
        pytest.param(b'{"text": "caf\xe9"}', id="latin1-byte"),
        pytest.param(b'{"text": "\xed\xa0\x80"}', id="encoded-surrogate"),
        pytest.param(b'["text", "hi"]', id="array"),
        pytest.param(b'"hi"', id="string"),
        pytest.param(b"null", id="null"),
        pytest.param(b"42", id="number"),
    ],
)
def test_decode_json_body_rejects(raw: bytes) -> None:
    with pytest.raises(BadRequest):
        decode_json_body(raw)


def test_decode_json_body_messages() -> None:
    with pytest.raises(BadRequest, match="not valid UTF-8"):
        decode_json_body(b'{"text": "\xff"}')
    with pytest.raises(BadRequest, match="Invalid JSON"):
        decode_json_body(b'{"text": }')
    with pytest.raises(BadRequest, match="JSON object"):
        decode_json_body(b"[]")
    assert decode_json_body('{"text": "caf\u00e9 \U0001f600"}'.encode()) == {"text": "caf\u00e9 \U0001f600"}


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({}, id="missing-text"),
        pytest.param({"sampling_params": {"max_new_tokens": 4}}, id="only-params"),
        pytest.param({"text": "a", "input_ids": [1]}, id="both-text-and-ids"),
        pytest.param({"text": 5}, id="text-int"),
        pytest.param({"text": {"a": 1}}, id="text-object"),
        pytest.param({"text": ["a", "b"]}, id="text-batch"),
        pytest.param({"input_ids": [[1, 2], [3]]}, id="ids-batch"),
        pytest.param({"input_ids": "1 2 3"}, id="ids-string"),
        pytest.param({"input_ids": [1, -2]}, id="ids-negative"),
        pytest.param({"input_ids": [1, 2.0]}, id="ids-float"),
        pytest.param({"input_ids": [1, True]}, id="ids-bool"),
        pytest.param({"input_ids": [1, "2"]}, id="ids-str-element"),
        pytest.param({"text": "a", "sampling_params": {"max_new_tokens": -1}}, id="max-new-negative"),
        pytest.param({"text": "a", "sampling_params": {"max_new_tokens": True}}, id="max-new-bool"),
        pytest.param({"text": "a", "sampling_params": {"max_new_tokens": "4"}}, id="max-new-string"),
        pytest.param({"text": "a", "sampling_params": {"max_new_tokens": 4.5}}, id="max-new-float"),
        pytest.param({"text": "a", "sampling_params": {"temperature": -0.1}}, id="temperature-negative"),
        pytest.param({"text": "a", "sampling_params": {"temperature": "hot"}}, id="temperature-string"),
        pytest.param({"text": "a", "sampling_params": {"temperature": True}}, id="temperature-bool"),
        pytest.param({"text": "a", "sampling_params": {"sampling_seed": True}}, id="seed-bool"),
        pytest.param({"text": "a", "sampling_params": {"sampling_seed": 1.5}}, id="seed-float"),
        pytest.param({"text": "a", "sampling_params": {"ignore_eos": 1}}, id="ignore-eos-int"),
        pytest.param({"text": "a", "sampling_params": {"stop": 5}}, id="stop-int"),
        pytest.param({"text": "a", "sampling_params": {"stop": ["a", 1]}}, id="stop-mixed"),
        pytest.param({"text": "a", "sampling_params": [1]}, id="params-list"),
        pytest.param({"text": "a", "stream": "yes"}, id="stream-string"),
        pytest.param({"text": "a", "stream": 1}, id="stream-int"),
        pytest.param({"text": "a", "rid": 7}, id="rid-int"),
        pytest.param({"text": "a", "bootstrap_room": "12"}, id="room-string"),
        pytest.param({"text": "a", "bootstrap_room": True}, id="room-bool"),
        pytest.param({"text": "a", "bootstrap_room": 1.0}, id="room-float"),
        pytest.param({"text": "a", "bootstrap_port": True}, id="port-bool"),
        pytest.param({"text": "a", "bootstrap_port": "8998"}, id="port-string"),
        pytest.param({"text": "a", "bootstrap_host": 127}, id="host-int"),
    ],
)
def test_parse_generate_rejects(body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        parse_generate(body, DEFAULT_MAX)


def test_parse_generate_messages() -> None:
    with pytest.raises(BadRequest, match="not both"):
        parse_generate({"text": "a", "input_ids": [1]}, DEFAULT_MAX)
    with pytest.raises(BadRequest, match=r"Either text or input_ids should be provided."):
        parse_generate({}, DEFAULT_MAX)
    with pytest.raises(BadRequest, match="max_new_tokens must be at least 0, got -1"):
        parse_generate({"text": "a", "sampling_params": {"max_new_tokens": -1}}, DEFAULT_MAX)
    with pytest.raises(BadRequest, match="boolean"):
        parse_generate({"text": "a", "sampling_params": {"temperature": False}}, DEFAULT_MAX)


@pytest.mark.parametrize(
    ("api", "body"),
    [
        pytest.param("chat", {}, id="chat-no-messages"),
        pytest.param("chat", {"messages": []}, id="chat-empty-messages"),
        pytest.param("chat", {"messages": "hi"}, id="chat-messages-string"),
        pytest.param("chat", {"messages": ["hi"]}, id="chat-message-string"),
        pytest.param("chat", {"messages": [{"role": "robot", "content": "hi"}]}, id="chat-bad-role"),
        pytest.param("chat", {"messages": [{"content": "hi"}]}, id="chat-no-role"),
        pytest.param("chat", {"messages": [{"role": "user", "content": 5}]}, id="chat-content-int"),
        pytest.param(
            "chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, id="chat-max-negative"
        ),
        pytest.param(
            "chat", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": True}, id="chat-max-bool"
        ),
        pytest.param(
            "chat", {"messages": [{"role": "user", "content": "hi"}], "stream": "true"}, id="chat-stream-string"
        ),
        pytest.param(
            "chat", {"messages": [{"role": "user", "content": "hi"}], "stream_options": True}, id="chat-stream-options"
        ),
        pytest.param("chat", {"messages": [{"role": "user", "content": "hi"}], "model": 3}, id="chat-model-int"),
        pytest.param(
            "chat", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, id="chat-temperature"
        ),
        pytest.param("chat", {"messages": [{"role": "user", "content": "hi"}], "seed": "1"}, id="chat-seed-string"),
        pytest.param(
            "chat", {"messages": [{"role": "user", "content": "hi"}], "bootstrap_room": False}, id="chat-room-bool"
        ),
        pytest.param("completions", {}, id="completions-no-prompt"),
        pytest.param("completions", {"prompt": 5}, id="completions-prompt-int"),
        pytest.param("completions", {"prompt": ["a", "b"]}, id="completions-prompt-batch"),
        pytest.param("completions", {"prompt": [1, 2]}, id="completions-prompt-ids"),
        pytest.param("completions", {"prompt": "a", "max_tokens": 1.5}, id="completions-max-float"),
        pytest.param("completions", {"prompt": "a", "stop": [None]}, id="completions-stop-null"),
    ],
)
def test_parse_openai_rejects(api: str, body: dict[str, Any]) -> None:
    with pytest.raises(BadRequest):
        parse_openai(api, body, DEFAULT_MAX)  # type: ignore[arg-type]


def _admit(body: dict[str, Any]) -> GenerateInput:
    """Parsing plus the engine's admission check: where a fix may live either way."""
    inp = parse_generate(body, DEFAULT_MAX)
    Engine(WorkerSettings(max_total_tokens=4096, context_length=2048)).validate(inp)
    return inp


def test_admission_accepts_largest_vocab_id_and_rejects_empty() -> None:
    assert _admit({"input_ids": [0, EOS_ID]}).input_ids == [0, EOS_ID]
    with pytest.raises(BadRequest):
        _admit({"input_ids": []})
    with pytest.raises(BadRequest):
        _admit({"text": ""})


@pytest.mark.parametrize("bad_id", [2**63, 2**64 + 5])
def test_admission_rejects_token_ids_beyond_int64(bad_id: int) -> None:
    with pytest.raises(BadRequest):
        _admit({"input_ids": [1, 2, bad_id]})


@pytest.mark.parametrize("room", [-1, 2**64])
def test_admission_rejects_bootstrap_room_outside_u64(room: int) -> None:
    with pytest.raises(BadRequest):
        _admit({"text": "hello", "bootstrap_room": room})


def test_bootstrap_room_u64_edges_accepted() -> None:
    assert _admit({"text": "hello", "bootstrap_room": 0}).bootstrap_room == 0
    assert _admit({"text": "hello", "bootstrap_room": 2**63 - 1}).bootstrap_room == 2**63 - 1


# ------------------------------------------------------------------------ finish reasons ----


def test_finish_to_json_shapes() -> None:
    assert Finish(type="length", length=7).to_json() == {"type": "length", "length": 7}
    assert Finish(type="length", length=0).to_json() == {"type": "length", "length": 0}
    assert Finish(type="stop", matched=EOS_ID).to_json() == {"type": "stop", "matched": EOS_ID}
    assert Finish(type="stop", matched="END").to_json() == {"type": "stop", "matched": "END"}
    assert Finish(type="stop").to_json() == {"type": "stop", "matched": None}
    assert abort("Aborted").to_json() == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert abort("too long", status_code=400, err_type="BadRequestError").to_json() == {
        "type": "abort",
        "message": "too long",
        "status_code": 400,
        "err_type": "BadRequestError",
    }
    for finish in (Finish(type="length", length=3), Finish(type="stop", matched="x"), abort("m", 500)):
        assert json.loads(json.dumps(finish.to_json())) == finish.to_json()
        assert finish.openai_reason == finish.type


def test_kv_transfer_error_text() -> None:
    assert kv_transfer_error(42, "Failed to get kvcache") == "KVTransferError(bootstrap_room=42): Failed to get kvcache"


# --------------------------------------------------------------------------- error bodies ----


def test_error_bodies_match_sglang() -> None:
    assert generate_error_body("bad") == {"error": {"message": "bad"}}
    assert openai_error_body("bad", 400) == {
        "object": "error",
        "message": "bad",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    assert openai_error_body("boom", 500) == {
        "object": "error",
        "message": "boom",
        "type": "500",
        "param": None,
        "code": 500,
    }
    assert server_error_body("boom", 500) == {
        "object": "error",
        "message": "boom",
        "type": "500",
        "param": None,
        "code": 500,
    }
    assert server_error_body("busy", 503) == {
        "object": "error",
        "message": "busy",
        "type": "503",
        "param": None,
        "code": 503,
    }
    # JSON-serialisable as is (param null).
    assert json.loads(json.dumps(openai_error_body("x", 400)))["param"] is None
