"""The packages' layers point one way: no import cycle, no import that runs back up, and
the library (``lowdiff``) never imports its lab (``lowdiff_lab``).

Every ``import`` of a ``lowdiff`` or ``lowdiff_lab`` module anywhere in a module counts: a
function-local import too, and one under ``if TYPE_CHECKING:`` too (hiding a cycle from
the interpreter does not remove it from the design).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import lowdiff
from lowdiff.format import atomic

SRC = Path(lowdiff.__file__).resolve().parent.parent
PACKAGES = ("lowdiff", "lowdiff_lab")

LAYERS: dict[str, list[tuple[int, tuple[str, ...]]]] = {
    "lowdiff": [
        (0, ("errors", "options", "format", "compressors", "remote")),
        (1, ("state",)),
        (2, ("strategy", "proc", "methods")),
        (3, ("ddp",)),
        (4, ("recovery",)),
        (5, ("plan",)),
        (6, ("engine",)),
        (7, ("legacy", "checkpointer")),
        (8, ("", "attach", "exporting", "inspection", "integrations")),
        (9, ("cli", "__main__")),
    ],
    "lowdiff_lab": [
        (0, ("", "faults", "harness", "machine", "checkpointers")),
        (1, ("baselines",)),
        (2, ("workloads", "prefork")),
        (3, ("bench", "chaos", "torture", "demo")),
        (4, ("cli", "plugin")),
    ],
}
"""Each top-level module or package and its layer ("" is the package itself). A module
may import modules of its own layer or below; the lab may import any library module."""

LAB_AREAS = ("bench", "chaos", "torture", "cli", "demo", "baselines", "workloads")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (SRC / pkg).rglob("*.py"):
            rel = p.relative_to(SRC).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    pkg, _, rest = module.partition(".")
    top = rest.split(".")[0]
    for layer, names in LAYERS[pkg]:
        if top in names:
            return layer
    raise AssertionError(f"{module}: no layer is assigned to {top!r} (add it to LAYERS)")


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported module of either package, line) of every import, TYPE_CHECKING ones too."""
    tree = ast.parse(path.read_text())
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] in PACKAGES]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] not in PACKAGES:
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((sub if sub in MODULES else base, node.lineno))
    return out


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_module_has_a_layer() -> None:
    for m in MODULES:
        _layer(m)


def test_the_library_never_imports_the_lab() -> None:
    bad = [
        f"{m}:{line} imports {dep}"
        for m, deps in GRAPH.items()
        if m.split(".")[0] == "lowdiff"
        for dep, line in deps
        if dep.split(".")[0] == "lowdiff_lab"
    ]
    assert bad == []


def test_no_import_runs_back_up() -> None:
    up = [
        f"{m}:{line} imports {dep} (layer {_layer(m)} -> {_layer(dep)})"
        for m, deps in GRAPH.items()
        for dep, line in deps
        if dep in MODULES
        and dep.split(".")[0] == m.split(".")[0]
        and _layer(dep) > _layer(m)
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


@pytest.mark.parametrize("area", LAB_AREAS)
def test_the_lab_uses_no_private_library_names(area: str) -> None:
    """Lab code uses public or documented internal APIs: it imports no ``_private`` name
    from another module."""
    bad = []
    for m, p in MODULES.items():
        if not m.startswith(f"lowdiff_lab.{area}"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lowdiff"):
                if node.module.startswith(f"lowdiff_lab.{area}"):
                    continue
                bad += [
                    f"{m}:{node.lineno} {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    assert bad == []


@pytest.mark.timeout(120)
def test_import_lowdiff_loads_no_lab_module_and_no_lab_dependency() -> None:
    """In a fresh interpreter, ``import lowdiff``, training with a Checkpointer of lowdiff's
    own and inspecting and verifying its directory import no lab module, and none of the
    lab's dependencies that torch does not import by itself."""
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "import lowdiff\n"
        "m = torch.nn.Linear(2, 2)\n"
        "ck = lowdiff.Checkpointer(None, m, torch.optim.SGD(m.parameters(), lr=0.1),\n"
        "                          method='compression-only', compressor=lowdiff.TopK(0.5))\n"
        "ck.close()\n"
        "import tempfile, pathlib\n"
        "d = pathlib.Path(tempfile.mkdtemp()) / 'ck'\n"
        "with lowdiff.Checkpointer(d, m, torch.optim.SGD(m.parameters(), lr=0.1),\n"
        "                          compressor=lowdiff.TopK(0.5)) as ck:\n"
        "    ck.resume()\n"
        "    m(torch.randn(3, 2)).sum().backward()\n"
        "    ck.step()\n"
        "lowdiff.inspect_dir(d, verify=True)\n"
        "assert lowdiff.verify_dir(d)[1] == []\n"
        "new = set(sys.modules) - before\n"
        "lab = sorted(x for x in new if x.split('.')[0] in\n"
        "             ('lowdiff_lab', 'psutil', 'tqdm', 'matplotlib', 'transformers'))\n"
        "print(lab)\n"
    )
    # the lab is installed, and reachable through its plugin: not loading it is a choice
    import importlib.metadata

    plugins = importlib.metadata.entry_points(group="lowdiff.plugins")
    assert "lowdiff_lab.plugin:register" in [ep.value for ep in plugins]
    env = {k: v for k, v in os.environ.items() if k != atomic.HOOKS_ENV}  # the suite's faults
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=100, check=True,
        env=env,
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_library_requires_only_what_it_uses_at_run_time() -> None:
    """The required dependencies are those the library imports (the lab's come with the
    ``lab`` extra)."""
    import tomllib

    project = tomllib.loads((SRC.parent / "pyproject.toml").read_text())["project"]
    required = {d.split(">")[0].split("<")[0].split("=")[0].strip() for d in project["dependencies"]}
    imported: set[str] = set()
    for m, p in MODULES.items():
        if not m.startswith("lowdiff.") and m != "lowdiff":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {"torch", "safetensors", "xxhash", "numpy"}
    assert required == third_party
    assert third_party <= imported
    for lab_dep in ("psutil", "tqdm", "matplotlib"):
        assert lab_dep not in imported, f"the library imports {lab_dep}, a lab dependency"
    assert {"psutil", "tqdm"} <= {
        d.split(">")[0].strip() for d in project["optional-dependencies"]["lab"]
    }
