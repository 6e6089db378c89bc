"""`target.vllm`: how to launch the vLLM CPU PD pair."""

from __future__ import annotations

from chaos.spec import Strict


class VllmSpec(Strict):
    pass
