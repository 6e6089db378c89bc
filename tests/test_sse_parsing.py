"""Reading response bodies (loadprofiles.sse) and judging requests from them (loadprofiles.recorder).

The reader must never raise, whatever the bytes; what is odd becomes an anomaly, and the outcome
is decided from what was seen.
"""

from __future__ import annotations

import json
import random

import pytest

from chaos.journal import Outcome
from loadprofiles.recorder import Observed, Sent, build_record, judge
from loadprofiles.sse import ParsedResponse, ResponseReader, parse_body

ROUTER_ERROR_BODY = b"""data: {'error': {"message":{"error":{"message"""  # sglang-router 0.3.2's, verbatim


def sse(*payloads: object, done: bool = True) -> bytes:
    lines = [f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n" for p in payloads]
    if done:
        lines.append("data: [DONE]\n\n")
    return "".join(lines).encode()


def gen_chunk(text: str, finish: dict | None = None, **meta: object) -> dict:
    return {"text": text, "output_ids": [], "meta_info": {"finish_reason": finish, **meta}}


def chat_chunk(content: str | None, finish: str | None = None) -> dict:
    delta = {} if content is None else {"content": content}
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def feed_in_pieces(reader: ResponseReader, body: bytes, size: int, t0: float = 100.0) -> ParsedResponse:
    for i in range(0, len(body), size):
        reader.feed(body[i : i + size], t0 + i)
    return reader.close(t0 + len(body))


# ----------------------------------------------------------------------------- well-formed ----


def test_generate_stream_text_is_cumulative() -> None:
    body = sse(
        gen_chunk("Hel"),
        gen_chunk("Hello"),
        gen_chunk("Hello wor"),
        gen_chunk(
            "Hello world", {"type": "length", "length": 4}, prompt_tokens=7, completion_tokens=4, cached_tokens=3
        ),
    )
    r = parse_body("generate", body, sse=True)
    assert r.text == "Hello world"
    assert r.finish is not None and r.finish.reason == "length"
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (7, 4, 3)
    assert r.done and r.anomalies == []
    assert len(r.token_times) == 4


def test_openai_streams_are_deltas_and_usage_comes_last() -> None:
    body = sse(
        chat_chunk(""),  # the role chunk: no content, no token
        chat_chunk("Hel"),
        chat_chunk("lo"),
        chat_chunk(" world", "stop"),
        {
            "choices": [],
            "usage": {"prompt_tokens": 9, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}},
        },
    )
    r = parse_body("chat", body, sse=True)
    assert r.text == "Hello world"
    assert r.finish is not None and r.finish.reason == "stop"
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens) == (9, 3, 8)
    assert len(r.token_times) == 3 and r.anomalies == []

    body = sse(
        {"choices": [{"index": 0, "text": "ab", "finish_reason": None}]},
        {"choices": [{"index": 0, "text": "cd", "finish_reason": "length"}]},
    )
    r = parse_body("completions", body, sse=True)
    assert r.text == "abcd" and r.finish is not None and r.finish.reason == "length"


def test_incremental_generate_stream_is_kept_whole_and_flagged() -> None:
    r = parse_body(
        "generate", sse(gen_chunk("Hel"), gen_chunk("lo"), gen_chunk(" you", {"type": "stop", "matched": 2})), sse=True
    )
    assert r.text == "Hello you"
    assert any(a.startswith("generate_text_not_cumulative") for a in r.anomalies)


@pytest.mark.parametrize("size", [1, 3, 7, 64, 10_000])
def test_any_split_of_the_bytes_reads_the_same(size: int) -> None:
    text = "Grüße, 世界! " * 5  # multi-byte characters split across chunks
    chunks = [gen_chunk(text[: i + 1]) for i in range(len(text))]
    chunks[-1]["meta_info"]["finish_reason"] = {"type": "length", "length": len(text)}
    body = sse(*chunks).replace(b"\n\n", b"\r\n\r\n")  # CRLF line ends too
    r = feed_in_pieces(ResponseReader("generate", sse=True), body, size)
    assert r.text == text and r.done and r.anomalies == []
    assert r.token_times == sorted(r.token_times)


