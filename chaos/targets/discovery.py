"""Read what a running target says about itself, through SGLang's endpoints where it has them."""

from __future__ import annotations

import httpx

from chaos.facts import parse_models, parse_server_info
from loadprofiles.config import TargetFacts


def discover_facts(base_url: str, abort_urls: tuple[str, ...] = (), timeout_s: float = 5.0) -> TargetFacts:
    """Model, context length and pool limits from /v1/models and /server_info; None if unsaid."""
    model, context, pool, max_input, api = "default", None, None, None, "openai"
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
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
    return TargetFacts(model=model, api=api, context_length=context, max_total_num_tokens=pool,
                       max_req_input_len=max_input, abort_urls=abort_urls)
