"""From a campaign's `target:` section to a Target: launched here, launched on Ray nodes, or attached.

One place knows every target kind; the runner and `pdchaos plan` ask it. A new engine adds its
package under `chaos/targets/`, its section to `TargetSpec` (chaos/targets/spec.py), and one
branch here. Each engine's stack is imported only when its kind is asked for: the embedded
engine's alone takes most of a second to import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import httpx

from chaos import transport
from chaos.errors import UsageError
from chaos.targets.attach import AttachTarget, check_attached
from chaos.targets.base import Stack, Target, WorkerRole
from chaos.targets.dialect import OPENAI, SGLANG, speaks_sglang
from chaos.targets.launcher import Launcher, LocalLauncher, PlannedCommand
from chaos.targets.nodes import RayLauncher
from chaos.targets.spec import TargetSpec


class TargetedCampaign(Protocol):
    """What the factory reads of a campaign (chaos/campaign.py): its `target:` section."""

    @property
    def target(self) -> TargetSpec: ...


def launcher_for(ray_address: str | None) -> Launcher:
    """Local processes, or (with --ray-address) each role on the Ray node offering its resource."""
    if ray_address is None:
        return LocalLauncher()
    return RayLauncher(ray_address)


def build_stack(campaign: TargetedCampaign, run_dir: Path, launcher: Launcher | None = None) -> Stack:
    """The stack a launched target kind describes, not started yet."""
    spec = campaign.target
    launcher = launcher or LocalLauncher()
    if spec.kind == "sim":
        from chaos.targets.sim.stack import SimStack, sim_stack_config

        return SimStack(sim_stack_config(spec.sim), run_dir, launcher)
    if spec.kind == "sglang":
        from chaos.targets.sglang.stack import SGLangStack

        assert spec.sglang is not None  # TargetSpec requires the section for this kind
        return SGLangStack(spec.sglang, run_dir, launcher)
    if spec.kind == "vllm":
        from chaos.targets.vllm.stack import VllmStack

        return VllmStack(spec.vllm, run_dir, launcher)
    raise UsageError(f"target.kind {spec.kind!r} is not launched by pdchaos; nothing to plan or start")


def attach(campaign: TargetedCampaign, run_dir: Path) -> Target:
    """A deployment someone else runs, reached by URL (and process ids, log paths where given)."""
    spec = campaign.target
    assert spec.url is not None  # TargetSpec requires it for kind 'attach'
    url = spec.url.rstrip("/")
    try:
        transport.get(f"{url}/v1/models", timeout=5.0, trust_env=False)
    except httpx.HTTPError as exc:
        transport.raise_if_untrusted(url, exc)
        raise UsageError(f"target.url: cannot reach {url} ({type(exc).__name__}); is the deployment up?") from None
    workers: list[tuple[WorkerRole, str]] = [
        ("prefill" if i == 0 else "decode", w.rstrip("/")) for i, w in enumerate(spec.workers)
    ]
    check_attached(spec.processes)
    dialect = SGLANG if speaks_sglang([url, *(w for _, w in workers)]) else OPENAI
    return AttachTarget(url, workers, run_dir, processes_given=list(spec.processes), dialect=dialect)


def plan_target(campaign: TargetedCampaign, run_dir: Path, ray_address: str | None = None) -> list[PlannedCommand]:
    """What launching the campaign's target would run, without running anything."""
    return build_stack(campaign, run_dir, launcher_for(ray_address) if ray_address else None).plan()