def test_single_newline_separators_and_sse_comments_and_fields() -> None:
    body = b": keep-alive\nevent: message\nid: 1\nretry: 5\n" + b"data:" + json.dumps(chat_chunk("a")).encode() + b"\n"
    body += b"data: " + json.dumps(chat_chunk("b", "length")).encode() + b"\ndata: [DONE]\n"
    r = parse_body("chat", body, sse=True)
    assert r.text == "ab" and r.done and r.anomalies == []


def test_non_stream_bodies_of_each_route() -> None:
    g = parse_body(
        "generate",
        json.dumps(gen_chunk("hi there", {"type": "length", "length": 2}, prompt_tokens=5, cached_tokens=0)).encode(),
        sse=False,
    )
    assert g.text == "hi there" and g.finish is not None and g.finish.reason == "length" and g.cached_tokens == 0
    assert len(g.token_times) == 1
    chat = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "yo"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3},
    }
    c = parse_body("chat", json.dumps(chat).encode(), sse=False)
    assert c.text == "yo" and c.prompt_tokens == 3 and c.anomalies == []


def test_error_bodies_give_their_message() -> None:
    r = parse_body(
        "generate",
        b'{"error": {"message": "The input (9000 tokens) is longer than the model\'s context length (8192 tokens)."}}',
        sse=False,
    )
    assert r.error_message is not None and "9000 tokens" in r.error_message
    r = parse_body(
        "chat",
        b'{"object": "error", "message": "too long", "type": "BadRequestError", "param": null, "code": 400}',
        sse=False,
    )
    assert r.error_message == "too long" and r.finish is not None and r.finish.status_code == 400


def test_in_band_abort_and_error_objects_are_aborts() -> None:
    abort = {"type": "abort", "message": "Aborted by AbortReq.", "status_code": None, "err_type": None}
    r = parse_body("generate", sse(gen_chunk("a"), gen_chunk("ab", abort)), sse=True)
    assert r.finish is not None and r.finish.is_abort and r.finish.status_code is None and r.text == "ab"
    r = parse_body(
        "chat", sse(chat_chunk("x"), {"error": {"message": "KVTransferError", "type": "500", "code": 500}}), sse=True
    )
    assert r.finish is not None and r.finish.is_abort and r.finish.status_code == 500


# ------------------------------------------------------------------------------- malformed ----


def test_the_routers_truncated_error_body() -> None:
    r = parse_body("chat", ROUTER_ERROR_BODY, sse=True)
    assert r.finish is not None and r.finish.is_abort
    assert any(a.startswith("malformed_sse") for a in r.anomalies)
    assert r.body_bytes == len(ROUTER_ERROR_BODY)
    # ... and the same line in the middle of a 200 stream that had started well.
    body = sse(chat_chunk("Hello"), done=False) + ROUTER_ERROR_BODY
    r = parse_body("chat", body, sse=True)
    assert r.text == "Hello" and r.finish is not None and r.finish.is_abort


def test_malformed_lines_are_skipped_and_recorded() -> None:
    body = b"data: {not json\n\nhello there\n\ndata: [1, 2]\n\n" + sse(chat_chunk("ok", "stop"))
    r = parse_body("chat", body, sse=True)
    assert r.text == "ok" and r.done and r.finish is not None
    kinds = [a.split(":")[0] for a in r.anomalies]
    assert kinds == ["malformed_sse"]  # one entry per kind, however many bad lines
    assert "{not json" in r.anomalies[0]


def test_truncated_stream_without_done() -> None:
    r = parse_body("generate", sse(gen_chunk("par"), gen_chunk("partial"), done=False), sse=True)
    assert r.text == "partial" and not r.done and r.finish is None
    assert any(a.startswith("truncated_stream") for a in r.anomalies)
    r = parse_body("chat", sse(chat_chunk("x", "length"), done=False), sse=True)
    assert any(a.startswith("missing_done") for a in r.anomalies)
    # The reader was stopped by its caller (a disconnect): that is not the server's anomaly.
    reader = ResponseReader("generate", sse=True)
    reader.feed(sse(gen_chunk("par"), done=False) + b'data: {"te', 1.0)
    r = reader.close(2.0, ended_by_server=False)
    assert r.text == "par" and r.anomalies == []


