"""Typed readers of the facts an SGLang worker publishes about itself.

Three sources, one module, so the preflight check, the target adapters and the oracles read the
same things the same way:

* **Node logs.** The scheduler's startup line (``max_total_num_tokens=..., context_len=...``), the
  memory pool's ``KV Cache is allocated`` line, the ``server_args=ServerArgs(...)`` banner and the
  HTTP server's ``The server is fired up and ready to roll!``. `parse_log` splits a log into
  *starts* (launches of the server) and, per start, per rank, collects the facts.
* **HTTP.** ``/server_info`` (`parse_server_info`) and ``/v1/models`` (`parse_models`).
* **Prometheus text** from ``/metrics`` (`parse_prometheus_text`, a small general parser that other
  modules reuse, and `read_pool_metrics` for the pool constants).

Every numeric fact is ``int | None``; None means UNKNOWN. A reader never guesses: a value that is
absent, null, NaN, fractional or otherwise not a plain integer is None.

Log format (SGLang ``configure_logger``): ``[%(asctime)s{prefix}] %(message)s`` with the date format
``%Y-%m-%d %H:%M:%S``. The scheduler's prefix names its ranks, in this order and each only when that
dimension is > 1 (DP only when DP is on): `` DP{dp}``, `` PP{pp}``, `` ATTN_CP{cp}``,
`` MOE_DP{r}``, `` TP{tp}``, `` EP{ep}``. So ``[2026-08-16 10:00:00 DP0 TP1]``,
``[2026-08-16 10:00:00 TP3 EP3]``, and ``[2026-08-16 10:00:00]`` both for the main process and
for the only scheduler of a TP=1 server. Logs in the wild add ANSI colours, a collector's own
timestamp or pod name before the bracket, and tqdm progress bars joined to a line by carriage
returns; all of those are tolerated.
A line with no bracket header is still read, with no timestamp and the empty rank.

Each fact line is recognised only at the *start* of a record's message, never in the middle of
one: with ``--log-requests`` a user's prompt is written to the same log, and a prompt that quotes
``max_total_num_tokens=..., context_len=...`` must not become a fact.

Start-splitting rule (`parse_log`). Lines are read in order; a new start begins at:

1. a ``server_args=ServerArgs(...)`` line. The launching process prints it once, before any
   scheduler starts, so it is the most reliable boundary;
2. a scheduler startup line or a ``KV Cache is allocated`` line that comes after the current
   start's ready line. Neither is printed while the server is up, so this is a relaunch whose
   banner is missing (log level raised, log truncated, or only the scheduler's output captured);
3. a scheduler startup line for a rank that has already printed one in the current start. A rank
   initialises once per launch, so a second line is a restarted process.

Before the first start, the first startup, KV-allocation or ready line opens an implicit start;
lines before it are ignored. Before the ready line, ``KV Cache is allocated`` lines never open a
start, because one rank legitimately prints several per launch (hybrid SWA/Mamba pools, a
speculative draft model); they belong to the start that is current when they appear. Known limit:
a relaunch with no banner whose previous start crashed before its ready line is only detected at
the relaunch's startup line (rule 3), so the relaunch's KV lines stay with the crashed start; and
one whose previous start crashed before any startup line is indistinguishable from one start.
"""

from __future__ import annotations

import gzip
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------------

_INT_TEXT = re.compile(r"[+-]?\d+")


def to_int(value: Any) -> int | None:
    """A plain integer, or None when the value is absent or not exactly an integer.

    Accepts ints, integral finite floats (Prometheus gauges arrive as ``681280.0``) and strings of
    digits. Rejects bools, NaN, infinities, fractions and anything else, since those are not a
    reading of a token count.
    """
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        return None
    if isinstance(value, str):
        text = value.strip()
        if _INT_TEXT.fullmatch(text):
            return int(text)
        return None
    return None


