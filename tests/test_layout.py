"""The layout holds: no import cycle in autoshard (function-level imports included), no module over 400
lines, and the seams between stages (docs/design.md): passes import the graph ops they insert, never the
runtime that drives them; the vocabulary packages import nothing above them.

The import graph is read from the source: every ``import`` and ``from ... import`` anywhere in a module
(inside functions too), resolved to the module it names, plus what Python runs implicitly: importing
``pkg.mod`` from outside ``pkg`` runs ``pkg/__init__.py`` first. Imports under ``if TYPE_CHECKING:``
never run and are left out (they name types only). The root ``autoshard/__init__.py`` is the public
facade on top of everything: modules inside import submodules, never names from it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"autoshard": ROOT / "autoshard", "autoshard.passes": ROOT / "passes"}


def modules() -> dict[str, Path]:
    out = {}
    for package, base in SOURCES.items():
        for path in sorted(base.rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if package == "autoshard" and parts[0] == "passes":
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([package, *parts])] = path
    return out


def _type_checking_only(tree: ast.Module) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for statement in node.body for n in ast.walk(statement))
    return skipped


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The autoshard modules importing ``name`` runs, directly or through a package's ``__init__``."""

    def resolve(dotted: str) -> str:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted

    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets |= {resolve(a.name) for a in node.names if a.name.startswith("autoshard")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            if base.startswith("autoshard"):
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in known else resolve(base))
    for target in list(targets):
        parts = target.split(".")
        for i in range(2, len(parts)):
            parent = ".".join(parts[:i])
            if parent in known and not (name == parent or name.startswith(parent + ".")):
                targets.add(parent)
    return targets - {name, ""}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walker_sees_function_level_and_package_imports(tmp_path: Path) -> None:
    """The walker itself: an import inside a function counts, one under TYPE_CHECKING does not, and
    importing a submodule from outside its package runs (so depends on) the package's __init__."""
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from autoshard.program import Program\n"
        "def f():\n    from autoshard.runtime.rank import RankRuntime\n"
    )
    known = {"autoshard.x.m": source, "autoshard.runtime": Path(), "autoshard.runtime.rank": Path(),
             "autoshard.program": Path()}  # fmt: skip
    assert imports_of("autoshard.x.m", source, known) == {"autoshard.runtime.rank", "autoshard.runtime"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_autoshard_has_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 80 and "autoshard.passes.tp_rewrite" in graph and "autoshard.runtime.rank" in graph
    assert cycles(graph) == []


def test_no_module_is_longer_than_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in modules().values() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_passes_import_the_graph_ops_never_the_runtime() -> None:
    graph = import_graph()
    for name, targets in graph.items():
        if name.startswith("autoshard.passes"):
            driver = sorted(t for t in targets if t.startswith(("autoshard.runtime", "autoshard.program")))
            assert driver == [], f"{name} imports {driver}: insert a graph op (autoshard/graph_ops/) instead"


# What each package may import at run time: the stages below it (docs/design.md draws the same picture).
LAYERS = {
    "autoshard.errors": set(),
    "autoshard.ir": {"autoshard.errors"},
    "autoshard.spec": {"autoshard.errors"},
    "autoshard.distributed": {"autoshard.errors", "autoshard.ir", "autoshard.spec"},
    "autoshard.graph_ops": {"autoshard.errors", "autoshard.ir", "autoshard.spec", "autoshard.distributed"},
    "autoshard.sharding": {"autoshard.errors", "autoshard.ir"},
}


def test_the_vocabulary_packages_import_nothing_above_them() -> None:
    graph = import_graph()

    def package(module: str) -> str:
        return next((p for p in LAYERS if module == p or module.startswith(p + ".")), module)

    for name, targets in graph.items():
        allowed = LAYERS.get(package(name))
        if allowed is None:
            continue
        above = sorted(t for t in targets if package(t) != package(name) and package(t) not in allowed)
        assert above == [], f"{name} imports {above}"
