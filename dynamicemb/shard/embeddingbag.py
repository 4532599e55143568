"""Sharded EmbeddingBagCollection with dynamic tables, and its sharder. With
``use_index_dedup``, row-wise shardings whose tables are all dynamic with one dim take the
dedup path (``rw_dedup_sharding``); other row-wise shardings pool on the owners and
TorchRec reduce-scatters. Table-wise tables pool on the owning rank."""

from typing import Any, Dict, List, Optional, Type

import torch
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionContext,
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
    replace_placement_with_meta_device,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb.planner.types import DYNAMIC_SHARDING_TYPES

from dynamicemb.shard._common import DynamicKernelsMixin, check_dynamic_plan, register_missing_placeholders
from dynamicemb.shard.dedup import IdCounters, count_sent_ids
from dynamicemb.shard.input_dist import DynamicEmbRwSparseFeaturesDist
from dynamicemb.shard.rw_dedup_sharding import (
    SENT_ATTR,
    DynamicEmbRwDedupInputDist,
    DynamicEmbRwDedupLookup,
    DynamicEmbRwDedupPooledEmbeddingSharding,
    dedup_applies,
)
from dynamicemb.shard.rw_sharding import DynamicEmbRwPooledEmbeddingSharding
from dynamicemb.shard.replicas import check_replica_plan, replicated_tables
from dynamicemb.shard.state_dict import register_state_hooks
from dynamicemb.shard.tw_sharding import DynamicEmbTwPooledEmbeddingSharding

__all__ = ["DynamicEmbeddingBagCollectionSharder", "ShardedDynamicEmbeddingBagCollection"]


class ShardedDynamicEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """``ShardedEmbeddingBagCollection`` whose ``customized_kernel`` tables are dynamic.

    ``id_counters`` counts ids per dynamic table and destination. ``use_index_dedup`` is a
    class attribute (TorchRec builds shardings in a classmethod).
    """

    use_index_dedup = False

    def __init__(self, module: EmbeddingBagCollection, table_name_to_parameter_sharding: Dict[str, ParameterSharding],
                 env: ShardingEnv, *args: Any, **kwargs: Any) -> None:
        check_dynamic_plan(table_name_to_parameter_sharding)
        check_replica_plan(table_name_to_parameter_sharding)
        self.id_counters = IdCounters(env.world_size)
        super().__init__(module, table_name_to_parameter_sharding, env, *args, **kwargs)
        register_state_hooks(self, "embedding_bags")
        if self._has_mean_pooling_callback:
            # TorchRec 1.8 divides every feature outside the row-wise SUM list by its
            # length once any row-wise table uses MEAN, including table-wise MEAN
            # features that the kernel already averaged: list those as SUM.
            row_wise = {f for names in self._pooling_type_to_rs_features.values() for f in names}
            for config in self._embedding_bag_configs:
                for name in config.feature_names:
                    if name not in row_wise:
                        self._pooling_type_to_rs_features[PoolingType.SUM.value].append(name)

    @classmethod
    def create_embedding_bag_sharding(cls, sharding_infos, env: ShardingEnv, device: Optional[torch.device] = None,
                                      permute_embeddings: bool = False, qcomm_codecs_registry=None):
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        kinds = {
            ShardingType.ROW_WISE.value: DynamicEmbRwPooledEmbeddingSharding,
            ShardingType.TABLE_WISE.value: DynamicEmbTwPooledEmbeddingSharding,
        }
        if sharding_type in kinds:
            if device is not None and device.type == "meta":
                replace_placement_with_meta_device(sharding_infos)
            sharding = kinds[sharding_type](sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)
            if cls.use_index_dedup and sharding_type == ShardingType.ROW_WISE.value and dedup_applies(sharding):
                sharding = DynamicEmbRwDedupPooledEmbeddingSharding(
                    sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)
            elif replicated_tables(sharding):
                raise NotImplementedError(
                    f"tables {replicated_tables(sharding)}: replicas of EmbeddingBagCollection tables "
                    f"need the dedup path (use_index_dedup=True and a row-wise sharding whose tables "
                    f"are all dynamic with one dim); set replicas=0 for them")
            return sharding
        return super().create_embedding_bag_sharding(
            sharding_infos, env, device, permute_embeddings, qcomm_codecs_registry)

    def reset_parameters(self) -> None:
        register_missing_placeholders(self, self.embedding_bags)
        super().reset_parameters()

    # ---------------------------------------------------------- replicas
    def _arm_replicas(self, ctx: EmbeddingBagCollectionContext) -> None:
        """Hands each dedup lookup its batch's replicas right before TorchRec runs it."""
        for lookup, sharding_ctx in zip(self._lookups, ctx.sharding_contexts):
            if isinstance(lookup, DynamicEmbRwDedupLookup):
                lookup.arm(getattr(sharding_ctx, SENT_ATTR).replicas)

    def _count_replicas(self, ctx: EmbeddingBagCollectionContext) -> None:
        for sharding_ctx in ctx.sharding_contexts:
            sent = getattr(sharding_ctx, SENT_ATTR, None)
            batch = None if sent is None else sent.replicas
            if batch is not None and batch.rows is not None:
                self.id_counters.add_replicas(batch.hot_positions.numel(), *batch.traffic)

    def compute(self, ctx: EmbeddingBagCollectionContext, dist_input):
        self._arm_replicas(ctx)
        out = super().compute(ctx, dist_input)
        self._count_replicas(ctx)
        return out

    def compute_and_output_dist(self, ctx: EmbeddingBagCollectionContext, input):
        self._arm_replicas(ctx)
        out = super().compute_and_output_dist(ctx, input)
        self._count_replicas(ctx)
        return out

    def input_dist(self, ctx: EmbeddingBagCollectionContext, features: KeyedJaggedTensor):
        awaitable = super().input_dist(ctx, features)
        given = dict(zip(features.keys(), features.length_per_key()))
        shardings = []
        for sharding_type, sharding, input_dist, sharding_ctx in zip(
                self._sharding_types, self._embedding_shardings, self._input_dists, ctx.sharding_contexts):
            if isinstance(input_dist, DynamicEmbRwDedupInputDist):
                setattr(sharding_ctx, SENT_ATTR, input_dist.take_sent())
            if sharding_type in DYNAMIC_SHARDING_TYPES:
                routed = isinstance(input_dist, (DynamicEmbRwSparseFeaturesDist, DynamicEmbRwDedupInputDist))
                shardings.append((sharding, input_dist.last_ids_sent if routed else given))
        count_sent_ids(self.id_counters, shardings, given)
        return awaitable


