"""The reference probes: what they hold, and the order they are replayed in under load."""

from __future__ import annotations

import itertools

import pytest

from chaos.markers import MarkerCodec
from chaos.probes import ADAPTER_PREFIX, build_probes, reader_order, replay_order


def test_adapter_probes_share_an_opening_and_are_replayed_back_to_back() -> None:
    probes = build_probes(MarkerCodec("K7QX"), 9, 2048, 16)
    adapters = [p for p in probes if p.lora_path]
    assert [p.index for p in adapters] == [2, 5, 8]
    assert {p.lora_path for p in adapters} == {"adapter-a", "adapter-b"}
    assert all(p.prompt.startswith(ADAPTER_PREFIX) for p in adapters)
    assert not any(p.prompt.startswith(ADAPTER_PREFIX) for p in probes if not p.lora_path)

    order = replay_order(probes)
    assert sorted(p.index for p in order) == list(range(9))  # every probe, once
    assert [p.index for p in order] == [0, 1, 2, 5, 8, 3, 4, 6, 7]
    # each adapter probe directly follows one under the other adapter (after the first)
    lora = [p.lora_path for p in order if p.lora_path]
    assert all(a != b for a, b in itertools.pairwise(lora))


def test_without_adapter_probes_the_order_is_unchanged() -> None:
    probes = build_probes(MarkerCodec("K7QX"), 2, 2048, 16)
    assert not any(p.lora_path for p in probes)
    assert replay_order(probes) == probes


def test_probes_are_sized_with_the_targets_own_token_count_and_use_only_served_adapters() -> None:
    """A tokenizer that gives 0.8 characters a token (the tiny model of the CPU tiers) must not get
    probes sized for 4: the longest stays near half the context either way."""
    codec = MarkerCodec("K7QX")
    coarse = build_probes(codec, 6, 2048, 16, chars_per_token=4.0)
    fine = build_probes(codec, 6, 2048, 16, chars_per_token=0.8)
    assert max(len(p.prompt) for p in coarse) > 4 * max(len(p.prompt) for p in fine)
    assert max(len(p.prompt) for p in fine) < 1024 * 0.8 + 300  # the filler, the ask and two markers
    assert not any(p.lora_path for p in build_probes(codec, 9, 2048, 16, adapters=()))
    served = build_probes(codec, 9, 2048, 16, adapters=("sql", "chat", "law"))
    assert {p.lora_path for p in served if p.lora_path} == {"sql", "chat"}


def test_served_adapters_from_sglang_server_info() -> None:
    from chaos.targets.discovery import served_adapters

    assert served_adapters({"prefill": {}, "decode": {}}) is None  # nobody says: the default names
    assert served_adapters({"prefill": {"enable_lora": None, "lora_paths": None}}) == ()  # SGLang 0.5.23 without LoRA
    both = {
        "prefill": {"enable_lora": True, "lora_paths": ["sql=/m/sql", "chat=/m/chat"]},
        "decode": {"enable_lora": True, "lora_paths": {"chat": "/m/chat", "sql": "/m/sql", "x": "/m/x"}},
    }
    assert served_adapters(both) == ("chat", "sql")  # what every worker serves
    assert served_adapters({"prefill": {"lora_paths": [{"lora_name": "a", "lora_path": "/a"}]}}) == ("a",)


def test_reuse_waves_replay_the_longer_half_of_the_probes_longest_first() -> None:
    probes = build_probes(MarkerCodec("K7QX"), 8, 2048, 16)
    readers = reader_order(probes)
    lengths = [len(p.prompt) for p in readers]
    assert len(readers) == 4 and lengths == sorted(lengths, reverse=True)
    assert min(lengths) >= max(len(p.prompt) for p in probes if p not in readers)
    assert [p.index for p in reader_order(probes[:1])] == [0]


