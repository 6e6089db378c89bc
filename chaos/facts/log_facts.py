"""The fact lines of an SGLang log: the scheduler's startup line, the memory pool's
``KV Cache is allocated`` line, the ``server_args=ServerArgs(...)`` banner and the HTTP server's
``The server is fired up and ready to roll!``.

Each fact line is recognised only at the *start* of a record's message, never in the middle of
one: with ``--log-requests`` a user's prompt is written to the same log, and a prompt that quotes
``max_total_num_tokens=..., context_len=...`` must not become a fact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from chaos.facts.values import to_float, to_int

_STARTUP_HEAD = re.compile(r"(?:\[gpu(?:_id)?=\d+\]\s*)?max_total_num_tokens=")
_KEY_VALUE = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)=([^,\s]+)")
_AVAILABLE_MEM = re.compile(r"\bavailable_([a-z]+)_mem=([^,\s]+)")


@dataclass(frozen=True)
class StartupFacts:
    """The scheduler's startup line.

    Format (``managers/scheduler.py``, TP0 of each DP rank)::

        max_total_num_tokens=%d, chunked_prefill_size=%d, max_prefill_tokens=%d,
        max_running_requests=%d, context_len=%d, available_gpu_mem=%.2f GB

    On CPU the last key is ``available_cpu_mem``. Older versions lack some keys; a missing key is
    None. ``chunked_prefill_size`` is printed as ``None`` when chunked prefill is off.
    """

    max_total_num_tokens: int | None
    context_len: int | None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int | None = None
    max_running_requests: int | None = None
    available_mem_gb: float | None = None
    mem_device: str | None = None  # "gpu", "cpu", ... from available_<device>_mem
    lineno: int = 0


def parse_startup_line(message: str, lineno: int = 0) -> StartupFacts | None:
    """The startup facts in a log message, or None when it is not the startup line.

    The message must begin with ``max_total_num_tokens=`` (after an optional ``[gpu_id=N]`` of
    older versions) and also carry ``context_len=``: other lines that mention the pool (a pool
    resize, a fork's extra line) lack the context length.
    """
    if _STARTUP_HEAD.match(message) is None or "context_len=" not in message:
        return None
    values = {key: value for key, value in _KEY_VALUE.findall(message)}
    if "max_total_num_tokens" not in values or "context_len" not in values:
        return None
    mem_match = _AVAILABLE_MEM.search(message)
    return StartupFacts(
        max_total_num_tokens=to_int(values.get("max_total_num_tokens")),
        context_len=to_int(values.get("context_len")),
        chunked_prefill_size=to_int(values.get("chunked_prefill_size")),
        max_prefill_tokens=to_int(values.get("max_prefill_tokens")),
        max_running_requests=to_int(values.get("max_running_requests")),
        available_mem_gb=to_float(mem_match.group(2)) if mem_match else None,
        mem_device=mem_match.group(1) if mem_match else None,
        lineno=lineno,
    )


_KV_ALLOC = re.compile(r"KV Cache is allocated\.(?P<rest>.*)$")  # anchored: used with .match
_KV_DTYPE = re.compile(r"\bdtype:\s*([^,\s]+)")
_KV_TOKENS = re.compile(r"#tokens:\s*([^,\s]+)")
_KV_K = re.compile(r"(?<![A-Za-z])K size:\s*([0-9.]+)\s*GB")
_KV_V = re.compile(r"(?<![A-Za-z])V size:\s*([0-9.]+)\s*GB")
_KV_KV = re.compile(r"\bKV size:\s*([0-9.]+)\s*GB")


@dataclass(frozen=True)
class KvAllocFacts:
    """The memory pool's allocation line (``mem_cache/memory_pool.py``)::

    KV Cache is allocated. dtype: torch.bfloat16, #tokens: N, K size: X GB, V size: Y GB
    KV Cache is allocated. #tokens: N, KV size: X GB        (MLA; older lines lack dtype)
    """

    tokens: int | None
    dtype: str | None = None
    k_size_gb: float | None = None
    v_size_gb: float | None = None
    kv_size_gb: float | None = None
    lineno: int = 0


def parse_kv_alloc_line(message: str, lineno: int = 0) -> KvAllocFacts | None:
    """The KV-allocation facts in a log message, or None when it is not that line."""
    match = _KV_ALLOC.match(message)
    if match is None:
        return None
    rest = match.group("rest")
    tokens = _KV_TOKENS.search(rest)
    dtype = _KV_DTYPE.search(rest)
    k_size, v_size, kv_size = _KV_K.search(rest), _KV_V.search(rest), _KV_KV.search(rest)
    return KvAllocFacts(
        tokens=to_int(tokens.group(1)) if tokens else None,
        dtype=dtype.group(1) if dtype else None,
        k_size_gb=to_float(k_size.group(1)) if k_size else None,
        v_size_gb=to_float(v_size.group(1)) if v_size else None,
        kv_size_gb=to_float(kv_size.group(1)) if kv_size else None,
        lineno=lineno,
    )


READY_TEXT = "The server is fired up and ready to roll!"


def is_ready_line(message: str) -> bool:
    """True for the HTTP server's ``The server is fired up and ready to roll!``."""
    return message.startswith(READY_TEXT)


# `server_args=ServerArgs(model_path='...', ...)` (a dataclass repr, older SGLang), or
# `server_args={'model_path': '...', ...}` (a dict of the resolved values: SGLang 0.5.19 and 0.5.23 log
# `resolved_dict()` in `srt/entrypoints/engine.py`; tests/fixtures/sglang/cpu-0.5.23/).
_SERVER_ARGS = re.compile(r"^server_args=\s*(?:ServerArgs\(|\{)")


@dataclass(frozen=True)
class ServerArgsFacts:
    """A few fields of the ``server_args=ServerArgs(...)`` (or ``server_args={...}``) banner.

    These are the *flags*, not resolved values: ``context_length`` is None when the model's own
    length is used, and ``max_total_tokens`` is the ``--max-total-tokens`` cap, not the pool.
    """

    disaggregation_mode: str | None = None
    context_length: int | None = None
    max_total_tokens: int | None = None
    page_size: int | None = None
    tp_size: int | None = None
    dp_size: int | None = None
    model_path: str | None = None
    lineno: int = 0


def _repr_field(text: str, name: str) -> str | None:
    value_pattern = r"""('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^,(){}\s]+)"""
    match = (
        re.search(rf"(?:\(|,\s*){name}={value_pattern}", text)  # ServerArgs(name=value, ...)
        or re.search(rf"(?:\{{|,\s*)'{name}':\s*{value_pattern}", text)
    )  # {'name': value, ...}
    if match is None:
        return None
    value = match.group(1)
    if value[:1] in "'\"" and value[-1:] == value[:1] and len(value) >= 2:
        return value[1:-1]
    return value


def parse_server_args_line(message: str, lineno: int = 0) -> ServerArgsFacts | None:
    """The banner's fields, or None when the message is not the ``server_args=`` banner."""
    if _SERVER_ARGS.match(message) is None:
        return None
    mode = _repr_field(message, "disaggregation_mode")
    return ServerArgsFacts(
        disaggregation_mode=None if mode in (None, "None") else mode,
        context_length=to_int(_repr_field(message, "context_length")),
        max_total_tokens=to_int(_repr_field(message, "max_total_tokens")),
        page_size=to_int(_repr_field(message, "page_size")),
        tp_size=to_int(_repr_field(message, "tp_size")),
        dp_size=to_int(_repr_field(message, "dp_size")),
        model_path=_repr_field(message, "model_path"),
        lineno=lineno,
    )
