"""Members of upstream's ``BatchedDynamicEmbeddingTablesV2`` that its tests and tools read
(``tables``, ``cache``, ``incremental_dump``, ``_admission_counter``), over this package's
module (``docs/MIGRATING.md``); upstream's storage and cache internals are not reproduced."""

from typing import Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist

from dynamicemb.storage.layouts import Cache, Placement
from dynamicemb.ops.interface import COMPOUND_COUNT_SHIFT, COMPOUND_TIME_MASK
from dynamicemb.types import DynamicEmbScoreStrategy

__all__ = ["CacheView", "DynamicEmbStorage", "HybridStorage", "StorageView", "admission_counter",
           "cache_view", "incremental_dump", "storage_view", "upstream_scores"]

#: Rows per chunk of upstream's exports (its ``BATCH_SIZE_PER_DUMP``).
BATCH_SIZE_PER_DUMP = 65536


def upstream_scores(scores: torch.Tensor, strategy: DynamicEmbScoreStrategy) -> torch.Tensor:
    """``scores`` (n,) int64 in upstream's layout: unchanged, except ``LRU_LFU`` (one word
    here, count above clock) as upstream's (n, 2) int64 ``[timestamp, frequency]``."""
    if strategy != DynamicEmbScoreStrategy.LRU_LFU:
        return scores
    return torch.stack([scores & COMPOUND_TIME_MASK, scores >> COMPOUND_COUNT_SHIFT], dim=1)


class StorageView:
    """``module.tables``: upstream's storage export over ``module``'s tables."""

    def __init__(self, module) -> None:
        self._module = module

    def export_keys_values(self, device: Optional[torch.device] = None,
                           batch_size: int = BATCH_SIZE_PER_DUMP, table_id: int = 0
                           ) -> Iterator[Tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor]]:
        """Upstream's chunked export of table ``table_id`` (its index in
        ``module.table_names``), at most ``batch_size`` rows per chunk, on ``device``
        (default the module's); device caches are flushed first.

        Yields:
            ``(keys (n,) int64, embeddings (n, dim) in the table's dtype, optimizer_states
            (n, state_dim) float32, scores)``, scores in upstream's layout (``upstream_scores``).

        Raises:
            ValueError: ``table_id`` out of range or ``batch_size`` < 1.
        """
        names = self._module.table_names
        if not 0 <= int(table_id) < len(names):
            raise ValueError(f"table_id must be in [0, {len(names)}) (tables {names}), "
                             f"got {table_id}")
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        name = names[int(table_id)]
        strategy = self._module.table_options[int(table_id)].score_strategy
        device = torch.device(device) if device is not None else self._module.device
        self._module.flush()
        size = int(batch_size)
        for chunk in self._module.iter_keys_values(name):  # chunks of slots scanned
            for start in range(0, chunk.keys.numel(), size):
                part = slice(start, start + size)
                yield (chunk.keys[part].to(device), chunk.embeddings[part].to(device),
                       chunk.optimizer_states[part].to(device),
                       upstream_scores(chunk.scores[part], strategy).to(device))

    def size(self, table_id: int = 0) -> int:
        """Rows stored in one table (upstream's ``size``)."""
        return self._module.table_size(self._module.table_names[int(table_id)])


class DynamicEmbStorage(StorageView):
    """``module.tables`` when each row lives in one store (device, host, or a store under a
    device cache), as upstream's ``DynamicEmbStorage``."""


class HybridStorage(StorageView):
    """``module.tables`` when an uncached table's device budget is smaller than its rows
    (the rest in host memory, no promotion), as upstream's ``HybridStorage``."""


