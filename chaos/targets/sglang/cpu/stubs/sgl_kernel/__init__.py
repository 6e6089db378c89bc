"""A stand-in for SGLang's CPU kernel package, in plain torch (ours, not SGLang's code).

With SGLANG_USE_CPU_ENGINE=1, SGLang imports a few CPU ops from `sgl_kernel` at module level
(`srt/mem_cache/allocation.py`, `kernels/ops/kvcache/cache_move.py`, `kernels/ops/speculative/`).
The PD pair's path calls only `assign_req_to_token_pool_cpu`, implemented here. The others are
importable names that raise NotImplementedError when called: KV moves between slots and the
speculative-decoding helpers, which this tier does not use. The real package is built from SGLang's source
tree for AMX CPUs and is not on the package index, so `make sglang-env` installs this module in
its place. It registers no `torch.ops.sgl_kernel.*` op: SGLang then finds no AMX kernels and picks
its `torch_native` attention and native layers by itself.

Any name not listed is missing on purpose: `from sgl_kernel import X` raises ImportError naming X, as
it would with no package at all, so a code path that needs a real kernel fails where it is called.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch

__version__ = "0.0.0+pdchaos.stub"


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """For request i of the batch: req_to_token[req_pool_indices[i], start[i]:end[i]] = the next
    end[i] - start[i] entries of out_cache_loc (requests take consecutive slices of it, in order)."""
    del pool_len  # the row length; the slices below are bounded by start/end
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends, strict=False):
        length = int(end) - int(start)
        if length <= 0:
            continue
        req_to_token[int(row), int(start) : int(end)] = out_cache_loc[taken : taken + length].to(req_to_token.dtype)
        taken += length


def _unavailable(name: str) -> Callable[..., None]:
    def call(*_args: object, **_kwargs: object) -> None:
        raise NotImplementedError(
            f"sgl_kernel.{name}: the pdchaos stand-in (docs/sglang-cpu-tier.md) has no real CPU "
            "kernel for it; this code path needs SGLang's CPU kernel build"
        )

    call.__name__ = name
    return call


# Imported at module level on CPU by SGLang 0.5.19-0.5.23, never called on the tier's path.
_IMPORTED_NOT_USED = (
    "copy_all_layer_kv_cache_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
)
globals().update({name: _unavailable(name) for name in _IMPORTED_NOT_USED})


def __getattr__(name: str) -> NoReturn:  # module attribute hook
    raise AttributeError(
        f"sgl_kernel stand-in (pdchaos, docs/sglang-cpu-tier.md) has no {name!r}: "
        "this code path needs SGLang's real CPU kernels"
    )
