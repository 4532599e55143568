"""Row-wise routing of dynamic ids: each raw id goes to its table's ``owner_rank`` (by
``dist_type`` and placement file) in TorchRec's one all-to-all per sharding."""

from typing import List, NamedTuple, Optional, Sequence

import torch
from torchrec.distributed.embedding_sharding import bucketize_kjt_before_all2all
from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb.placement import TablePlacement, placement_word
from dynamicemb.types import DynamicEmbDistType

__all__ = ["DynamicEmbRwSparseFeaturesDist", "FeatureRoute"]


class FeatureRoute(NamedTuple):
    """How a dynamic feature's ids find their owner: the table's ``dist_type`` and its
    placement file entry (None: none)."""

    dist_type: DynamicEmbDistType
    placement: Optional[TablePlacement]


class DynamicEmbRwSparseFeaturesDist(RwSparseFeaturesDist):
    """``RwSparseFeaturesDist`` where dynamic features go to their table's ``owner_rank``.

    Static features keep TorchRec's block routing and local row ids; dynamic ids are bucketized
    on their ``placement_word`` (block size 0: ``uint64(word) % W``) or their placed rank, then
    put back raw. Weights (and dedup counts) travel along.

    Args:
        feature_routes: per feature, its table's ``FeatureRoute``, or None for a static table.
        feature_hash_sizes: ``num_embeddings`` per feature (static routing).
    """

    def __init__(self, feature_routes: Sequence[Optional[FeatureRoute]],
                 feature_hash_sizes: List[int], **kwargs) -> None:
        hash_sizes = [size if route is None else 0
                      for route, size in zip(feature_routes, feature_hash_sizes)]
        super().__init__(feature_hash_sizes=hash_sizes, **kwargs)
        feature_dist_types = [None if r is None else DynamicEmbDistType(r.dist_type)
                              for r in feature_routes]
        # the placements of the sharding's dynamic features, each with its feature mask
        self._placements = [
            (d, torch.tensor([t == d for t in feature_dist_types]))
            for d in dict.fromkeys(t for t in feature_dist_types if t is not None)]
        # per feature with a placement file entry: (feature index, the entry)
        self._files = [(f, r.placement) for f, r in enumerate(feature_routes)
                       if r is not None and r.placement is not None]
        self._dynamic_features = torch.tensor([t is not None for t in feature_dist_types])
        self._any_dynamic = bool(self._placements)
        # (world_size, num_features) ids sent by the last forward, per destination and feature
        self.last_ids_sent: Optional[torch.Tensor] = None

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        if not self._any_dynamic:
            bucketized = self._bucketize(sparse_features)
        else:
            values = sparse_features.values()
            per_key = torch.tensor(sparse_features.length_per_key(), dtype=torch.int64)
            dynamic = torch.repeat_interleave(self._dynamic_features, per_key, output_size=values.numel())
            words = values.to(torch.int64)
            for dist_type, features in self._placements:
                mine = dynamic if len(self._placements) == 1 else torch.repeat_interleave(
                    features, per_key, output_size=values.numel())
                words = torch.where(mine, placement_word(values, dist_type), words)
            if self._files:
                ends = per_key.cumsum(0).tolist()
                for f, placement in self._files:  # only the feature's ids are looked up
                    start = ends[f] - int(per_key[f])
                    ranks, placed = placement.lookup(values[start:ends[f]])
                    # a rank < W is its own owner: the bucketize sends the id there
                    words[start:ends[f]] = torch.where(placed, ranks, words[start:ends[f]])
            routed = KeyedJaggedTensor(
                keys=sparse_features.keys(),
                values=words,
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
