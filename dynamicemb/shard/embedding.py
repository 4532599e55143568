"""Sharded EmbeddingCollection with dynamic tables, and its sharder.

Dynamic tables (``customized_kernel``) are row-wise or table-wise; every other table
stays TorchRec's. With ``use_index_dedup`` each table's ids are made unique on the
sender before the all-to-all (any int64 id; no GPU op needed), and the occurrence
counts travel with them as the kernel's ``frequencies``.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Type

import torch
from torchrec.distributed.embedding import (
    EmbeddingCollectionContext,
    EmbeddingCollectionSharder,
    ShardedEmbeddingCollection,
)
from torchrec.distributed.embedding_sharding import EmbeddingSharding
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb.planner.types import CUSTOMIZED_KERNEL, DYNAMIC_SHARDING_TYPES
from dynamicemb.shard._common import DynamicKernelsMixin, check_dynamic_plan, import_dense_rows, register_missing_placeholders
from dynamicemb.shard.input_dist import DynamicEmbRwSparseFeaturesDist
from dynamicemb.shard.rw_sharding import DynamicEmbRwSequenceEmbeddingSharding
from dynamicemb.shard.tw_sharding import DynamicEmbTwSequenceEmbeddingSharding

__all__ = ["DynamicEmbeddingCollectionSharder", "IdCounters", "ShardedDynamicEmbeddingCollection"]


@dataclass
class IdCounters:
    """Ids of each table since the last ``reset()``: ``before_dedup`` counts every
    id the module was given; ``sent[table][r]`` the ids sent to rank ``r`` (after
    dedup when it is on). Row-wise and table-wise tables are counted."""

    world_size: int
    before_dedup: Dict[str, int] = field(default_factory=dict)
    sent: Dict[str, torch.Tensor] = field(default_factory=dict)

    def reset(self) -> None:
        self.before_dedup.clear()
        self.sent.clear()

    def add_sent(self, table: str, per_rank: torch.Tensor) -> None:
        total = self.sent.get(table)
        self.sent[table] = per_rank.clone() if total is None else total + per_rank

    def add_before_dedup(self, table: str, count: int) -> None:
        self.before_dedup[table] = self.before_dedup.get(table, 0) + count


def _table_spans(sharding: EmbeddingSharding) -> List[tuple]:
    """(table name, number of features) of a sharding, in its feature order."""
    return [(t.name, t.num_features()) for t in sharding.embedding_tables()]


def _dedup_features(features: KeyedJaggedTensor, spans: List[tuple]):
    """Per table (a span of features), the unique ids of all its features.

    Returns the deduplicated KJT (a table's unique ids sit in the bag of its first
    feature and sample 0; weights = occurrence counts) and ``reverse`` (N,) int64:
    the position of each original id in the deduplicated values.
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


