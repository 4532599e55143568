"""Hot-row replicas of row-wise dynamic tables at ``replica_staleness`` 0 (s > 0:
``stale_replicas.py``); the protocol is in docs/ARCHITECTURE.md, "Hot-row replicas".

Replicated ids skip the id all-to-all; their owners send the rows to every rank and get the
gradients back, summed in rank order inside the owner's one fused backward. Replicas hold no
state between steps (checkpoints see owner rows only); with dedup, training equals training
without replicas bit for bit. Collectives run in the same order on every rank.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingDist
from torchrec.distributed.types import Awaitable, ParameterSharding
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb.checkpoint.tables import PendingUpdates
from dynamicemb.placement import owner_rank, table_placement
from dynamicemb.planner.types import CUSTOMIZED_KERNEL, table_options
from dynamicemb.shard._common import get_dynamic_tables
from dynamicemb.shard.input_dist import DynamicEmbRwSparseFeaturesDist, FeatureRoute
from dynamicemb.shard.lookup import DynamicEmbGroupedEmbeddingsLookup

__all__ = ["ReplicaBatch", "ReplicaPendingUpdates", "ReplicaSet", "check_replica_plan", "refresh_replicas",
           "replicated_ids", "serve_owned", "split_replicated", "with_replica_rows"]

# attribute of a batch's SequenceShardingContext holding its ``ReplicaBatch``
REPLICA_ATTR = "dynamicemb_replica_batch"


class ReplicatedTable(NamedTuple):
    """A table with replicas in a sharding: where its features are and its option."""

    name: str
    first_feature: int  # in the sharding's feature order
    num_features: int
    replicas: float  # DynamicEmbTableOptions.replicas
    route: FeatureRoute


@dataclass
class ReplicaBatch:
    """One batch of a sharding with replicas; the lookup sets the last three fields.

    Attributes:
        hot_positions: (h,) positions in the sent (deduplicated) values served by replicas.
        hot_slots: (h,) the replicated-id slot of each.
        cold_positions: (n - h,) positions of the values that cross the all-to-all.
        local_counts: (S,) int64 occurrences of each replicated id in this rank's batch.
        active_slots: (A,) sorted slots some rank looks up (every slot at staleness > 0).
        rows: (A, dim) the owners' rows of those slots (this rank's copies at staleness > 0).
        traffic: (counts all-reduced, rows sent by owners, gradient rows sent to owners).
    """

    hot_positions: torch.Tensor
    hot_slots: torch.Tensor
    cold_positions: torch.Tensor
    local_counts: torch.Tensor
    active_slots: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None
    traffic: Tuple[int, int, int] = (0, 0, 0)


class ReplicaSet:
    """The replicated ids of a row-wise sharding's tables, the same on every rank.

    Slots number the ids of all tables, table after table, each table's ids sorted. Empty until
    ``refresh_replicas`` (or ``set_ids``) fills it; ``stale`` holds the ``StaleCopies`` at
    staleness > 0, else None.
    """

    def __init__(self, tables: List[ReplicatedTable], pg: dist.ProcessGroup, staleness: int = 0,
                 feature_names: Optional[List[str]] = None) -> None:
        self.tables = tables
        self.pg = pg
        self.staleness = staleness
        self.feature_names = list(feature_names or [])
        self.stale: Any = None
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)
        self._ids: Dict[str, torch.Tensor] = {t.name: torch.empty(0, dtype=torch.int64) for t in tables}
        self._flatten()

    def ids_of(self, table: str) -> torch.Tensor:
        """(n,) int64 sorted replicated ids of ``table``."""
        return self._ids[table]

    def set_ids(self, table: str, ids: torch.Tensor) -> None:
        """Replaces ``table``'s replicated ids (the same ids on every rank, between steps).

        Raises:
            ValueError: an unknown table, or ids that are not a 1-D integer tensor.
        """
        if table not in self._ids:
            raise ValueError(f"table {table!r} has no replicas here (tables with replicas: "
                             f"{sorted(self._ids)})")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point():
            raise ValueError(f"replicated ids of {table!r} must be a 1-D integer tensor")
        if self.stale is not None:  # pending gradients reach the owners first
            self.stale.flush()
        self._ids[table] = torch.unique(ids.to(torch.int64).cpu())
        self._flatten()
        if self.stale is not None:
            self.stale.drop()

    def _flatten(self) -> None:
        ids = [self._ids[t.name] for t in self.tables]
        self.ids = torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64)  # (S,)
        sizes = torch.tensor([i.numel() for i in ids], dtype=torch.int64)
        self.starts = torch.zeros(len(ids) + 1, dtype=torch.int64)
        self.starts[1:] = sizes.cumsum(0)
        self.table_of_slot = torch.repeat_interleave(torch.arange(len(ids)), sizes)  # (S,)
        owners = [owner_rank(i, self.world_size, t.route.dist_type, t.route.placement)
                  for i, t in zip(ids, self.tables)]
        self.owners = torch.cat(owners) if owners else torch.empty(0, dtype=torch.int64)  # (S,)

    @property
    def num_slots(self) -> int:
        return int(self.ids.numel())


def replica_set_of(sharding) -> Optional[ReplicaSet]:
    """A ``ReplicaSet`` for a row-wise sharding with replicated dynamic tables, else None;
    ``ValueError`` if those tables differ in ``replica_staleness``."""
    tables, feature, staleness = [], 0, {}
    for table in sharding.embedding_tables():
        if table.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            options = table_options(table)
            if options.replicas:
                route = FeatureRoute(options.dist_type, table_placement(
                    options.placement, table.name, sharding._world_size))
                tables.append(ReplicatedTable(table.name, feature, table.num_features(),
                                              options.replicas, route))
                staleness[table.name] = options.replica_staleness
        feature += table.num_features()
    if len(set(staleness.values())) > 1:
        raise ValueError(f"tables with replicas in one row-wise sharding must share "
                         f"replica_staleness (their windows sync together); got {staleness}")
    if not tables:
        return None
    return ReplicaSet(tables, sharding._pg, next(iter(staleness.values())), sharding.feature_names())


def check_replica_plan(params: Mapping[str, ParameterSharding]) -> None:
    """Refuses replicas of tables that are not row-wise."""
    for name, sharding in params.items():
        options = getattr(sharding, "dynamicemb_options", None)
        if sharding.compute_kernel != CUSTOMIZED_KERNEL or options is None or not options.replicas:
            continue
        if sharding.sharding_type != "row_wise":
            raise ValueError(f"table {name!r}: replicas need row_wise sharding, the plan has "
                             f"{sharding.sharding_type!r}; set replicas=0 or shard it row-wise")


def replicated_tables(sharding) -> List[str]:
    """The dynamic tables of a sharding with ``replicas`` > 0."""
    return [t.name for t in sharding.embedding_tables()
            if t.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL and table_options(t).replicas]


# ------------------------------------------------------------------- sender
def split_replicated(features: KeyedJaggedTensor, replicas: ReplicaSet
                     ) -> Tuple[ReplicaBatch, KeyedJaggedTensor]:
    """The sender's ``ReplicaBatch`` of a sharding's (deduplicated) features, and the features
    left to cross the all-to-all (without the replicated ids)."""
    values = features.values()
    n = values.numel()
    hot = torch.zeros(n, dtype=torch.bool)
    slots = torch.zeros(n, dtype=torch.int64)
    ends = torch.tensor(features.length_per_key(), dtype=torch.int64).cumsum(0).tolist()
    for t, table in enumerate(replicas.tables):
        ids = replicas.ids_of(table.name)
        if ids.numel() == 0:
            continue
        last = table.first_feature + table.num_features - 1
        start = ends[table.first_feature - 1] if table.first_feature else 0
        v = values[start:ends[last]].to(torch.int64)
        at = torch.searchsorted(ids, v).clamp_(max=ids.numel() - 1)
        found = ids[at] == v
        hot[start:ends[last]] = found
        slots[start:ends[last]] = at + int(replicas.starts[t])
    hot_positions = torch.nonzero(hot).flatten()
    cold_positions = torch.nonzero(~hot).flatten()
    hot_slots = slots[hot_positions]
    weights = features.weights_or_none()
    occurrences = (torch.ones(hot_slots.numel(), dtype=torch.int64) if weights is None
                   else weights[hot_positions].round().to(torch.int64))
    counts = torch.zeros(replicas.num_slots, dtype=torch.int64).index_add_(0, hot_slots, occurrences)
    batch = ReplicaBatch(hot_positions, hot_slots, cold_positions, counts)
    if hot_positions.numel() == 0:
        return batch, features
    lengths = features.lengths()
    bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.to(torch.int64), output_size=n)
    cold = KeyedJaggedTensor(
        keys=features.keys(),
        values=values[cold_positions],
        lengths=torch.bincount(bag[cold_positions], minlength=lengths.numel()).to(lengths.dtype),
        weights=None if weights is None else weights[cold_positions],
        stride=features.stride(),
    )
    return batch, cold


class DynamicEmbRwReplicaSparseFeaturesDist(DynamicEmbRwSparseFeaturesDist):
    """Row-wise input dist that keeps replicated ids out of the all-to-all;
    ``take_batch()`` hands the batch's ``ReplicaBatch`` to the sharded module."""

    def __init__(self, replicas: ReplicaSet, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replicas = replicas
        self._batch: Optional[ReplicaBatch] = None

    def take_batch(self) -> ReplicaBatch:
        batch, self._batch = self._batch, None
        if batch is None:
            raise RuntimeError("replicas: no input dist ran for this batch")
        return batch

    def forward(self, sparse_features: KeyedJaggedTensor):
        self._batch, cold = split_replicated(sparse_features, self.replicas)
        return super().forward(cold)


# -------------------------------------------------------------------- owner
class _OwnerRowsToAll(torch.autograd.Function):
    """Owners' rows of the active replicated ids to every rank; backward returns the gradients."""

    @staticmethod
    def forward(ctx, owned, by_owner, sizes, pg):  # noqa: D102
        world_size = len(sizes)
        ctx.by_owner, ctx.sizes, ctx.pg = by_owner, sizes, pg
        received = owned.new_empty(sum(sizes), owned.shape[1])
        dist.all_to_all_single(received, owned.detach().repeat(world_size, 1), sizes,
                               [owned.shape[0]] * world_size, group=pg)
        rows = torch.empty_like(received)
        rows[by_owner] = received
        return rows

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        sizes = ctx.sizes
        world_size, mine = len(sizes), sizes[dist.get_rank(ctx.pg)]
        received = grad.new_empty(world_size * mine, grad.shape[1])
        dist.all_to_all_single(received, grad[ctx.by_owner].contiguous(), [mine] * world_size, sizes,
                               group=ctx.pg)
        parts = received.view(world_size, mine, grad.shape[1])
        if get_gradient_division():
            parts = parts / world_size
        total = parts[0].clone()
        for part in parts[1:]:  # rank order: the order the owner's kernel would sum them in
            total += part
        return total, None, None, None


def append_owned(features: KeyedJaggedTensor, replicas: ReplicaSet, slots: torch.Tensor,
                 counts: torch.Tensor) -> Tuple[KeyedJaggedTensor, torch.Tensor]:
    """Appends the replicated ids of ``slots`` to the last bag of their table's first feature
    (weights: ``counts``); returns the features and (k,) the appended ids' positions."""
    if slots.numel() == 0:
        return features, torch.empty(0, dtype=torch.int64)
    values = features.values()
    weights = features.weights_or_none()
    weights = torch.ones(values.numel(), dtype=torch.float32) if weights is None else weights
    lengths = features.lengths().clone()
    stride = features.stride()
    ends = torch.tensor(features.length_per_key(), dtype=torch.int64).cumsum(0).tolist()
    tables = replicas.table_of_slot[slots]
    v_parts, w_parts, positions = [], [], []
    done, shift = 0, 0
    for t, table in enumerate(replicas.tables):  # tables are in feature order
        mine = tables == t
        k = int(mine.sum())
        if k == 0:
            continue
        end = ends[table.first_feature]
        v_parts += [values[done:end], replicas.ids[slots[mine]].to(values.dtype)]
        w_parts += [weights[done:end], counts[mine].to(weights.dtype)]
        positions.append(torch.arange(end + shift, end + shift + k))
        lengths[(table.first_feature + 1) * stride - 1] += k
        done, shift = end, shift + k
    v_parts.append(values[done:])
    w_parts.append(weights[done:])
    out = KeyedJaggedTensor(keys=features.keys(), values=torch.cat(v_parts), lengths=lengths,
                            weights=torch.cat(w_parts), stride=stride)
    return out, torch.cat(positions)


def serve_owned(replicas: ReplicaSet, batch: Optional[ReplicaBatch], features: KeyedJaggedTensor,
                lookup, dim: int) -> torch.Tensor:
    """Owner side of a batch: looks up the received ids and, in the same ``lookup`` call, the
    replicated ids this rank owns that some rank uses; sets ``batch.rows`` (owners' rows in
    ``batch.active_slots`` order) on every rank. Returns (received ids, dim) rows, in order."""
    if replicas.stale is not None:  # staleness > 0: copies, no exchange
        return replicas.stale.serve(batch, features)
    if batch is None:
        raise RuntimeError("replicas: the lookup needs its batch's ReplicaBatch (run the "
                           "module through the dynamic sharded collections)")
    counts = batch.local_counts.clone()
    if counts.numel():
        dist.all_reduce(counts, group=replicas.pg)
    active = torch.nonzero(counts > 0).flatten()  # (A,) the same on every rank
    mine = torch.nonzero(replicas.owners[active] == replicas.rank).flatten()
    slots = active[mine]
    features, appended = append_owned(features, replicas, slots, counts[slots])
    rows = lookup(features).view(-1, dim)
    received = torch.ones(rows.shape[0], dtype=torch.bool)
    received[appended] = False
    batch.active_slots = active
    owned = rows[appended]
    if active.numel():
        if torch.is_grad_enabled() and not owned.requires_grad:
            owned.requires_grad_()  # every rank's graph holds the exchange's backward
        owners = replicas.owners[active]
        sizes = torch.bincount(owners, minlength=replicas.world_size).tolist()
        by_owner = torch.argsort(owners, stable=True)
        owned = _OwnerRowsToAll.apply(owned, by_owner, sizes, replicas.pg)
    batch.rows = owned
    batch.traffic = (counts.numel(), active.numel(), active.numel())
    return rows[received]


class ReplicaPendingUpdates(PendingUpdates):
    """Checkpoint hooks: flush or drop the stale replicas' pending gradients of ``_replicas``."""

    _replicas: Optional[ReplicaSet]

    def flush_pending(self) -> None:
        if self._replicas is not None and self._replicas.stale is not None:
            self._replicas.stale.flush()

    def drop_pending(self) -> None:
        if self._replicas is not None and self._replicas.stale is not None:
            self._replicas.stale.drop()


class DynamicEmbRwReplicaLookup(ReplicaPendingUpdates, DynamicEmbGroupedEmbeddingsLookup):
    """Owner side of a row-wise EC sharding with replicas (``serve_owned``)."""

    def __init__(self, *args, replicas: ReplicaSet, dim: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._replicas = replicas
        self._dim = dim
        self._armed: Optional[ReplicaBatch] = None

    def arm(self, batch: ReplicaBatch) -> None:
        """The batch the next ``forward`` serves (the sharded module sets it)."""
        self._armed = batch

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        batch, self._armed = self._armed, None
        return serve_owned(self._replicas, batch, sparse_features, super().forward, self._dim)


# ------------------------------------------------------------------- sender
class _WithReplicaRows(Awaitable[torch.Tensor]):
    """The rows of a sharding's sent values: the all-to-all's, and the replicas'."""

    def __init__(self, inner: Awaitable[torch.Tensor], batch: ReplicaBatch) -> None:
        super().__init__()
        self._inner = inner
        self._batch = batch

    def _wait_impl(self) -> torch.Tensor:
        return with_replica_rows(self._inner.wait(), self._batch)


def with_replica_rows(crossed: torch.Tensor, batch: ReplicaBatch) -> torch.Tensor:
    """The rows of every sent (deduplicated) value: ``crossed`` (n - h, dim), the all-to-all's
    rows in the order the values crossed, and the owners' rows of the replicated ones."""
    # always index the owners' rows: every rank's graph reaches the exchange
    hot = batch.rows[torch.searchsorted(batch.active_slots, batch.hot_slots)]
    n_crossed = batch.cold_positions.numel()
    order = torch.empty(n_crossed + batch.hot_positions.numel(), dtype=torch.int64)
    order[batch.cold_positions] = torch.arange(n_crossed)
    order[batch.hot_positions] = torch.arange(n_crossed, order.numel())
    return torch.cat([crossed, hot])[order]


class DynamicEmbRwReplicaSequenceEmbeddingDist(RwSequenceEmbeddingDist):
    """Row-wise sequence output dist that also returns the replicated ids' rows, in sent order."""

    def forward(self, local_embs: torch.Tensor, sharding_ctx=None) -> Awaitable[torch.Tensor]:
        batch: Optional[ReplicaBatch] = getattr(sharding_ctx, REPLICA_ATTR, None)
        if batch is None or batch.rows is None:
            raise RuntimeError("replicas: the output dist needs the batch's ReplicaBatch after its "
                               "lookup (run the module through ShardedDynamicEmbeddingCollection)")
        return _WithReplicaRows(super().forward(local_embs, sharding_ctx), batch)


# ------------------------------------------------------------------ refresh
def replica_sets(module: nn.Module) -> List[ReplicaSet]:
    """Every ``ReplicaSet`` in ``module``, in module order (the same on every rank)."""
    found = []
    for sub in module.modules():
        # the sharded EC keeps its shardings by type, the sharded EBC in a list
        shardings = getattr(sub, "_embedding_shardings", None) or list(
            (getattr(sub, "_sharding_type_to_sharding", None) or {}).values())
        found += [s.replicas for s in shardings if getattr(s, "replicas", None) is not None]
    return found


def replicated_ids(module: nn.Module) -> Dict[str, torch.Tensor]:
    """``{table name: (n,) int64 sorted replicated ids}`` of ``module`` (e.g. a
    ``DistributedModelParallel``), the same on every rank, empty before ``refresh_replicas``;
    local, no collective. A sample router can treat them as local to every rank."""
    return {t.name: replicas.ids_of(t.name) for replicas in replica_sets(module)
            for t in replicas.tables}


def _gather(t: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
    """Every rank's ``t`` (1-D, any length) concatenated in rank order."""
    size = torch.tensor([t.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(sizes, size, group=pg)
    most = max(int(s) for s in sizes)
    widest = torch.zeros(most, dtype=t.dtype)  # every rank sends the longest length
    widest[:t.numel()] = t
    parts = [torch.zeros_like(widest) for _ in sizes]
    dist.all_gather(parts, widest, group=pg)
    return torch.cat([p[:int(s)] for p, s in zip(parts, sizes)])


def _top(keys: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` keys of highest score, ties to the smaller key."""
    by_key = torch.argsort(keys)
    by_score = torch.argsort(scores[by_key], descending=True, stable=True)
    return by_key[by_score[:k]]


def _choose(table: ReplicatedTable, stored_here, pg: dist.ProcessGroup) -> torch.Tensor:
    """A table's replicated ids: the top scores of all owners' local tops (collectives)."""
    rows = stored_here.export_keys_values(table.name)
    keys, scores = rows.keys.cpu(), rows.scores.cpu().to(torch.int64)
    count = table.replicas
    if isinstance(count, float):
        stored = torch.tensor([keys.numel()], dtype=torch.int64)
        dist.all_reduce(stored, group=pg)
        count = int(round(count * int(stored)))
    local = _top(keys, scores, count)
    all_keys, all_scores = _gather(keys[local], pg), _gather(scores[local], pg)
    return all_keys[_top(all_keys, all_scores, count)]


def _broadcast(ids: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
    """Rank 0's ids on every rank."""
    size = torch.tensor([ids.numel()], dtype=torch.int64)
    dist.broadcast(size, src=dist.get_global_rank(pg, 0), group=pg)
    out = ids.to(torch.int64).cpu().contiguous() if dist.get_rank(pg) == 0 else torch.zeros(
        int(size), dtype=torch.int64)
    dist.broadcast(out, src=dist.get_global_rank(pg, 0), group=pg)
    return out


def refresh_replicas(module: nn.Module, ids: Optional[Mapping[str, torch.Tensor]] = None
                     ) -> Dict[str, int]:
    """Chooses the replicated ids of every table with ``replicas`` > 0 in ``module``.

    A collective: call it on every rank at the same point between steps. Each table gets the
    ids of highest score over its owners (``replicas`` of them, or that fraction of its stored
    rows; ties to the smaller id), or rank 0's ``ids`` for the tables that names. At staleness 0
    this changes only what crosses the all-to-all; at staleness > 0 it flushes first.

    Args:
        module: a ``DistributedModelParallel`` or anything holding sharded collections.
        ids: ``{table name: (n,) int64}`` replicated ids to use (rank 0's count).

    Returns:
        ``{table name: number of replicated ids}``. ``ValueError`` (before any change or
        collective) if ``ids`` names a table without replicas or holds non 1-D integer ids.
    """
    sets = replica_sets(module)
    names = {t.name for s in sets for t in s.tables}
    unknown = sorted(set(ids or {}) - names)
    if unknown:
        raise ValueError(f"refresh_replicas: tables {unknown} have no replicas (tables with "
                         f"replicas: {sorted(names)})")
    for name, given in (ids or {}).items():
        if not isinstance(given, torch.Tensor) or given.dim() != 1 or given.is_floating_point() \
                or given.dtype == torch.bool:
            raise ValueError(f"refresh_replicas: the ids of {name!r} must be a 1-D integer tensor")
    for replicas in sets:  # stale replicas' pending gradients reach the owners first
        if replicas.stale is not None:
            replicas.stale.flush()
    stored_here = None
    chosen: Dict[str, int] = {}
    for replicas in sets:
        for table in replicas.tables:
            if ids is not None and table.name in ids:
                hot = _broadcast(ids[table.name], replicas.pg)
            else:
                if stored_here is None:
                    stored_here = get_dynamic_tables(module)
                hot = _choose(table, stored_here[table.name], replicas.pg)
            replicas.set_ids(table.name, hot)
            chosen[table.name] = int(replicas.ids_of(table.name).numel())
    return chosen
