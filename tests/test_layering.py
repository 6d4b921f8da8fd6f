"""The dependency direction of the house plan: kernels <- hybrid (layers, model, caches, engine) <- eval,
recipes; persistence above the model; the CLI imports eval only inside the sub-commands that use it."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path, *, top_level_only: bool) -> set[str]:
    """Module names a file imports (relative imports resolved against the ``hybrid`` package layout)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            names.add(("." * node.level) + (node.module or ""))
            names.update(("." * node.level) + (node.module + "." if node.module else "") + a.name for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


PERSISTENCE = ("checkpoint", "interop", "pretrained", "eval", "recipes")


def test_the_model_does_not_import_its_persistence():
    for f in ("hybrid/model.py", "hybrid/layers/attention.py", "hybrid/layers/mamba2.py", "hybrid/layers/mamba1.py"):
        mods = imported_modules(ROOT / f, top_level_only=f == "hybrid/model.py")
        bad = {m for m in mods if any(x in m for x in PERSISTENCE)}
        assert not bad, f"{f} imports {bad}"
    # HybridLM.save_pretrained / from_pretrained (transformers' names) import hybrid.pretrained when called, and
    # nothing else in the model does
    tree = ast.parse((ROOT / "hybrid/model.py").read_text())
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        mods = {("." * n.level) + (n.module or "") for n in ast.walk(fn) if isinstance(n, ast.ImportFrom)}
        bad = {m for m in mods if any(x in m for x in PERSISTENCE)}
        assert not bad or (fn.name in ("save_pretrained", "from_pretrained") and bad == {".pretrained"}), fn.name


def test_kernels_import_nothing_of_the_library():
    for f in (ROOT / "kernels").glob("*.py"):
        mods = imported_modules(f, top_level_only=False)
        assert not {m for m in mods if m.startswith("..") or m.startswith("hybrid")}, f


def absolute(name: str, package: str) -> str:
    """``..eval.x`` in package ``hybrid.cli`` -> ``hybrid.eval.x``."""
    level = len(name) - len(name.lstrip("."))
    if not level:
        return name
    base = package.split(".")[: len(package.split(".")) - level + 1]
    return ".".join(base + ([name[level:]] if name[level:] else []))


def test_the_cli_imports_eval_only_inside_sub_commands():
    files = sorted((ROOT / "hybrid/cli").glob("*.py"))
    assert len(files) >= 9, "hybrid/cli/ holds one module per sub-command"
    for f in files:
        mods = {absolute(m, "hybrid.cli") for m in imported_modules(f, top_level_only=True)}
        assert not {m for m in mods if m.startswith("hybrid.eval") or m.startswith("lm_eval")}, f
        tree = ast.parse(f.read_text())
        for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("build_parser",
                                                                                        "add_parser")):
            mods = {absolute("." * n.level + (n.module or ""), "hybrid.cli") for n in ast.walk(fn)
                    if isinstance(n, ast.ImportFrom)}
            assert not {m for m in mods if m.startswith("hybrid.eval")}, f"{f.name}: building the parser imports eval"


def imported_modules_of(fn: ast.FunctionDef) -> set[str]:
    return {n.module or "" for n in ast.walk(fn) if isinstance(n, ast.ImportFrom)}


def test_no_module_is_named_after_the_function_it_exports():
    import hybrid
    from hybrid import kernels

    assert callable(hybrid.generate) and callable(kernels.selective_scan)
    assert not (ROOT / "hybrid/generate.py").exists() and not (ROOT / "kernels/selective_scan.py").exists()


def test_import_hybrid_then_recipes_works_in_a_fresh_interpreter():
    code = "import hybrid; cfg = hybrid.recipes.get('llama-tiny'); print(cfg.pattern); import sys; " \
           "print('hybrid.eval' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["*-*-*-*-", "False"]  # and eval (lm-eval, matplotlib) was not pulled in
