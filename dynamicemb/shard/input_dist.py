"""Row-wise routing of dynamic ids: which rank owns a key, and the input dist that
sends each id there (raw, unchanged) in TorchRec's one all-to-all per sharding."""

from typing import List, Optional

import torch
from torchrec.distributed.embedding_sharding import bucketize_kjt_before_all2all
from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["DynamicEmbRwSparseFeaturesDist", "owner_rank", "routing_hash"]

_MASK = [(1 << (64 - s)) - 1 for s in range(64)]


def _shift_right_logical(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & _MASK[s]


def routing_hash(keys: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer (Stafford's Mix13) of the raw keys, as int64 bits.

    Bijective on 64 bits. It is deliberately not the table's bucket hash
    (``dynamicemb.table.hash_keys``): that hash picks buckets from its low bits, so
    routing with it would leave each rank only 1/W of its buckets usable.

    Args:
        keys (Tensor): (n,) int64, any value.

    Returns:
        (n,) int64: the mixed 64-bit words (read as unsigned).
    """
    x = keys.to(torch.int64)
    x = x ^ _shift_right_logical(x, 30)
    x = x * -4658895280553007687  # 0xbf58476d1ce4e5b9, wrapping
    x = x ^ _shift_right_logical(x, 27)
    x = x * -7723592293110705685  # 0x94d049bb133111eb
    return x ^ _shift_right_logical(x, 31)


def owner_rank(keys: torch.Tensor, world_size: int) -> torch.Tensor:
    """The rank that stores each key of a row-wise dynamic table:
    ``uint64(routing_hash(key)) % world_size``.

    Args:
        keys (Tensor): (n,) int64.
        world_size: number of shards (ranks) of the table.

    Returns:
        (n,) int64 ranks in ``[0, world_size)``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    mixed = routing_hash(keys)
    # uint64 % W with int64 ops: (2 * (m >>> 1) + (m & 1)) % W
    return ((_shift_right_logical(mixed, 1) % world_size) * 2 + (mixed & 1)) % world_size


class DynamicEmbRwSparseFeaturesDist(RwSparseFeaturesDist):
    """``RwSparseFeaturesDist`` where dynamic features go to ``owner_rank(id, W)``.

    Static features keep TorchRec's block routing and local row ids; dynamic
    features are bucketized on their routing hash (block size 0 means
    ``uint64(h) % W``) and then their raw ids are put back, so the owner receives
    the ids as given. Weights (and dedup counts) travel along.

    Args:
        dynamic_features: per feature of the sharding, whether its table is dynamic.
        feature_hash_sizes: ``num_embeddings`` per feature (static routing).
        **kwargs: the remaining ``RwSparseFeaturesDist`` arguments.
    """

    def __init__(self, dynamic_features: List[bool], feature_hash_sizes: List[int], **kwargs) -> None:
        hash_sizes = [0 if dynamic else size for dynamic, size in zip(dynamic_features, feature_hash_sizes)]
        super().__init__(feature_hash_sizes=hash_sizes, **kwargs)
        self._dynamic_features = torch.tensor(dynamic_features, dtype=torch.bool)
        self._any_dynamic = any(dynamic_features)
        # (world_size, num_features) ids sent by the last forward, per destination and feature
        self.last_ids_sent: Optional[torch.Tensor] = None

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        if not self._any_dynamic:
            bucketized = self._bucketize(sparse_features)
        else:
            values = sparse_features.values()
            per_key = torch.tensor(sparse_features.length_per_key(), dtype=torch.int64)
            dynamic = torch.repeat_interleave(self._dynamic_features, per_key, output_size=values.numel())
            routed = KeyedJaggedTensor(
                keys=sparse_features.keys(),
                values=torch.where(dynamic, routing_hash(values), values),
                lengths=sparse_features.lengths(),
                weights=sparse_features.weights_or_none(),
                stride=sparse_features.stride(),
            )
            bucketized = self._bucketize(routed)
            bucketized.values()[self._permute[dynamic]] = values[dynamic]
        self.unbucketize_permute_tensor = self._permute if self._is_sequence else None
        self.last_ids_sent = torch.tensor(bucketized.length_per_key(), dtype=torch.int64).view(
            self._world_size, -1)
        return self._dist(bucketized)

    def _bucketize(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        bucketized, self._permute = bucketize_kjt_before_all2all(
            features,
            num_buckets=self._world_size,
            block_sizes=self._feature_block_sizes_tensor,
            output_permute=True,
            bucketize_pos=(self._has_feature_processor if features.weights_or_none() is None
                           else self._need_pos),
            keep_original_indices=False,
        )
        return bucketized