def test_non_json_and_unexpected_bodies() -> None:
    r = parse_body("generate", b"<html>502 Bad Gateway</html>", sse=False)
    assert r.raw_text.startswith("<html>") and r.anomalies[0].startswith("non_json_body")
    r = parse_body("generate", b"[1, 2, 3]", sse=False)
    assert r.anomalies[0].startswith("unexpected_shape")
    r = parse_body("chat", b'{"hello": "world"}', sse=False)
    assert not r.shape_ok and r.anomalies[0].startswith("unexpected_shape")
    r = parse_body("generate", b"\xff\xfe\x00garbage", sse=False)
    assert "invalid_utf8" in r.anomalies


def test_body_with_the_other_content_type_is_still_read() -> None:
    r = parse_body("chat", b'{"object": "error", "message": "bad", "code": 400}', sse=True)
    assert r.error_message == "bad"
    r = parse_body("chat", sse(chat_chunk("hi", "stop")), sse=False)
    assert r.text == "hi" and r.done
    assert any(a.startswith("sse_body_without_sse_content_type") for a in r.anomalies)


def test_body_over_the_cap_stops_and_keeps_what_arrived() -> None:
    cap = 1024
    reader = ResponseReader("generate", sse=False, cap=cap)
    body = b'{"text": "' + b"A" * 5000 + b'"}'
    keep_going = [reader.feed(body[i : i + 300], float(i)) for i in range(0, len(body), 300)]
    assert keep_going[:3] == [True, True, True] and keep_going[3] is False
    r = reader.close(99.0)
    assert r.over_cap and r.body_bytes == 1200  # bytes received, the last chunk included
    assert len(r.raw_text) == cap and r.raw_text.startswith('{"text": "AAA')
    assert [a.split(":")[0] for a in r.anomalies] == ["body_over_cap"]


def test_eight_mib_stream_is_capped() -> None:
    chunk = sse(chat_chunk("x" * 4000), done=False)
    reader = ResponseReader("chat", sse=True)
    fed = 0
    while reader.feed(chunk, 1.0):
        fed += len(chunk)
        assert fed < 9 * 1024 * 1024
    r = reader.close(2.0, ended_by_server=False)
    assert r.over_cap and r.body_bytes > 8 * 1024 * 1024
    assert 8 * 1024 * 1024 - 4000 < len(r.text) <= 8 * 1024 * 1024 + 4000  # what arrived is kept
    assert r.anomalies[0].startswith("body_over_cap")


def test_the_cap_bounds_what_is_kept_not_a_cumulative_streams_wire_bytes() -> None:
    # /generate resends its whole text each chunk: 1000 tokens of 40 chars are 20 MB on the wire.
    reader = ResponseReader("generate", sse=True, cap=1024 * 1024)
    text = ""
    for i in range(1000):
        text += f"word{i:05d} " * 4
        finish = {"type": "length", "length": 1000} if i == 999 else None
        assert reader.feed(sse(gen_chunk(text, finish), done=i == 999), float(i))
    r = reader.close(1000.0)
    assert not r.over_cap and r.body_bytes > 20_000_000 and r.text == text and r.anomalies == []
    assert len(r.token_times) == 1000


def test_random_garbage_never_raises() -> None:
    rng = random.Random(7)
    pieces = [
        b"data: ",
        b"[DONE]",
        b"{",
        b"}",
        b"\n",
        b"\r\n",
        b'"text"',
        b":",
        b"\xff",
        b"error",
        b"[[[[[[" * 500,
        b"data: {'error'",
    ]
    for _ in range(300):
        body = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        for api in ("generate", "chat", "completions"):
            for as_sse in (True, False):
                reader = ResponseReader(api, sse=as_sse, cap=4096)
                feed_in_pieces(reader, body, rng.randint(1, 50))


# --------------------------------------------------------------------------------- judging ----


