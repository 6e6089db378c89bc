"""Every oracle by name, and the default set a run evaluates (docs/architecture.md, "Oracles").

The pool preflight (pool >= context on every node) runs before the load (`chaos/preflight.py`)
and is not an oracle over the journal, so it is not listed here.
"""

from __future__ import annotations

from chaos.oracles.base import Oracle
from chaos.oracles.contracts import StatusContractOracle, UsageContractOracle
from chaos.oracles.integrity import EngineIntegrityOracle
from chaos.oracles.leaks import CanaryLeakOracle
from chaos.oracles.liveness import LivenessOracle
from chaos.oracles.reference import ReferenceOracle
from chaos.oracles.tenants import TenantIsolationOracle
from chaos.oracles.timing import TimingTellOracle

ALL_ORACLES: dict[str, type[Oracle]] = {
    cls.name: cls
    for cls in (
        CanaryLeakOracle,
        ReferenceOracle,
        StatusContractOracle,
        UsageContractOracle,
        TimingTellOracle,
        EngineIntegrityOracle,
        LivenessOracle,
        TenantIsolationOracle,
    )
}


def default_oracles() -> list[Oracle]:
    """One instance of every oracle, in report order (leaks first)."""
    return [cls() for cls in ALL_ORACLES.values()]


def oracles_named(names: list[str]) -> list[Oracle]:
    """The oracles a campaign asks for, by name; an unknown name is a usage error naming the choices."""
    unknown = [n for n in names if n not in ALL_ORACLES]
    if unknown:
        raise ValueError(f"unknown oracle(s) {', '.join(unknown)}; choose from {', '.join(ALL_ORACLES)}")
    return [ALL_ORACLES[n]() for n in names]