def _to_float(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


# --------------------------------------------------------------------------------------------------
# Log lines
# --------------------------------------------------------------------------------------------------

# CSI sequences (colours, cursor moves), OSC sequences (titles, links) and lone two-byte escapes.
_ANSI = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI ... final byte
    r"|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)"  # OSC ... BEL or ST
    r"|\x1b[@-Z\\-_]"  # two-byte escapes
    r"|\x9b[0-?]*[ -/]*[@-~]"  # 8-bit CSI
)

_HEADER = re.compile(
    r"\[(?P<ts>\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d{1,9})?)"
    r"(?P<tags>(?:[ \t]+[A-Za-z][A-Za-z_]*\d*)*)[ \t]*\][ \t]?"
)
_TAG = re.compile(r"([A-Za-z][A-Za-z_]*?)(\d*)")


def strip_ansi(text: str) -> str:
    """Remove ANSI escape sequences (colours, cursor moves, OSC titles) from text."""
    return _ANSI.sub("", text)


@dataclass(frozen=True)
class LogLine:
    """One log record: where it came from and what it says, with the header taken apart.

    ``rank`` is the rank prefix as written (``"DP0 TP1"``, ``"TP3 EP3"``) or ``""`` when the line
    has none (the main process, or the scheduler of a TP=1 server, or a line with no header).
    """

    lineno: int
    timestamp: str | None
    rank: str
    message: str

    @property
    def rank_parts(self) -> dict[str, int | None]:
        """The rank prefix as a mapping, e.g. ``{"DP": 0, "TP": 1}``."""
        return parse_rank(self.rank)


def parse_rank(rank: str) -> dict[str, int | None]:
    """``"DP0 TP1 EP1"`` -> ``{"DP": 0, "TP": 1, "EP": 1}``; a tag without a number maps to None."""
    parts: dict[str, int | None] = {}
    for token in rank.split():
        match = _TAG.fullmatch(token)
        if match is None:
            continue
        name, number = match.group(1).upper(), match.group(2)
        parts[name] = int(number) if number else None
    return parts


def split_log_line(text: str, lineno: int = 0) -> LogLine:
    """Split one log record into timestamp, rank prefix and message (ANSI codes removed).

    The bracket header is searched for anywhere in the line, so a collector's own prefix before it
    (a Docker timestamp, ``pod/name |``) is skipped. A line without a header keeps its whole text
    as the message.
    """
    clean = strip_ansi(text).rstrip("\r\n")
    match = _HEADER.search(clean)
    if match is None:
        return LogLine(lineno=lineno, timestamp=None, rank="", message=clean.strip())
    rank = " ".join(match.group("tags").split())
    return LogLine(
        lineno=lineno,
        timestamp=match.group("ts"),
        rank=rank,
        message=clean[match.end() :].strip(),
    )


def iter_log_records(lines: Iterable[str]) -> Iterator[LogLine]:
    """Log records of a stream of physical lines, numbered from 1.

    A physical line holding carriage returns (a tqdm bar redrawn in place, then a log record) is
    split at them; every piece keeps the physical line number.
    """
    for lineno, physical in enumerate(lines, start=1):
        text = strip_ansi(physical.rstrip("\n"))
        for piece in text.split("\r"):
            if piece.strip():
                yield split_log_line(piece, lineno)


# --------------------------------------------------------------------------------------------------
# Facts from individual log messages
# --------------------------------------------------------------------------------------------------

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
        available_mem_gb=_to_float(mem_match.group(2)) if mem_match else None,
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
        k_size_gb=_to_float(k_size.group(1)) if k_size else None,
        v_size_gb=_to_float(v_size.group(1)) if v_size else None,
        kv_size_gb=_to_float(kv_size.group(1)) if kv_size else None,
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
    match = (re.search(rf"(?:\(|,\s*){name}={value_pattern}", text)  # ServerArgs(name=value, ...)
             or re.search(rf"(?:\{{|,\s*)'{name}':\s*{value_pattern}", text))  # {'name': value, ...}
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


# --------------------------------------------------------------------------------------------------
# Starts
# --------------------------------------------------------------------------------------------------

