"""What a worker's HTTP endpoints say about it: ``/server_info``, ``/v1/models`` and the per-rank
objects of ``/v1/loads``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chaos.facts.values import to_int


@dataclass(frozen=True)
class ServerInfoFacts:
    """Fields of ``/server_info`` (deprecated alias ``/get_server_info``).

    ``max_total_num_tokens`` and ``max_req_input_len`` come from the scheduler (resolved values);
    ``context_length`` is the ``--context-length`` flag and is None when the model's own length is
    used, so it is the weakest source for the context length.
    """

    max_total_num_tokens: int | None = None
    max_req_input_len: int | None = None
    context_length: int | None = None
    page_size: int | None = None
    disaggregation_mode: str | None = None
    version: str | None = None


def parse_server_info(payload: Any) -> ServerInfoFacts:
    """Read `ServerInfoFacts` from a decoded ``/server_info`` body; anything missing is None."""
    if not isinstance(payload, Mapping):
        return ServerInfoFacts()
    mode = payload.get("disaggregation_mode")
    version = payload.get("version")
    return ServerInfoFacts(
        max_total_num_tokens=to_int(payload.get("max_total_num_tokens")),
        max_req_input_len=to_int(payload.get("max_req_input_len")),
        context_length=to_int(payload.get("context_length")),
        page_size=to_int(payload.get("page_size")),
        disaggregation_mode=mode if isinstance(mode, str) else None,
        version=version if isinstance(version, str) else None,
    )


@dataclass(frozen=True)
class ModelsFacts:
    """``/v1/models``: each served model's id and ``max_model_len`` (the advertised context)."""

    models: tuple[tuple[str, int | None], ...] = ()

    @property
    def max_model_len(self) -> int | None:
        """Largest advertised length over the listed models: the worst case a client may send."""
        values = [length for _, length in self.models if length is not None]
        return max(values) if values else None


def parse_models(payload: Any) -> ModelsFacts:
    """Read `ModelsFacts` from a decoded ``/v1/models`` body.

    Shape: ``{"data": [{"id": ..., "max_model_len": ...}, ...]}``.
    """
    if not isinstance(payload, Mapping) or not isinstance(payload.get("data"), Sequence):
        return ModelsFacts()
    models: list[tuple[str, int | None]] = []
    for entry in payload["data"]:
        if not isinstance(entry, Mapping):
            continue
        model_id = entry.get("id")
        models.append((model_id if isinstance(model_id, str) else "", to_int(entry.get("max_model_len"))))
    return ModelsFacts(models=tuple(models))


def loads_ranks(data: Any) -> list[Mapping[str, Any]]:
    """The per-rank objects of a `/v1/loads` answer: one object, a list of them (DP), or real
    SGLang's `{"loads": [{"dp_rank": ..., ...}], ...}`."""
    if isinstance(data, Mapping):
        nested = data.get("loads")
        if isinstance(nested, list):
            return [d for d in nested if isinstance(d, Mapping)]
        return [data]
    if isinstance(data, list):
        return [d for d in data if isinstance(d, Mapping)]
    return []
