"""The load users' own HTTP client (loadprofiles/http_client.py, `perform_fast`) against httpx
(`perform`, the simple path the probes use): the same reply makes the same record, whatever the
server sends; the users journal the same rows either way; every request carries the transport's
headers and TLS settings, and no byte of the key reaches a record. And the Locust benchmark's
short mode runs and reports what docs/performance.md quotes.

The server here speaks HTTP/1.1 by hand, so each framing a broken server may send is exact: chunked,
length-delimited and close-delimited bodies, gzip, a connection reset mid-stream, a status line
that is not HTTP, a connection closed without a reply, a slow first byte, an idle connection the
server hangs up. It demands `Authorization: Bearer <key>` when given one (401 otherwise, echoing
what it got, as gateways do) and echoes the header into its replies.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import trustme

from chaos import transport
from chaos.journal import Outcome, RequestRecord
from chaos.markers import MarkerCodec, new_run_prefix
from chaos.targets.discovery import TargetFacts
from chaos.transport import Transport
from loadprofiles.config import CONFIG_ENV, LoadConfig, ShapeSpec
from loadprofiles.exchange import ROUTES, Interrupt, perform, perform_fast, request_body
from loadprofiles.http_client import Connection
from loadprofiles.prompts import PromptFactory
from loadprofiles.recorder import Observed, Sent, build_record, judge
from loadprofiles.sse import Api

pytestmark = pytest.mark.usefixtures("fresh_transport")
REPO = Path(__file__).resolve().parents[1]
KEY = "sk-pdchaos-fast-user-51c0ffee9d2b7a44"
VAR = "PDCHAOS_FAST_USER_TEST_KEY"
CAP = 8 * 1024 * 1024
HUGE_BYTES = 9 * 1024 * 1024
TIMINGS = ("t_send", "t_first_byte", "t_first_token", "t_end", "token_times")


# ------------------------------------------------------------------------------ the server ----


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class RawServer:
    """Replies chosen by the `kind` query parameter (default "good"); keep-alive unless a kind ends
    the connection. `event_delay_s` spaces streamed events so each arrives in a read of its own."""

    def __init__(self, *, key: str | None = None, tls: ssl.SSLContext | None = None, event_delay_s: float = 0.0):
        self.key = key
        self.tls = tls
        self.event_delay_s = event_delay_s
        self.unauthorized = 0
        self.aborts = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        host = "localhost" if tls else "127.0.0.1"  # the test CA's certificate names localhost
        self.url = f"{'https' if tls else 'http'}://{host}:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> RawServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept: the port refuses from now on
        self.sock.close()
        self.thread.join(5)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.tls:
                conn = self.tls.wrap_socket(conn, server_side=True)
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _version = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
                length = int(headers.get("content-length", "0"))
                while len(buf) < length:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                body, buf = buf[:length], buf[length:]
                if not self._reply(conn, method, target, headers, body):
                    return
        except OSError:
            pass
        finally:
            conn.close()

    def _reply(self, conn: socket.socket, method: str, target: str, headers: dict[str, str], raw: bytes) -> bool:
        """Answer one request; False: the connection ends here."""
        parts = urlsplit(target)
        kind = parse_qs(parts.query).get("kind", ["good"])[0]
        given = headers.get("authorization")
        if self.key is not None and given != f"Bearer {self.key}":
            self.unauthorized += 1
            body = json.dumps({"error": {"message": f"bad credentials: {given}", "code": 401}}).encode()
            conn.sendall(self._head(401, "application/json", len(body)) + body)
            return True
        if parts.path == "/abort_request":
            self.aborts += 1
            conn.sendall(self._head(200, "application/json", 2) + b"{}")
            return True
        request = json.loads(raw or b"{}")
        route = parts.path
        stream = bool(request.get("stream"))
        prompt = request.get("text") or request.get("prompt") or (request.get("messages") or [{}])[-1].get("content")
        text = f"{str(prompt)[:40]} (authorization: {given})"
        pieces = [text[i : i + 12] for i in range(0, len(text), 12)]
        sse = "text/event-stream"
        if kind == "silent_close":
            return False
        if kind == "not_http":
            conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
            return False
        if kind == "slow":
            time.sleep(0.3)
        if kind == "garbage":
            body = b"<html>definitely not json</html>"
            conn.sendall(self._head(200, "text/html", len(body)) + body)
            return True
        if kind == "router_error":
            body = b"""data: {'error': {"message":{"error":{"message"""
            conn.sendall(self._head(500, sse, len(body)) + body)
            return True
        if kind == "unavailable":
            body = b'{"error": "No available decode workers"}'
            conn.sendall(self._head(503, "application/json", len(body)) + body)
            return True
        if kind == "huge":
            conn.sendall(self._head(200, "application/json", HUGE_BYTES))
            conn.sendall(b'{"text": "' + b"x" * (HUGE_BYTES - 12) + b'"}')
            return True
        events = self._events(route, pieces, streaming=stream or kind in ("truncated", "reset", "malformed"))
        if kind == "malformed":
            events.insert(1, b"data: {broken json\n\nthis is not sse\n\ndata: \xff\xfe not utf-8\n\n")
        if kind in ("truncated", "reset"):
            events = events[:1]
        if not stream and kind not in ("truncated", "reset", "malformed"):
            body = self._whole(route, text)
            if kind == "gzip":
                body = gzip.compress(body)
                conn.sendall(self._head(200, "application/json", len(body), extra="Content-Encoding: gzip\r\n") + body)
                return True
            if kind == "close_delimited":
                conn.sendall(self._head(200, "application/json", None, extra="Connection: close\r\n") + body)
                return False
            conn.sendall(self._head(200, "application/json", len(body)) + body)
            return kind != "hang_up_later" or self._hang_up_later(conn)
        conn.sendall(self._head(200, sse, None, extra="Transfer-Encoding: chunked\r\n"))
        for n, event in enumerate(events):
            if n and self.event_delay_s:
                time.sleep(self.event_delay_s)
            conn.sendall(_chunk(event))
        if kind == "reset":
            return False
        conn.sendall(b"0\r\n\r\n")
        return kind != "hang_up_later" or self._hang_up_later(conn)

    @staticmethod
    def _hang_up_later(conn: socket.socket) -> bool:
        """What an idle keep-alive timeout does: the reply was whole, then the server closes."""
        time.sleep(0.05)
        return False

    @staticmethod
    def _head(status: int, content_type: str, length: int | None, extra: str = "") -> bytes:
        reason = {200: "OK", 401: "Unauthorized", 500: "Internal Server Error", 503: "Service Unavailable"}[status]
        size = f"Content-Length: {length}\r\n" if length is not None else ""
        return f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n{size}{extra}\r\n".encode()

    @staticmethod
    def _whole(route: str, text: str) -> bytes:
        usage = {"prompt_tokens": 11, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 4}}
        if route == "/generate":
            meta = {"finish_reason": {"type": "length", "length": 3}, "prompt_tokens": 11, "completion_tokens": 3}
            return json.dumps({"text": text, "meta_info": meta}).encode()
        if route == "/v1/chat/completions":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length"}
        return json.dumps({"id": "x", "choices": [choice], "usage": usage}).encode()

    @staticmethod
    def _events(route: str, pieces: list[str], *, streaming: bool) -> list[bytes]:
        out = []
        so_far = ""
        for n, piece in enumerate(pieces):
            last = n == len(pieces) - 1
            if route == "/generate":
                so_far += piece
                finish = {"type": "length", "length": len(pieces)} if last else None
                meta = {"finish_reason": finish, "prompt_tokens": 11, "completion_tokens": n + 1, "cached_tokens": 2}
                out.append(_sse({"text": so_far, "meta_info": meta}))
            else:
                holder = {"delta": {"content": piece}} if route.endswith("chat/completions") else {"text": piece}
                choice = {"index": 0, **holder, "finish_reason": "length" if last else None}
                out.append(_sse({"id": "x", "choices": [choice]}))
        if route != "/generate":
            usage = {
                "prompt_tokens": 11,
                "completion_tokens": len(pieces),
                "prompt_tokens_details": {"cached_tokens": 2},
            }
            out.append(_sse({"id": "x", "choices": [], "usage": usage}))
        out.append(b"data: [DONE]\n\n")
        return out


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


# ----------------------------------------------------------------- one exchange, two clients ----


def _row(record: RequestRecord) -> dict[str, Any]:
    """A record without its times (the token count stays)."""
    row = {k: v for k, v in asdict(record).items() if k not in TIMINGS}
    row["tokens"] = len(record.token_times)
    return row


def _both(url: str, route: Api, *, stream: bool, interrupt: Interrupt | None = None) -> tuple[dict, dict]:
    """The same request through httpx (`perform`) and through the users' connection (`perform_fast`)."""
    prompts = PromptFactory(MarkerCodec("K7QX"), 3, TargetFacts())
    prompt = prompts.canary(41, medium=False, repeat=True)
    body = request_body(route, prompt, stream=stream, max_tokens=16, model="m", rid=None)
    sent = Sent(
        id="K7QX-load-000000041-abcdef",
        request_index=41,
        phase="load",
        user_kind="canary_chat",
        actor="actor0/a0u0",
        endpoint=ROUTES[route],
        stream=stream,
        markers=prompt.markers,
        prompt=prompt.as_text(),
        max_tokens=16,
        planned_send=None,
    )
    how: dict[str, Any] = {
        "api": route,
        "timeout_s": 10.0,
        "cap": CAP,
        "headers": {"X-Request-Id": sent.id},
        "interrupt": interrupt,
    }
    with transport.client() as client:
        obs = Observed()
        perform(client, url, body, obs=obs, **how)
        httpx_row = _row(build_record(sent, obs, judge(obs)))
    conn = Connection("{0.scheme}://{0.netloc}".format(urlsplit(url)))
    try:
        obs = Observed()
        perform_fast(conn, url, body, obs=obs, **how)
        fast_row = _row(build_record(sent, obs, judge(obs)))
    finally:
        conn.close()
    return httpx_row, fast_row


KINDS = [
    ("good", "generate", True),
    ("good", "chat", True),
    ("good", "completions", True),
    ("good", "generate", False),
    ("good", "chat", False),
    ("good", "completions", False),
    ("gzip", "chat", False),
    ("close_delimited", "generate", False),
    ("garbage", "chat", False),
    ("router_error", "generate", True),
    ("unavailable", "generate", False),
    ("truncated", "generate", True),
    ("malformed", "chat", True),
    ("reset", "completions", True),
    ("not_http", "chat", False),
    ("silent_close", "chat", True),
]


@pytest.mark.parametrize(("kind", "route", "stream"), KINDS)
def test_both_clients_record_the_same_reply_the_same_way(kind: str, route: Api, stream: bool) -> None:
    with RawServer() as server:
        httpx_row, fast_row = _both(f"{server.url}{ROUTES[route]}?kind={kind}", route, stream=stream)
    if kind == "not_http":  # what each says of a status line that is not one is its own
        assert fast_row.pop("error_detail").startswith("RemoteProtocolError: ")
        assert httpx_row.pop("error_detail").startswith("RemoteProtocolError: ")
    assert fast_row == httpx_row
    if kind == "good":
        assert fast_row["outcome"] is Outcome.OK and (fast_row["tokens"] > 2 if stream else fast_row["tokens"] == 1)
        assert fast_row["response_text"].startswith(fast_row["markers"][0])


def test_a_huge_body_is_cut_at_the_cap_by_both() -> None:
    with RawServer() as server:
        httpx_row, fast_row = _both(f"{server.url}/generate?kind=huge", "generate", stream=False)
    for row in (httpx_row, fast_row):
        assert row["error_class"] == "body_over_cap" and row["outcome"] is Outcome.INFO
        assert CAP <= row["body_bytes"] < HUGE_BYTES and len(row["response_text"]) == CAP
    # how far past the cap each read went differs: the byte counts aside, the records agree
    same = {k: v for k, v in fast_row.items() if k not in ("body_bytes", "anomaly", "error_detail")}
    assert same == {k: v for k, v in httpx_row.items() if k not in ("body_bytes", "anomaly", "error_detail")}
    assert re.sub(r"\d+ bytes", "N bytes", fast_row["anomaly"]) == re.sub(r"\d+ bytes", "N bytes", httpx_row["anomaly"])


def test_interrupts_and_refusals_are_recorded_the_same_way() -> None:
    with RawServer(event_delay_s=0.1) as server:  # a read per event, however busy the machine
        port = server.sock.getsockname()[1]
        before = _both(
            f"{server.url}/v1/completions?kind=slow",
            "completions",
            stream=False,
            interrupt=Interrupt("before_first_byte", read_timeout_s=0.05),
        )
        mid = _both(
            f"{server.url}/v1/chat/completions", "chat", stream=True, interrupt=Interrupt("mid_stream", after_chunks=2)
        )
    refused_url = f"http://127.0.0.1:{port}/generate"  # closed now: refused
    refused = _both(refused_url, "generate", stream=True)
    for (httpx_row, fast_row), error_class in ((before, "disconnect"), (mid, "disconnect"), (refused, "connect_error")):
        assert fast_row == httpx_row
        assert fast_row["error_class"] == error_class
    assert "at before_first_byte, 50 ms after sending" in before[1]["error_detail"]
    assert "at mid_stream (after 2 content chunks)" in mid[1]["error_detail"] and mid[1]["tokens"] == 2
    assert refused[1]["outcome"] is Outcome.FAIL and "ConnectError" in refused[1]["error_detail"]


def test_the_connection_is_kept_and_replaced_when_the_server_hung_up() -> None:
    with RawServer() as server:
        conn = Connection(server.url)
        route: Api = "chat"
        body = request_body(
            route,
            PromptFactory(MarkerCodec("K7QX"), 3, TargetFacts()).canary(7, medium=False, repeat=True),
            stream=True,
            max_tokens=8,
            model=None,
            rid=None,
        )
        kept = []
        for kind in ("good", "good", "hang_up_later", "good", "reset", "good"):
            obs = Observed()
            perform_fast(
                conn, f"{server.url}/v1/chat/completions?kind={kind}", body, api=route, timeout_s=5.0, obs=obs, cap=CAP
            )
            kept.append(conn.reused)
            verdict = judge(obs)
            assert verdict.outcome is (Outcome.INFO if kind == "reset" else Outcome.OK), (kind, verdict)
            time.sleep(0.3)  # the hang-up lands while the connection is idle
        conn.close()
    # a new connection, then kept; after the hang-up and after the reset, a new one again
    assert kept == [False, True, True, False, True, False]


# ------------------------------------------------------------------------ the users in Locust ----


def _locust(config: LoadConfig, timeout_s: float = 60.0) -> list[RequestRecord]:
    """One Locust process with our users, as the driver starts it; its records, one per request it counted."""
    argv = [
        sys.executable,
        "-m",
        "locust",
        "--headless",
        "-f",
        "loadprofiles/locustfile.py",
        "--json",
        "--only-summary",
        "--skip-log",
    ]
    full = {**os.environ, CONFIG_ENV: config.to_json()}
    proc = subprocess.run(argv, cwd=REPO, env=full, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats = json.loads(proc.stdout)
    records = [RequestRecord(**json.loads(line)) for line in Path(config.records_path).read_text().splitlines()]
    assert len(records) == sum(entry["num_requests"] for entry in stats)
    return records


def _config(tmp_path: Path, name: str, url: str, **extra: Any) -> LoadConfig:
    return LoadConfig(
        run_prefix=extra.pop("run_prefix", None) or new_run_prefix(),
        target_url=url,
        records_path=str(tmp_path / f"{name}.jsonl"),
        mix=extra.pop("mix", {"canary_chat": 1.0}),
        shape=ShapeSpec(
            kind="steady", duration_s=extra.pop("duration_s", 3.0), users=extra.pop("users", 1), spawn_rate=10.0
        ),
        think_time_s=(0.0, 0.0),
        seed=5,
        **extra,
    )


@pytest.mark.integration
def test_the_users_journal_the_same_rows_with_either_client(tmp_path: Path) -> None:
    """One user, the same seed and run prefix: the same requests in the same order, so row by row
    the same record, the rid's random tail and the times aside."""
    prefix = new_run_prefix()
    with RawServer() as server:
        fast = _locust(_config(tmp_path, "fast", server.url, run_prefix=prefix))
        slow = _locust(_config(tmp_path, "httpx", server.url, run_prefix=prefix, http_client="httpx"))

    def rows(records: list[RequestRecord]) -> dict[int, dict[str, Any]]:
        done = [r for r in records if r.error_class != "load_stopped"]
        return {r.request_index: {k: v for k, v in _row(r).items() if k not in ("id", "planned_send")} for r in done}

    by_fast, by_httpx = rows(fast), rows(slow)
    common = sorted(set(by_fast) & set(by_httpx))
    assert len(common) >= 20, (len(by_fast), len(by_httpx))
    for index in common:
        assert by_fast[index] == by_httpx[index]
    assert {by_fast[i]["outcome"] for i in common} == {Outcome.OK}
    assert {(by_fast[i]["endpoint"], by_fast[i]["stream"]) for i in common} >= {
        ("/generate", True),
        ("/v1/chat/completions", False),
    }


@pytest.mark.integration
@pytest.mark.parametrize("scheme", ["http", "https"])
def test_every_request_carries_the_key_and_no_record_keeps_it(
    scheme: str, tmp_path: Path, ca: trustme.CA, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The load requests and the /abort_request calls carry the bearer key (and go over TLS with
    the run's CA); the server echoes the key into its replies; the records keep `[redacted]`."""
    monkeypatch.setenv(VAR, KEY)
    tls = None
    ca_bundle = None
    if scheme == "https":
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("localhost", "127.0.0.1").configure_cert(tls)
        ca_bundle = str(tmp_path / "ca.pem")
        ca.cert_pem.write_to_path(ca_bundle)
    transport.configure(Transport(api_key_env=VAR, ca_bundle=ca_bundle))  # the child inherits it
    with RawServer(key=KEY, tls=tls, event_delay_s=0.02) as server:
        facts = TargetFacts(model="m", api="sglang", abort_urls=(server.url,))
        config = _config(
            tmp_path,
            "keyed",
            server.url,
            mix={"canary_chat": 1.0, "aborting": 1.0},
            users=4,
            duration_s=4.0,
            facts=facts,
        )
        records = _locust(config)
        assert server.unauthorized == 0
        assert server.aborts >= 1
    answered = [r for r in records if r.status == 200]
    assert len(answered) >= 10
    assert KEY.encode() not in Path(config.records_path).read_bytes()
    assert any("Bearer [redacted]" in r.response_text for r in answered)
    aborted = [r for r in records if "/abort_request at" in (r.error_detail or "")]
    assert aborted and all(f"{server.url} 200" in (r.error_detail or "") for r in aborted)


# ---------------------------------------------------------------------------- the benchmark ----


@pytest.mark.integration
def test_the_benchmarks_short_mode_reports_what_the_docs_quote(tmp_path: Path) -> None:
    out = tmp_path / "locust_users.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/locust_users.py", "--short", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"nproc", "cpu_model", "loadavg_start"} <= set(report["machine"]) and report["loadavg_end"]
    assert report["utc"] and report["command"].startswith("benchmarks/locust_users.py")
    summary = report["summary"]
    for variant in ("ours", "fasthttp"):
        assert summary[variant]["rps"] > 0 and summary[variant]["locust_ms_per_req"] > 0
    assert report["ratios"]["rps"] > 0 and report["ratios"]["locust_cpu_per_req"] > 0
    (records,) = report["records"]
    assert (
        records["records"] > 0 and records["own_marker_back"] == records["with_text"] and records["other_markers"] == 0
    )
    assert set(report["breakdown"]) >= {"prompt", "parse whole reply", "judge + record + write"}
    assert "| req/s |" in proc.stdout
