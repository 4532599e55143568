"""Row-wise sharding of dynamic tables (EC and EBC): ids routed by ``owner_rank`` of
their table's ``dist_type``, raw; static row-wise tables of the same module keep
TorchRec's block routing."""

from typing import List, Optional

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType

from dynamicemb.planner.types import table_options
from dynamicemb.shard.input_dist import DynamicEmbRwSparseFeaturesDist
from dynamicemb.types import DynamicEmbDistType
from dynamicemb.shard.lookup import DynamicEmbGroupedEmbeddingsLookup, DynamicEmbGroupedPooledEmbeddingsLookup

__all__ = ["DynamicEmbRwPooledEmbeddingSharding", "DynamicEmbRwSequenceEmbeddingSharding"]


def feature_dist_types(sharding) -> List[Optional[DynamicEmbDistType]]:
    """Per feature of a sharding (in its KJT order): its table's ``dist_type`` if the
    table is dynamic, else None."""
    dist_types: List[Optional[DynamicEmbDistType]] = []
    for table in sharding.embedding_tables():
        dist_type = None
        if table.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            dist_type = table_options(table).dist_type
        dist_types.extend([dist_type] * table.num_features())
    return dist_types


def _input_dist(sharding, device: Optional[torch.device], is_sequence: bool, need_pos: bool):
    return DynamicEmbRwSparseFeaturesDist(
        feature_dist_types(sharding),
        sharding._get_feature_hash_sizes(),
        pg=sharding._pg,
        num_features=sharding._get_num_features(),
        device=device if device is not None else sharding._device,
        is_sequence=is_sequence,
        has_feature_processor=sharding._has_feature_processor,
        need_pos=need_pos,
    )


class DynamicEmbRwSequenceEmbeddingSharding(RwSequenceEmbeddingSharding):
    """Row-wise EmbeddingCollection sharding with dynamic tables."""

    def create_input_dist(self, device: Optional[torch.device] = None):
        return _input_dist(self, device, is_sequence=True, need_pos=False)

    def create_lookup(self, device: Optional[torch.device] = None, fused_params=None, feature_processor=None):
        return DynamicEmbGroupedEmbeddingsLookup(
            self._grouped_embedding_configs, pg=self._pg,
            device=device if device is not None else self._device, env=self._env)


class DynamicEmbRwPooledEmbeddingSharding(RwPooledEmbeddingSharding):
    """Row-wise EmbeddingBagCollection sharding with dynamic tables: each rank pools
    the ids it owns, TorchRec reduce-scatters the partial sums."""

    def create_input_dist(self, device: Optional[torch.device] = None):
        return _input_dist(self, device, is_sequence=False, need_pos=self._need_pos)

    def create_lookup(self, device: Optional[torch.device] = None, fused_params=None, feature_processor=None):
        return DynamicEmbGroupedPooledEmbeddingsLookup(
            self._grouped_embedding_configs, device=device if device is not None else self._device,
            pg=self._pg, feature_processor=feature_processor,
            sharding_type=ShardingType.ROW_WISE, env=self._env)
