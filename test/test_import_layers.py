"""The package's import graph keeps its layers (docs/ARCHITECTURE.md, "Layers").

Every module under ``dynamicemb/`` is parsed (``ast``; imports inside functions
count too, as they run all the same) and each import of a ``dynamicemb`` module
becomes an edge to the most specific module it names. Two rules:

- no circle between modules (a lazy import that only dodges an import error is a
  circle all the same);
- no import runs up a layer: each top-level part of the package (``ops``,
  ``table``, ``options``, ...) sits in one layer of ``LAYERS``, and may import only
  its own layer and those below it.

The import of a package is an edge to its ``__init__``, never to the parents a
submodule's import also runs (every module would reach ``dynamicemb/__init__``).
"""

import ast
import pathlib
from typing import Dict, List, Set, Tuple

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "dynamicemb"

#: Bottom up; each entry: (layer, the top-level parts of ``dynamicemb`` in it).
LAYERS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    # read by every layer; imports nothing above (kvstore: the external stores'
    # interface, specs and drivers, importing nothing of dynamicemb)
    ("configuration", ("_upstream", "types", "placement", "options", "kvstore")),
    ("backend seam", ("ops",)),
    ("hash table", ("table", "sizing")),
    ("storage", ("storage",)),
    ("module", ("optimizer", "embedding")),
    ("checkpoint", ("checkpoint", "lifetime", "clean_exit")),
    ("serving", ("inference",)),
    ("TorchRec", ("_torchrec", "planner", "plan", "shard", "partition")),
    # upstream's module paths (thin re-exports of compat/, which holds their code) and
    # the package's public names
    ("upstream paths", ("__init__", "compat", "batched_dynamicemb_tables", "construct_twin_module",
                        "dump_load", "dynamicemb_config", "embedding_admission",
                        "exportable_tables", "extendable_tensor", "get_planner",
                        "incremental_dump", "index_range_meta", "key_value_table",
                        "lookup_meta", "scored_hashtable", "utils")),
)

#: Imports that still run up a layer, each with why; the test fails when one is
#: gone too, so that this list only shrinks.
KNOWN_UPWARD: Dict[Tuple[str, str], str] = {}


def _modules() -> Dict[str, pathlib.Path]:
    """Dotted name -> file, for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(name: str, source: str, is_package: bool, modules: Dict[str, pathlib.Path]
             ) -> Set[Tuple[str, int]]:
    """(imported module, line) for every import of a package module in ``source``, the
    text of module ``name`` (``is_package``: an ``__init__.py``)."""
    found = set()
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([base] if base else []))
            # ``from a import b``: the submodule a.b if there is one, else a
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                     for alias in node.names]
        else:
            continue
        for target in names:
            while target and target not in modules:  # ``import a.b.c`` of a name in a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add((target, node.lineno))
    return found


def _graph() -> Dict[str, Set[Tuple[str, int]]]:
    modules = _modules()
    return {name: _imports(name, path.read_text(), path.name == "__init__.py", modules)
            for name, path in modules.items()}


def _part(module: str) -> str:
    """The top-level part of the package a module belongs to (``__init__``: the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _layer_of() -> Dict[str, int]:
    return {part: rank for rank, (_, parts) in enumerate(LAYERS) for part in parts}


def _circles(graph: Dict[str, Set[Tuple[str, int]]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    circles: List[List[str]] = []

    def visit(node: str) -> None:  # the package is a few hundred modules: recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target, _ in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_every_part_has_a_layer():
    layer_of = _layer_of()
    assert len(layer_of) == sum(len(parts) for _, parts in LAYERS), "a part in two layers"
    parts = {_part(m) for m in _modules()}
    missing = sorted(parts - set(layer_of))
    assert not missing, f"parts of dynamicemb with no layer in LAYERS: {missing}"
    stale = sorted(set(layer_of) - parts)
    assert not stale, f"LAYERS names parts dynamicemb does not have: {stale}"


def test_no_import_circle():
    assert _circles(_graph()) == []


def _upward(graph: Dict[str, Set[Tuple[str, int]]]) -> Dict[Tuple[str, str], int]:
    """(module, imported module) -> line, for every import that runs up a layer."""
    layer_of = _layer_of()
    return {(source, target): line for source, targets in graph.items()
            for target, line in targets if layer_of[_part(target)] > layer_of[_part(source)]}


def test_no_import_runs_up_a_layer():
    upward = _upward(_graph())
    unknown = {edge: line for edge, line in upward.items() if edge not in KNOWN_UPWARD}
    assert not unknown, "imports that run up a layer (module -> module: line): " + "; ".join(
        f"{s} -> {t}: {line}" for (s, t), line in sorted(unknown.items()))
    gone = sorted(set(KNOWN_UPWARD) - set(upward))
    assert not gone, f"KNOWN_UPWARD lists imports that are gone (remove them): {gone}"


def _with_source(graph, name: str, extra: str):
    """``graph`` with module ``name``'s imports read from its file plus ``extra``."""
    modules = _modules()
    path = modules[name]
    changed = dict(graph)
    changed[name] = _imports(name, path.read_text() + extra, path.name == "__init__.py",
                             modules)
    return changed


def test_an_upward_import_is_refused_even_inside_a_function():
    graph = _graph()
    lazy = "\n\ndef _f():\n    from dynamicemb.shard._common import dynamic_kernels\n"
    assert ("dynamicemb.checkpoint.tables", "dynamicemb.shard._common") in _upward(
        _with_source(graph, "dynamicemb.checkpoint.tables", lazy))
    lazy = "\n\ndef _f():\n    from dynamicemb.storage.external import tier\n"
    assert ("dynamicemb.options", "dynamicemb.storage.external.tier") in _upward(
        _with_source(graph, "dynamicemb.options", lazy))
    top = "\nimport dynamicemb.storage.tiered\n"
    assert ("dynamicemb.options", "dynamicemb.storage.tiered") in _upward(
        _with_source(graph, "dynamicemb.options", top))


def test_a_lazy_circle_is_refused():
    lazy = "\n\ndef _f():\n    from dynamicemb.embedding.module import TableClocks\n"
    circles = _circles(_with_source(_graph(), "dynamicemb.embedding.state", lazy))
    assert any({"dynamicemb.embedding.module", "dynamicemb.embedding.state"} <= set(c)
               for c in circles)
    relative = "\n\ndef _f():\n    from .module import TableClocks\n"
    circles = _circles(_with_source(_graph(), "dynamicemb.embedding.state", relative))
    assert any({"dynamicemb.embedding.module", "dynamicemb.embedding.state"} <= set(c)
               for c in circles)