class ShardedDynamicEmbeddingCollection(ShardedEmbeddingCollection):
    """``ShardedEmbeddingCollection`` whose ``customized_kernel`` tables are dynamic.

    Besides TorchRec's behaviour: ``id_counters`` counts ids per table and
    destination; a dense weight loaded into a dynamic table (from a non-meta
    ``EmbeddingCollection``) is imported as keys ``0..N-1``.
    """

    def __init__(self, module: EmbeddingCollection, table_name_to_parameter_sharding: Dict[str, ParameterSharding],
                 env: ShardingEnv, *args: Any, **kwargs: Any) -> None:
        check_dynamic_plan(table_name_to_parameter_sharding)
        self.id_counters = IdCounters(env.world_size)
        super().__init__(module, table_name_to_parameter_sharding, env, *args, **kwargs)

    @classmethod
    def create_embedding_sharding(cls, sharding_type: str, sharding_infos, env: ShardingEnv,
                                  device: Optional[torch.device] = None, qcomm_codecs_registry=None):
        kinds = {
            ShardingType.ROW_WISE.value: DynamicEmbRwSequenceEmbeddingSharding,
            ShardingType.TABLE_WISE.value: DynamicEmbTwSequenceEmbeddingSharding,
        }
        if sharding_type in kinds:
            return kinds[sharding_type](sharding_infos=sharding_infos, env=env, device=device,
                                        qcomm_codecs_registry=qcomm_codecs_registry)
        return super().create_embedding_sharding(sharding_type, sharding_infos, env, device, qcomm_codecs_registry)

    def reset_parameters(self) -> None:
        register_missing_placeholders(self, self.embeddings)
        super().reset_parameters()

    @staticmethod
    def _pre_load_state_dict_hook(self, state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
        for name, sharding in self.module_sharding_plan.items():
            key = f"{prefix}embeddings.{name}.weight"
            if sharding.compute_kernel != CUSTOMIZED_KERNEL or key not in state_dict:
                continue
            weight = state_dict[key]
            if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.numel() > 0:
                import_dense_rows(self, name, weight.detach())
            state_dict[key] = self.embeddings[name].weight.detach().clone()
        ShardedEmbeddingCollection._pre_load_state_dict_hook(self, state_dict, prefix, *args)

    # ------------------------------------------------------------ dedup
    def _create_hash_size_info(self, feature_names: List[str], ctx: Optional[EmbeddingCollectionContext] = None) -> None:
        # TorchRec's version builds buffers for fbgemm's jagged_unique_indices (no CPU
        # kernel, ids linearized as offset + id); we only need each table's features.
        self._table_spans = [_table_spans(s) for s in self._sharding_type_to_sharding.values()]

    def _dedup_indices(self, ctx: EmbeddingCollectionContext,
                       input_feature_splits: List[KeyedJaggedTensor]) -> List[KeyedJaggedTensor]:
        deduped = []
        for spans, features in zip(self._table_spans, input_feature_splits):
            unique, reverse = _dedup_features(features, spans)
            # every sharding appends, so ctx lists stay aligned with the shardings
            ctx.input_features.append(features)
            ctx.reverse_indices.append(reverse)
            deduped.append(unique)
        return deduped

    # ---------------------------------------------------------- counters
    def input_dist(self, ctx: EmbeddingCollectionContext, features: KeyedJaggedTensor):
        awaitable = super().input_dist(ctx, features)
        self._count_ids(ctx, features)
        return awaitable

    def _count_ids(self, ctx: EmbeddingCollectionContext, features: KeyedJaggedTensor) -> None:
        per_key = dict(zip(features.keys(), features.length_per_key()))
        world_size = self.id_counters.world_size
        shardings = zip(self._sharding_type_to_sharding.items(), self._input_dists, ctx.sharding_contexts)
        for (sharding_type, sharding), input_dist, sharding_ctx in shardings:
            if sharding_type not in DYNAMIC_SHARDING_TYPES:
                continue
            sent = sharding_ctx.features_before_input_dist.length_per_key()
            if isinstance(input_dist, DynamicEmbRwSparseFeaturesDist):
                by_rank = input_dist.last_ids_sent  # (W, F)
            else:
                by_rank = torch.zeros(world_size, len(sent), dtype=torch.int64)
                feature = 0
                for rank, names in enumerate(sharding.feature_names_per_rank()):
                    by_rank[rank, feature:feature + len(names)] = torch.tensor(sent[feature:feature + len(names)])
                    feature += len(names)
            feature = 0
            for table in sharding.embedding_tables():
                names = table.feature_names
                self.id_counters.add_sent(table.name, by_rank[:, feature:feature + len(names)].sum(1))
                self.id_counters.add_before_dedup(table.name, sum(per_key.get(f, 0) for f in names))
                feature += len(names)


class DynamicEmbeddingCollectionSharder(DynamicKernelsMixin, EmbeddingCollectionSharder):
    """``EmbeddingCollectionSharder`` that also shards dynamic tables
    (``DynamicEmbParameterSharding``, row-wise or table-wise).

    Args:
        fused_params: TorchRec's (optimizer, learning_rate, ...), shared by static
            and dynamic tables; dynamic options come from the plan, never from here.
        qcomm_codecs_registry: as TorchRec's.
        use_index_dedup: deduplicate ids per table before the all-to-all.

    Example::

        sharder = DynamicEmbeddingCollectionSharder(
            fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1})
        model = DistributedModelParallel(model, plan=plan, sharders=[sharder])
    """

    def __init__(self, fused_params: Optional[Dict[str, Any]] = None, qcomm_codecs_registry=None,
                 use_index_dedup: bool = True) -> None:
        super().__init__(fused_params, qcomm_codecs_registry, use_index_dedup)

    def shard(self, module: EmbeddingCollection, params: Dict[str, ParameterSharding], env: ShardingEnv,
              device: Optional[torch.device] = None, module_fqn: Optional[str] = None) -> ShardedDynamicEmbeddingCollection:
        return ShardedDynamicEmbeddingCollection(
            module, params, env, self.fused_params, device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=self._use_index_dedup, module_fqn=module_fqn)

    @property
    def sharded_module_type(self) -> Type[ShardedDynamicEmbeddingCollection]:
        return ShardedDynamicEmbeddingCollection
