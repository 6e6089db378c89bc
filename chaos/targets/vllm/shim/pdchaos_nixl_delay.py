"""Give every NIXL agent a progress-thread delay (pthrDelay) instead of NIXL's hard-coded 0.

nixl 1.5.1's Python API (`nixl_cu12/_api.py`, `nixl_agent.__init__`) sets `pthrDelay = 0` on the
agent config it builds, so the UCX progress thread polls with a zero timeout: one busy core per
idle engine (docs/performance.md). vLLM builds that agent inside its worker process
(`nixl/base_worker.py`), which is spawned, so the fix is an import hook installed by
`sitecustomize` (this directory is on PYTHONPATH of every engine process): when the NIXL API
module is imported, its binding's agent constructor gets the delay set first.

Stdlib only: this runs in the vLLM venv. `PDCHAOS_NIXL_PTHR_DELAY_US` unset or 0 = NIXL's default.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from typing import Any

ENV = "PDCHAOS_NIXL_PTHR_DELAY_US"
API_MODULES = ("nixl_cu12._api", "nixl_cu13._api", "nixl._api")


def delay_us() -> int:
    value = os.environ.get(ENV, "")
    return int(value) if value.isdigit() else 0


def patch(module: Any, delay: int) -> None:
    binding = getattr(module, "nixlBind", None)
    if binding is None or getattr(binding, "_pdchaos_delay", None) is not None:
        return
    original = binding.nixlAgent

    def agent_with_delay(name: str, config: Any, *args: Any, **kwargs: Any) -> Any:
        config.pthrDelay = delay
        return original(name, config, *args, **kwargs)

    binding.nixlAgent = agent_with_delay
    binding._pdchaos_delay = delay
    print(f"[pdchaos] NIXL agents get pthrDelay={delay}us ({module.__name__})", file=sys.stderr, flush=True)


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self, delay: int) -> None:
        self.delay = delay

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in API_MODULES:
            return None
        sys.meta_path.remove(self)  # find the real spec without finding ourselves again
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module
        delay = self.delay

        def exec_module(module: Any) -> None:
            execute(module)
            patch(module, delay)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    delay = delay_us()
    if delay <= 0 or any(isinstance(h, _Hook) for h in sys.meta_path):
        return
    for name in API_MODULES:  # already imported (unlikely this early): patch it now
        if name in sys.modules:
            patch(sys.modules[name], delay)
    sys.meta_path.insert(0, _Hook(delay))
