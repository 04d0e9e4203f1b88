"""The product's import graph (lnstab, lnstab.callbacks, lnstab.datamodules) has no cycle, counting imports inside
functions too: a module that needs another at call time still depends on it, and no module imports a layer above
its own (ARCHITECTURE.md's import rules)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"lnstab": ROOT / "lnstab", "lnstab.callbacks": ROOT / "callbacks",
            "lnstab.datamodules": ROOT / "datamodules"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The product modules ``name`` imports anywhere in its file (``from pkg import submodule``: the submodule)."""
    out: set[str] = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            out.update(subs if len(subs) == len(node.names) else [base, *subs])
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_product_has_no_import_cycle() -> None:
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert len(graph) > 90 and graph["lnstab.check.cli"]  # the walk found the product and its imports
    assert cycles(graph) == []


def test_a_cycle_is_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# ARCHITECTURE.md's layers, bottom up: a module imports only modules of its own layer or below. The first matching
# prefix gives a module's layer.
LAYERS = [
    ("shared", ("lnstab.errors", "lnstab.validation", "lnstab.loss", "lnstab.measures", "lnstab.formatting",
                "lnstab.rundir", "lnstab.safeload", "lnstab.parentdeath", "lnstab.distributed", "lnstab.precision",
                "lnstab.tokenizer", "lnstab.runlock", "lnstab.checkpoint", "lnstab.hub")),
    ("model", ("lnstab.gptconfig", "lnstab.placements", "lnstab.layers", "lnstab.model", "lnstab.moduleargs",
               "lnstab.hf", "lnstab.flops", "lnstab.memory")),
    ("instruments and data", ("lnstab.callbacks", "lnstab.datamodules")),
    ("training", ("lnstab.module", "lnstab.trainer", "lnstab.evaluation", "lnstab.lightning_cli", "lnstab.runconfig",
                  "lnstab.configfiles", "lnstab.runs")),
    ("commands", ("lnstab.sweep", "lnstab.report", "lnstab.check")),
    ("dispatch", ("lnstab.cli", "lnstab.__main__", "lnstab.apidoc")),
]
# The two lazy imports up a layer, on purpose (ARCHITECTURE.md): lnstab.callbacks.FinalEvaluation, and a grid's
# runs parsed by lnstab's own command line.
UPWARD = {("lnstab.callbacks", "lnstab.evaluation.callback"), ("lnstab.sweep.cli", "lnstab.cli")}


def layer(name: str) -> int:
    if name == "lnstab":
        return 0
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{name} is in no layer of ARCHITECTURE.md's import rules")


def test_no_product_module_imports_a_layer_above_its_own() -> None:
    known = modules()
    upward = {(name, target) for name, path in known.items() for target in imports(name, path, known)
              if layer(target) > layer(name)}
    assert upward == UPWARD


def test_no_test_module_imports_another() -> None:
    """What several test files share lives in tests/support (helpers) or tests/conftest.py (fixtures): a test module
    imported by another runs its module-level code twice and ties two files' edits together."""
    tests = ROOT / "tests"
    names = {p.stem for p in tests.glob("test_*.py")}
    offenders = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                       else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {t}" for t in targets
                          if t.split(".")[0] in names or t.startswith("tests.test_")]
    assert offenders == [], offenders
