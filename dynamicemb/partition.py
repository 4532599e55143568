"""Graph-partitioned placement of ids (HET-GMP): a METIS (``pymetis``) partition of the
bipartite sample-id graph puts each id on the rank whose samples use it most, so that with
samples routed to their ids' ranks (``route_samples``) most lookups stay local. Every vertex
weighs 1; with several nodes the partition runs over the nodes first, then over each node's
ranks, so the costly inter-node cut is minimized first.

Example::

    result = partition_ids(sparse, ["t_a", "t_b"], PartitionConfig(world_size=2))
    write_placement("placement.npz", 2, result.placements)
"""

import time
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from dynamicemb.placement import owner_rank

__all__ = ["BipartiteGraph", "PartitionConfig", "PartitionResult", "bipartite_graph", "partition_ids",
           "route_samples"]

#: HET-GMP's costs of a cut edge: between two ranks of one node, and between nodes.
INTRA_NODE_COST = 0.1
INTER_NODE_COST = 1.0


@dataclass
class PartitionConfig:
    """What ``partition_ids`` does.

    Attributes:
        world_size: ranks to place ids on.
        ranks_per_node: ranks of one node; None: all on one node.
        min_count: ids seen fewer times in the sample stay on their hash owner.
        max_ids: keep at most this many ids, the most frequent (None: all).
        seed: METIS's random seed.
        imbalance: METIS's ``ufactor``: a part may weigh (1 + imbalance/1000) x the average.
        replicas: the ids replicas will serve, kept out of the graph on their hash owner: a
            fraction in (0, 1) of each table's ids in the sample or a count per table (>= 1),
            the most frequent; 0: none. Match ``DynamicEmbTableOptions.replicas``.
    """

    world_size: int
    ranks_per_node: Optional[int] = None
    min_count: int = 2
    max_ids: Optional[int] = None
    seed: int = 0
    imbalance: int = 30
    replicas: float = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.ranks_per_node is None:
            self.ranks_per_node = self.world_size
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"ranks_per_node ({self.ranks_per_node}) must divide world_size "
                             f"({self.world_size})")
        if self.min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {self.min_count}")
        if self.max_ids is not None and self.max_ids < 1:
            raise ValueError(f"max_ids must be >= 1 or None, got {self.max_ids}")
        if self.imbalance < 1:
            raise ValueError(f"imbalance must be >= 1 (METIS ufactor), got {self.imbalance}")
        if not (self.replicas == 0 or 0 < self.replicas < 1
                or (self.replicas >= 1 and self.replicas == int(self.replicas))):
            raise ValueError(f"replicas must be 0, a fraction in (0, 1) or a whole count >= 1, "
                             f"got {self.replicas}")

    def replicated_count(self, ids: int) -> int:
        """Replicated ids among a table's ``ids`` distinct ones (the table option's rounding)."""
        if self.replicas >= 1:
            return min(ids, int(self.replicas))
        return int(round(self.replicas * ids))

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node


@dataclass
class PartitionResult:
    """A partition of a sample's ids (and samples) over the ranks.

    Attributes:
        placements: ``{table: (ids (n,) int64, ranks (n,) int64)}`` for ``write_placement``.
        replicated: ``{table: (m,) int64 sorted ids}`` left out for replicas.
        sample_ranks: (S,) int64, the rank of each sample.
        stats: sizes, times and the cut: ``local_fraction`` (lookups of placed ids on their
            sample's rank) and ``cost`` (topology-weighted cut per lookup), against ``hash_*``
            (ids on their hash owner, sample ``i`` on rank ``i % W``) and ``placement_only_*``.
    """

    placements: Dict[str, Tuple[np.ndarray, np.ndarray]]
    replicated: Dict[str, np.ndarray]
    sample_ranks: np.ndarray
    stats: Dict[str, float] = field(default_factory=dict)


