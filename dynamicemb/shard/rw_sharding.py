"""Row-wise sharding of dynamic tables (EC and EBC): ids routed by ``owner_rank`` of
their table's ``dist_type`` and placement file, raw; static row-wise tables of the same module keep
TorchRec's block routing."""

from typing import List, Optional

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingType

from dynamicemb.planner.types import table_options
from dynamicemb.placement import table_placement
from dynamicemb.shard.input_dist import DynamicEmbRwSparseFeaturesDist, FeatureRoute
from dynamicemb.shard.lookup import DynamicEmbGroupedEmbeddingsLookup, DynamicEmbGroupedPooledEmbeddingsLookup
from dynamicemb.shard.replicas import (
    DynamicEmbRwReplicaLookup,
    DynamicEmbRwReplicaSequenceEmbeddingDist,
    DynamicEmbRwReplicaSparseFeaturesDist,
    replica_set_of,
)
from dynamicemb.shard.stale_replicas import attach_copies

__all__ = ["DynamicEmbRwPooledEmbeddingSharding", "DynamicEmbRwSequenceEmbeddingSharding"]


def feature_routes(sharding) -> List[Optional[FeatureRoute]]:
    """Per feature of a sharding (in its KJT order): its table's ``dist_type`` and
    placement (``FeatureRoute``) if the table is dynamic, else None."""
    routes: List[Optional[FeatureRoute]] = []
    world_size = sharding._world_size
    for table in sharding.embedding_tables():
        route = None
        if table.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
            options = table_options(table)
            route = FeatureRoute(options.dist_type,
                                 table_placement(options.placement, table.name, world_size))
        routes.extend([route] * table.num_features())
    return routes


def _input_dist(sharding, device: Optional[torch.device], is_sequence: bool, need_pos: bool,
                replicas=None):
    kind, first = ((DynamicEmbRwSparseFeaturesDist, ()) if replicas is None
                   else (DynamicEmbRwReplicaSparseFeaturesDist, (replicas,)))
    return kind(
        *first,
        feature_routes(sharding),
        sharding._get_feature_hash_sizes(),
        pg=sharding._pg,
        num_features=sharding._get_num_features(),
        device=device if device is not None else sharding._device,
        is_sequence=is_sequence,
        has_feature_processor=sharding._has_feature_processor,
        need_pos=need_pos,
    )


class DynamicEmbRwSequenceEmbeddingSharding(RwSequenceEmbeddingSharding):
    """Row-wise EmbeddingCollection sharding with dynamic tables; ``self.replicas`` (None
    without) serves the replicated ids of tables with ``replicas`` > 0."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.replicas = replica_set_of(self)

    def create_input_dist(self, device: Optional[torch.device] = None):
        return _input_dist(self, device, is_sequence=True, need_pos=False, replicas=self.replicas)

    def create_lookup(self, device: Optional[torch.device] = None, fused_params=None, feature_processor=None):
        device = device if device is not None else self._device
        if self.replicas is not None:
            dim = self.embedding_tables()[0].embedding_dim
            lookup = DynamicEmbRwReplicaLookup(
                self._grouped_embedding_configs, pg=self._pg, device=device, env=self._env,
                replicas=self.replicas, dim=dim)
            attach_copies(self.replicas, lookup, dim)
            return lookup
        return DynamicEmbGroupedEmbeddingsLookup(
            self._grouped_embedding_configs, pg=self._pg, device=device, env=self._env)

    def create_output_dist(self, device: Optional[torch.device] = None):
        if self.replicas is None:
            return super().create_output_dist(device)
        return DynamicEmbRwReplicaSequenceEmbeddingDist(
            self._pg, self._get_num_features(), device if device is not None else self._device,
            qcomm_codecs_registry=self.qcomm_codecs_registry)


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
