"""`target.vllm`: how to launch the vLLM CPU PD pair (docs/vllm-tier.md, docs/performance.md)."""

from __future__ import annotations

from pydantic import Field

from chaos.spec import Strict


class VllmRoleSpec(Strict):
    """Per-role settings that override the shared ones (what memory_fraction restarts change)."""

    max_model_len: int | None = Field(None, ge=16)
    kv_cache_bytes: int | None = Field(None, ge=1 << 20)


class VllmSpec(Strict):
    """A prefill (kv_producer) and a decode (kv_consumer) engine with NixlConnector, and vllm-router in front."""

    venv: str = Field(
        ".venv-vllm", description="the vLLM venv (made by `make vllm-env`), relative to the repo or absolute"
    )
    model: str = Field("", description="model directory; empty = VENV/models/tiny-llama (built by `make vllm-env`)")
    served_model_name: str = "tiny"
    max_model_len: int = Field(2048, ge=16, description="--max-model-len (the context length)")
    kv_cache_bytes: int = Field(256 << 20, ge=1 << 20, description="--kv-cache-memory-bytes per engine")
    enforce_eager: bool = Field(True, description="--enforce-eager: no torch.compile warm-up (30 s instead of 67 s)")
    prefix_caching: bool = True
    nixl_progress_delay_us: int = Field(
        10_000, ge=0, description="NIXL agent pthrDelay; 0 is NIXL's default, a busy-polling progress thread per engine"
    )
    kv_lease_s: int | None = Field(
        None,
        ge=3,
        description="NixlConnector kv_lease_duration: prefill frees KV no decode pulled or renewed in this "
        "long (vLLM's default 30 s when unset)",
    )
    startup_timeout_s: float = Field(240.0, gt=0, description="engines are ready in 35-70 s on 2 cores; more when busy")
    server_dev_mode: bool = Field(True, description="VLLM_SERVER_DEV_MODE=1: /reset_prefix_cache for cold baselines")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for both engines")
    prefill: VllmRoleSpec = Field(default_factory=VllmRoleSpec)
    decode: VllmRoleSpec = Field(default_factory=VllmRoleSpec)