BOUNDARY_BANNER = "server_args banner"
BOUNDARY_AFTER_READY = "startup after ready"
BOUNDARY_RANK_AGAIN = "rank started again"
BOUNDARY_FIRST = "first startup facts"


@dataclass
class RankFacts:
    """What one rank printed during one start."""

    rank: str
    startup: StartupFacts | None = None
    kv_allocs: list[KvAllocFacts] = field(default_factory=list)


@dataclass
class LogStart:
    """One launch of the server, as seen in a log.

    ``index`` counts from 1 in file order; ``boundary`` says which rule opened it (see the module
    docstring).
    """

    index: int
    first_lineno: int
    timestamp: str | None
    boundary: str
    server_args: ServerArgsFacts | None = None
    ranks: dict[str, RankFacts] = field(default_factory=dict)
    ready_lineno: int | None = None
    last_lineno: int = 0

    @property
    def ready(self) -> bool:
        return self.ready_lineno is not None

    @property
    def startup_ranks(self) -> list[RankFacts]:
        """Ranks that printed the startup line, in first-seen order."""
        return [facts for facts in self.ranks.values() if facts.startup is not None]

    @property
    def pool_tokens(self) -> int | None:
        """Smallest ``max_total_num_tokens`` over the ranks that printed it.

        None when no rank printed it or any rank's value is unreadable.
        """
        values = [
            facts.startup.max_total_num_tokens for facts in self.startup_ranks if facts.startup
        ]
        if not values or any(value is None for value in values):
            return None
        return min(value for value in values if value is not None)

    @property
    def context_len(self) -> int | None:
        """Largest ``context_len`` over the ranks that printed it (None as for `pool_tokens`)."""
        values = [facts.startup.context_len for facts in self.startup_ranks if facts.startup]
        if not values or any(value is None for value in values):
            return None
        return max(value for value in values if value is not None)

    @property
    def kv_tokens(self) -> int | None:
        """Smallest ``#tokens`` of the KV-allocation lines.

        Informational only: hybrid models allocate pools of different kinds and sizes.
        """
        values = [
            alloc.tokens
            for facts in self.ranks.values()
            for alloc in facts.kv_allocs
            if alloc.tokens
        ]
        return min(values) if values else None

    @property
    def role(self) -> str | None:
        """``prefill`` / ``decode`` / ``unified`` from the banner, or None without a banner."""
        if self.server_args is None:
            return None
        mode = self.server_args.disaggregation_mode
        if mode is None or mode == "null":
            return "unified"
        return mode

    def rank(self, name: str) -> RankFacts:
        if name not in self.ranks:
            self.ranks[name] = RankFacts(rank=name)
        return self.ranks[name]


def parse_log(lines: Iterable[str]) -> list[LogStart]:
    """Split a log into starts and collect, per start and rank, the startup and KV facts.

    ``lines`` are physical lines (with or without their newline). See the module docstring for the
    rule that opens a new start.
    """
    starts: list[LogStart] = []
    current: LogStart | None = None

    def open_start(record: LogLine, boundary: str) -> LogStart:
        start = LogStart(
            index=len(starts) + 1,
            first_lineno=record.lineno,
            timestamp=record.timestamp,
            boundary=boundary,
            last_lineno=record.lineno,
        )
        starts.append(start)
        return start

    for record in iter_log_records(lines):
        message = record.message
        banner = parse_server_args_line(message, record.lineno)
        if banner is not None:
            current = open_start(record, BOUNDARY_BANNER)
            current.server_args = banner
            continue

        startup = parse_startup_line(message, record.lineno)
        if startup is not None:
            if current is None:
                current = open_start(record, BOUNDARY_FIRST)
            elif current.ready:
                current = open_start(record, BOUNDARY_AFTER_READY)
            elif record.rank in current.ranks and current.ranks[record.rank].startup is not None:
                current = open_start(record, BOUNDARY_RANK_AGAIN)
            current.rank(record.rank).startup = startup
            current.last_lineno = record.lineno
            continue

        kv_alloc = parse_kv_alloc_line(message, record.lineno)
        if kv_alloc is not None:
            if current is None:
                current = open_start(record, BOUNDARY_FIRST)
            elif current.ready:
                current = open_start(record, BOUNDARY_AFTER_READY)
            current.rank(record.rank).kv_allocs.append(kv_alloc)
            current.last_lineno = record.lineno
            continue

        if is_ready_line(message):
            if current is None:
                current = open_start(record, BOUNDARY_FIRST)
            if current.ready_lineno is None:
                current.ready_lineno = record.lineno
            current.last_lineno = record.lineno
            continue

        if current is not None:
            current.last_lineno = record.lineno
    return starts


