"""The installed package's import graph has no cycle, and no layer imports cache policy.

The graph is read from the source (``ast``), not from ``sys.modules``, so a cycle that today's import
order happens to survive (a function-level import that runs after both modules are loaded) still counts.
Nodes are the modules of ``hybrid`` as installed (``kernels/`` -> ``hybrid.kernels``, ``eval/`` ->
``hybrid.eval``, ``recipes/`` -> ``hybrid.recipes``: pyproject's package-dir mapping). An edge is every
``import`` / ``from ... import`` statement of a module, at module level and inside functions or classes alike
(lazy imports included: they run the imported module all the same), relative imports resolved against the
importing module's package; ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg``. Importing ``a.b.c`` also runs ``a`` and ``a.b``'s ``__init__``, but those implicit edges to parent
packages are not counted (Python's own rule, and pydeps' / import-linter's: the parent is loaded first, so it
cannot close a cycle through its child's import). Imports outside the package (torch, stdlib) are not nodes.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject.toml's package-dir)
PACKAGES = {"hybrid": "hybrid", "kernels": "hybrid.kernels", "eval": "hybrid.eval", "recipes": "hybrid.recipes"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (source file, whether it is a package's ``__init__``)."""
    mods = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            mods[".".join([package, *parts])] = (path, is_pkg)
    return mods


def _imports(name: str, path: Path, is_pkg: bool, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file."""
    package = name if is_pkg else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, is_pkg, known) for name, (path, is_pkg) in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as its modules in order (first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return path[path.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_graph_is_read_from_the_package():
    g = import_graph()
    # spot checks that the resolution works: relative, parent-relative and absolute imports
    assert "hybrid.layers.registry" in g["hybrid.model"]
    assert "hybrid.kernels" in g["hybrid.layers.attention"]  # from .. import kernels
    assert "hybrid.kernels.state_tiles" in g["hybrid.kernels.kv_quant"]  # from . import state_tiles
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# The one sanctioned back edge: HybridLM.save_pretrained / from_pretrained are the ecosystem's names for
# hybrid.pretrained's functions (issue 26) and import it inside the methods, never at module level: the model does
# not depend on its persistence to load, only the two thin methods reach it.
LAZY_DELEGATION = {("hybrid.model", "hybrid.pretrained")}


def _module_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {(n.module or "") for n in tree.body if isinstance(n, ast.ImportFrom)} | \
        {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}


def test_no_import_cycle():
    graph = import_graph()
    for a, b in LAZY_DELEGATION:
        assert b.rpartition(".")[2] not in _module_level_imports(_modules()[a][0]), f"{a} imports {b} at module level"
        graph[a].discard(b)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_layer_imports_cache_policy():
    """Layers compute; the cache views decide dtype, quantisation and pruning (hybrid.cache.views)."""
    g = import_graph()
    policy = {"hybrid.cache.pruning", "hybrid.kernels.kv_quant", "hybrid.kernels.int8_state_step"}
    layers = {n: deps & policy for n, deps in g.items() if n.startswith("hybrid.layers")}
    assert len(layers) > 5
    assert {n: d for n, d in layers.items() if d} == {}


def _reach(graph: dict[str, set[str]], start: set[str], through) -> set[str]:
    """The modules ``start`` reaches along edges whose target ``through`` allows (the targets themselves included)."""
    seen, todo = set(), list(start)
    while todo:
        for m in graph[todo.pop()]:
            if m not in seen:
                seen.add(m)
                if through(m):
                    todo.append(m)
    return seen


def test_the_model_and_layers_do_not_import_the_native_library_or_the_decode_backends():
    """How a decode step runs is the decode backends' business (hybrid.decode, chosen by the model runner): the model
    and every layer neither import them nor the native library, directly or through another module of the library
    (the kernels' ops, which pick their own backend per call, are the one door they use; a layer's lower_decode is
    handed a builder, never imports one)."""
    g = import_graph()
    model_side = {n for n in g if n == "hybrid.model" or n.startswith("hybrid.layers")}
    assert len(model_side) > 8 and "hybrid.layers.attention" in model_side

    def forbidden(m: str) -> bool:
        return m == "hybrid.decode" or m.startswith(("hybrid.decode.", "hybrid.kernels.native"))

    reached = _reach(g, model_side, lambda m: not m.startswith("hybrid.kernels"))
    assert not {m for m in reached if forbidden(m)}, sorted(m for m in reached if forbidden(m))
    # the check can fail: the runner does reach both
    assert any(forbidden(m) for m in _reach(g, {"hybrid.engine.runner"}, lambda m: True))
