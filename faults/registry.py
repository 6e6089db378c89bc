"""Every fault family by name; a campaign names faults by these keys."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from chaos.errors import UsageError
from faults.base import Fault
from faults.links.partition import NetnsPartition
from faults.links.proxy_faults import KvTransfer, RouterLink
from faults.process import ProcessKill, TransferStall
from faults.provoke import split_params
from faults.restarts import EngineFailure, MemoryFraction
from faults.traffic.cache_flush import CacheFlush
from faults.traffic.client_abort import ClientAbort
from faults.traffic.over_length import OverLengthBurst

FAULTS: dict[str, type[Fault]] = {
    cls.name: cls
    for cls in (
        TransferStall,
        ProcessKill,
        MemoryFraction,
        EngineFailure,
        KvTransfer,
        RouterLink,
        NetnsPartition,
        ClientAbort,
        OverLengthBurst,
        CacheFlush,
    )
}


def build_fault(name: str, params: Mapping[str, Any], where: str) -> Fault:
    cls = FAULTS.get(name)
    if cls is None:
        raise UsageError(
            f"{where}: unknown fault {name!r}; known faults: {', '.join(sorted(FAULTS))} (see `pdchaos faults list`)"
        )
    params, _ = split_params(params, where)  # `provoke:` belongs to the window, not the fault
    return cls(cls.Params.from_mapping(params, where))


def describe(cls: type[Fault]) -> list[str]:
    fields = [f"{f.name}: {f.type} = {f.default!r}" for f in dataclasses.fields(cls.Params)]
    return [f"{cls.name}  [{', '.join(sorted(cls.targets))}]", f"    {cls.summary}"] + [
        f"    - {line}" for line in fields
    ]
