"""Patch a module the moment it is imported, in every process of a vLLM engine.

vLLM spawns its workers, so a fix has to ride on `sitecustomize` (this directory is on PYTHONPATH of
every engine process) and wait for the module it fixes: `patch_on_import(names, patch)` installs a
meta-path finder that lets the real loader run, then calls `patch(module)` once. A module that is
already imported is patched at once.

Stdlib only: this runs in the vLLM venv.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Iterable
from typing import Any

Patch = Callable[[Any], None]


class _Hook(importlib.abc.MetaPathFinder):
    def __init__(self, names: frozenset[str], patch: Patch) -> None:
        self.names = names
        self.patch = patch

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.names:
            return None
        sys.meta_path.remove(self)  # find the real spec without finding ourselves again
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module
        patch = self.patch

        def exec_module(module: Any) -> None:
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def patch_on_import(names: Iterable[str], patch: Patch) -> None:
    """Call `patch(module)` when any of `names` is imported (now, for one already imported)."""
    wanted = frozenset(names)
    if any(isinstance(h, _Hook) and h.names == wanted for h in sys.meta_path):
        return  # installed already (sitecustomize ran twice)
    for name in wanted:
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _Hook(wanted, patch))
