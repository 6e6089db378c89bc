"""A lean HTTP/1.1 client for the load users: one keep-alive connection per user, under gevent.

The users send one request at a time and read each reply as it arrives. Under gevent httpx spends
several times the CPU of the rest of a request on that (h11's pure-Python parser, httpcore's pool
and its readability poll before each reuse, two sends per request, objects per body chunk), which
held one Locust process to a fifth of Locust's own `FastHttpUser` (docs/performance.md). This
client does what the users need and no more:

* one `sendall` per request (request line, headers and body together);
* llhttp, the C parser geventhttpclient (and so `FastHttpUser`) uses, for the status line, headers,
  chunked and length-delimited bodies and premature ends;
* the body handed over as each `recv` returns it, so every piece is timed when it arrives;
* a kept connection checked with one non-blocking `select` before it is reused (a server may
  have closed it while it was idle); a request is never sent twice.

Headers and TLS come from `chaos.transport` (the caller passes `request_headers(url)` and
`ssl_context()`); no header is added that the caller did not ask for except Host and
Content-Length, and no Accept-Encoding (a reply arrives uncompressed; gzip and deflate are decoded
all the same when a server compresses unasked).

Errors are httpx's exception classes, with httpx's wording, so a journaled request reads the same
whichever client sent it (loadprofiles/exchange.py).
"""

from __future__ import annotations

import contextlib
import re
import ssl
import zlib
from collections.abc import Iterator, Mapping
from urllib.parse import urlsplit

import gevent.socket
import httpx
from gevent import monkey
from geventhttpclient._parser import HTTPParseError, HTTPResponseParser

# The real select.select, even inside a gevent-patched process: a zero-timeout readability check
# of one idle socket needs no hub round trip.
_select = monkey.get_original("select", "select")

# RFC 9110: a header name is a token, a value has no CR, LF or other control character but tab;
# a request target (RFC 9112, origin-form) has no whitespace or control character.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*")
_REQUEST_TARGET = re.compile(r"/[\x21-\x7e]*")

TCP_QUICKACK: int | None = getattr(gevent.socket, "TCP_QUICKACK", None)  # Linux only
RECV_BYTES = 65536  # per recv: a streamed event is far smaller, a whole body needs few reads
DEFAULT_PORTS = {"http": 80, "https": 443}


class _Parser(HTTPResponseParser):
    """llhttp's callbacks into plain attributes; the body pieces wait in `body` for the reader."""

    def __init__(self) -> None:
        super().__init__()
        self.headers: list[tuple[str, str]] = []
        self.headers_complete = False
        self.complete = False
        self.body: list[bytes] = []
        self.body_bytes = 0  # as sent (before any decoding)
        self._field = ""
        self._value: str | None = None

    def _on_message_begin(self) -> None:  # also after an interim 1xx reply
        self.headers = []
        self.headers_complete = self.complete = False

    def _on_status(self, text: str) -> None:
        pass  # the reason phrase says nothing the code does not

    def _on_header_field(self, text: str) -> None:
        if self._value is not None:  # a new field: the previous one is whole
            self.headers.append((self._field.lower(), self._value))
            self._field, self._value = text, None
        else:  # a field cut across two reads
            self._field += text

    def _on_header_value(self, text: str) -> None:
        self._value = text if self._value is None else self._value + text

    def _on_headers_complete(self) -> bool:
        if self._value is not None:
            self.headers.append((self._field.lower(), self._value))
        self._field, self._value = "", None
        self.headers_complete = True
        return False  # a body follows (no HEAD requests here)

    def _on_body(self, data: bytearray) -> None:
        self.body.append(bytes(data))
        self.body_bytes += len(data)

    def _on_message_complete(self) -> None:
        self.complete = True