class BipartiteGraph(NamedTuple):
    """The sample-id graph of ``bipartite_graph``: METIS's CSR ``xadj``, ``adjncy`` (int64,
    both directions), (n,) int64 ``vertex_table`` and ``vertex_id`` of each kept id vertex,
    and ``replicated``: per table index, the (m,) int64 sorted ids left out for replicas."""

    xadj: np.ndarray
    adjncy: np.ndarray
    vertex_table: np.ndarray
    vertex_id: np.ndarray
    replicated: Dict[int, np.ndarray]


def bipartite_graph(sparse: np.ndarray, column_table: np.ndarray, config: PartitionConfig,
                    empty_id: Optional[int] = None) -> BipartiteGraph:
    """The sample-id graph of (S, F) int64 ``sparse`` ids with (F,) int64 ``column_table`` (table
    index per feature): vertices ``[0, S)`` are the samples, ``S + j`` the kept ``(table, id)``
    pairs (by ``config``'s ``replicas``, ``min_count``, ``max_ids``; never ``empty_id``), one
    edge per sample and distinct id."""
    samples = sparse.shape[0]
    column_table = np.asarray(column_table, np.int64)
    vertex_table, vertex_id, edge_sample, edge_vertex, kept = [], [], [], [], 0
    vertex_replicated: List[np.ndarray] = []  # per table: whether replicas serve the id
    replicated: Dict[int, np.ndarray] = {}
    for table in np.unique(column_table):  # one 1-D unique per table: (table, id) pairs
        ids = sparse[:, column_table == table]
        owner = np.broadcast_to(np.arange(samples, dtype=np.int64)[:, None], ids.shape).reshape(-1)
        ids = ids.reshape(-1)
        valid = ids != empty_id if empty_id is not None else np.ones(ids.shape, bool)
        unique, inverse, counts = np.unique(ids[valid], return_inverse=True, return_counts=True)
        hot = np.zeros(len(unique), bool)
        hot[np.argsort(-counts, kind="stable")[:config.replicated_count(len(unique))]] = True
        vertex_replicated.append(hot)
        replicated[int(table)] = unique[hot]
        vertex_table.append(np.full(len(unique), table, np.int64))
        vertex_id.append(unique)
        edge_sample.append(owner[valid])
        edge_vertex.append(inverse.reshape(-1) + kept)
        kept += len(unique)
    counts_all = np.bincount(np.concatenate(edge_vertex), minlength=kept) if kept else np.zeros(0, np.int64)
    keep = counts_all >= config.min_count
    if kept:  # replicated ids are local to every sample: out of the graph
        keep &= ~np.concatenate(vertex_replicated)
    if config.max_ids is not None and keep.sum() > config.max_ids:
        chosen = np.argsort(-np.where(keep, counts_all, -1), kind="stable")[:config.max_ids]
        keep = np.zeros_like(keep)
        keep[chosen] = True
    vertex = np.full(kept, -1, np.int64)
    vertex[keep] = np.arange(int(keep.sum()))
    edge_id = vertex[np.concatenate(edge_vertex)] if kept else np.zeros(0, np.int64)
    mine = edge_id >= 0
    ids_kept = int(keep.sum())
    # distinct (sample, id) edges, one int64 each: sample * ids + id
    code = np.sort(np.concatenate(edge_sample)[mine] * max(1, ids_kept) + edge_id[mine])
    code = code[np.concatenate([[True], code[1:] != code[:-1]])] if len(code) else code
    first, second = code // max(1, ids_kept), code % max(1, ids_kept) + samples
    total = samples + ids_kept
    source = np.concatenate([first, second])
    target = np.concatenate([second, first])
    order = np.argsort(source, kind="stable")
    xadj = np.zeros(total + 1, np.int64)
    np.cumsum(np.bincount(source, minlength=total), out=xadj[1:])
    tables = np.concatenate(vertex_table) if vertex_table else np.zeros(0, np.int64)
    ids_all = np.concatenate(vertex_id) if vertex_id else np.zeros(0, np.int64)
    return BipartiteGraph(xadj, target[order], tables[keep], ids_all[keep], replicated)


