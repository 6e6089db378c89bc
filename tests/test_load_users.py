"""The Locust load users against the embedded PD stack, each run as the driver runs it: a subprocess.

Each test starts `python -m locust --headless -f loadprofiles/locustfile.py --json --only-summary
--skip-log` with a small `LoadConfig` for a few seconds (the shape class sets users and duration),
then checks the records file against Locust's own count and the properties every record must have.
"""

from __future__ import annotations

import contextlib
import http.server
import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from aiohttp import web

from chaos.journal import Journal, Outcome, RequestRecord
from chaos.markers import MarkerCodec, new_run_prefix
from chaos.process import free_port
from chaos.targets.discovery import TargetFacts
from chaos.targets.sim.stack import SimStack
from chaos.targets.sim.tokenizer import tokenize
from loadprofiles.config import CONFIG_ENV, LoadConfig, ShapeSpec, Stage
from loadprofiles.prompts import PromptFactory
from loadprofiles.shapes import users_at
from tests.aiohttp_thread import ThreadedServer

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
LOCUSTFILE = "loadprofiles/locustfile.py"


@dataclass
class Run:
    rc: int
    wall_s: float
    stats: list[dict]
    records: list[RequestRecord]
    stderr: str
    codec: MarkerCodec

    @property
    def locust_requests(self) -> int:
        return sum(entry["num_requests"] for entry in self.stats)

    def of(self, kind: str) -> list[RequestRecord]:
        return [r for r in self.records if r.user_kind == kind]


def facts_of(stack: SimStack) -> TargetFacts:
    s = stack.settings["prefill"]
    return TargetFacts(
        model=s.model_name,
        api="sglang",
        context_length=s.context_length,
        max_total_num_tokens=s.pool_tokens,
        max_req_input_len=s.max_req_input_len,
        abort_urls=(stack.worker_url("prefill"), stack.worker_url("decode")),
    )


def config_for(
    tmp_path: Path,
    url: str,
    facts: TargetFacts,
    mix: dict[str, float],
    *,
    users: int = 2,
    duration_s: float = 5.0,
    **extra: object,
) -> LoadConfig:
    return LoadConfig(
        run_prefix=new_run_prefix(),
        target_url=url,
        records_path=str(tmp_path / "records.jsonl"),
        facts=facts,
        mix=mix,
        shape=ShapeSpec(kind="steady", duration_s=duration_s, users=users, spawn_rate=float(users)),
        **extra,  # type: ignore[arg-type]
    )


def run_locust(config: LoadConfig, timeout_s: float = 40.0) -> Run:
    env = {**os.environ, CONFIG_ENV: config.to_json()}
    argv = [sys.executable, "-m", "locust", "--headless", "-f", LOCUSTFILE, "--json", "--only-summary", "--skip-log"]
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    wall = time.monotonic() - started
    assert proc.stdout.strip(), f"no JSON on stdout; stderr:\n{proc.stderr[-3000:]}"
    stats = json.loads(proc.stdout)
    path = Path(config.records_path)
    lines = path.read_text().splitlines() if path.exists() else []
    records = [RequestRecord(**json.loads(line)) for line in lines]
    return Run(proc.returncode, wall, stats, records, proc.stderr, MarkerCodec(config.run_prefix))


def check_every_record(run: Run) -> None:
    """What holds for any run: counts, ids, markers, timing order, no leak on the clean engine."""
    assert run.rc == 0, run.stderr[-3000:]
    assert run.records, run.stderr[-3000:]
    assert len(run.records) == run.locust_requests
    assert len({r.id for r in run.records}) == len(run.records)
    assert len({r.request_index for r in run.records}) == len(run.records)
    for r in run.records:
        where = f"{r.user_kind} {r.endpoint} stream={r.stream} {r.outcome.value}/{r.error_class}"
        assert r.markers == [run.codec.marker(r.request_index, 0), run.codec.marker(r.request_index, 1)]
        assert str(r.request_index) in r.id or f"{r.request_index:09d}" in r.id
        times = [t for t in (r.t_send, r.t_first_byte, r.t_first_token, r.t_end) if t is not None]
        assert r.t_send is not None and r.t_end is not None, where
        assert times == sorted(times), where
        assert r.token_times == sorted(r.token_times), where
        if r.token_times:
            assert r.t_first_token == r.token_times[0] and r.token_times[-1] <= r.t_end, where
            assert r.t_first_byte is not None and r.t_first_byte <= r.token_times[0], where
        assert r.planned_send is None or r.planned_send <= r.t_send + 0.5, where
        assert not run.codec.scan_others(r.response_text, r.request_index), f"leak in {where}: {r.response_text[:200]}"


