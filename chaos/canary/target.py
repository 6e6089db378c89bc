"""The target as the canary finds it: its model, routes and limits, and where each was read."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from chaos import transport
from chaos.errors import UsageError
from chaos.limits import tightest
from chaos.targets.discovery import TargetFacts, discover_facts

DEFAULT_TIMEOUT_S = 60.0
DISCOVERY_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CanaryTarget:
    """Where the target answers, what it says about itself (`facts`: the model, the routes it
    serves, its limits) and where that was read."""

    url: str
    facts: TargetFacts
    sources: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        facts = self.facts
        return {
            "url": self.url,
            "model": facts.model,
            "api": facts.api,
            "context_length": facts.context_length,
            "max_total_num_tokens": facts.max_total_num_tokens,
            "max_req_input_len": facts.max_req_input_len,
            "sources": list(self.sources),
        }


def _check_reachable(url: str, timeout_s: float) -> None:
    try:
        with transport.client(timeout=min(timeout_s, DISCOVERY_TIMEOUT_S), trust_env=False) as client:
            client.get(f"{url}/v1/models")
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        raise UsageError(
            f"--url {url}: not a usable URL ({exc}). Give the target's base URL, e.g. --url http://127.0.0.1:30000."
        ) from None
    except httpx.TransportError as exc:
        raise UsageError(
            f"--url {url}: cannot reach the target ({type(exc).__name__}: {exc or 'no detail'}). "
            "Check the host and port and that the server is up."
        ) from None


def _router_workers(url: str, timeout_s: float) -> list[tuple[str, str]]:
    """(worker URL, worker type) from an SGLang router's ``/workers``; [] when there is none."""
    try:
        with transport.client(timeout=min(timeout_s, DISCOVERY_TIMEOUT_S), trust_env=False) as client:
            response = client.get(f"{url}/workers")
        if response.status_code != 200:
            return []
        payload = response.json()
    except (httpx.HTTPError, ValueError):
        return []
    workers = payload.get("workers") if isinstance(payload, Mapping) else None
    if not isinstance(workers, list):
        return []
    out = []
    for worker in workers:
        if isinstance(worker, Mapping) and isinstance(worker.get("url"), str):
            kind = worker.get("worker_type")
            out.append((worker["url"].rstrip("/"), kind if isinstance(kind, str) else "worker"))
    return out


def discover_target(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, model: str | None = None) -> CanaryTarget:
    """Model, API style and limits of the target at `url` (raises UsageError if unreachable).

    A router states no limits itself; then its workers are asked, and the smallest of each limit
    is kept (the first size some worker must reject).
    """
    _check_reachable(url, timeout_s)
    facts = discover_facts(url, timeout_s=min(timeout_s, DISCOVERY_TIMEOUT_S))
    if model:
        facts = dataclasses.replace(facts, model=model)
    target = CanaryTarget(url=url, facts=facts, sources=(f"{url} (/v1/models, /server_info)",))
    if facts.states_a_size:
        return target
    workers = _router_workers(url, timeout_s)
    if not workers:
        return target
    found = [(w, kind, discover_facts(w, timeout_s=min(timeout_s, DISCOVERY_TIMEOUT_S))) for w, kind in workers]
    limits = tightest(f for _, _, f in found)
    api = "sglang" if any(f.api == "sglang" for _, _, f in found) else facts.api
    return CanaryTarget(
        url=url,
        facts=dataclasses.replace(facts, api=api, **dataclasses.asdict(limits)),
        sources=target.sources + tuple(f"{w} ({kind}, via the router's /workers)" for w, kind, _ in found),
    )
