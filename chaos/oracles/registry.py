"""Every oracle by name (docs/architecture.md, "Oracles").

A run evaluates the oracles its campaign's `oracles.enabled` names. That field's default, in the
campaign schema beneath this module (`chaos/campaign.py`), must name every oracle here, else a
campaign that leaves it out never runs a new one: tests/test_oracles.py holds the two equal.

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


def oracles_named(names: list[str]) -> list[Oracle]:
    """The oracles a campaign asks for, by name; an unknown name is a usage error naming the choices."""
    unknown = [n for n in names if n not in ALL_ORACLES]
    if unknown:
        raise ValueError(f"unknown oracle(s) {', '.join(unknown)}; choose from {', '.join(ALL_ORACLES)}")
    return [ALL_ORACLES[n]() for n in names]
