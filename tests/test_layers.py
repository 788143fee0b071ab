"""The package's layers point one way: no import cycle, no import that runs back up.

Every ``import`` of a ``lowdiff`` module anywhere in a module counts (a function-local
import too: hiding a cycle inside a function does not remove it), except those under
``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lowdiff

SRC = Path(lowdiff.__file__).resolve().parent

LAYERS: list[tuple[int, tuple[str, ...]]] = [
    (0, ("errors", "format", "compressors", "machine", "remote")),
    (1, ("state",)),
    (2, ("strategy", "proc")),
    (3, ("ddp",)),
    (4, ("recovery",)),
    (5, ("plan",)),
    (6, ("engine",)),
    (7, ("baselines",)),
    (8, ("", "checkpointer", "attach", "exporting", "inspect", "integrations")),
    (
        9,
        ("harness", "prefork", "workloads", "bench", "chaos", "torture", "cli", "demo", "__main__"),
    ),
]
"""Each top-level module or package of lowdiff and its layer ("" is the package itself).
A module may import modules of its own layer or below."""

HARNESS = ("bench", "chaos", "torture", "cli")


def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(["lowdiff", *parts])] = p
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for layer, names in LAYERS:
        if top in names:
            return layer
    raise AssertionError(f"{module}: no layer is assigned to {top!r} (add it to LAYERS)")


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported lowdiff module, line) of every import that can run."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "lowdiff"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    + ([base] if base else [])
                )
            if base.split(".")[0] != "lowdiff":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if sub in MODULES else base, node.lineno))
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer() -> None:
    for m in MODULES:
        _layer(m)


def test_no_import_runs_back_up() -> None:
    up = [
        f"{m}:{line} imports {dep} (layer {_layer(m)} -> {_layer(dep)})"
        for m, deps in GRAPH.items()
        for dep, line in deps
        if dep in MODULES and _layer(dep) > _layer(m)
    ]
    assert up == []


def test_recovery_imports_nothing_from_engine() -> None:
    bad = [
        f"{m}:{line} imports {dep}"
        for m, deps in GRAPH.items()
        if m.startswith("lowdiff.recovery")
        for dep, line in deps
        if dep.startswith("lowdiff.engine")
    ]
    assert bad == []


def test_no_cycles() -> None:
    edges = {
        m: sorted({d for d, _ in deps if d in MODULES and d != m}) for m, deps in GRAPH.items()
    }
    # a package's __init__ re-exporting its own submodules is not a cycle of logic
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        stack.append(m)
        for d in edges[m]:
            if state.get(d) == 1:
                cycle = stack[stack.index(d) :] + [d]
                if not _init_reexport(cycle):
                    cycles.append(cycle)
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    assert cycles == []


def _init_reexport(cycle: list[str]) -> bool:
    """A package and one of its own submodules importing the package's other names."""
    return len(set(cycle)) == 2 and any(
        MODULES[m].name == "__init__.py" and all(c.startswith(m) for c in cycle) for m in cycle
    )


@pytest.mark.parametrize("area", HARNESS)
def test_harness_uses_no_private_library_names(area: str) -> None:
    """Harness code (bench, chaos, torture, cli) uses public or documented internal APIs:
    it imports no ``_private`` name from another lowdiff module."""
    bad = []
    for m, p in MODULES.items():
        if not m.startswith(f"lowdiff.{area}"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lowdiff"):
                if node.module.split(".")[1:2] == [area]:
                    continue
                bad += [
                    f"{m}:{node.lineno} {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert bad == []
