"""From a campaign's `target:` section to a Target: launched here, launched on Ray nodes, or attached.

One place knows every target kind; the runner and `pdchaos plan` ask it. A new engine adds its
package under `chaos/targets/`, its section to `TargetSpec`, and one branch here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from chaos.errors import UsageError
from chaos.targets.attach import AttachTarget
from chaos.targets.base import Stack, Target
from chaos.targets.launcher import Launcher, LocalLauncher, PlannedCommand

if TYPE_CHECKING:
    from chaos.campaign import Campaign


def launcher_for(ray_address: str | None) -> Launcher:
    """Local processes, or (with --ray-address) each role on the Ray node offering its resource."""
    if ray_address is None:
        return LocalLauncher()
    from chaos.targets.nodes import RayLauncher

    return RayLauncher(ray_address)


def build_stack(campaign: Campaign, run_dir: Path, launcher: Launcher | None = None) -> Stack:
    """The stack a launched target kind describes, not started yet."""
    spec = campaign.target
    launcher = launcher or LocalLauncher()
    if spec.kind == "sim":
        from chaos.targets.sim.stack import SimStack, sim_stack_config

        return SimStack(sim_stack_config(spec.sim), run_dir, launcher)
    if spec.kind == "sglang":
        from chaos.targets.sglang.stack import SGLangStack

        assert spec.sglang is not None  # the campaign model requires the section for this kind
        return SGLangStack(spec.sglang, run_dir, launcher)
    if spec.kind == "vllm":
        from chaos.targets.vllm.stack import VllmStack

        return VllmStack(spec.vllm, run_dir, launcher)
    raise UsageError(f"target.kind {spec.kind!r} is not launched by pdchaos; nothing to plan or start")


def attach(campaign: Campaign, run_dir: Path) -> Target:
    """A deployment someone else runs, reached by URL (and process ids, log paths where given)."""
    spec = campaign.target
    assert spec.url is not None  # the campaign model requires it for kind 'attach'
    url = spec.url.rstrip("/")
    try:
        httpx.get(f"{url}/v1/models", timeout=5.0, trust_env=False)
    except httpx.HTTPError as exc:
        raise UsageError(f"target.url: cannot reach {url} ({type(exc).__name__}); is the deployment up?") from None
    workers = [("prefill" if i == 0 else "decode", w.rstrip("/")) for i, w in enumerate(spec.workers)]
    return AttachTarget(url, workers, run_dir, processes_given=list(spec.processes))


def plan_target(campaign: Campaign, run_dir: Path, ray_address: str | None = None) -> list[PlannedCommand]:
    """What launching the campaign's target would run, without running anything."""
    return build_stack(campaign, run_dir, launcher_for(ray_address) if ray_address else None).plan()