def open_log(path: str | Path) -> Iterator[str]:
    """Physical lines of a log file (``.gz`` is decompressed), decoded leniently.

    Lines are split on ``\\n`` only, so carriage returns inside a line reach `iter_log_records`.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:  # type: ignore[operator]
        for raw in handle:
            yield raw.decode("utf-8", errors="replace")


def read_log(path: str | Path) -> list[LogStart]:
    """`parse_log` of a file."""
    return parse_log(open_log(path))


# --------------------------------------------------------------------------------------------------
# HTTP: /server_info and /v1/models
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerInfoFacts:
    """Fields of ``/server_info`` (deprecated alias ``/get_server_info``).

    ``max_total_num_tokens`` and ``max_req_input_len`` come from the scheduler (resolved values);
    ``context_length`` is the ``--context-length`` flag and is None when the model's own length is
    used, so it is the weakest source for the context length.
    """

    max_total_num_tokens: int | None = None
    max_req_input_len: int | None = None
    context_length: int | None = None
    page_size: int | None = None
    disaggregation_mode: str | None = None
    version: str | None = None


def parse_server_info(payload: Any) -> ServerInfoFacts:
    """Read `ServerInfoFacts` from a decoded ``/server_info`` body; anything missing is None."""
    if not isinstance(payload, Mapping):
        return ServerInfoFacts()
    mode = payload.get("disaggregation_mode")
    version = payload.get("version")
    return ServerInfoFacts(
        max_total_num_tokens=to_int(payload.get("max_total_num_tokens")),
        max_req_input_len=to_int(payload.get("max_req_input_len")),
        context_length=to_int(payload.get("context_length")),
        page_size=to_int(payload.get("page_size")),
        disaggregation_mode=mode if isinstance(mode, str) else None,
        version=version if isinstance(version, str) else None,
    )


@dataclass(frozen=True)
class ModelsFacts:
    """``/v1/models``: each served model's id and ``max_model_len`` (the advertised context)."""

    models: tuple[tuple[str, int | None], ...] = ()

    @property
    def max_model_len(self) -> int | None:
        """Largest advertised length over the listed models: the worst case a client may send."""
        values = [length for _, length in self.models if length is not None]
        return max(values) if values else None


def parse_models(payload: Any) -> ModelsFacts:
    """Read `ModelsFacts` from a decoded ``/v1/models`` body.

    Shape: ``{"data": [{"id": ..., "max_model_len": ...}, ...]}``.
    """
    if not isinstance(payload, Mapping) or not isinstance(payload.get("data"), Sequence):
        return ModelsFacts()
    models: list[tuple[str, int | None]] = []
    for entry in payload["data"]:
        if not isinstance(entry, Mapping):
            continue
        model_id = entry.get("id")
        models.append(
            (model_id if isinstance(model_id, str) else "", to_int(entry.get("max_model_len")))
        )
    return ModelsFacts(models=tuple(models))


# --------------------------------------------------------------------------------------------------
# Prometheus text exposition format
# --------------------------------------------------------------------------------------------------


class PrometheusParseError(ValueError):
    """A line of Prometheus text that is not a valid sample."""


