"""Id dedup before the all-to-all and id counters (sharded EC and EBC): a table's ids are
made unique over its features and samples on the sender, their occurrence counts travel as
KJT weights (the owner's ``frequencies``) and the inverse index restores the outputs."""

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Tuple, Union

import torch
from torchrec.distributed.embedding_sharding import EmbeddingSharding
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["IdCounters", "count_sent_ids", "dedup_features", "table_spans"]


@dataclass
class IdCounters:
    """Ids of each table since the last ``reset()`` (row-wise and table-wise dynamic tables).

    ``before_dedup[table]``: the ids the module was given; ``sent[table][r]``: those sent to
    rank ``r`` (after dedup when on). With replicas: ``replicated`` ids served from replicas
    instead of sent, ``replica_slots`` replicated ids whose counts were all-reduced,
    ``replica_rows`` rows owners sent to every other rank (staleness 0: the rows in use, each
    step; s > 0: every replicated row, each sync) and ``replica_grads`` gradient rows sent back
    to the owners."""

    world_size: int
    before_dedup: Dict[str, int] = field(default_factory=dict)
    sent: Dict[str, torch.Tensor] = field(default_factory=dict)
    replicated: int = 0
    replica_slots: int = 0
    replica_rows: int = 0
    replica_grads: int = 0

    def reset(self) -> None:
        self.before_dedup.clear()
        self.sent.clear()
        self.replicated = self.replica_slots = self.replica_rows = self.replica_grads = 0

    def add_replicas(self, replicated: int, slots: int, rows: int, grads: int) -> None:
        self.replicated += replicated
        self.replica_slots += slots
        self.replica_rows += rows
        self.replica_grads += grads

    def add_sent(self, table: str, per_rank: torch.Tensor) -> None:
        total = self.sent.get(table)
        self.sent[table] = per_rank.clone() if total is None else total + per_rank

    def add_before_dedup(self, table: str, count: int) -> None:
        self.before_dedup[table] = self.before_dedup.get(table, 0) + count


def table_spans(sharding: EmbeddingSharding) -> List[Tuple[str, int]]:
    """(table name, number of features) of a sharding, in its feature order."""
    return [(t.name, t.num_features()) for t in sharding.embedding_tables()]


def dedup_features(features: KeyedJaggedTensor,
                   spans: List[Tuple[str, int]]) -> Tuple[KeyedJaggedTensor, torch.Tensor]:
    """Per table (a span of ``table_spans``), the unique ids of all its features.

    Returns:
        The deduplicated KJT (a table's unique ids in the bag of its first feature and sample
        0; weights = float32 occurrence counts) and ``reverse``, (N,) int64 position of each
        original id in the deduplicated values.
    """
    batch = features.stride()
    per_key = features.length_per_key()
    values = features.values()
    lengths = torch.zeros(len(per_key) * batch, dtype=features.lengths().dtype)
    uniques, counts, reverse = [], [], []
    feature, start, base = 0, 0, 0
    for _, num_features in spans:
        n = sum(per_key[feature:feature + num_features])
        unique, inverse, count = torch.unique(values[start:start + n], return_inverse=True, return_counts=True)
        uniques.append(unique)
        counts.append(count)
        reverse.append(inverse + base)
        lengths[feature * batch] = unique.numel()
        base += unique.numel()
        start += n
        feature += num_features
    empty = values.new_empty(0)
    deduped = KeyedJaggedTensor(
        keys=features.keys(),
        values=torch.cat(uniques) if uniques else empty,
        lengths=lengths,
        weights=torch.cat(counts).to(torch.float32) if counts else empty.float(),
        stride=batch,
    )
    return deduped, torch.cat(reverse) if reverse else empty


def count_sent_ids(counters: IdCounters,
                   shardings: Iterable[Tuple[EmbeddingSharding, Union[torch.Tensor, Mapping[str, int]]]],
                   ids_per_feature: Mapping[str, int]) -> None:
    """Adds one batch to ``counters``.

    Args:
        shardings: for each row-wise or table-wise sharding, the ids it sent: a ``(W, F)``
            tensor per destination and feature (row-wise) or ``{feature: ids}`` (table-wise).
        ids_per_feature: ids given to the module, per feature name.
    """
    world_size = counters.world_size
    for sharding, sent_ids in shardings:
        owner = ({} if isinstance(sent_ids, torch.Tensor) else
                 {name: rank for rank, names in enumerate(sharding.feature_names_per_rank()) for name in names})
        feature = 0
        for table in sharding.embedding_tables():
            names = table.feature_names
            if isinstance(sent_ids, torch.Tensor):
                sent = sent_ids[:, feature:feature + len(names)].sum(1)
            else:
                sent = torch.zeros(world_size, dtype=torch.int64)
                sent[owner[names[0]]] = sum(sent_ids.get(f, 0) for f in names)
            counters.add_sent(table.name, sent)
            counters.add_before_dedup(table.name, sum(ids_per_feature.get(f, 0) for f in names))
            feature += len(names)
