"""Sharded EmbeddingBagCollection with dynamic tables, and its sharder.

Row-wise dynamic tables pool the ids each rank owns and TorchRec reduce-scatters the
partial sums; table-wise ones pool on the owning rank. Ids are not deduplicated
before the all-to-all (each rank's kernel deduplicates what it receives).
"""

from typing import Any, Dict, List, Optional, Type

import torch
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
    replace_placement_with_meta_device,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from dynamicemb.shard._common import DynamicKernelsMixin, check_dynamic_plan, register_missing_placeholders
from dynamicemb.shard.rw_sharding import DynamicEmbRwPooledEmbeddingSharding
from dynamicemb.shard.tw_sharding import DynamicEmbTwPooledEmbeddingSharding

__all__ = ["DynamicEmbeddingBagCollectionSharder", "ShardedDynamicEmbeddingBagCollection"]


class ShardedDynamicEmbeddingBagCollection(ShardedEmbeddingBagCollection):
    """``ShardedEmbeddingBagCollection`` whose ``customized_kernel`` tables are dynamic."""

    def __init__(self, module: EmbeddingBagCollection, table_name_to_parameter_sharding: Dict[str, ParameterSharding],
                 env: ShardingEnv, *args: Any, **kwargs: Any) -> None:
        check_dynamic_plan(table_name_to_parameter_sharding)
        super().__init__(module, table_name_to_parameter_sharding, env, *args, **kwargs)
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
            return kinds[sharding_type](sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry)
        return super().create_embedding_bag_sharding(
            sharding_infos, env, device, permute_embeddings, qcomm_codecs_registry)

    def reset_parameters(self) -> None:
        register_missing_placeholders(self, self.embedding_bags)
        super().reset_parameters()


class DynamicEmbeddingBagCollectionSharder(DynamicKernelsMixin, EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` that also shards dynamic tables
    (``DynamicEmbParameterSharding``, row-wise or table-wise). Arguments as TorchRec's."""

    def shard(self, module: EmbeddingBagCollection, params: Dict[str, ParameterSharding], env: ShardingEnv,
              device: Optional[torch.device] = None,
              module_fqn: Optional[str] = None) -> ShardedDynamicEmbeddingBagCollection:
        return ShardedDynamicEmbeddingBagCollection(
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
