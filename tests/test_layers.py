"""Imports point down: every module of chaos/, faults/, loadprofiles/ and reports/ sits in a layer,
imports only from the layers below it and its own group, and no two modules import each other,
however indirectly.

The imports are read with `ast` from the files of the tree `chaos` is imported from, every one of
them: at the top of a module, inside a function (a lazy import is a dependency all the same) and
under `if TYPE_CHECKING:` (a cycle through a type-only import turns real with the first runtime
import along it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from fnmatch import fnmatchcase
from pathlib import Path

import chaos

PACKAGES = ("chaos", "faults", "loadprofiles", "reports")
ROOT = Path(chaos.__file__).resolve().parents[1]

# Bottom to top. A module may import any module of a lower layer and of its own group; the groups of
# one layer are independent of each other. Names and fnmatch patterns (over dotted names) place every
# module of the four packages in exactly one group; a module named exactly is placed by its name,
# not by a pattern it also matches.
LAYERS: tuple[dict[str, tuple[str, ...]], ...] = (
    {
        "foundation": (
            "chaos",
            "chaos.errors",
            "chaos.durations",
            "chaos.spec",
            "chaos.process",
            "chaos.files",
            "chaos.gpu",
            "chaos.fingerprint",
            "chaos.facts",
            "chaos.facts.*",
            "chaos.http_status",
            "chaos.journal",
            "chaos.verdict",
            "chaos.windows",
            "chaos.markers",
            "chaos.ray_session",
            "chaos.stop_signals",
            "chaos.loadstats",
            "chaos.exit_codes",
            "chaos.limits",
            "chaos.refusal",
            "chaos.run_evidence",
            "chaos.transport",
        )
    },
    {"targets": ("chaos.targets", "chaos.targets.*")},
    {"oracle contract": ("chaos.oracles.base",)},  # OracleSettings, which the campaign's oracles section makes
    {
        "campaign schema": ("chaos.campaign",),  # pure data: the registries it is checked against sit above it
        "load profiles": ("loadprofiles", "loadprofiles.*"),
    },
    {
        "faults": ("faults", "faults.*"),
        "oracles": ("chaos.oracles", "chaos.oracles.*"),
        "pool preflight": ("chaos.preflight",),
        "load placement": ("chaos.cluster", "chaos.load"),
    },
    {
        "campaign validation": ("chaos.campaign_validation",),
        "the run's parts": (
            "chaos.probes",
            "chaos.tenant_probe",
            "chaos.probe_traffic",
            "chaos.pools",
            "chaos.watchdog",
            "chaos.fault_schedule",
        ),
        "judging": ("chaos.judging", "chaos.judging.*"),  # the verdict from a journal alone
        "canary command": ("chaos.canary", "chaos.canary.*"),
        "heal": ("chaos.heal",),
    },
    {"reports": ("reports", "reports.*")},  # read a journal; judge one that recorded no verdict
    {"runner": ("chaos.runner", "chaos.explore")},
    {"cli": ("chaos.cli*",)},
)

# Cycles still in the tree, each with the change that removes it. An entry whose cycle is
# gone fails the test too: delete it then.
TEMPORARY_CYCLES: dict[frozenset[str], str] = {}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The modules of `known` that module `name` imports, wherever in the file the import is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from package import module` imports that module; `from module import name` the module
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.attr` style: the longest module named
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: set(imported(name, path, known)) for name, path in known.items()}


def groups_of(name: str) -> list[tuple[int, str]]:
    """The (layer, group) pairs that name `name`, or else the ones with a pattern it matches."""
    named = [
        (level, group) for level, layer in enumerate(LAYERS) for group, patterns in layer.items() if name in patterns
    ]
    return named or [
        (level, group)
        for level, layer in enumerate(LAYERS)
        for group, patterns in layer.items()
        if any(fnmatchcase(name, pattern) for pattern in patterns)
    ]


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_is_in_exactly_one_layer() -> None:
    placed = {name: groups_of(name) for name in modules()}
    unplaced = sorted(name for name, where in placed.items() if not where)
    twice = sorted(f"{name}: {where}" for name, where in placed.items() if len(where) > 1)
    assert not unplaced, f"modules in no layer (add them to LAYERS where they belong): {unplaced}"
    assert not twice, f"modules in more than one group: {twice}"
    unused = sorted(
        pattern
        for layer in LAYERS
        for patterns in layer.values()
        for pattern in patterns
        if not any(fnmatchcase(name, pattern) for name in placed)
    )
    assert not unused, f"LAYERS names modules that do not exist: {unused}"


def test_imports_point_down() -> None:
    graph = import_graph()
    place = {name: where[0] for name in graph if (where := groups_of(name))}  # the unplaced fail the test above
    upward = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            if name not in place or target not in place:
                continue
            (level, group), (target_level, target_group) = place[name], place[target]
            if target_level > level or (target_level == level and target_group != group):
                upward.append(f"{name} ({group}) imports {target} ({target_group})")
    assert not upward, "imports that do not point down:\n  " + "\n  ".join(upward)


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    new = [sorted(c) for c in found if c not in TEMPORARY_CYCLES]
    gone = [why for c, why in TEMPORARY_CYCLES.items() if c not in found]
    assert not new, f"modules that import each other: {new}"
    assert not gone, f"these cycles are gone; delete them from TEMPORARY_CYCLES: {gone}"