def observed(
    status: int | None, body: bytes = b"", *, api: str = "generate", as_sse: bool = True, **kwargs: object
) -> Observed:
    obs = Observed(
        t_send=1.0, t_first_byte=1.1 if status is not None else None, t_end=2.0, status=status, sse=as_sse, **kwargs
    )  # type: ignore[arg-type]
    if status is not None:
        obs.parsed = parse_body(api, body, sse=as_sse, now=1.5)  # type: ignore[arg-type]
    return obs


def test_outcomes_follow_jepsen() -> None:
    finished = sse(gen_chunk("ok", {"type": "length", "length": 1}))
    assert judge(observed(200, finished)).outcome is Outcome.OK
    # A definite rejection or server error: fail.
    for status in (400, 404, 429, 500, 503):
        verdict = judge(observed(status, b'{"error": {"message": "no"}}', as_sse=False))
        assert (verdict.outcome, verdict.error_class) == (Outcome.FAIL, f"http_{status}")
    assert judge(observed(400, ROUTER_ERROR_BODY)).outcome is Outcome.FAIL
    # Indeterminate: the gateway lost its worker, a timeout, a disconnect, a truncated stream.
    assert judge(observed(502, b"{}", as_sse=False)).outcome is Outcome.INFO
    assert judge(observed(None, transport=("timeout", "ReadTimeout"))).error_class == "timeout"
    assert judge(observed(None, transport=("timeout", "ReadTimeout"))).outcome is Outcome.INFO
    assert judge(observed(None, transport=("connect_error", "refused"))).outcome is Outcome.FAIL
    truncated = judge(observed(200, sse(gen_chunk("par"), done=False)))
    assert (truncated.outcome, truncated.error_class) == (Outcome.INFO, "truncated_stream")
    garbage = judge(observed(200, b"data: nonsense\n\n"))
    assert (garbage.outcome, garbage.error_class) == (Outcome.INFO, "malformed_sse")
    not_json = judge(observed(200, b"<html>", as_sse=False))
    assert (not_json.outcome, not_json.error_class) == (Outcome.INFO, "malformed_body")


def test_aborts_and_disconnects() -> None:
    abort = {"type": "abort", "message": "Aborted by AbortReq.", "status_code": None}
    aborted = sse(gen_chunk("a", abort))
    assert (judge(observed(200, aborted)).outcome, judge(observed(200, aborted)).error_class) == (Outcome.INFO, "abort")
    # An abort the server chose, with a status: a definite failure, unless we asked for it.
    server_abort = sse(gen_chunk("a", {"type": "abort", "message": "KVTransferError", "status_code": 500}))
    assert judge(observed(200, server_abort)).outcome is Outcome.FAIL
    assert judge(observed(200, server_abort, abort_sent_at=1.2)).outcome is Outcome.INFO
    # We closed the connection: indeterminate, unless the reply had already finished.
    cut = judge(observed(200, sse(gen_chunk("a"), done=False), client_closed="at mid_stream"))
    assert (cut.outcome, cut.error_class) == (Outcome.INFO, "disconnect")
    early = judge(observed(200, sse(gen_chunk("a", {"type": "length", "length": 1})), client_closed="at mid_stream"))
    assert early.outcome is Outcome.OK


def test_over_cap_is_indeterminate_and_the_record_keeps_the_bytes() -> None:
    reader = ResponseReader("generate", sse=False, cap=64)
    reader.feed(b'{"text": "UULK7QX' + b"B" * 100, 1.2)
    obs = Observed(t_send=1.0, t_first_byte=1.1, t_end=1.3, status=200, sse=False, parsed=reader.close(1.3))
    verdict = judge(obs)
    assert (verdict.outcome, verdict.error_class) == (Outcome.INFO, "body_over_cap")
    sent = Sent(
        id="r1",
        request_index=1,
        phase="load",
        user_kind="canary_chat",
        actor="a0",
        endpoint="/generate",
        stream=False,
        markers=("M0", "M1"),
        prompt="p",
        max_tokens=4,
        planned_send=0.9,
    )
    record = build_record(sent, obs, verdict)
    assert "UULK7QX" in record.response_text  # scanned by the canary oracle all the same
    assert record.anomaly is not None and record.anomaly.startswith("body_over_cap")
    assert record.body_bytes == 117 and record.outcome is Outcome.INFO
