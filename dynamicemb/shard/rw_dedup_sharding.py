"""Row-wise EBC sharding of dynamic tables (all dynamic, one dim) with ids deduplicated
before the all-to-all: owners return one row per unique id through an all-to-all of rows
and the sender pools them (SUM; TorchRec divides MEAN afterwards), so outputs and updates
equal the reduce-scatter path's. The sender's bookkeeping rides in the batch's sharding
context; the owner's goes from the lookup to the output dist (TorchRec runs them back to
back)."""

from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import Awaitable, NoWait
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from dynamicemb.shard.dedup import dedup_features, table_spans
from dynamicemb.shard.lookup import DynamicEmbGroupedEmbeddingsLookup
from dynamicemb.shard.replicas import (ReplicaBatch, ReplicaPendingUpdates, ReplicaSet,
                                       replica_set_of, serve_owned, split_replicated,
                                       with_replica_rows)
from dynamicemb.shard.rw_sharding import _input_dist
from dynamicemb.shard.stale_replicas import attach_copies

__all__ = ["DynamicEmbRwDedupPooledEmbeddingSharding", "dedup_applies"]

# attribute of a batch's EmbeddingShardingContext holding its ``SentIds``
SENT_ATTR = "dynamicemb_sent_ids"


@dataclass
class SentIds:
    """Sender side of one batch of a dedup sharding."""

    offsets: torch.Tensor  # (F * B + 1,) bag offsets of the original features
    weights: Optional[torch.Tensor]  # (N,) per-sample weights or None
    batch: int
    reverse: torch.Tensor  # (N,) position of each id in the deduplicated values
    permute: torch.Tensor  # (U,) position of each deduplicated value in the sent order
    per_dest: List[int]  # unique ids sent to each rank
    replicas: Optional[ReplicaBatch] = None  # with hot-row replicas (``replicas.py``)


class _RowsAllToAll(torch.autograd.Function):
    """All-to-all of rows; backward returns the gradients, divided as TorchRec divides."""

    @staticmethod
    def forward(ctx, rows, output_splits, input_splits, pg):  # noqa: D102
        ctx.splits, ctx.pg = (output_splits, input_splits), pg
        out = rows.new_empty(sum(output_splits), rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), output_splits, input_splits, group=pg)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        output_splits, input_splits = ctx.splits
        grad = grad.contiguous()
        out = grad.new_empty(sum(input_splits), grad.shape[1])
        dist.all_to_all_single(out, grad, input_splits, output_splits, group=ctx.pg)
        if get_gradient_division():
            out = out / dist.get_world_size(ctx.pg)
        return out, None, None, None


