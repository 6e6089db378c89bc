"""`target:` of a campaign: which kind of deployment to qualify, and each kind's section.

The engines' sections live with their targets (sim/spec.py, sglang/spec.py, vllm/spec.py);
`attach` has no package of its own, so its process list is here. chaos/targets/factory.py turns
this section into a running target.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from chaos.spec import Strict
from chaos.targets.sglang.spec import SGLangSpec
from chaos.targets.sim.spec import SimSpec
from chaos.targets.vllm.spec import VllmSpec


class AttachedProcess(Strict):
    """attach: a process of the deployment the suite may signal and whose log it may read."""

    role: Literal["prefill", "decode", "router"]
    pid: int | None = Field(None, ge=1, description="its process group is signalled (start each server with setsid)")
    log: str | None = Field(None, description="path of its log file (for confirmations and the integrity oracle)")
    command: str | None = Field(
        None,
        description="a piece of its command line (e.g. sglang.launch_server): a pid that runs something else is refused",
    )
    started_at: float | None = Field(
        None,
        description='its start time, epoch seconds (date -d "$(ps -o lstart= -p PID)" +%s): '
        "a pid started at another time is another process that reuses it, and is refused",
    )


class TargetSpec(Strict):
    kind: Literal["sim", "attach", "sglang", "vllm"] = "sim"
    sim: SimSpec = Field(default_factory=SimSpec)
    sglang: SGLangSpec | None = Field(None, description="kind 'sglang': launch a real SGLang PD deployment")
    vllm: VllmSpec = Field(default_factory=VllmSpec, description="kind 'vllm': launch the vLLM CPU PD pair")
    url: str | None = Field(None, description="attach: the router (or server) URL")
    workers: list[str] = Field(default_factory=list, description="attach: worker URLs (abort, loads, metrics)")
    processes: list[AttachedProcess] = Field(default_factory=list, description="attach: processes the suite may act on")

    @model_validator(mode="after")
    def _kind_has_its_section(self) -> TargetSpec:
        if self.kind == "sglang" and self.sglang is None:
            raise ValueError("kind 'sglang' needs a sglang section, at least sglang: {model_path: /models/...}")
        if self.kind == "attach":
            if not self.url:
                raise ValueError(
                    "kind 'attach' needs url: the router or server to qualify, e.g. http://127.0.0.1:30000"
                )
            if not self.url.startswith(("http://", "https://")):
                raise ValueError(f"url {self.url!r} must start with http:// or https://")
        return self
