"""`target:` of a campaign: which kind of deployment to qualify, and each kind's section.

The engines' sections live with their targets (sim/spec.py, sglang/spec.py, vllm/spec.py);
`attach` has no package of its own, so its process list is here. chaos/targets/factory.py turns
this section into a running target.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from chaos.spec import Strict
from chaos.targets.sglang.spec import SGLangSpec
from chaos.targets.sim.spec import SimSpec
from chaos.targets.vllm.spec import VllmSpec
from chaos.transport import Transport, looks_secret

ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
    api_key_env: str | None = Field(
        None,
        description="environment variable holding the API key, sent as 'Authorization: Bearer <key>' "
        "(the campaign names the variable; the key is never written anywhere)",
    )
    worker_api_key_env: str | None = Field(None, description="the workers' key, where it differs from the router's")
    headers: dict[str, str] = Field(
        default_factory=dict, description="extra headers on every request (not secret: they are kept with the run)"
    )
    header_env: dict[str, str] = Field(
        default_factory=dict, description="header name -> environment variable holding its secret value"
    )
    ca_bundle: str | None = Field(None, description="PEM file of the CA that signed an https:// target's certificate")
    insecure: bool = Field(False, description="https:// without certificate verification (never the default)")

    @field_validator("api_key_env", "worker_api_key_env")
    @classmethod
    def _names_a_variable(cls, value: str | None) -> str | None:
        if value is not None and not ENV_NAME.fullmatch(value):
            # never echo the value: it may be the key itself, pasted by mistake
            raise ValueError("must name an environment variable (e.g. PDCHAOS_API_KEY), not hold the key")
        return value

    @field_validator("header_env")
    @classmethod
    def _header_env_names_variables(cls, value: dict[str, str]) -> dict[str, str]:
        for name, variable in value.items():
            if not ENV_NAME.fullmatch(variable):
                raise ValueError(f"header_env[{name}] must name an environment variable, not hold the value")
        return value

    @field_validator("headers")
    @classmethod
    def _headers_hold_no_secret(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if looks_secret(name):
                raise ValueError(
                    f"headers[{name}] looks like a credential, and headers are kept with the run: "
                    f"put it in header_env ({name}: VARIABLE) or use api_key_env"
                )
        return value

    def transport(self) -> Transport:
        """How every request reaches this target (chaos/transport.py); the workers' origins take
        `worker_api_key_env`."""
        return Transport(
            api_key_env=self.api_key_env,
            worker_api_key_env=self.worker_api_key_env,
            worker_urls=tuple(self.workers),
            headers=tuple(self.headers.items()),
            header_env=tuple(self.header_env.items()),
            ca_bundle=self.ca_bundle,
            insecure=self.insecure,
        )

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
        if self.insecure and self.ca_bundle:
            raise ValueError("give ca_bundle (verify against that CA) or insecure: true (no verification), not both")
        return self