@dataclass(frozen=True)
class Sample:
    """One sample: metric name, labels and value (NaN and +/-Inf kept as floats).

    ``timestamp`` is the optional trailing timestamp as written (milliseconds in the Prometheus
    format, seconds in OpenMetrics).
    """

    name: str
    labels: dict[str, str] = field(default_factory=dict, hash=False)
    value: float = math.nan
    timestamp: float | None = None

    def label(self, key: str, default: str | None = None) -> str | None:
        return self.labels.get(key, default)


_METRIC_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
_NUMBER = re.compile(
    r"[+-]?(?:(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
    r"|[Ii][Nn][Ff](?:[Ii][Nn][Ii][Tt][Yy])?|[Nn][Aa][Nn])"
)


def _skip_spaces(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t":
        pos += 1
    return pos


def _read_quoted(text: str, pos: int) -> tuple[str, int]:
    """Read a double-quoted string starting at ``text[pos] == '"'``; return (value, next pos)."""
    out: list[str] = []
    pos += 1
    while pos < len(text):
        char = text[pos]
        if char == "\\" and pos + 1 < len(text):
            nxt = text[pos + 1]
            out.append(_ESCAPES.get(nxt, "\\" + nxt))
            pos += 2
            continue
        if char == '"':
            return "".join(out), pos + 1
        out.append(char)
        pos += 1
    raise PrometheusParseError("unterminated quoted string")


def _parse_number(token: str) -> float:
    if not _NUMBER.fullmatch(token):
        raise PrometheusParseError(f"not a number: {token!r}")
    return float(token)


def _parse_sample_line(line: str) -> Sample:
    pos = 0
    name: str | None = None
    match = _METRIC_NAME.match(line)
    if match is not None:
        name, pos = match.group(0), match.end()
    labels: dict[str, str] = {}
    brace = _skip_spaces(line, pos)
    if brace < len(line) and line[brace] == "{":
        pos = brace + 1
        while True:
            pos = _skip_spaces(line, pos)
            if pos >= len(line):
                raise PrometheusParseError("unterminated label set")
            if line[pos] == "}":
                pos += 1
                break
            if line[pos] == '"':
                key, pos = _read_quoted(line, pos)
                quoted_key = True
            else:
                key_match = _LABEL_NAME.match(line, pos)
                if key_match is None:
                    raise PrometheusParseError(f"bad label name at column {pos + 1}")
                key, pos = key_match.group(0), key_match.end()
                quoted_key = False
            pos = _skip_spaces(line, pos)
            if pos < len(line) and line[pos] == "=":
                pos = _skip_spaces(line, pos + 1)
                if pos >= len(line) or line[pos] != '"':
                    raise PrometheusParseError(f"label {key!r} has no quoted value")
                value, pos = _read_quoted(line, pos)
                if key in labels:
                    raise PrometheusParseError(f"duplicate label {key!r}")
                labels[key] = value
            elif quoted_key and name is None:
                name = key  # OpenMetrics 2 / UTF-8 names: {"metric.name", label="v"}
            else:
                raise PrometheusParseError(f"label {key!r} has no value")
            pos = _skip_spaces(line, pos)
            if pos < len(line) and line[pos] == ",":
                pos += 1
            elif pos < len(line) and line[pos] == "}":
                continue
            else:
                raise PrometheusParseError(f"expected ',' or '}}' at column {pos + 1}")
    if not name:
        raise PrometheusParseError("no metric name")
    rest = line[pos:]
    if rest and rest[0] not in " \t":
        raise PrometheusParseError(f"unexpected {rest[0]!r} after metric name")
    rest = rest.split("#", 1)[0]  # an OpenMetrics exemplar follows '#'
    parts = rest.split()
    if not parts or len(parts) > 2:
        raise PrometheusParseError("expected a value and an optional timestamp")
    value = _parse_number(parts[0])
    timestamp = _parse_number(parts[1]) if len(parts) == 2 else None
    return Sample(name=name, labels=labels, value=value, timestamp=timestamp)


def parse_prometheus_text(text: str, *, strict: bool = False) -> list[Sample]:
    """Samples of a Prometheus (or OpenMetrics) text exposition, in order.

    Comments, ``# HELP``/``# TYPE``/``# EOF`` and blank lines are skipped. Label values may hold
    escaped quotes, backslashes and newlines (``\\"``, ``\\\\``, ``\\n``) and any of ``{},=#``.
    Values ``NaN``, ``+Inf``, ``-Inf`` are kept as floats. Exemplars are dropped. A malformed line
    is skipped, or raises `PrometheusParseError` naming its line number when ``strict``.
    """
    samples: list[Sample] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            samples.append(_parse_sample_line(line))
        except PrometheusParseError as exc:
            if strict:
                raise PrometheusParseError(f"line {lineno}: {exc}: {raw!r}") from None
    return samples


def find_samples(samples: Iterable[Sample], name: str, **labels: str) -> list[Sample]:
    """Samples named ``name`` whose labels include every given ``label=value``."""
    return [
        sample
        for sample in samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    ]


METRIC_POOL = "sglang:max_total_num_tokens"
METRIC_CONTEXT = "sglang:context_len"
METRIC_PAGE_SIZE = "sglang:page_size"
METRIC_VLLM_CACHE_CONFIG = "vllm:cache_config_info"  # labels num_gpu_blocks and block_size: the pool


@dataclass(frozen=True)
class PoolMetricSeries:
    """The pool constants reported under one label set (one scheduler rank)."""

    labels: dict[str, str] = field(default_factory=dict, hash=False)
    max_total_num_tokens: int | None = None
    context_len: int | None = None
    page_size: int | None = None


@dataclass(frozen=True)
class PoolMetrics:
    """``sglang:max_total_num_tokens``, ``sglang:context_len`` and ``sglang:page_size`` per rank."""

    series: tuple[PoolMetricSeries, ...] = ()

    def _values(self, attribute: str) -> list[int]:
        return [
            value for item in self.series if (value := getattr(item, attribute)) is not None
        ]

    @property
    def max_total_num_tokens(self) -> int | None:
        """Smallest pool over the ranks that report one."""
        values = self._values("max_total_num_tokens")
        return min(values) if values else None

    @property
    def context_len(self) -> int | None:
        """Largest context length over the ranks that report one."""
        values = self._values("context_len")
        return max(values) if values else None

    @property
    def page_size(self) -> int | None:
        values = self._values("page_size")
        return max(values) if values else None

    @property
    def engine_types(self) -> tuple[str, ...]:
        """The ``engine_type`` labels seen (prefill, decode, unified), sorted."""
        types = {item.labels["engine_type"] for item in self.series if "engine_type" in item.labels}
        return tuple(sorted(types))


def read_pool_metrics(samples: Iterable[Sample] | str) -> PoolMetrics:
    """Group the pool constants by label set. Accepts samples or the raw ``/metrics`` text."""
    if isinstance(samples, str):
        samples = parse_prometheus_text(samples)
    attribute = {
        METRIC_POOL: "max_total_num_tokens",
        METRIC_CONTEXT: "context_len",
        METRIC_PAGE_SIZE: "page_size",
    }
    grouped: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for sample in samples:
        if sample.name == METRIC_VLLM_CACHE_CONFIG:  # vLLM states its pool as labels of an info gauge
            blocks, block_size = to_int(sample.labels.get("num_gpu_blocks")), to_int(sample.labels.get("block_size"))
            if blocks is not None and block_size is not None:
                key = tuple(sorted(sample.labels.items()))
                grouped.setdefault(key, {}).update(max_total_num_tokens=blocks * block_size, page_size=block_size)
            continue
        if sample.name not in attribute:
            continue
        key = tuple(sorted(sample.labels.items()))
        grouped.setdefault(key, {})[attribute[sample.name]] = to_int(sample.value)
    return PoolMetrics(
        series=tuple(
            PoolMetricSeries(labels=dict(key), **values) for key, values in grouped.items()
        )
    )
