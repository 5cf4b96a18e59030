"""optkit's import graph: no cycles, and imports that only run down the floors.

Every import counts: at module level, inside functions, under ``if TYPE_CHECKING:``, and module
paths written as strings for importlib (``"optkit.a.b"`` or ``"optkit.a.b:Name"``). For cycles,
importing ``optkit.a.b`` also counts as importing the package ``optkit.a`` (Python runs its
``__init__.py`` first).
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "optkit"
ARCHITECTURE_DOC = PACKAGE.parent / "docs" / "architecture.md"

# Floors, lowest first: a module may import from its own floor or a lower one.
# A module's floor is that of the longest prefix listed. docs/architecture.md states the same floors
# (test_the_architecture_doc_states_these_floors).
LEVELS = {
    "optkit.core": 0,
    # ONNX Runtime and OpenVINO sessions, distributed helpers: they need the runtimes and torch alone.
    "optkit.runtime": 1,
    "optkit.kinds": 2,
    # Model utilities: statistics, example inputs, train/eval mode and caches, the BatchNorm folding engine.
    "optkit.model": 3,
    # The pipeline measures each pass's model with optkit.model.stats; nothing below it runs a pipeline.
    "optkit.core.pipeline": 3,
    "optkit.io": 4,
    "optkit.data": 4,
    "optkit.demo": 4,
    "optkit.analysis": 5,
    "optkit.export": 5,
    "optkit.passes": 6,
    "optkit.workflow": 7,
    "optkit.cli": 8,
    "optkit.__main__": 8,
    "optkit": 9,  # the public API re-exports (lazily) from every floor
}

# Strings that spell an optkit module but do not import it.
NOT_IMPORTS = {
    ("optkit.core.registry", "optkit.passes"): "the entry-point group plugin passes register under",
    ("optkit.kinds.registry", "optkit.kinds"): "the entry-point group plugin kinds register under",
}

_MODULE_STRING = re.compile(r"(optkit(?:\.\w+)+)(?::[\w.]+)?")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _packages(module: str) -> set[str]:
    """``optkit.a.b`` and the packages above it: ``{"optkit", "optkit.a", "optkit.a.b"}``."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)}


def _imported(name: str, is_package: bool, tree: ast.AST, modules: set[str]) -> set[str]:
    """Every optkit module that the source of ``name`` imports, wherever the import sits."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _MODULE_STRING.fullmatch(node.value)
            if match and (name, match[1]) not in NOT_IMPORTS:
                found.add(match[1])
    # A module's own packages are already being imported when it runs.
    return {target for target in found if target in modules} - _packages(name)


def imports(sources: dict[str, tuple[bool, str]]) -> dict[str, set[str]]:
    """Module -> the optkit modules it imports, from ``{module: (is_package, source)}``."""
    return {name: _imported(name, is_package, ast.parse(source), set(sources))
            for name, (is_package, source) in sources.items()}


def with_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each import also reaching the packages Python imports on the way (not the importer's own)."""
    expanded = {}
    for name, targets in graph.items():
        reached = set().union(*map(_packages, targets))
        expanded[name] = (reached & set(graph)) - _packages(name)
    return expanded


