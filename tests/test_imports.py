"""The import graph of the packages: no cycles between files, layers that point one way, and no
private names reached across modules from the Flower adapter.

The graph is read from the source (``ast``), not from ``sys.modules``: every ``import`` and
``from ... import`` counts, at module level or inside a function (a lazy import hides a cycle
at import time but not from a reader, and it breaks as soon as someone moves it to the top).
An edge goes to the file that defines the imported name: ``from bayesfl.config import
describe`` is an edge to ``bayesfl/config.py``, ``from bayesfl.strategies import fedlog`` one
to ``bayesfl/strategies/fedlog/fedlog.py``. Parent packages are not edges (importing
``bayesfl.strategies.base`` runs ``bayesfl/strategies/__init__.py`` too, but every package
``__init__`` that re-exports its modules would otherwise be a cycle with each of them).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bayesfl", "calibration", "inference")

KNOWN_CYCLES: dict[frozenset[str], str] = {}
"""Cycles that exist and are being removed, each with its issue. The list only shrinks: a cycle
not listed fails, and so does a listed one that is gone (remove it here)."""

KNOWN_FLOWER_PRIVATE_IMPORTS: dict[tuple[str, str, str], str] = {}
"""(importer, module, private name) imports under ``bayesfl/flower/`` still to remove, each with
its issue; shrinks like `KNOWN_CYCLES`."""


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    return {_module_name(root, p): p
            for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module (a file of ours) that ``name`` names or lies in; None outside our packages."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path,
             modules: Mapping[str, Path]) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) of every import statement in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: list[tuple[str, str | None]] = []
    for node in ast.walk(tree):  # every statement, function bodies included
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, modules)
                if target:
                    found.append((target, None))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from . import x / from ..a import b
                base = package[:len(package) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:  # from bayesfl.strategies import fedlog (a module)
                    found.append((submodule, None))
                else:
                    target = _resolve(source, modules)
                    if target:
                        found.append((target, alias.name))
    return found


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """Module -> the modules (files) of ``packages`` it imports anywhere in its source."""
    modules = _modules(root, packages)
    return {m: {t for t, _ in _imports(m, p, modules)} - {m} for m, p in modules.items()}


def cycles(graph: Mapping[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


# ---- the checker itself can fail ----------------------------------------------------------
def _write(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import f\n",
        "pkg/b.py": "def f():\n    from pkg import c\n    return c\n",
        "pkg/c.py": "from . import a\n",  # relative, back to a: a -> b -> c -> a
        "pkg/d.py": "import pkg.a\n",  # imports into the cycle, not part of it
    })
    graph = import_graph(tmp_path, ["pkg"])
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.b", "pkg.c"})]


def test_an_acyclic_package_has_no_cycles(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg.a import x\nfrom pkg.b import y\n",
        "pkg/a.py": "x = 1\n",
        "pkg/b.py": "from pkg.a import x\ny = x\n",
    })
    assert cycles(import_graph(tmp_path, ["pkg"])) == []


# ---- the repository ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT, PACKAGES)


def test_no_import_cycles_between_files(graph):
    found = set(cycles(graph))
    new = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    gone = [f"{sorted(c)} ({why})" for c, why in KNOWN_CYCLES.items() if c not in found]
    assert not new, f"import cycles between files: {new}; break them (a lazy import does not)"
    assert not gone, f"fixed, remove from KNOWN_CYCLES in tests/test_imports.py: {gone}"


def test_the_layers_point_one_way(graph):
    # DESIGN.md: bayesfl -> inference, calibration; the two never import bayesfl
    upward = sorted((m, t) for m, targets in graph.items() if not m.startswith("bayesfl")
                    for t in targets if t.startswith("bayesfl"))
    assert upward == []


def test_the_settings_schema_is_below_the_cli_and_the_transports(graph):
    # one schema (bayesfl.settings) that the CLI and Flower read; they do not read each other
    assert "bayesfl.settings" in graph["bayesfl.cli"]
    assert "bayesfl.settings" in graph["bayesfl.flower.command"]
    assert "bayesfl.settings" in graph["bayesfl.flower.protocol"]
    flower = [m for m in graph if m.startswith("bayesfl.flower")]
    assert [m for m in flower if "bayesfl.cli" in graph[m]] == []
    assert not {"bayesfl.cli", *flower} & graph["bayesfl.settings"]


def test_nothing_under_flower_imports_a_private_name_of_another_module():
    modules = _modules(ROOT, PACKAGES)
    private = set()
    for module, path in modules.items():
        if not module.startswith("bayesfl.flower"):
            continue
        for target, name in _imports(module, path, modules):
            if name is not None and name.startswith("_") and target != module:
                private.add((module, target, name))
    new = sorted(private - set(KNOWN_FLOWER_PRIVATE_IMPORTS))
    gone = sorted(set(KNOWN_FLOWER_PRIVATE_IMPORTS) - private)
    assert not new, f"private names imported under bayesfl/flower: {new}; make them public"
    assert not gone, ("no longer imported, remove from KNOWN_FLOWER_PRIVATE_IMPORTS in "
                      f"tests/test_imports.py: {gone}")


def test_the_run_config_imports_no_strategy_or_calibration_module(graph):
    # the settings schema sits below the algorithms: a strategy's options are validated by the
    # registry (bayesfl.strategies.registry), not by the config that names the strategy; the
    # run steps (calibrate, conformal) are parsed from small spec modules. Checked over every
    # module config reaches, not only its own import lines: one step in between (config ->
    # bayesfl.conformal -> bayesfl.strategies.base) is how the rule was broken before.
    reached, todo = set(), ["bayesfl.config"]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in reached:
                reached.add(target)
                todo.append(target)
    found = sorted(t for t in reached
                   if t.startswith(("bayesfl.strategies", "bayesfl.calibrate"))
                   or t == "bayesfl.conformal")
    assert found == [], f"bayesfl/config.py reaches {found}: check at run start instead " \
                        "(bayesfl.engine.preflight)"
