"""Upstream's ``dynamicemb.incremental_dump``: ``get_score``, ``set_score`` and an
``incremental_dump`` keyed by collection path: ``"model"`` for the model itself, else
``"model."`` and its module path with DMP/DDP unwrapped (``"model.embedding_module"``).
"""

from typing import Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from dynamicemb.checkpoint._collective import Collective
from dynamicemb.checkpoint.incremental import incremental_dump as _dump_by_table
from dynamicemb.checkpoint.tables import local_tables, unwrap
from dynamicemb.embedding import BatchedDynamicEmbeddingTables
from dynamicemb.types import DynamicEmbScoreStrategy

__all__ = ["get_score", "incremental_dump", "set_score"]

Rows = Tuple[torch.Tensor, torch.Tensor]


def collection_tables(model: nn.Module) -> Dict[str, List[str]]:
    """Collection path -> the dynamic tables it holds on this rank."""
    tables = local_tables(model)
    by_module: Dict[int, List[str]] = {}
    for name, table in tables.items():
        by_module.setdefault(id(table.module), []).append(name)
    out: Dict[str, List[str]] = {}
    for path, module in unwrap(model).named_modules():
        names: List[str] = []
        if isinstance(module, BatchedDynamicEmbeddingTables):
            names = by_module.get(id(module), [])
        for lookup in getattr(module, "_lookups", None) or ():  # sharded collections
            for sub in lookup.modules():
                emb = getattr(sub, "emb_module", None)
                if isinstance(emb, BatchedDynamicEmbeddingTables):
                    names += by_module.get(id(emb), [])
        if names:
            out["model" + ("." + path if path else "")] = sorted(set(names))
    return out


def _paths(model: nn.Module, group: Collective) -> Dict[str, List[str]]:
    """``collection_tables`` merged over the ranks."""
    merged: Dict[str, set] = {}
    for per_rank in group.all_gather(collection_tables(model)):
        for path, names in per_rank.items():
            merged.setdefault(path, set()).update(names)
    return {path: sorted(names) for path, names in merged.items()}


def get_score(model: nn.Module, pg: Optional[dist.ProcessGroup] = None
              ) -> Dict[str, Dict[str, int]]:
    """Per collection path and table, the score the next training batch gives (the
    smallest over ranks; CUSTOMIZED: ``set_score``'s), for ``incremental_dump``. A
    collective over ``pg``; ``CheckpointError`` on every rank for LFU or NO_EVICTION."""
    group = Collective(pg)
    tables = local_tables(model)
    local: Dict[str, int] = {}
    error = None
    try:
        local = {name: table.module.next_score(name) for name, table in tables.items()}
    except ValueError as err:
        error = f"rank {group.rank}: {err}"
    group.agree(error)
    scores: Dict[str, int] = {}
    for per_rank in group.all_gather(local):
        for name, score in per_rank.items():
            scores[name] = min(scores.get(name, score), score)
    return {path: {name: scores[name] for name in names}
            for path, names in _paths(model, group).items()}


def _flat_thresholds(score_threshold: Mapping[str, Mapping[str, int]],
                     paths: Mapping[str, List[str]]) -> Dict[str, int]:
    flat: Dict[str, int] = {}
    for path, per_table in score_threshold.items():
        if path not in paths:
            raise ValueError(f"no collection {path!r} with dynamic tables in the model "
                             f"(paths: {sorted(paths)})")
        unknown = sorted(set(per_table) - set(paths[path]))
        if unknown:
            raise ValueError(f"collection {path!r} has no dynamic tables {unknown}")
        flat.update({name: int(t) for name, t in per_table.items()})
    return flat


def incremental_dump(
    model: nn.Module,
    score_threshold: Union[int, Mapping[str, Mapping[str, int]]],
    pg: Optional[dist.ProcessGroup] = None,
) -> Tuple[Dict[str, Dict[str, Rows]], Dict[str, Dict[str, int]]]:
    """``dynamicemb.incremental_dump`` by collection path and table (upstream's shape).

    Args:
        model, pg: as ``dynamicemb.incremental_dump``'s.
        score_threshold: one threshold for every table, or ``{path: {table: threshold}}``
            (``get_score``'s shape) naming the tables to dump.

    Returns:
        ``(rows, next_threshold)``: ``rows[path][table] = (keys (n,) int64,
        embeddings (n, dim) float32)`` of every rank, ``next_threshold[path][table]``.

    Raises:
        CheckpointError: on every rank, for a path or table the model does not have, or
            scores that do not order rows by time.
    """
    group = Collective(pg)
    paths = _paths(model, group)
    threshold: Union[int, Dict[str, int]] = 0
    error = None
    try:
        threshold = (_flat_thresholds(score_threshold, paths)
                     if isinstance(score_threshold, Mapping) else int(score_threshold))
    except ValueError as err:
        error = f"rank {group.rank}: {err}"
    group.agree(error)
    rows, next_threshold = _dump_by_table(model, threshold, pg)
    nested_rows = {path: {n: rows[n] for n in names if n in rows} for path, names in paths.items()}
    nested_next = {path: {n: next_threshold[n] for n in names if n in next_threshold}
                   for path, names in paths.items()}
    return ({p: r for p, r in nested_rows.items() if r},
            {p: t for p, t in nested_next.items() if t})


def set_score(model: nn.Module, table_score: Union[int, Mapping[str, Mapping[str, int]]]) -> None:
    """Registers the score the next training batches give the rows they touch in
    CUSTOMIZED tables. Local to this rank: call it on every rank.

    Args:
        model: a sharded or unsharded model with dynamic tables.
        table_score: one score for every dynamic table on this rank, or
            ``{collection: {table: score}}``, a collection named by its path
            (``"model.embedding_module"``) or its attribute name (``"embedding_module"``).

    Raises:
        ValueError: an unknown collection or table, a table not CUSTOMIZED, or a
            negative score (nothing is set).
    """
    tables = local_tables(model)
    if isinstance(table_score, Mapping):
        paths = collection_tables(model)
        by_name = {path.rpartition(".")[2]: path for path in paths}
        flat: Dict[str, int] = {}
        for collection, per_table in table_score.items():
            path = collection if collection in paths else by_name.get(collection)
            if path is None:
                raise ValueError(f"no collection {collection!r} with dynamic tables on this rank "
                                 f"(paths: {sorted(paths)})")
            unknown = sorted(set(per_table) - set(paths[path]))
            if unknown:
                raise ValueError(f"collection {collection!r} has no dynamic tables {unknown} on "
                                 f"this rank")
            flat.update({name: int(score) for name, score in per_table.items()})
    else:
        flat = {name: int(table_score) for name in tables}
    by_module: Dict[int, Tuple[BatchedDynamicEmbeddingTables, Dict[str, int]]] = {}
    for name, score in flat.items():
        module = tables[name].module
        by_module.setdefault(id(module), (module, {}))[1][name] = score
    for module, scores in by_module.values():  # check every table before setting any
        for name in scores:
            if module.table_options[module.table_names.index(name)].score_strategy != \
                    DynamicEmbScoreStrategy.CUSTOMIZED:
                raise ValueError(f"table {name!r} does not use the CUSTOMIZED score strategy "
                                 f"(set_score registers CUSTOMIZED scores)")
    for module, scores in by_module.values():
        module.set_score(scores)
