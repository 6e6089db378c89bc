"""What a running target says about itself (`TargetFacts`, what the load is aimed with), read
through SGLang's endpoints where it has them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from chaos import transport
from chaos.facts.endpoints import parse_models, parse_server_info
from chaos.limits import WorkerLimits

ApiStyle = Literal["sglang", "openai"]


@dataclass(frozen=True)
class TargetFacts(WorkerLimits):
    """What the users need of the target: its limits (the tightest any worker states; None where
    none says), the model to name, the routes it serves and where an abort goes."""

    model: str = "default"
    api: ApiStyle = "sglang"  # "sglang": /generate is served too; "openai": OpenAI routes only
    abort_urls: tuple[str, ...] = ()  # workers that take POST /abort_request (SGLang: both)


def discover_facts(base_url: str, abort_urls: tuple[str, ...] = (), timeout_s: float = 5.0) -> TargetFacts:
    """Model, context length and pool limits from /v1/models and /server_info; None if unsaid."""
    model, context, pool, max_input = "default", None, None, None
    api: ApiStyle = "openai"
    with transport.client(timeout=timeout_s, trust_env=False) as client:
        try:
            models = parse_models(client.get(f"{base_url}/v1/models").json())
            if models.models:
                model = models.models[0][0]
            context = models.max_model_len
        except (httpx.HTTPError, ValueError):
            pass
        for path in ("/server_info", "/get_server_info"):
            try:
                response = client.get(f"{base_url}{path}")
            except httpx.HTTPError:
                continue
            if response.status_code != 200:
                continue
            try:
                info = parse_server_info(response.json())
            except ValueError:
                continue
            api = "sglang"
            pool, max_input = info.max_total_num_tokens, info.max_req_input_len
            context = context or info.context_length
            break
    return TargetFacts(
        model=model,
        api=api,
        context_length=context,
        max_total_num_tokens=pool,
        max_req_input_len=max_input,
        abort_urls=abort_urls,
    )


def served_adapters(infos: Mapping[str, Mapping[str, Any]]) -> tuple[str, ...] | None:
    """The LoRA adapter names every worker serves, from SGLang's `/server_info` (`lora_paths`:
    `name=path` strings, `{name: path}`, or `{"lora_name": ...}` entries); `()` when a worker says
    LoRA is off (`enable_lora` false or null, no `lora_paths`); None when no worker says either way."""
    served: list[set[str]] | None = None
    for info in infos.values():
        if "lora_paths" not in info and "enable_lora" not in info:
            continue
        raw = info.get("lora_paths") or ()
        entries = raw.items() if isinstance(raw, Mapping) else ((e, None) for e in raw) if isinstance(raw, list) else ()
        names = set()
        for entry, _ in entries:
            if isinstance(entry, Mapping):
                entry = entry.get("lora_name") or entry.get("name")
            if isinstance(entry, str) and entry:
                names.add(entry.split("=", 1)[0].strip())
        served = (served or []) + [names]
    if served is None:
        return None
    return tuple(sorted(set.intersection(*served)))