class DynamicEmbRwDedupInputDist(nn.Module):
    """Dedups each table's ids, then routes them (``DynamicEmbRwSparseFeaturesDist``);
    ``take_sent()`` hands the sender's bookkeeping to the sharded module."""

    def __init__(self, inner: nn.Module, spans: List[tuple], replicas: Optional[ReplicaSet] = None) -> None:
        super().__init__()
        self._inner = inner
        self._spans = spans
        self._replicas = replicas
        self._sent: Optional[SentIds] = None

    @property
    def last_ids_sent(self) -> Optional[torch.Tensor]:
        """(world_size, num_features) unique ids sent by the last forward (a table's
        unique ids are counted under its first feature)."""
        return self._inner.last_ids_sent

    def take_sent(self) -> SentIds:
        sent, self._sent = self._sent, None
        if sent is None:
            raise RuntimeError("dynamic id dedup: no input dist ran for this batch")
        return sent

    def forward(self, features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        if features.variable_stride_per_key():
            raise NotImplementedError("dynamic id dedup does not support variable batch sizes (VBE)")
        deduped, reverse = dedup_features(features, self._spans)
        replicated = None
        if self._replicas is not None:  # the replicated ids leave the all-to-all
            replicated, deduped = split_replicated(deduped, self._replicas)
        awaitable = self._inner(deduped)
        self._sent = SentIds(
            offsets=features.offsets(), weights=features.weights_or_none(), batch=features.stride(),
            reverse=reverse, permute=self._inner._permute,
            per_dest=self._inner.last_ids_sent.sum(1).tolist(), replicas=replicated)
        return awaitable


class _OwnerSplits:
    """The rows each source rank is owed, from the lookup to the output dist."""

    def __init__(self) -> None:
        self.per_source: Optional[List[int]] = None


class DynamicEmbRwDedupLookup(ReplicaPendingUpdates, DynamicEmbGroupedEmbeddingsLookup):
    """Owner side: one row per received (unique) id, returned in source-rank order
    (the order the rows all-to-all sends them back in)."""

    def __init__(self, *args, owner: _OwnerSplits, world_size: int, dim: int,
                 replicas: Optional[ReplicaSet] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._owner = owner
        self._world_size = world_size
        self._dim = dim
        self._replicas = replicas
        self._armed: Optional[ReplicaBatch] = None

    def arm(self, batch: Optional[ReplicaBatch]) -> None:
        """The replicas' part of the batch the next ``forward`` serves."""
        self._armed = batch

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        num_features = len(sparse_features.keys())
        # received layout: feature, source rank, sample
        received = sparse_features.lengths().view(num_features, self._world_size, -1).sum(2)
        if self._replicas is None:
            rows = super().forward(sparse_features).view(-1, self._dim)  # flattened sequence rows
        else:  # and the owned replicated rows go to every rank
            batch, self._armed = self._armed, None
            rows = serve_owned(self._replicas, batch, sparse_features, super().forward, self._dim)
        segment = torch.arange(received.numel(), dtype=torch.int64)  # f * W + r
        source_major = (segment % self._world_size) * num_features + segment // self._world_size
        key = torch.repeat_interleave(source_major, received.reshape(-1), output_size=rows.shape[0])
        self._owner.per_source = received.sum(0).tolist()
        return rows[torch.argsort(key, stable=True)]


class DynamicEmbRwDedupOutputDist(nn.Module):
    """Returns the rows to the senders and pools them there: (batch, features * dim)."""

    def __init__(self, pg: dist.ProcessGroup, dim: int, num_features: int, owner: _OwnerSplits) -> None:
        super().__init__()
        self._pg = pg
        self._dim = dim
        self._num_features = num_features
        self._owner = owner

    def forward(self, rows: torch.Tensor, sharding_ctx=None) -> Awaitable[torch.Tensor]:
        sent: Optional[SentIds] = getattr(sharding_ctx, SENT_ATTR, None)
        per_source, self._owner.per_source = self._owner.per_source, None
        if sent is None or per_source is None:
            raise RuntimeError("dynamic id dedup: the output dist needs the batch's sharding context "
                               "and its lookup (run the module through ShardedDynamicEmbeddingBagCollection)")
        back = _RowsAllToAll.apply(rows, sent.per_dest, per_source, self._pg)
        unique_rows = back[sent.permute]  # the returned rows are in the sent (bucketized) order
        if sent.replicas is not None:
            unique_rows = with_replica_rows(unique_rows, sent.replicas)
        weights = None if sent.weights is None else sent.weights.to(unique_rows.dtype)
        pooled = torch.nn.functional.embedding_bag(
            sent.reverse, unique_rows, sent.offsets.to(torch.int64), mode="sum", per_sample_weights=weights,
            include_last_offset=True)  # (F * B, dim)
        pooled = pooled.view(self._num_features, sent.batch, self._dim).transpose(0, 1)
        return NoWait(pooled.reshape(sent.batch, self._num_features * self._dim))


def dedup_applies(sharding: RwPooledEmbeddingSharding) -> bool:
    """Whether a row-wise EBC sharding can dedup: every table dynamic, one dim."""
    tables = sharding.embedding_tables()
    return bool(tables) and all(
        t.compute_kernel == EmbeddingComputeKernel.CUSTOMIZED_KERNEL for t in tables) and len(
        {t.embedding_dim for t in tables}) == 1


class DynamicEmbRwDedupPooledEmbeddingSharding(RwPooledEmbeddingSharding):
    """Row-wise EBC sharding of dynamic tables (one dim) with ids deduplicated per
    table before the all-to-all; rows come back and are pooled on the sender."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._owner = _OwnerSplits()
        self.replicas = replica_set_of(self)  # None without replicated tables

    def _dim(self) -> int:
        return self.embedding_tables()[0].embedding_dim

    def create_input_dist(self, device: Optional[torch.device] = None) -> DynamicEmbRwDedupInputDist:
        inner = _input_dist(self, device, is_sequence=False, need_pos=False)
        return DynamicEmbRwDedupInputDist(inner, table_spans(self), self.replicas)

    def create_lookup(self, device: Optional[torch.device] = None, fused_params=None, feature_processor=None):
        if feature_processor is not None:
            raise NotImplementedError("feature processors are not supported with dynamic id dedup")
        lookup = DynamicEmbRwDedupLookup(
            self._grouped_embedding_configs, pg=self._pg,
            device=device if device is not None else self._device, env=self._env,
            owner=self._owner, world_size=self._world_size, dim=self._dim(), replicas=self.replicas)
        attach_copies(self.replicas, lookup, self._dim())
        return lookup

    def create_output_dist(self, device: Optional[torch.device] = None) -> DynamicEmbRwDedupOutputDist:
        return DynamicEmbRwDedupOutputDist(self._pg, self._dim(), self._get_num_features(), self._owner)