def test_probes_name_the_model_the_target_serves() -> None:
    """An OpenAI server may refuse a model it does not serve: the probes and the sizing request
    send the name discovery read from /v1/models, not a placeholder."""
    import json

    import httpx

    from chaos.probes import chars_per_token, send_probe

    seen: list[str] = []

    def serve(request: httpx.Request) -> httpx.Response:
        model = json.loads(request.content)["model"]
        seen.append(model)
        if model != "tiny-llama":
            return httpx.Response(404, json={"error": {"message": f"The model `{model}` does not exist."}})
        return httpx.Response(
            200,
            json={
                "choices": [{"text": "ok", "finish_reason": "length"}],
                "usage": {"prompt_tokens": 300, "completion_tokens": 1},
            },
        )

    probe = build_probes(MarkerCodec("K7QX"), 1, 2048, 1)[0]
    with httpx.Client(transport=httpx.MockTransport(serve)) as client:
        per_token, sizing = chars_per_token(client, "http://target", "openai", 0, model="tiny-llama")
        record = send_probe(client, "http://target", probe, "baseline", "openai", model="tiny-llama")
    assert seen == ["tiny-llama", "tiny-llama"]
    assert sizing.status == 200 and record.status == 200
    assert per_token == len(sizing.prompt) / 300


def test_the_span_probe_decodes_its_whole_length_on_either_api_and_says_when_it_decodes() -> None:
    """ignore_eos in SGLang's sampling_params and in the OpenAI body (SGLang and vLLM read it
    there); the event is set once the first token is in."""
    import json
    import threading

    import httpx

    from chaos.probes import build_span_probe, send_probe

    bodies: list[dict] = []

    def serve(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        chunk = (
            {"text": "a", "meta_info": {"completion_tokens": 1}}
            if request.url.path == "/generate"
            else {"choices": [{"text": "a", "finish_reason": None}]}
        )
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(),
        )

    span = build_span_probe(MarkerCodec("K7QX"), 12, 3000)
    assert span.max_tokens == 3000 and span.index == 12 and "repeat" not in span.prompt.lower()
    decoding = {api: threading.Event() for api in ("sglang", "openai")}
    with httpx.Client(transport=httpx.MockTransport(serve)) as client:
        for api, event in decoding.items():
            send_probe(client, "http://target", span, "span", api, first_token=event)
    assert bodies[0]["sampling_params"]["ignore_eos"] is True and bodies[0]["sampling_params"]["max_new_tokens"] == 3000
    assert bodies[1]["ignore_eos"] is True and bodies[1]["max_tokens"] == 3000
    assert all(e.is_set() for e in decoding.values())
    # the reference probes decode as the model decides
    probe = build_probes(MarkerCodec("K7QX"), 1, 2048, 8)[0]
    with httpx.Client(transport=httpx.MockTransport(serve)) as client:
        send_probe(client, "http://target", probe, "load", "sglang")
    assert "ignore_eos" not in bodies[-1]["sampling_params"]


def test_the_span_probe_is_sized_from_the_isolated_pace_within_its_room() -> None:
    from chaos.journal import RequestRecord
    from chaos.probes import isolated_itl, span_tokens

    def baseline(rid: str, tokens: int, seconds: float, status: int = 200) -> RequestRecord:
        return RequestRecord(
            id=rid,
            request_index=0,
            status=status,
            t_first_token=100.0,
            t_end=100.0 + seconds,
            completion_tokens=tokens,
        )

    records = [
        baseline("a", 11, 0.05),
        baseline("b", 21, 0.1),
        baseline("c", 5, 9.0, status=500),
        baseline("d", 1, 0.2),
    ]
    assert isolated_itl(records) == pytest.approx(0.005)  # a failed reply and a single token say nothing of the pace
    assert isolated_itl([]) is None
    assert span_tokens(8.0, 0.005, room_tokens=4000) == 1600
    assert span_tokens(8.0, 0.001, room_tokens=4000) == 4000
