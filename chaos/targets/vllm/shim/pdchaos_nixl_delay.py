"""Give every NIXL agent a progress-thread delay (pthrDelay) instead of NIXL's hard-coded 0.

nixl 1.5.1's Python API (`nixl_cu12/_api.py`, `nixl_agent.__init__`) sets `pthrDelay = 0` on the
agent config it builds, so the UCX progress thread polls with a zero timeout: one busy core per
idle engine (docs/performance.md). vLLM builds that agent inside its worker process
(`nixl/base_worker.py`), which is spawned, so the fix is an import hook installed by
`sitecustomize` (pdchaos_import_hook.py): when the NIXL API module is imported, its binding's
agent constructor gets the delay set first.

Stdlib only: this runs in the vLLM venv. `PDCHAOS_NIXL_PTHR_DELAY_US` unset or 0 = NIXL's default.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from pdchaos_import_hook import patch_on_import

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


def install() -> None:
    delay = delay_us()
    if delay > 0:
        patch_on_import(API_MODULES, lambda module: patch(module, delay))
