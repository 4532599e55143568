"""TorchRec lookups that build the dynamic kernel for ``customized_kernel`` groups
(every other kernel is TorchRec's own)."""

from typing import Optional

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv

from dynamicemb.shard.kernel import DynamicEmbEmbedding, DynamicEmbEmbeddingBag

__all__ = ["DynamicEmbGroupedEmbeddingsLookup", "DynamicEmbGroupedPooledEmbeddingsLookup"]

_CUSTOMIZED = EmbeddingComputeKernel.CUSTOMIZED_KERNEL


class DynamicEmbGroupedEmbeddingsLookup(GroupedEmbeddingsLookup):
    """Sequence lookup: dynamic groups get ``DynamicEmbEmbedding``."""

    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup],
                                 device: Optional[torch.device], env: Optional[ShardingEnv] = None):
        if config.compute_kernel == _CUSTOMIZED:
            return DynamicEmbEmbedding(config, pg, device)
        return super()._create_embedding_kernel(config, pg, device, env)


class DynamicEmbGroupedPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """Pooled lookup: dynamic groups get ``DynamicEmbEmbeddingBag``."""

    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, device: Optional[torch.device],
                                 pg: Optional[dist.ProcessGroup], sharding_type, env=None):
        if config.compute_kernel == _CUSTOMIZED:
            return DynamicEmbEmbeddingBag(config, pg, device, sharding_type)
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)
