"""No import circle among the eval suite's modules or the benchmark scripts: the import graph (every
``import`` / ``from ... import`` of a module in the same folder, at any depth of the file, read with ``ast``)
has no cycle."""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path, package: str, names: set[str]) -> set[str]:
    """The sibling modules of ``path`` (within ``names``) that it imports, relatively or by full name."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 1:
                mods = [base] if base else [a.name for a in node.names]
            elif node.level == 0 and base.startswith(package + "."):
                mods = [base[len(package) + 1:]]
            elif node.level == 0 and base == package:
                mods = [a.name for a in node.names]
            else:
                continue
        elif isinstance(node, ast.Import):
            mods = [a.name[len(package) + 1:] for a in node.names if a.name.startswith(package + ".")]
        else:
            continue
        out |= {m.split(".")[0] for m in mods} & names
    return out


def graph(folder: Path, package: str) -> dict[str, set[str]]:
    files = {p.stem: p for p in folder.glob("*.py")}
    names = set(files) | {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    return {name: _imports(path, package, names) - {name} for name, path in files.items()}


def cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``g`` as a path of names (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(g):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_the_checker_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("folder, package", [("eval", "hybrid.eval"), ("benchmarks", "benchmarks")])
def test_no_import_circle(folder, package):
    g = graph(REPO / folder, package)
    assert g, folder
    assert cycle(g) is None, f"import circle in {folder}/: {' -> '.join(cycle(g))}"
    if folder == "eval":  # the report draws the plot; the plot reads members, never the report
        assert "tradeoff_report" not in g["tradeoff_plot"] and "tradeoff_members" in g["tradeoff_plot"]