class Connection:
    """A keep-alive connection to one origin, for one user: one request at a time.

    `request` sends and returns when the reply's status line and headers are in; `body` then
    yields the body as it arrives. A reply not read to its end (the caller stopped, or it broke)
    must be ended with `close()`, which drops the connection: the next request opens a new one.
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: Mapping[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        recv_bytes: int = RECV_BYTES,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in DEFAULT_PORTS or not parts.hostname:
            raise ValueError(f"{base_url!r}: need an http:// or https:// URL with a host")
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port or DEFAULT_PORTS[parts.scheme]
        self.origin = f"{parts.scheme}://{parts.netloc}"
        if self.scheme == "https" and ssl_context is None:
            raise ValueError(f"{base_url!r}: an https URL needs an SSL context (chaos.transport)")
        self.ssl_context = ssl_context if self.scheme == "https" else None
        self.recv_bytes = recv_bytes
        host_header = f"[{self.host}]" if ":" in self.host else self.host
        if parts.port is not None and parts.port != DEFAULT_PORTS[parts.scheme]:
            host_header += f":{parts.port}"
        self._fixed = encode_headers({"Host": host_header, **(headers or {})})
        self._sock: gevent.socket.socket | None = None
        self._timeout: float | None = None
        self._parser: _Parser | None = None  # the reply being read
        self._paths: dict[str, bytes] = {}  # url -> request target, checked once
        self.reused = False  # the last request went out on a kept connection

    # ------------------------------------------------------------------------- request ----

    def path_of(self, url: str) -> bytes:
        """The request target of `url`, which must be on this connection's origin."""
        path = self._paths.get(url)
        if path is None:
            if not url.startswith(self.origin) or url[len(self.origin) : len(self.origin) + 1] not in ("/", "?", ""):
                raise ValueError(f"{url!r} is not on {self.origin}")
            target = url[len(self.origin) :]
            target = target if target.startswith("/") else "/" + target
            if not _REQUEST_TARGET.fullmatch(target):
                raise ValueError(f"{url!r}: whitespace, control or non-ASCII characters in the request target")
            if len(self._paths) >= 64:  # a user posts to a few routes; anything else is not kept
                self._paths.clear()
            path = self._paths[url] = target.encode("ascii")
        return path

    def request(
        self,
        method: str,
        url: str,
        body: bytes,
        *,
        headers: Mapping[str, str] | None = None,
        connect_timeout_s: float,
        write_timeout_s: float,
        read_timeout_s: float,
    ) -> tuple[int, list[tuple[str, str]]]:
        """Send one request with `headers` besides the connection's own; wait for the reply's
        status and headers (names in lower case). Raises an `httpx.TransportError` (or a
        GreenletExit). Timeouts as httpx's: connecting (and the TLS handshake), each write, each
        read."""
        path = self.path_of(url)
        extra = encode_headers(headers) if headers else b""
        if self._parser is not None:  # the previous reply was not read to its end
            self.close()
        sock = self._ready(connect_timeout_s)
        head = b"%s %s HTTP/1.1\r\n%s%sContent-Length: %d\r\n\r\n" % (
            method.encode("ascii"),
            path,
            self._fixed,
            extra,
            len(body),
        )
        parser = self._parser = _Parser()
        self._settimeout(sock, write_timeout_s)
        try:
            sock.sendall(head + body)
        except TimeoutError as exc:
            self.close()
            raise httpx.WriteTimeout("timed out") from exc
        except OSError as exc:
            self.close()
            raise httpx.WriteError(str(exc)) from exc
        self._settimeout(sock, read_timeout_s)
        received = 0
        while not (parser.headers_complete and parser.get_code() >= 200):
            data = self._recv(sock)
            if not data:
                self.close()
                if not received:
                    raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
                raise httpx.RemoteProtocolError("peer closed connection before the end of the reply's headers")
            received += len(data)
            self._feed(parser, data)
        return parser.get_code(), parser.headers

    def body(self) -> Iterator[bytes]:
        """The reply's body, a piece per read, decoded when the server compressed it; returns at
        the reply's end, raises an `httpx.TransportError` when the connection ends before it."""
        parser = self._parser
        sock = self._sock
        assert parser is not None and sock is not None, "body() without a request"
        encoding = next((v.strip().lower() for k, v in parser.headers if k == "content-encoding"), "identity")
        inflate = zlib.decompressobj(zlib.MAX_WBITS | 32) if encoding in ("gzip", "x-gzip", "deflate") else None
        while True:
            if parser.body:
                piece = parser.body[0] if len(parser.body) == 1 else b"".join(parser.body)
                parser.body.clear()
                if inflate is not None:
                    try:
                        piece = inflate.decompress(piece)
                    except zlib.error as exc:
                        self.close()
                        raise httpx.RemoteProtocolError(f"cannot decode the {encoding} body: {exc}") from exc
                if piece:
                    yield piece
            if parser.complete:
                break
            self._feed(parser, self._recv(sock))
        self._parser = None
        if not parser.should_keep_alive():
            self.close()

    def close(self) -> None:
        """Drop the connection (a reply cut short, an error, the user stopping)."""
        sock, self._sock, self._parser, self._timeout = self._sock, None, None, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()

    # ------------------------------------------------------------------------ internals ----

    def _ready(self, connect_timeout_s: float) -> gevent.socket.socket:
        """The kept socket if the server has not closed it while idle, else a new one."""
        sock = self._sock
        if sock is not None:
            try:
                readable = _select([sock], [], [], 0)[0]
            except (OSError, ValueError):
                readable = [sock]
            if not readable:  # idle and open: nothing may arrive before a request
                self.reused = True
                return sock
            self.close()  # closed by the server (or junk on an idle line)
        self.reused = False
        try:
            sock = gevent.socket.create_connection((self.host, self.port), timeout=connect_timeout_s)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout("timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        try:
            sock.setsockopt(gevent.socket.IPPROTO_TCP, gevent.socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
        except TimeoutError as exc:
            sock.close()
            raise httpx.ConnectTimeout("timed out (TLS handshake)") from exc
        except OSError as exc:  # ssl.SSLError included: a bad certificate is a failed connect
            sock.close()
            raise httpx.ConnectError(str(exc)) from exc
        self._sock, self._timeout = sock, None
        return sock

    def _settimeout(self, sock: gevent.socket.socket, timeout_s: float) -> None:
        if self._timeout != timeout_s:
            sock.settimeout(timeout_s)
            self._timeout = timeout_s

    def _recv(self, sock: gevent.socket.socket) -> bytes:
        try:
            if TCP_QUICKACK is not None:
                # Linux delays an ACK by up to 40 ms and forgets QUICKACK after each read. A server
                # that writes a stream's headers and its first event apart under Nagle (the SGLang
                # router does) holds the event until that ACK: 40 ms added to the TTFT we report.
                sock.setsockopt(gevent.socket.IPPROTO_TCP, TCP_QUICKACK, 1)
            data: bytes = sock.recv(self.recv_bytes)
        except TimeoutError as exc:
            self.close()
            raise httpx.ReadTimeout("timed out") from exc
        except OSError as exc:
            self.close()
            raise httpx.ReadError(str(exc)) from exc
        return data

    def _feed(self, parser: _Parser, data: bytes) -> None:
        """Parse `data`; empty data is the server's end of the connection."""
        try:
            parser.feed(data)
        except HTTPParseError as exc:
            self.close()
            if not data:
                raise httpx.RemoteProtocolError(_cut_short(parser)) from exc
            raise httpx.RemoteProtocolError(f"not an HTTP/1.1 reply: {exc}") from exc
        if not data and not parser.complete:  # llhttp took the end without complaint: still short
            self.close()
            raise httpx.RemoteProtocolError(_cut_short(parser))


def _cut_short(parser: _Parser) -> str:
    """httpx's words for a body the server ended early."""
    headers = dict(parser.headers)
    if "chunked" in headers.get("transfer-encoding", "").lower():
        why = "incomplete chunked read"
    elif headers.get("content-length", "").strip().isdigit():
        why = f"received {parser.body_bytes} bytes, expected {int(headers['content-length'])}"
    else:
        why = "incomplete body"
    return f"peer closed connection without sending complete message body ({why})"


def encode_headers(headers: Mapping[str, str]) -> bytes:
    """`Name: value\\r\\n` lines; a name or value that could split the request is refused."""
    out = []
    for name, value in headers.items():
        if not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise ValueError(f"header {name!r}: a name or value that would break the request")
        out.append(f"{name}: {value}\r\n")
    return "".join(out).encode("latin-1")
