"""Sharded EmbeddingCollection with dynamic tables (row-wise or table-wise; other tables stay
TorchRec's), and its sharder. With ``use_index_dedup`` each table's ids are made unique on
the sender before the all-to-all, their counts passed on as the kernel's ``frequencies``."""

from typing import Any, Dict, List, Optional, Type

import torch
from torchrec.distributed.embedding import (
    EmbeddingCollectionContext,
    EmbeddingCollectionSharder,
    ShardedEmbeddingCollection,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb.planner.types import CUSTOMIZED_KERNEL, DYNAMIC_SHARDING_TYPES
from dynamicemb.shard._common import DynamicKernelsMixin, check_dynamic_plan, import_dense_rows, register_missing_placeholders
from dynamicemb.shard.dp_sharding import DynamicEmbDpSequenceEmbeddingSharding
from dynamicemb.shard.dedup import IdCounters, count_sent_ids, dedup_features, table_spans
from dynamicemb.shard.input_dist import DynamicEmbRwSparseFeaturesDist
from dynamicemb.shard.replicas import (
    REPLICA_ATTR,
    DynamicEmbRwReplicaLookup,
    DynamicEmbRwReplicaSparseFeaturesDist,
    check_replica_plan,
)
from dynamicemb.shard.rw_sharding import DynamicEmbRwSequenceEmbeddingSharding
from dynamicemb.shard.state_dict import register_state_hooks
from dynamicemb.shard.tw_sharding import DynamicEmbTwSequenceEmbeddingSharding

__all__ = ["DynamicEmbeddingCollectionSharder", "ShardedDynamicEmbeddingCollection"]


class ShardedDynamicEmbeddingCollection(ShardedEmbeddingCollection):
    """``ShardedEmbeddingCollection`` whose ``customized_kernel`` tables are dynamic.

    ``id_counters`` counts ids per table and destination; a dense weight loaded into a dynamic
    table (from a non-meta ``EmbeddingCollection``) is imported as keys ``0..N-1``.
    """

    def __init__(self, module: EmbeddingCollection, table_name_to_parameter_sharding: Dict[str, ParameterSharding],
                 env: ShardingEnv, *args: Any, **kwargs: Any) -> None:
        check_dynamic_plan(table_name_to_parameter_sharding)
        check_replica_plan(table_name_to_parameter_sharding)
        self.id_counters = IdCounters(env.world_size)
        super().__init__(module, table_name_to_parameter_sharding, env, *args, **kwargs)
        register_state_hooks(self, "embeddings")

    @classmethod
    def create_embedding_sharding(cls, sharding_type: str, sharding_infos, env: ShardingEnv,
                                  device: Optional[torch.device] = None, qcomm_codecs_registry=None):
        kinds = {
            ShardingType.ROW_WISE.value: DynamicEmbRwSequenceEmbeddingSharding,
            ShardingType.TABLE_WISE.value: DynamicEmbTwSequenceEmbeddingSharding,
        }
        if sharding_type == ShardingType.DATA_PARALLEL.value:
            return DynamicEmbDpSequenceEmbeddingSharding(sharding_infos=sharding_infos, env=env, device=device)
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
        self._table_spans = [table_spans(s) for s in self._sharding_type_to_sharding.values()]

    def _dedup_indices(self, ctx: EmbeddingCollectionContext,
                       input_feature_splits: List[KeyedJaggedTensor]) -> List[KeyedJaggedTensor]:
        deduped = []
        for spans, features in zip(self._table_spans, input_feature_splits):
            unique, reverse = dedup_features(features, spans)
            # every sharding appends, so ctx lists stay aligned with the shardings
            ctx.input_features.append(features)
            ctx.reverse_indices.append(reverse)
            deduped.append(unique)
        return deduped

    # ---------------------------------------------------------- replicas
    def _arm_replicas(self, ctx: EmbeddingCollectionContext) -> None:
        """Hands each replica lookup its batch right before TorchRec runs it (never queued)."""
        for lookup, sharding_ctx in zip(self._lookups, ctx.sharding_contexts):
            if isinstance(lookup, DynamicEmbRwReplicaLookup):
                lookup.arm(getattr(sharding_ctx, REPLICA_ATTR))

    def _count_replicas(self, ctx: EmbeddingCollectionContext) -> None:
        for sharding_ctx in ctx.sharding_contexts:
            batch = getattr(sharding_ctx, REPLICA_ATTR, None)
            if batch is not None and batch.rows is not None:
                self.id_counters.add_replicas(batch.hot_positions.numel(), *batch.traffic)

    def compute(self, ctx: EmbeddingCollectionContext, dist_input):
        self._arm_replicas(ctx)
        out = super().compute(ctx, dist_input)
        self._count_replicas(ctx)
        return out

    def compute_and_output_dist(self, ctx: EmbeddingCollectionContext, input):
        self._arm_replicas(ctx)
        out = super().compute_and_output_dist(ctx, input)
        self._count_replicas(ctx)
        return out

    # ---------------------------------------------------------- counters
    def input_dist(self, ctx: EmbeddingCollectionContext, features: KeyedJaggedTensor):
        awaitable = super().input_dist(ctx, features)
        for input_dist, sharding_ctx in zip(self._input_dists, ctx.sharding_contexts):
            if isinstance(input_dist, DynamicEmbRwReplicaSparseFeaturesDist):
                setattr(sharding_ctx, REPLICA_ATTR, input_dist.take_batch())
        self._count_ids(ctx, features)
        return awaitable

    def _count_ids(self, ctx: EmbeddingCollectionContext, features: KeyedJaggedTensor) -> None:
        shardings = []
        for (sharding_type, sharding), input_dist, sharding_ctx in zip(
                self._sharding_type_to_sharding.items(), self._input_dists, ctx.sharding_contexts):
            if sharding_type not in DYNAMIC_SHARDING_TYPES:
                continue
            if isinstance(input_dist, DynamicEmbRwSparseFeaturesDist):
                shardings.append((sharding, input_dist.last_ids_sent))
            else:  # what was sent: the deduplicated features when dedup is on
                sent = sharding_ctx.features_before_input_dist
                shardings.append((sharding, dict(zip(sent.keys(), sent.length_per_key()))))
        count_sent_ids(self.id_counters, shardings, dict(zip(features.keys(), features.length_per_key())))


class DynamicEmbeddingCollectionSharder(DynamicKernelsMixin, EmbeddingCollectionSharder):
    """``EmbeddingCollectionSharder`` that also shards dynamic tables (row-wise or table-wise).

    Args:
        fused_params: TorchRec's (optimizer, learning_rate, ...), for static and dynamic
            tables; dynamic options come from the plan only.
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
