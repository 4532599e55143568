"""TorchRec lookups that build the dynamic kernel for ``customized_kernel`` groups
(every other kernel is TorchRec's own)."""

from typing import Optional

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb.shard.kernel import DynamicEmbEmbedding, DynamicEmbEmbeddingBag

__all__ = ["DynamicEmbGroupedEmbeddingsLookup", "DynamicEmbGroupedPooledEmbeddingsLookup"]

_CUSTOMIZED = EmbeddingComputeKernel.CUSTOMIZED_KERNEL


class DynamicEmbGroupedEmbeddingsLookup(GroupedEmbeddingsLookup):
    """Sequence lookup: dynamic groups get ``DynamicEmbEmbedding``, which TorchRec's
    prefetch pipelines prefetch."""

    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup],
                                 device: Optional[torch.device], env: Optional[ShardingEnv] = None):
        if config.compute_kernel == _CUSTOMIZED:
            return DynamicEmbEmbedding(config, pg, device)
        return super()._create_embedding_kernel(config, pg, device, env)

    def prefetch(self, sparse_features: KeyedJaggedTensor,
                 forward_stream: Optional[torch.cuda.Stream] = None) -> None:
        """Prefetches the dynamic groups, and the static ones as TorchRec does."""
        for emb_op, features in zip(self._emb_modules, sparse_features.split(self._feature_splits)):
            if isinstance(emb_op, DynamicEmbEmbedding):
                emb_op.prefetch(features, forward_stream)
            elif self._need_prefetch and hasattr(emb_op.emb_module, "prefetch"):
                emb_op.emb_module.prefetch(indices=features.values(), offsets=features.offsets(),
                                           forward_stream=forward_stream)


class DynamicEmbGroupedPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):
    """Pooled lookup: dynamic groups get ``DynamicEmbEmbeddingBag``, which TorchRec's
    prefetch pipelines prefetch."""

    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, device: Optional[torch.device],
                                 pg: Optional[dist.ProcessGroup], sharding_type, env=None):
        if config.compute_kernel == _CUSTOMIZED:
            return DynamicEmbEmbeddingBag(config, pg, device, sharding_type)
        return super()._create_embedding_kernel(config, device, pg, sharding_type, env)

    def prefetch(self, sparse_features: KeyedJaggedTensor,
                 forward_stream: Optional[torch.cuda.Stream] = None) -> None:
        """Prefetches the dynamic groups; TorchRec prefetches the static ones (it skips
        ``customized_kernel`` groups)."""
        for emb_op, features in zip(self._emb_modules, sparse_features.split(self._feature_splits)):
            if isinstance(emb_op, DynamicEmbEmbeddingBag):
                emb_op.prefetch(features, forward_stream)
        super().prefetch(sparse_features, forward_stream)