@lru_cache(maxsize=1)
def _optkit_imports() -> dict[str, frozenset[str]]:
    sources = {_module_name(p): (p.name == "__init__.py", p.read_text(encoding="utf-8")) for p in PACKAGE.rglob("*.py")}
    return {name: frozenset(targets) for name, targets in imports(sources).items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle through each group of modules that import each other, as ``[a, b, ..., a]``."""
    return sorted(_cycle_through(graph, min(group), group) for group in _strongly_connected(graph) if len(group) > 1)


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    # Tarjan's algorithm.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = set(stack[stack.index(node):])
            del stack[stack.index(node):]
            groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def _cycle_through(graph: dict[str, set[str]], start: str, group: set[str]) -> list[str]:
    # Breadth first inside the group, so the cycle shown is a shortest one.
    came_from = {start: start}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return path[::-1] + [start]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is in a group of modules importing each other but no cycle returns to it")


def level(module: str) -> int:
    """The floor of an optkit module (that of the longest prefix in ``LEVELS``)."""
    return LEVELS[max((p for p in LEVELS if p in _packages(module)), key=len)]


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """``(importer, imported)`` pairs where the imported module sits on a higher floor."""
    return {(name, target) for name, targets in graph.items() for target in targets if level(target) > level(name)}


def _lines(pairs) -> str:
    return "\n".join(f"{a} -> {b}" for a, b in sorted(pairs))


def test_no_import_cycles_among_optkit_modules():
    found = cycles(with_packages({name: set(targets) for name, targets in _optkit_imports().items()}))
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_imports_only_run_down_the_floors():
    offending = upward_imports(_optkit_imports())
    assert not offending, "imports from a higher floor:\n" + _lines(offending)


def documented_floors(text: str) -> list[set[str]]:
    """The floors a document states, lowest first, from its sentence "Imports only run down these floors, lowest
    first: `core` < `runtime`, ... < `optkit` (...)": each floor as its module names, ``optkit.`` left out."""
    chain = text.split("Imports only run down these floors, lowest first:", 1)[1].split(" (", 1)[0]
    return [set(re.findall(r"`([\w.]+)`", floor)) for floor in chain.split("<")]


def test_the_architecture_doc_states_these_floors():
    floors: dict[int, set[str]] = {}
    for module, floor in LEVELS.items():
        floors.setdefault(floor, set()).add(module.removeprefix("optkit.") if module != "optkit" else module)
    assert documented_floors(ARCHITECTURE_DOC.read_text(encoding="utf-8")) == [floors[f] for f in sorted(floors)]


def test_the_floors_sentence_is_read_floor_by_floor():
    text = "Imports only run down these floors, lowest first: `core` < `a`, `b.c` <\n`optkit` (the API). `x` < `y`"
    assert documented_floors(text) == [{"core"}, {"a", "b.c"}, {"optkit"}]


def test_every_optkit_folder_has_a_floor_of_its_own():
    # Only the public API may fall through to the top floor, which may import anything.
    assert [name for name in _optkit_imports() if level(name) == LEVELS["optkit"]] == ["optkit"]


def test_every_kind_of_import_is_counted():
    source = '''
import importlib
from typing import TYPE_CHECKING
import optkit.a.first
from optkit.a import second
if TYPE_CHECKING:
    from optkit.a.third import Name
def f():
    from optkit.a.fourth import name
    importlib.import_module("optkit.a.fifth")
LAZY = {"Name": "optkit.a.sixth:Name", "key": "optkit.not_a_module"}
'''
    modules = {f"optkit.a.{n}": (False, "") for n in ("first", "second", "third", "fourth", "fifth", "sixth")}
    graph = imports({"optkit.b": (False, source), "optkit.a": (True, ""), "optkit": (True, ""), **modules})
    assert graph["optkit.b"] == set(modules)
    assert with_packages(graph)["optkit.b"] == {"optkit.a", *modules}


def test_relative_imports_and_own_packages():
    graph = imports({"optkit": (True, ""),
                     "optkit.a": (True, "from . import b\nfrom .c import name"),
                     "optkit.a.b": (False, "from . import c\nfrom .. import a\nimport optkit"),
                     "optkit.a.c": (False, "")})
    assert graph == {"optkit": set(), "optkit.a": {"optkit.a.b", "optkit.a.c"}, "optkit.a.b": {"optkit.a.c"},
                     "optkit.a.c": set()}


def test_an_import_through_a_package_init_closes_a_cycle():
    graph = {"optkit": set(), "optkit.a": {"optkit.a.x"}, "optkit.a.x": {"optkit.b.y"}, "optkit.b": set(),
             "optkit.b.y": set(), "optkit.b.z": {"optkit.a.w"}, "optkit.a.w": set()}
    assert cycles(graph) == []
    graph["optkit.b"] = {"optkit.b.z"}
    assert cycles(with_packages(graph)) == [["optkit.a", "optkit.a.x", "optkit.b", "optkit.b.z", "optkit.a"]]


def test_the_cycle_finder_finds_every_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d", "a"}}
    assert cycles(graph) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_floor_check_names_upward_imports():
    graph = {"optkit.core.x": {"optkit.passes.y"}, "optkit.passes.y": {"optkit.core.x", "optkit.analysis.z"},
             "optkit.analysis.z": set()}
    assert upward_imports(graph) == {("optkit.core.x", "optkit.passes.y")}
