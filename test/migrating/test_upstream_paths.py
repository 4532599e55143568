"""Upstream's module paths at the package root are thin re-exports of
``dynamicemb.compat`` (docs/ARCHITECTURE.md, "Upstream module paths"), and the texts
that refuse upstream's names say what is accepted today."""

import ast
import importlib
import pathlib
import re

import pytest
import torch

import dynamicemb
from dynamicemb import BatchedDynamicEmbeddingTables, DynamicEmbScoreStrategy, DynamicEmbTableOptions
from dynamicemb._upstream import REFUSED, REFUSED_MODULES

PACKAGE = pathlib.Path(dynamicemb.__file__).parent
#: Every module of ``dynamicemb/compat`` is the code of the root path of its name.
COMPAT = sorted(p.stem for p in (PACKAGE / "compat").glob("*.py") if p.stem != "__init__")


def _thin_problems(name: str, package: pathlib.Path = PACKAGE) -> list:
    """What in ``<package>/<name>.py`` is more than a docstring naming its compat module,
    imports from it, and ``__all__``."""
    tree = ast.parse((package / f"{name}.py").read_text())
    problems = []
    doc = ast.get_docstring(tree) or ""
    if f"dynamicemb.compat.{name}" not in doc:
        problems.append(f"the docstring does not name dynamicemb.compat.{name}")
    for node in tree.body[1:] if doc else tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == f"dynamicemb.compat.{name}":
            continue
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == \
                ["__all__"]:
            continue
        problems.append(f"line {node.lineno}: {ast.dump(node)[:60]}")
    return problems


def test_the_compat_modules_are_the_upstream_paths():
    assert {"dump_load", "incremental_dump", "get_planner", "exportable_tables"} <= set(COMPAT)


@pytest.mark.parametrize("name", COMPAT)
def test_a_root_path_only_reexports_its_compat_module(name):
    assert _thin_problems(name) == []
    root = importlib.import_module(f"dynamicemb.{name}")
    code = importlib.import_module(f"dynamicemb.compat.{name}")
    assert sorted(root.__all__) == sorted(code.__all__)
    for attribute in code.__all__:
        assert getattr(root, attribute) is getattr(code, attribute), attribute
    namespace = {}
    exec(f"from dynamicemb.{name} import *", namespace)  # noqa: S102 - the star import itself
    assert set(namespace) - {"__builtins__"} == set(code.__all__)
    # the refusals of upstream's names not provided: the compat module's, under the root path
    if "__getattr__" in vars(code):
        assert root.__getattr__ is code.__getattr__
        with pytest.raises(AttributeError, match=rf"'dynamicemb\.{name}' has no attribute"):
            getattr(root, "no_such_name")


def test_the_thinness_check_can_fail(tmp_path):
    """A root path with code of its own, or importing from elsewhere, is caught."""
    thin = (PACKAGE / "dump_load.py").read_text()
    (tmp_path / "dump_load.py").write_text(thin + "\nLIMIT = 3\n")
    assert any("Assign" in p for p in _thin_problems("dump_load", tmp_path))
    (tmp_path / "dump_load.py").write_text(thin + "\nfrom dynamicemb.checkpoint import tables\n")
    assert any("ImportFrom" in p for p in _thin_problems("dump_load", tmp_path))


# ------------------------------------------------------------- refusal texts today
#: A clause saying external storage or compound scores are refused (texts once did).
_DENIED = re.compile(r"(external|compound)[^;:.()]*\b(refused|not supported|unsupported|"
                     r"do(es)? not exist|no longer)", re.IGNORECASE)


def _texts():
    return {**{f"name {n}": t for n, t in REFUSED.items()},
            **{f"module {n}": t for n, t in REFUSED_MODULES.items()}}


def test_no_refusal_text_denies_external_storage_or_compound_scores():
    denied = {k: t for k, t in _texts().items() if _DENIED.search(t)}
    assert denied == {}
    # the pattern catches the texts this package once had
    assert _DENIED.search("the storage and cache interfaces do not exist here "
                          "(external_storage is refused)")
    assert _DENIED.search("score_strategy is one DynamicEmbScoreStrategy (compound tuples are "
                          "refused)")


def test_refusal_texts_name_what_the_options_accept(tmp_path):
    """Every text that names external storage names the forms the options take; the
    one naming upstream's compound names LRU_LFU. A module with both trains and sends
    rows down to RocksDB."""
    external = {k: t for k, t in _texts().items() if "external_storage" in t}
    assert {"name Storage", "name OptionsT", "name Cache"} <= set(external)
    for text in external.values():
        for form in ("directory path", "redis://", "redis+cluster://", "RocksDBStorage",
                     "RedisStorage", "RedisClusterStorage", "KVStore"):
            assert form in text
    compound = [t for t in _texts().values() if "compound" in t]
    assert compound and all("(TIMESTAMP, LFU)" in t and "LRU_LFU" in t for t in compound)

    assert isinstance(DynamicEmbTableOptions(dim=4, max_capacity=64,
                                             external_storage="redis://h:1").external_storage,
                      dynamicemb.RedisStorage)
    assert isinstance(DynamicEmbTableOptions(dim=4, max_capacity=64,
                                             external_storage="redis+cluster://h:1,h:2"
                                             ).external_storage, dynamicemb.RedisClusterStorage)
    row_bytes = 8 * 4  # dim 4 + SGD's no state, rounded: the host store holds 32 rows or fewer
    options = DynamicEmbTableOptions(dim=4, max_capacity=1024, bucket_capacity=16,
                                     score_strategy=(0, 3), external_storage=str(tmp_path / "db"),
                                     local_host_for_values=32 * row_bytes)
    assert options.score_strategy == DynamicEmbScoreStrategy.LRU_LFU
    assert isinstance(options.external_storage, dynamicemb.RocksDBStorage)
    module = BatchedDynamicEmbeddingTables([options], learning_rate=0.1)
    for step in range(6):
        ids = torch.arange(step * 16, step * 16 + 16)
        module(ids, torch.arange(0, 17, 4)).sum().backward()
    assert module.table_size("t0") == 96
    assert module.cache_metrics()["t0"].external_writes > 0