class _DedupShardedDynamicEmbeddingBagCollection(ShardedDynamicEmbeddingBagCollection):
    use_index_dedup = True


class DynamicEmbeddingBagCollectionSharder(DynamicKernelsMixin, EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` that also shards dynamic tables (row-wise or table-wise).

    Args:
        *args, **kwargs: TorchRec's (``fused_params``, ``qcomm_codecs_registry``, ...).
        use_index_dedup: deduplicate row-wise dynamic ids per table before the all-to-all
            (False keeps TorchRec's pool-then-reduce-scatter).
    """

    def __init__(self, *args: Any, use_index_dedup: bool = True, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._use_index_dedup = use_index_dedup

    def shard(self, module: EmbeddingBagCollection, params: Dict[str, ParameterSharding], env: ShardingEnv,
              device: Optional[torch.device] = None,
              module_fqn: Optional[str] = None) -> ShardedDynamicEmbeddingBagCollection:
        cls = (_DedupShardedDynamicEmbeddingBagCollection if self._use_index_dedup
               else ShardedDynamicEmbeddingBagCollection)
        return cls(
            module=module, table_name_to_parameter_sharding=params, env=env,
            fused_params=self.fused_params, device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry, module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite)

    def sharding_types(self, compute_device_type: str) -> List[str]:
        # TorchRec offers row_wise for EBC only on CUDA; dynamic tables need it everywhere.
        types = super().sharding_types(compute_device_type)
        return types if ShardingType.ROW_WISE.value in types else types + [ShardingType.ROW_WISE.value]

    @property
    def sharded_module_type(self) -> Type[ShardedDynamicEmbeddingBagCollection]:
        return ShardedDynamicEmbeddingBagCollection
