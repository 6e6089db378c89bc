"""How every request reaches a target: its credentials, extra headers and TLS settings.

A campaign names the environment variable that holds the API key (`target.api_key_env`, and
`target.worker_api_key_env` where the workers take another key), never the key itself. The key is
read from the environment where a request is sent, so it crosses no file, journal row or Ray
argument; child processes (Locust, Ray actors) get the settings without it through
`PDCHAOS_TRANSPORT` and read the key from the environment they inherit.

The secret is never written: `redact` replaces it (and every secret header value) in any text
that could echo it (a reply body, an error message), and `scrub_tree` rewrites a run directory's
files in place as the last guard, byte for byte the same length, so a SQLite journal stays valid.

`current()` is the transport of this process: `configure` sets it for the run; every HTTP client
that talks to a target is made by `client()` / `async_client()` so none forgets the headers.
"""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from chaos.errors import UsageError

ENV = "PDCHAOS_TRANSPORT"  # the settings, without any secret, for child processes
REDACTED = "[redacted]"
SCRUB_BYTE = b"*"  # same-length replacement in files, so binary formats keep their offsets
SECRET_HEADER_WORDS = ("auth", "token", "key", "secret", "cookie", "password")


@dataclass(frozen=True)
class Transport:
    """Credentials, headers and TLS for every request to one target; holds no secret itself."""

    api_key_env: str | None = None  # the variable holding the router's (or server's) API key
    worker_api_key_env: str | None = None  # the workers' key, where it differs
    worker_urls: tuple[str, ...] = ()  # origins that take the worker key
    headers: tuple[tuple[str, str], ...] = ()  # sent as given (not secret: they are in the campaign)
    header_env: tuple[tuple[str, str], ...] = ()  # header name -> variable holding its (secret) value
    ca_bundle: str | None = None  # PEM file of the CA that signed the target's certificate
    insecure: bool = False  # skip certificate verification (https only; never the default)

    # ------------------------------------------------------------------ secrets ----

    def _read(self, variable: str, what: str) -> str:
        value = os.environ.get(variable, "")
        if not value:
            raise UsageError(
                f"{what} names the environment variable {variable}, which is not set or empty: "
                f"export {variable}=<the key> before running pdchaos"
            )
        return value

    def api_key(self, url: str | None = None) -> str | None:
        """The key for a request to `url`: the worker key for a worker origin, else the target's."""
        if self.worker_api_key_env and url is not None and _origin(url) in {_origin(u) for u in self.worker_urls}:
            return self._read(self.worker_api_key_env, "target.worker_api_key_env")
        if self.api_key_env:
            return self._read(self.api_key_env, "target.api_key_env")
        return None

    def request_headers(self, url: str | None = None) -> dict[str, str]:
        """Every header to send to `url`, secrets included (never log this)."""
        out = dict(self.headers)
        for name, variable in self.header_env:
            out[name] = self._read(variable, f"target.header_env[{name}]")
        key = self.api_key(url)
        if key is not None:
            out["Authorization"] = f"Bearer {key}"
        return out

    def secrets(self) -> list[str]:
        """Every value that must never be written: the keys, secret header values, their bearer forms."""
        values: list[str] = []
        for variable in (self.api_key_env, self.worker_api_key_env, *(v for _, v in self.header_env)):
            if variable and os.environ.get(variable):
                values.append(os.environ[variable])
        values += [value for name, value in self.headers if looks_secret(name) and value]
        return sorted({v for v in values if len(v) >= 4}, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for secret in self.secrets():
            if secret in text:
                text = text.replace(secret, REDACTED)
        return text

    @property
    def has_secrets(self) -> bool:
        return bool(self.api_key_env or self.worker_api_key_env or self.header_env) or any(
            looks_secret(name) for name, _ in self.headers
        )

    # ---------------------------------------------------------------------- TLS ----

    def verify(self) -> bool | ssl.SSLContext:
        """httpx's `verify`: on by default, the campaign's CA bundle, or off by explicit request."""
        if self.insecure:
            return False
        if self.ca_bundle:
            return self.ssl_context()
        return True

    def ssl_context(self) -> ssl.SSLContext:
        """For clients that take an SSLContext (the load users, aiohttp)."""
        if self.insecure:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            return context
        if self.ca_bundle and not Path(self.ca_bundle).is_file():
            raise UsageError(f"target.ca_bundle {self.ca_bundle}: no such file; give the PEM file of the target's CA")
        return ssl.create_default_context(cafile=self.ca_bundle)

    # ------------------------------------------------------------------ clients ----

    def auth(self) -> httpx.Auth:
        return _HeaderAuth(self)

    def client(self, **kwargs: Any) -> httpx.Client:
        """A synchronous client for the target: its headers on every request, its TLS settings."""
        kwargs.setdefault("trust_env", False)
        return httpx.Client(auth=self.auth(), verify=self.verify(), **kwargs)

    def async_client(self, **kwargs: Any) -> httpx.AsyncClient:
        kwargs.setdefault("trust_env", False)
        return httpx.AsyncClient(auth=self.auth(), verify=self.verify(), **kwargs)

    def get(self, url: str, *, timeout: float = 5.0, trust_env: bool = False, **kwargs: Any) -> httpx.Response:
        """One GET (a control call: /metrics, /health, /v1/loads)."""
        with self.client(timeout=timeout, trust_env=trust_env) as http:
            return http.get(url, **kwargs)

    def post(self, url: str, *, timeout: float = 5.0, trust_env: bool = False, **kwargs: Any) -> httpx.Response:
        with self.client(timeout=timeout, trust_env=trust_env) as http:
            return http.post(url, **kwargs)

    # --------------------------------------------------------- child processes ----

    def to_env(self) -> str:
        return json.dumps(
            {
                "api_key_env": self.api_key_env,
                "worker_api_key_env": self.worker_api_key_env,
                "worker_urls": list(self.worker_urls),
                "headers": [list(h) for h in self.headers],
                "header_env": [list(h) for h in self.header_env],
                "ca_bundle": self.ca_bundle,
                "insecure": self.insecure,
            }
        )

    @classmethod
    def from_env(cls, value: str | None) -> Transport:
        if not value:
            return cls()
        raw = json.loads(value)
        return cls(
            api_key_env=raw.get("api_key_env"),
            worker_api_key_env=raw.get("worker_api_key_env"),
            worker_urls=tuple(raw.get("worker_urls", ())),
            headers=tuple((str(k), str(v)) for k, v in raw.get("headers", ())),
            header_env=tuple((str(k), str(v)) for k, v in raw.get("header_env", ())),
            ca_bundle=raw.get("ca_bundle"),
            insecure=bool(raw.get("insecure", False)),
        )

    def with_workers(self, urls: Iterable[str]) -> Transport:
        return Transport(
            self.api_key_env,
            self.worker_api_key_env,
            tuple(urls),
            self.headers,
            self.header_env,
            self.ca_bundle,
            self.insecure,
        )

    def check_variables(self) -> None:
        """Fail early (exit 2) when a named variable is unset, before any process starts."""
        self.request_headers()
        if self.worker_api_key_env:
            self._read(self.worker_api_key_env, "target.worker_api_key_env")


class _HeaderAuth(httpx.Auth):
    """Adds the transport's headers per request, so the key can depend on the URL (router or worker)."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        for name, value in self._transport.request_headers(str(request.url)).items():
            request.headers.setdefault(name, value)
        yield request


def raise_if_untrusted(url: str, exc: BaseException) -> None:
    """A connection that failed on the certificate is a setup problem with a known fix: say it."""
    if _certificate_refused(exc):
        raise UsageError(
            f"{url}: its TLS certificate is not trusted ({_root_cause(exc)}). Give the PEM file of the CA "
            "that signed it as target.ca_bundle (--ca-bundle PEM), or, for a test deployment only, "
            "target.insecure: true (--insecure)"
        ) from None


def _root_cause(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return exc


def _certificate_refused(exc: BaseException) -> bool:
    return isinstance(_root_cause(exc), ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(exc)


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def looks_secret(header: str) -> bool:
    lowered = header.lower()
    return any(word in lowered for word in SECRET_HEADER_WORDS)


def parse_header(text: str) -> tuple[str, str]:
    """`--header 'Name: value'` -> (name, value)."""
    name, sep, value = text.partition(":")
    if not sep or not name.strip() or any(c.isspace() for c in name.strip()):
        raise UsageError(f"--header {text!r}: write it as 'Name: value', e.g. --header 'X-Tenant: blue'")
    return name.strip(), value.strip()


# ------------------------------------------------------------------- this process ----

_current: Transport | None = None


def configure(transport: Transport) -> None:
    """The transport of this process and of every child it starts from now on."""
    global _current
    _current = transport
    os.environ[ENV] = transport.to_env()


def current() -> Transport:
    """The run's transport: set by `configure`, inherited through `PDCHAOS_TRANSPORT`, or none."""
    global _current
    if _current is None:
        _current = Transport.from_env(os.environ.get(ENV))
    return _current


def client(**kwargs: Any) -> httpx.Client:
    return current().client(**kwargs)


def async_client(**kwargs: Any) -> httpx.AsyncClient:
    return current().async_client(**kwargs)


def get(url: str, **kwargs: Any) -> httpx.Response:
    return current().get(url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return current().post(url, **kwargs)


def redact(text: str) -> str:
    return current().redact(text) if current().has_secrets else text


def scrub_tree(root: Path, secrets: Iterable[str] | None = None) -> list[Path]:
    """Overwrite every occurrence of a secret in the files under `root`, keeping each file's size.

    The last guard behind `redact`: whatever echoed a secret into a log or a journal page, no byte
    of it stays on disk. Returns the files it had to change.
    """
    needles = [s.encode() for s in (secrets if secrets is not None else current().secrets()) if s]
    if not needles:
        return []
    changed: list[Path] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        cleaned = data
        for needle in needles:
            if needle in cleaned:
                cleaned = cleaned.replace(needle, SCRUB_BYTE * len(needle))
        if cleaned != data:
            path.write_bytes(cleaned)
            changed.append(path)
    return changed


def check_access(url: str, *, route: str = "/v1/models", timeout_s: float = 10.0) -> None:
    """Stop early (exit 2) when the target refuses our credentials, naming the variable, never the key.

    Any answer but 401/403 passes: a server without `route` or one that is down is judged later,
    by discovery and the oracles.
    """
    chosen = current()
    try:
        status = chosen.get(f"{url}{route}", timeout=timeout_s).status_code
    except httpx.HTTPError as exc:
        raise_if_untrusted(url, exc)
        return
    if status not in (401, 403):
        return
    key = chosen.worker_api_key_env if _origin(url) in {_origin(u) for u in chosen.worker_urls} else None
    key = key or chosen.api_key_env
    if key is None:
        raise UsageError(
            f"{url}{route} answered {status}: the target demands credentials. Name the environment variable "
            "that holds the key with target.api_key_env (or --api-key-env VAR)"
        )
    raise UsageError(f"{url}{route} answered {status} to the key in ${key}: set {key} to a key this target accepts")
