"""Table-wise sharding of dynamic tables (EC and EBC): TorchRec's routing by
feature, the dynamic kernel on the owning rank."""

from typing import Optional

import torch
from torchrec.distributed.sharding.tw_sequence_sharding import TwSequenceEmbeddingSharding
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding

from dynamicemb.shard.lookup import DynamicEmbGroupedEmbeddingsLookup, DynamicEmbGroupedPooledEmbeddingsLookup

__all__ = ["DynamicEmbTwPooledEmbeddingSharding", "DynamicEmbTwSequenceEmbeddingSharding"]


class DynamicEmbTwSequenceEmbeddingSharding(TwSequenceEmbeddingSharding):
    """Table-wise EmbeddingCollection sharding with dynamic tables."""

    def create_lookup(self, device: Optional[torch.device] = None, fused_params=None, feature_processor=None):
        return DynamicEmbGroupedEmbeddingsLookup(
            self._grouped_embedding_configs, pg=self._pg,
            device=device if device is not None else self._device, env=self._env)


class DynamicEmbTwPooledEmbeddingSharding(TwPooledEmbeddingSharding):
    """Table-wise EmbeddingBagCollection sharding with dynamic tables."""

    def create_lookup(self, device: Optional[torch.device] = None, fused_params=None, feature_processor=None):
        return DynamicEmbGroupedPooledEmbeddingsLookup(
            self._grouped_embedding_configs, device=device if device is not None else self._device,
            pg=self._pg, feature_processor=feature_processor, env=self._env)