def _metis(xadj: np.ndarray, adjncy: np.ndarray, parts: int, config: PartitionConfig) -> np.ndarray:
    """METIS's k-way partition of a CSR graph into ``parts`` (int64 part per vertex)."""
    if parts == 1 or len(xadj) <= 1:
        return np.zeros(len(xadj) - 1, np.int64)
    try:
        import pymetis  # imported here: only the partition tool needs it
    except ImportError as err:
        raise ImportError(f"partitioning needs METIS's Python binding ({err}): "
                          "pip install 'dynamicemb[partition]' (or pymetis)") from err

    options = pymetis.Options()
    options.seed = config.seed
    options.ufactor = config.imbalance
    graph = pymetis.CSRAdjacency(adj_starts=xadj, adjacent=adjncy)
    return np.asarray(pymetis.part_graph(parts, graph, options=options).vertex_part, np.int64)


def _subgraph(xadj: np.ndarray, adjncy: np.ndarray, chosen: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """The CSR graph induced by the vertices ``chosen`` (sorted int64), renumbered."""
    renumber = np.full(len(xadj) - 1, -1, np.int64)
    renumber[chosen] = np.arange(len(chosen))
    degree = np.diff(xadj)
    source = np.repeat(np.arange(len(degree)), degree)
    keep = (renumber[source] >= 0) & (renumber[adjncy] >= 0)
    sub_source, sub_target = renumber[source[keep]], renumber[adjncy[keep]]
    sub_xadj = np.zeros(len(chosen) + 1, np.int64)
    np.cumsum(np.bincount(sub_source, minlength=len(chosen)), out=sub_xadj[1:])
    return sub_xadj, sub_target  # already grouped by source: the CSR order is kept


def _hierarchical(xadj: np.ndarray, adjncy: np.ndarray, config: PartitionConfig) -> np.ndarray:
    """Each vertex's rank: a partition over the nodes, then each node's over its ranks."""
    node = _metis(xadj, adjncy, config.nodes, config)
    if config.nodes == 1:
        return _metis(xadj, adjncy, config.ranks_per_node, config)
    rank = np.zeros_like(node)
    for n in range(config.nodes):
        chosen = np.flatnonzero(node == n)
        sub_xadj, sub_adjncy = _subgraph(xadj, adjncy, chosen)
        rank[chosen] = n * config.ranks_per_node + _metis(sub_xadj, sub_adjncy, config.ranks_per_node, config)
    return rank


def _cost(sample_rank: np.ndarray, id_rank: np.ndarray, config: PartitionConfig) -> Tuple[float, float]:
    """(local fraction, topology-weighted cost per lookup) of per-lookup rank pairs."""
    if len(sample_rank) == 0:
        return 1.0, 0.0
    local = sample_rank == id_rank
    same_node = sample_rank // config.ranks_per_node == id_rank // config.ranks_per_node
    cost = np.where(local, 0.0, np.where(same_node, INTRA_NODE_COST, INTER_NODE_COST))
    return float(local.mean()), float(cost.mean())


def partition_ids(sparse: np.ndarray, tables: Sequence[str], config: PartitionConfig,
                  empty_id: Optional[int] = None) -> PartitionResult:
    """Partitions a sample of training data's (S, F) int64 ``sparse`` ids (and its samples)
    over the ranks. ``tables`` names the table of each feature (features of one table share
    ids); ``empty_id`` is never placed. ``ValueError`` unless ``tables`` has one name per
    feature."""
    sparse = np.ascontiguousarray(sparse, np.int64)
    if sparse.ndim != 2 or len(tables) != sparse.shape[1]:
        raise ValueError(f"need (samples, features) ids and one table per feature, got ids of "
                         f"shape {sparse.shape} and {len(tables)} tables")
    names = list(dict.fromkeys(tables))
    table_of = np.array([names.index(t) for t in tables], np.int64)
    start = time.perf_counter()
    graph = bipartite_graph(sparse, table_of, config, empty_id)
    xadj, adjncy, vertex_table, vertex_id = graph.xadj, graph.adjncy, graph.vertex_table, graph.vertex_id
    built = time.perf_counter()
    part = _hierarchical(xadj, adjncy, config)
    done = time.perf_counter()
    samples = sparse.shape[0]
    sample_ranks, id_ranks = part[:samples], part[samples:]
    placements, replicated = {}, {}
    for t, name in enumerate(names):
        mine = vertex_table == t
        placements[name] = (vertex_id[mine], id_ranks[mine])
        replicated[name] = graph.replicated.get(t, np.zeros(0, np.int64))
    edge_sample = np.repeat(np.arange(samples), np.diff(xadj[:samples + 1]))
    edge_id_rank = part[adjncy[:xadj[samples]]]
    local, cost = _cost(sample_ranks[edge_sample], edge_id_rank, config)
    hashed = _hash_ranks(vertex_id, config.world_size)[adjncy[:xadj[samples]] - samples]
    spread = np.arange(samples, dtype=np.int64) % config.world_size
    hash_local, hash_cost = _cost(spread[edge_sample], hashed, config)
    alone_local, alone_cost = _cost(spread[edge_sample], edge_id_rank, config)
    stats = {"samples": samples, "ids_placed": int(len(vertex_id)), "edges": int(xadj[samples]),
             "graph_seconds": built - start, "partition_seconds": done - built,
             "local_fraction": local, "cost": cost, "hash_local_fraction": hash_local,
             "hash_cost": hash_cost, "placement_only_local_fraction": alone_local,
             "placement_only_cost": alone_cost, "replicas": config.replicas,
             "ids_per_rank": np.bincount(id_ranks, minlength=config.world_size).tolist(),
             "samples_per_rank": np.bincount(sample_ranks, minlength=config.world_size).tolist()}
    return PartitionResult(placements, replicated, sample_ranks, stats)


def _hash_ranks(ids: np.ndarray, world_size: int) -> np.ndarray:
    """The default (``hash``) owner of each id."""
    return owner_rank(torch.from_numpy(np.ascontiguousarray(ids, np.int64)), world_size).numpy()


def route_samples(owners: torch.Tensor, world_size: int) -> List[torch.Tensor]:
    """Splits a global batch over the ranks, the same number each, each sample preferably to
    the rank owning most of its ids; deterministic, so every rank computes the same split.

    Args:
        owners (Tensor): (S, F) int64 owner rank of each sample's ids (``owner_rank`` with the
            tables' placements), -1 for an id local to every rank (replicated); S a multiple
            of ``world_size``, else ``ValueError``.

    Returns:
        ``world_size`` (S / W,) int64 tensors of sample indices, each increasing.
    """
    samples = owners.shape[0]
    if samples % world_size:
        raise ValueError(f"{samples} samples do not split evenly over {world_size} ranks")
    per_rank = samples // world_size
    votes = torch.zeros(samples, world_size + 1, dtype=torch.int64)  # column 0: no vote
    votes.scatter_add_(1, owners.clamp(min=-1) + 1, torch.ones_like(owners))
    best = votes[:, 1:].max(1)
    # the most decided samples pick first; ties keep the sample order
    order = torch.argsort(-best.values, stable=True)
    wanted = best.indices[order]
    seat = torch.zeros(samples, dtype=torch.int64)
    for r in range(world_size):  # the place of each sample in its rank's queue
        mine = wanted == r
        seat[mine] = torch.arange(int(mine.sum()))
    rank = torch.where(seat < per_rank, wanted, -1)
    left = torch.nonzero(rank < 0).squeeze(1)
    room = torch.cat([torch.full((per_rank - int((rank == r).sum()),), r, dtype=torch.int64)
                      for r in range(world_size)])
    rank[left] = room
    chosen = torch.empty(samples, dtype=torch.int64)
    chosen[order] = rank
    return [torch.nonzero(chosen == r).squeeze(1) for r in range(world_size)]
