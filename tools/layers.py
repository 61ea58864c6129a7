"""Check the floors of the house: code on a floor runs without the floors above it, the
ground imports nothing else, and no modules import each other in a circle.

    python tools/layers.py           the floors, the imports between folders, and every
                                     violation (exit 1 if there is one)
    python tools/layers.py --quiet   violations only

It reads the code as Python resolves it: module names come from pyproject.toml's
package-dir mapping (coordinator/ is ripples.coordinator, ...), and every `import` and
`from ... import` counts, at module level or inside a function (a lazy import is still a
dependency: a spec's loader that imports its runtime sits above that runtime). An import
under `if TYPE_CHECKING:` only names a type for the annotations: a floor may name a type
of a floor above it that way (an interface typed with what implements it), but the ground
may not, and two modules whose classes name each other so import no circle.
docs/architecture.md explains the floors; the table below is their one definition.
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
from collections import defaultdict
from pathlib import Path

from layout import REPO, modules

FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ground", ("ripples.*", "ripples.v1", "ripples.protocols.settings")),
    ("mechanisms", (
        "ripples.coordinator.comm_directory", "ripples.coordinator.decisions",
        "ripples.coordinator.errors", "ripples.coordinator.groups", "ripples.coordinator.heap",
        "ripples.coordinator.history", "ripples.coordinator.http",
        "ripples.coordinator.live_sums", "ripples.coordinator.pairing",
        "ripples.coordinator.policies", "ripples.coordinator.progress",
        "ripples.coordinator.registry", "ripples.coordinator.root_watch",
        "ripples.coordinator.schema", "ripples.coordinator.state_store",
        "ripples.coordinator.stop", "ripples.coordinator.topology",
        "ripples.worker", "ripples.sim",
    )),
    ("protocols", ("ripples.protocols",)),
    ("registry", ("ripples.protocols.registry",)),
    ("services", (
        "ripples.coordinator",
        "ripples.worker.api", "ripples.worker.checkpoint", "ripples.worker.daemon",
        "ripples.worker.optimizer", "ripples.worker.runner", "ripples.worker.sampler",
        "ripples.worker.synchronizer",
        "ripples.sim.config", "ripples.sim.coordinators", "ripples.sim.engine",
        "ripples.sim.summary",
        "ripples.dashboard",
    )),
    ("roof", ("ripples", "ripples.cli", "ripples.bench", "ripples.examples")),
)
"""Floor name and what is on it, from the ground up. An entry takes the modules of its
package and its subpackages, unless a longer entry names them: "ripples.coordinator" puts
the coordinator on the services floor, and "ripples.coordinator.policies" (like the
pairing, the group table, the topology, ...) takes that mechanism down to the second. "ripples.*"
is the modules directly in ripples/ (the shared plumbing); "ripples" alone is the
package's __init__ (the public API's face, which hands out names from the worker).

- ground: plumbing every part may use (gRPC channels, security, files, the static
  schedule, the generated stubs, the base of protocol settings);
- mechanisms: what the protocols are built from (the coordinator's policies, pairing and
  tables; the worker's data plane, client and session; the simulator's models);
- protocols: one package each (its spec, coordinator role, runtime, simulated workers);
- registry: the list of protocols;
- services: what runs a protocol by its name (the coordinator's core and gRPC service,
  ripples.Optimizer and the runner, the simulation, the dashboard);
- roof: the command line, the local cluster, the benchmarks, the examples."""


def floor_of(module: str) -> int:
    """The floor index of a module (the longest matching entry of FLOORS)."""
    best, best_len = -1, -1
    for index, (_, packages) in enumerate(FLOORS):
        for package in packages:
            if package.endswith(".*"):
                parent = package[:-2]
                matches = module.rpartition(".")[0] == parent and module not in _subpackages()
                length = len(parent) + 1
            else:
                matches = module == package or module.startswith(package + ".")
                length = len(package)
            if matches and length > best_len:
                best, best_len = index, length
    if best < 0:
        raise ValueError(f"module {module} is on no floor: add its package to FLOORS")
    return best


@functools.cache
def _subpackages() -> frozenset[str]:
    """The packages of the distribution (read once: floor_of asks for every import)."""
    return frozenset(m for m, path in modules().items() if path.name == "__init__.py")


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported module of the distribution, line, for typing only) for every import in a
    module; for typing only: under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - child.level + 1] + ([base] if base else []))
                # `from package import name`: the submodule `name`, else the package itself
                # (a package's __init__ runs for every submodule: that is no dependency).
                names = [f"{base}.{alias.name}" for alias in child.names]
            for name in names:
                target = _resolve(name, known)
                if target and target != module:
                    found.append((target, child.lineno, typing_only))  # type: ignore[attr-defined]
            visit(child, typing_only or _is_type_checking_block(child))

    visit(tree, False)
    return found


def _is_type_checking_block(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(name: str, known: dict[str, Path]) -> str:
    """The module of the distribution an import name refers to ("" if none)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm,
    iterative: the graph has hundreds of modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def check() -> tuple[list[str], dict[str, set[str]]]:
    """(violations, the import graph)."""
    known = modules()
    graph: dict[str, set[str]] = {m: set() for m in known}
    runtime: dict[str, set[str]] = {m: set() for m in known}
    violations: list[str] = []
    for module, path in known.items():
        if module.endswith("_pb2") or module.endswith("_pb2_grpc"):
            continue  # generated: imports only its own siblings and the runtime
        here = floor_of(module)
        for target, line, typing_only in imports(module, path, known):
            graph[module].add(target)
            if not typing_only:
                runtime[module].add(target)
            there = floor_of(target)
            if there > here and (not typing_only or here == 0):
                violations.append(
                    f"{path.relative_to(REPO)}:{line}: {module} ({FLOORS[here][0]}) imports "
                    f"{target}, a floor above ({FLOORS[there][0]})")
    for component in cycles(runtime):
        violations.append("modules import each other in a circle: " + " -> ".join(component))
    return violations, graph


def folder_of(module: str, known: dict[str, Path]) -> str:
    """A module's top-level folder; for ripples/, its subpackage folder (ground and roof
    share that folder)."""
    parts = known[module].relative_to(REPO).parts[:-1]
    return "/".join(parts[:2] if parts[0] == "ripples" else parts[:1]) + "/"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quiet", action="store_true", help="print violations only")
    args = parser.parse_args()
    violations, graph = check()
    if not args.quiet:
        known = modules()
        print("floors, from the top down:")
        for index in reversed(range(len(FLOORS))):
            members = sorted(m for m in known if floor_of(m) == index)
            print(f"  {index + 1} {FLOORS[index][0]}: {len(members)} modules "
                  f"({', '.join(FLOORS[index][1])})")
        between: dict[tuple[str, str], int] = defaultdict(int)
        for module, targets in graph.items():
            for target in targets:
                a, b = folder_of(module, known), folder_of(target, known)
                if a != b:
                    between[(a, b)] += 1
        print("imports between folders (modules importing -> imported):")
        for (a, b), count in sorted(between.items()):
            print(f"  {a} -> {b}: {count}")
    for violation in violations:
        print(violation)
    if not args.quiet:
        print(f"{len(violations)} violation(s)")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