class CacheView:
    """``module.cache``: ``cache_metrics`` is upstream's ``[unique keys, hits]`` (int64) of
    the cached ``tables`` since the previous read."""

    def __init__(self, module, tables: List[str]) -> None:
        self._module, self._tables = module, tables
        self._read = self._totals()

    def _totals(self) -> Tuple[int, int]:
        metrics = self._module.cache_metrics()
        return (sum(metrics[n].lookups for n in self._tables),
                sum(metrics[n].hits for n in self._tables))

    @property
    def cache_metrics(self) -> torch.Tensor:
        totals = self._totals()
        delta = [now - before for now, before in zip(totals, self._read)]
        self._read = totals
        return torch.tensor(delta, dtype=torch.int64)


def storage_view(module) -> StorageView:
    """``module.tables``: a ``HybridStorage`` when a table splits rows between device and
    host memory without a cache, else a ``DynamicEmbStorage``."""
    split = any(isinstance(g.layout, Placement) for g in module._groups)
    return (HybridStorage if split else DynamicEmbStorage)(module)


def cache_view(module) -> Optional[CacheView]:
    """``module.cache``: one ``CacheView`` per module of its cached tables, None when none
    is cached."""
    cached = [n for n in module.table_names
              if isinstance(module._location(n)[0].layout, Cache)]
    if not cached:
        return None
    view = module.__dict__.get("_upstream_cache_view")
    if view is None:
        view = module.__dict__["_upstream_cache_view"] = CacheView(module, cached)
    return view


def admission_counter(groups):
    """The one admission ``Counter`` of ``groups``, or None without admission.

    Raises:
        AttributeError: the tables are in groups with counters of their own.
    """
    counters = {id(g.admission.counter): g.admission.counter
                for g in groups if g.admission is not None}
    if len(counters) > 1:
        raise AttributeError(
            "this module's tables count admissions in several counters (one per table "
            "group), not in upstream's one _admission_counter: use "
            "export_admission_counters(table_name)")
    return next(iter(counters.values()), None)


def incremental_dump(module, named_thresholds: Union[int, Mapping[str, int], None] = None,
                     pg: Optional[dist.ProcessGroup] = None
                     ) -> Tuple[Dict[str, Tuple[torch.Tensor, torch.Tensor]], Dict[str, int]]:
    """Upstream's module-level incremental dump: each named table's rows scoring at least
    its threshold (the last access for LRU / STEP / the compound, the registered score for
    CUSTOMIZED), and the thresholds to pass next time (``get_score()``).

    Args:
        named_thresholds: ``{table: threshold}`` (tables not named are skipped), one
            threshold for every table, or None (0: every row).
        pg: with a process group, gathers the rows of every rank of it (a collective).

    Returns:
        ``(rows, next_thresholds)``: ``rows[table] = (keys (n,) int64, embeddings
        (n, dim) in the table's dtype)`` on the CPU.

    Raises:
        ValueError: an unknown table, or one whose scores do not order rows by time
            (LFU, NO_EVICTION); nothing is dumped.
    """
    names = module.table_names
    if named_thresholds is None or not isinstance(named_thresholds, Mapping):
        named_thresholds = {n: int(named_thresholds or 0) for n in names}
    unknown = sorted(set(named_thresholds) - set(names))
    if unknown:
        raise ValueError(f"no tables {unknown} in this module (tables {names})")
    next_scores = {n: module.next_score(n) for n in named_thresholds}
    module.flush()
    rows: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
    for name, threshold in named_thresholds.items():
        chunks = list(module.iter_keys_values(name, min_score=int(threshold)))
        rows[name] = (torch.cat([c.keys for c in chunks]).cpu(),
                      torch.cat([c.embeddings for c in chunks]).cpu())
    if pg is not None:
        gathered = [None] * dist.get_world_size(pg)  # every rank's, in rank order
        dist.all_gather_object(gathered, (rows, next_scores), group=pg)
        rows = {n: (torch.cat([g[0][n][0] for g in gathered]),
                    torch.cat([g[0][n][1] for g in gathered])) for n in rows}
        next_scores = {n: min(g[1][n] for g in gathered) for n in next_scores}
    return rows, next_scores