def ok(records: list[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.outcome is Outcome.OK]


# ---------------------------------------------------------------------------- pure helpers ----


def test_shapes_follow_their_spec() -> None:
    steady = ShapeSpec(kind="steady", duration_s=10, users=8, spawn_rate=4)
    assert users_at(steady, 0) == (8, 4) and users_at(steady, 9.9) == (8, 4) and users_at(steady, 10) is None
    ramp = ShapeSpec(kind="ramp", duration_s=10, users=10, spawn_rate=1)
    counts = [users_at(ramp, t)[0] for t in range(10)]  # type: ignore[index]
    assert counts == sorted(counts) and counts[0] == 1 and counts[-1] == 9
    spike = ShapeSpec(kind="spike", duration_s=10, users=20, spawn_rate=5)
    assert [users_at(spike, t)[0] for t in (0, 3.9, 4, 5.9, 6, 9.9)] == [2, 2, 20, 20, 2, 2]  # type: ignore[index]
    stages = ShapeSpec(kind="stages", stages=(Stage(2, 1, 1), Stage(5, 4, 2)))
    assert users_at(stages, 1) == (1, 1) and users_at(stages, 3) == (4, 2) and users_at(stages, 5) is None
    assert users_at(ShapeSpec(kind="soak", duration_s=3600, users=3), 1800) == (3, 8.0)


def test_over_length_prompts_hit_each_threshold_on_the_toy_tokenizer() -> None:
    facts = TargetFacts(context_length=8192, max_total_num_tokens=39312, max_req_input_len=8186)
    factory = PromptFactory(MarkerCodec(new_run_prefix()), seed=3, facts=facts)
    by_name = {t.name: t for t in factory.thresholds()}
    assert set(by_name) == {
        "at_context_length",
        "over_context_length",
        "at_max_total_num_tokens",
        "over_max_total_num_tokens",
        "band_max_req_input_len",
    }
    for i, threshold in enumerate(by_name.values()):
        prompt = factory.over_length(i, threshold)
        tokens = len(tokenize(prompt.as_text()))
        assert tokens == threshold.target == prompt.est_tokens, threshold
        assert prompt.as_text().startswith(prompt.markers[0]) and prompt.as_text().endswith(prompt.markers[1])
    band = by_name["band_max_req_input_len"]
    assert 8186 <= band.target < 8192 and band.target + band.max_new_tokens() <= 8192
    # Nothing known: one probe at an assumed size, flagged as such.
    assert [t.known for t in PromptFactory(MarkerCodec(new_run_prefix()), 0, TargetFacts()).thresholds()] == [False]


def test_prompts_are_deterministic_and_carry_only_their_own_markers() -> None:
    facts = TargetFacts(context_length=8192)
    codec = MarkerCodec(new_run_prefix())
    one, two = PromptFactory(codec, 5, facts), PromptFactory(codec, 5, facts)
    assert one.canary(7, medium=True, repeat=True) == two.canary(7, medium=True, repeat=True)
    assert one.shared_prefix == two.shared_prefix and "repeat" not in one.shared_prefix.lower()
    long = one.long_context(9, max_tokens=32, repeat=False)
    assert long is not None and 0.69 * 8192 < len(tokenize(long.as_text())) < 8192 - 32
    assert "repeat" not in long.as_text().lower()
    assert PromptFactory(codec, 5, TargetFacts()).long_context(9, max_tokens=32, repeat=False) is None
    talk = one.new_conversation()
    for index in range(10, 16):
        prompt = talk.next_turn(index, repeat=False)
        text = prompt.as_text()
        assert text.startswith("system: " + one.shared_prefix)
        assert {hit.request_index for hit in codec.scan(text)} == {index}  # history is scrubbed
        talk.add_reply(f"reply quoting {codec.marker(index, 0)} back")


# ------------------------------------------------------------------------ against the stack ----


def test_canary_chat_markers_round_trip(sim_stack: SimStack, tmp_path: Path) -> None:
    config = config_for(tmp_path, sim_stack.router_url, facts_of(sim_stack), {"canary_chat": 1.0}, users=3)
    run = run_locust(config)
    check_every_record(run)
    assert 4.5 < run.wall_s < 20  # the shape ran the show: no --users, no --run-time
    assert all(r.outcome is Outcome.OK for r in run.records if r.error_class != "load_stopped"), Counter(
        r.error_class for r in run.records
    )
    assert {(r.endpoint, r.stream) for r in run.records} >= {
        ("/generate", True),
        ("/generate", False),
        ("/v1/chat/completions", True),
        ("/v1/completions", False),
    }
    repeats = [r for r in ok(run.records) if "repeat" in r.prompt.lower()]
    assert len(repeats) >= 5
    for r in repeats:  # the toy model copies its prompt: its own head marker comes back out
        assert r.markers[0] in r.response_text, (r.endpoint, r.response_text[:80])
    assert all(r.stream == (len(r.token_times) > 1) for r in ok(run.records))
    assert all(r.phase == "load" and r.user_kind == "canary_chat" for r in run.records)


def test_prefix_sharing_hits_the_cache(sim_stack: SimStack, tmp_path: Path) -> None:
    run = run_locust(config_for(tmp_path, sim_stack.router_url, facts_of(sim_stack), {"prefix_sharing": 1.0}))
    check_every_record(run)
    good = ok(run.records)
    assert len(good) >= 5
    assert sum(1 for r in good if (r.cached_tokens or 0) > 0) >= len(good) // 2
    assert any(r.prompt.count("assistant:") >= 2 for r in run.records)  # conversations grew


def test_long_context_fills_most_of_the_context(sim_stack: SimStack, tmp_path: Path) -> None:
    facts = facts_of(sim_stack)
    run = run_locust(config_for(tmp_path, sim_stack.router_url, facts, {"long_context": 1.0}))
    check_every_record(run)
    good = ok(run.records)
    assert len(good) >= 3
    assert facts.context_length is not None
    for r in good:
        assert r.prompt_tokens is not None and 0.6 * facts.context_length < r.prompt_tokens < facts.context_length


def test_over_length_is_rejected_at_every_threshold(sim_stack: SimStack, tmp_path: Path) -> None:
    run = run_locust(config_for(tmp_path, sim_stack.router_url, facts_of(sim_stack), {"over_length": 1.0}))
    check_every_record(run)
    judged = [r for r in run.records if r.error_class != "load_stopped"]
    assert len(judged) >= 10
    for r in judged:
        assert r.outcome is Outcome.FAIL and r.status is not None and 400 <= r.status < 500, (r.status, r.error_detail)
        assert r.error_detail is not None and r.error_detail.startswith("over_length threshold=")
    names = {r.error_detail.split()[1] for r in judged if r.error_detail}
    assert names == {
        f"threshold={n}"
        for n in (
            "at_context_length",
            "over_context_length",
            "at_max_total_num_tokens",
            "over_max_total_num_tokens",
            "band_max_req_input_len",
        )
    }
    band = [r for r in judged if "band_max_req_input_len" in (r.error_detail or "")]
    assert all("exceeds the maximum allowed length" in (r.error_detail or "") for r in band)  # the scheduler check
    # Locust counts an expected rejection as a success (a request cut off by the stop is not one).
    assert sum(entry["num_failures"] for entry in run.stats) == len(run.records) - len(judged)


def test_aborting_users_disconnect_and_abort(sim_stack: SimStack, tmp_path: Path) -> None:
    run = run_locust(config_for(tmp_path, sim_stack.router_url, facts_of(sim_stack), {"aborting": 1.0}, users=3))
    check_every_record(run)
    classes = Counter((r.outcome, r.error_class) for r in run.records)
    assert classes[(Outcome.INFO, "abort")] >= 1, classes
    assert classes[(Outcome.INFO, "disconnect")] >= 2, classes
    phases = {
        (r.error_detail or "").split("abort phase=")[1].split()[0]
        for r in run.records
        if "abort phase=" in (r.error_detail or "")
    }
    assert phases == {"before_first_byte", "after_first_token", "mid_stream", "abort_request"}
    aborted = [r for r in run.records if r.error_class == "abort"]
    assert all(r.endpoint == "/generate" and "/abort_request at" in (r.error_detail or "") for r in aborted)
    # Every record is judged: an aborted request that still finished says so (ok), never silently.
    assert all(r.outcome is not Outcome.FAIL for r in run.records), [
        (r.status, r.error_class, r.error_detail, r.anomaly) for r in run.records if r.outcome is Outcome.FAIL
    ]


def test_mixed_run_with_two_actors_shares_one_index_space(sim_stack: SimStack, tmp_path: Path) -> None:
    facts = facts_of(sim_stack)
    mix = {"canary_chat": 1.0, "prefix_sharing": 1.0, "long_context": 1.0, "over_length": 1.0, "aborting": 1.0}
    base = config_for(tmp_path, sim_stack.router_url, facts, mix, users=5, duration_s=6.0, actor_count=2)
    base = replace(base, shape=ShapeSpec(kind="ramp", duration_s=6.0, users=5, spawn_rate=5.0))
    configs = [replace(base, actor_index=i, records_path=str(tmp_path / f"actor{i}.jsonl")) for i in range(2)]
    procs = []
    for config in configs:  # two Locust processes at once, as two load actors would run them
        env = {**os.environ, CONFIG_ENV: config.to_json()}
        argv = [
            sys.executable,
            "-m",
            "locust",
            "--headless",
            "-f",
            LOCUSTFILE,
            "--json",
            "--only-summary",
            "--skip-log",
        ]
        procs.append(
            subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    all_indices: list[int] = []
    for config, proc in zip(configs, procs, strict=True):
        stdout, stderr = proc.communicate(timeout=40)
        lines = Path(config.records_path).read_text().splitlines()
        run = Run(
            proc.returncode,
            0.0,
            json.loads(stdout),
            [RequestRecord(**json.loads(x)) for x in lines],
            stderr,
            MarkerCodec(config.run_prefix),
        )
        check_every_record(run)
        assert {r.user_kind for r in run.records} == set(mix)
        assert all(r.request_index % 2 == config.actor_index for r in run.records)
        assert all(r.actor.startswith(f"actor{config.actor_index}/a{config.actor_index}u") for r in run.records)
        # The ramp starts with one user: the first second sees fewer users than the last.
        start = min(r.t_send or 0 for r in run.records)
        early = {r.actor for r in run.records if (r.t_send or 0) < start + 1.0}
        late = {r.actor for r in run.records if (r.t_send or 0) > start + 4.0}
        assert len(early) < len(late)
        all_indices += [r.request_index for r in run.records]
        with Journal.create(tmp_path / f"journal{config.actor_index}") as journal:  # what the driver will do
            journal.append_requests(run.records)
            assert journal.count_requests() == len(run.records)
    assert len(all_indices) == len(set(all_indices))


# --------------------------------------------------------------------------- a broken server ----

BIG_BODY_BYTES = 9 * 1024 * 1024


class GarbageServer:
    """Answers every route with the next of a cycle of broken replies (and, sometimes, a good one)."""

    KINDS = ("garbage", "truncated_sse", "router_error", "huge", "malformed_lines", "reset", "good")

    def __init__(self) -> None:
        self.counter = itertools.count()
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("POST", "/{tail:.*}", self.handle)
        self.server = ThreadedServer(app)
        self.port = self.server.port

    def __enter__(self) -> GarbageServer:
        self.server.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        kind = self.KINDS[next(self.counter) % len(self.KINDS)]
        sse_headers = {"Content-Type": "text/event-stream"}
        if kind == "garbage":
            return web.Response(status=200, text="<html>definitely not json</html>", content_type="text/html")
        if kind == "router_error":
            return web.Response(
                status=500, body=b"""data: {'error': {"message":{"error":{"message""", headers=sse_headers
            )
        if kind == "huge":
            response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
            await response.prepare(request)
            try:
                await response.write(b'{"text": "')
                block = b"x" * (1024 * 1024)
                for _ in range(BIG_BODY_BYTES // len(block)):
                    await response.write(block)
                await response.write(b'"}')
            except (ConnectionResetError, ConnectionError):
                pass
            return response
        response = web.StreamResponse(status=200, headers=sse_headers)
        await response.prepare(request)
        chunk = {
            "text": "partial",
            "meta_info": {"finish_reason": None},
            "choices": [{"index": 0, "text": "partial", "delta": {"content": "partial"}, "finish_reason": None}],
        }
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if kind == "reset":
            assert request.transport is not None
            request.transport.close()  # the connection drops mid-stream
            return response
        if kind == "malformed_lines":
            await response.write(b"data: {broken json\n\nthis is not sse\n\n")
        if kind in ("malformed_lines", "good"):
            done = {
                "text": "partial",
                "meta_info": {"finish_reason": {"type": "length", "length": 1}},
                "choices": [{"index": 0, "text": "", "delta": {}, "finish_reason": "length"}],
            }
            await response.write(f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode())
        await response.write_eof()  # truncated_sse: a clean end, but no [DONE] and no finish
        return response


@pytest.fixture()
def garbage_server() -> Iterator[GarbageServer]:
    with GarbageServer() as server:
        yield server


def test_broken_replies_become_anomalies_and_the_users_keep_going(
    garbage_server: GarbageServer, tmp_path: Path
) -> None:
    facts = TargetFacts(model="m", api="sglang", context_length=4096)
    config = config_for(
        tmp_path,
        f"http://127.0.0.1:{garbage_server.port}",
        facts,
        {"canary_chat": 1.0},
        users=2,
        duration_s=4.0,
        request_timeout_s=10.0,
    )
    run = run_locust(config)
    check_every_record(run)
    anomalies = " ".join(r.anomaly or "" for r in run.records)
    for kind in ("non_json_body", "truncated_stream", "malformed_sse", "body_over_cap"):
        assert kind in anomalies, kind
    classes = Counter(r.error_class for r in run.records)
    assert {"malformed_body", "truncated_stream", "http_500", "body_over_cap", "disconnect", None} <= set(classes), (
        classes
    )
    huge = [r for r in run.records if r.error_class == "body_over_cap"]
    assert all(r.outcome is Outcome.INFO and r.body_bytes is not None and r.body_bytes >= 8 * 1024 * 1024 for r in huge)
    assert all(len(r.response_text) <= 8 * 1024 * 1024 and r.response_text.startswith('{"text": "xxx') for r in huge)
    # A reply cut off when Locust stopped its user at the end has no body to judge.
    router_errors = [r for r in run.records if r.error_class == "http_500" and r.body_bytes]
    assert router_errors
    assert all(r.outcome is Outcome.FAIL and "malformed_sse" in (r.anomaly or "") for r in router_errors), [
        (r.outcome, r.anomaly, r.error_detail, r.body_bytes) for r in router_errors
    ]
    # Each user went on sending after its broken replies.
    for record in huge[:3]:
        later = [r for r in run.records if r.actor == record.actor and (r.t_send or 0) > (record.t_end or 0)]
        assert later, f"{record.actor} stopped after an 8 MiB body"
    assert len(run.records) >= 3 * len(GarbageServer.KINDS)


@contextlib.contextmanager
def _unavailable(kind: str) -> Iterator[str]:
    """A URL where nothing listens, or where a router with no worker answers every request 503."""
    if kind == "refused":
        yield f"http://127.0.0.1:{free_port()}"
        return

    class NoWorker(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", 0)))
            body = b'{"error": "No available decode workers"}'
            self.send_response(503)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NoWorker)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("kind", "ending"), [("refused", "connect_error"), ("no_worker", "http_503")])
def test_users_back_off_while_the_target_is_unavailable(kind: str, ending: str, tmp_path: Path) -> None:
    """A router killed on purpose refuses connections, one whose worker was killed answers 503:
    each user waits longer after each such ending (doubling, jittered, at most a second) instead
    of spinning at hundreds of attempts a second, and every attempt is still recorded."""
    facts = TargetFacts(model="m", api="sglang", context_length=4096)
    with _unavailable(kind) as url:
        run = run_locust(config_for(tmp_path, url, facts, {"canary_chat": 1.0}, users=2, duration_s=5.0))
    check_every_record(run)
    endings = [r for r in run.records if r.error_class != "load_stopped"]  # one may be cut by the end
    assert {r.error_class for r in endings} == {ending}
    for actor in {r.actor for r in endings}:
        sends = sorted(r.t_send for r in endings if r.actor == actor and r.t_send is not None)
        gaps = [b - a for a, b in itertools.pairwise(sends)]
        assert 3 <= len(sends) <= 15, (actor, len(sends))
        assert max(gaps) >= 0.4 and max(gaps) <= 1.5, gaps
        assert gaps[-1] > gaps[0], gaps
