"""`target.sglang`: how to launch a real SGLang PD deployment (sglang-facts.md has every flag)."""

from __future__ import annotations

from pydantic import Field

from chaos.spec import Strict


class SGLangSpec(Strict):
    model_path: str = Field(description="--model-path of both servers")
