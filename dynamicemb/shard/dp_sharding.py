"""Data-parallel EmbeddingCollection sharding with correct sequence outputs on CPU, where
FBGEMM's dense kernel ignores ``PoolingMode.NONE`` (pytorch/FBGEMM#4586): each feature is
one ``embedding`` over a view of TorchRec's flat weight, so the parameter, state dict,
initialization and DDP stay TorchRec's. Other devices keep TorchRec's kernel."""

from typing import Optional

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torchrec.distributed.batched_embedding_kernel import BatchedDenseEmbedding
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.sharding.dp_sequence_sharding import DpSequenceEmbeddingSharding
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["CpuDenseSequenceEmbedding", "DynamicEmbDpSequenceEmbeddingSharding"]


class CpuDenseSequenceEmbedding(BatchedDenseEmbedding):
    """``BatchedDenseEmbedding`` whose forward returns one row per id, (N, dim)."""

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        module = self._emb_module
        values = features.values().long()
        per_key = features.length_per_key()
        outputs, feature, start = [], 0, 0
        for t, table in enumerate(self._config.embedding_tables):
            rows, dim = module.embedding_specs[t][:2]
            offset = module.weights_physical_offsets[t]
            weight = module.weights[offset:offset + rows * dim].view(rows, dim)
            for _ in range(table.num_features()):
                n = per_key[feature]
                outputs.append(F.embedding(values[start:start + n], weight))
                start += n
                feature += 1
        return torch.cat(outputs) if outputs else module.weights.new_empty(0, module.max_D)


class _DpSequenceLookup(GroupedEmbeddingsLookup):
    def _create_embedding_kernel(self, config: GroupedEmbeddingConfig, pg: Optional[dist.ProcessGroup],
                                 device: Optional[torch.device], env: Optional[ShardingEnv] = None):
        if config.compute_kernel == EmbeddingComputeKernel.DENSE and (device is None or device.type == "cpu"):
            return CpuDenseSequenceEmbedding(config=config, pg=pg, device=device)
        return super()._create_embedding_kernel(config, pg, device, env)


class DynamicEmbDpSequenceEmbeddingSharding(DpSequenceEmbeddingSharding):
    """``DpSequenceEmbeddingSharding`` with correct sequence outputs on CPU."""

    def create_lookup(self, device: Optional[torch.device] = None, fused_params=None, feature_processor=None):
        assert feature_processor is None
        return _DpSequenceLookup(
            grouped_configs=self._grouped_embedding_configs, pg=self._env.process_group,
            device=device if device is not None else self._device, env=self._env)
