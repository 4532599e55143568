"""``torch.ops.dynamicemb.frozen_lookup``, registered on import with a fake implementation
(``torch.export`` records one node), over the training backend's kernels, which read
16-bit rows in place. The CUDA registration has not run on a GPU here.
"""

from typing import List, Optional

import torch

from dynamicemb.ops import for_device
from dynamicemb.ops.interface import (Backend, InitRows, InitSpec, RowFormat, RowSources,
                                      TableMemory)

__all__ = ["POOLING_CODES", "frozen_lookup"]

#: The op's ``pooling`` argument: SUM and MEAN pool bags, NONE returns a row per id.
POOLING_CODES = {"SUM": 0, "MEAN": 1, "NONE": 2}
_NONE = POOLING_CODES["NONE"]

#: The op's qualified name (``torch.ops.dynamicemb.frozen_lookup``).
_LIB = "dynamicemb::frozen_lookup"


@torch.library.custom_op(_LIB, mutates_args=(), device_types="cpu")
def frozen_lookup(
    ids: torch.Tensor,
    offsets: torch.Tensor,
    weights: Optional[torch.Tensor],
    index: List[torch.Tensor],
    row_of_slot: torch.Tensor,
    rows: torch.Tensor,
    dim: int,
    feature_tids: torch.Tensor,
    feature_cols: torch.Tensor,
    init_ints: torch.Tensor,
    init_floats: torch.Tensor,
    bucket_capacity: int,
    out_cols: int,
    pooling: int,
) -> torch.Tensor:
    """Looks ids up in a frozen table group and pools them per bag.

    Args:
        ids (Tensor): (N,) int64 raw ids, feature-major.
        offsets (Tensor): (F * B + 1,) int64 bag boundaries (bag ``f * B + b``).
        weights (Tensor, optional): (N,) float32 per-sample weights (SUM only).
        index: the hash table's arrays: keys and scores (C, 2) int64, table ids (C,)
            int16, digests (C,) uint8, occupied and pinned bits (buckets, words) int64.
        row_of_slot (Tensor): (C + 1,) int64 row of each slot, -1 where empty and last.
        rows (Tensor): (R, P) float32, float16 or bfloat16 stored rows: ``dim``
            embedding elements padded to whole 4-byte words (P: ``dim``, or ``dim + 1``
            for 16-bit rows of an odd ``dim``), the float32 words of
            ``RowFormat(rows.dtype, dim, 0)`` viewed as ``rows.dtype``.
        dim: embedding columns of a row.
        feature_tids (Tensor): (F,) int16 table of each feature (the group's ids).
        feature_cols (Tensor): (F,) int64 first output column of each feature (-1: none).
        init_ints, init_floats (Tensor): (T, 3) int64 (stream, mode code, seed) and
            (T, 5) float64 (mean, std_dev, lower, upper, value): each table's eval
            initializer (``init_spec``).
        bucket_capacity: slots per bucket of the index.
        out_cols: columns of the output (every group's features).
        pooling: ``POOLING_CODES`` value.

    Returns:
        (B, out_cols) float32 pooled bags (columns of other groups are zero), or
        (N, dim) for pooling NONE. An id without a row reads its table's initializer's
        row as a stored row of ``rows.dtype`` would hold it (rounded to nearest).
    """
    return _lookup(for_device(ids.device), ids, offsets, weights, index, row_of_slot, rows,
                   dim, feature_tids, feature_cols, init_ints, init_floats, bucket_capacity,
                   out_cols, pooling)


@frozen_lookup.register_kernel("cuda")
def _frozen_lookup_cuda(ids, offsets, weights, index, row_of_slot, rows, dim, feature_tids,
                        feature_cols, init_ints, init_floats, bucket_capacity, out_cols,
                        pooling):
    return _lookup(for_device(ids.device), ids, offsets, weights, index, row_of_slot, rows,
                   dim, feature_tids, feature_cols, init_ints, init_floats, bucket_capacity,
                   out_cols, pooling)


@frozen_lookup.register_fake
def _frozen_lookup_fake(ids, offsets, weights, index, row_of_slot, rows, dim, feature_tids,
                        feature_cols, init_ints, init_floats, bucket_capacity, out_cols,
                        pooling):
    if pooling == _NONE:
        return ids.new_empty((ids.shape[0], dim), dtype=torch.float32)
    batch = (offsets.shape[0] - 1) // feature_tids.shape[0]
    return ids.new_empty((batch, out_cols), dtype=torch.float32)


def _lookup(ops: Backend, ids, offsets, weights, index, row_of_slot, rows, dim, feature_tids,
            feature_cols, init_ints, init_floats, bucket_capacity, out_cols, pooling):
    num_features = feature_tids.numel()
    batch = (offsets.numel() - 1) // num_features
    problem = ops.check_offsets(offsets=offsets, num_indices=ids.numel())
    if problem or (offsets.numel() - 1) % num_features:
        raise ValueError(
            f"offsets must have num_features * batch_size + 1 = {num_features} * B + 1 "
            f"non-decreasing entries from 0 to len(ids)={ids.numel()}")
    if weights is not None and weights.numel() != ids.numel():
        raise ValueError(f"per_sample_weights must have shape ({ids.numel()},) like ids, "
                         f"got {tuple(weights.shape)}")
    tids = _lookup_tables(offsets, feature_tids, batch, ids.numel(), init_ints.shape[0])
    refs = _row_refs(ops, ids, tids, index, row_of_slot, rows, bucket_capacity,
                     init_ints.shape[0])
    init = InitRows(ids.contiguous(), tids.contiguous(),
                    InitSpec(init_ints, init_floats.to(torch.float32)))
    sources = _sources(rows, dim, init)
    inverse = torch.arange(ids.numel(), dtype=torch.int64, device=ids.device)
    if pooling == _NONE:
        out = torch.empty(ids.numel(), dim, dtype=torch.float32, device=ids.device)
        ops.sequence_forward(sources=sources, row_ref=refs, inverse=inverse, dim=dim, out=out)
        return out
    # Columns of other groups stay zero: the module adds the groups' outputs.
    alone = bool((feature_cols >= 0).all()) and num_features * dim == out_cols
    out = (torch.empty if alone else torch.zeros)(batch, out_cols, dtype=torch.float32,
                                                 device=ids.device)
    ops.pooled_forward(sources=sources, row_ref=refs, inverse=inverse, offsets=offsets,
                       weights=weights, feature_col=feature_cols, batch=batch, dim=dim,
                       mean=pooling == POOLING_CODES["MEAN"], out=out)
    return out


def _lookup_tables(offsets, feature_tids, batch, n, num_tables):
    """(N,) int16 table of each lookup, from the bag boundaries of its feature."""
    if num_tables == 1:  # every lookup of this group is table 0's
        return torch.zeros(n, dtype=torch.int16, device=offsets.device)
    bounds = offsets[::max(batch, 1)] if batch else torch.zeros(
        feature_tids.numel() + 1, dtype=torch.int64, device=offsets.device)
    return torch.repeat_interleave(feature_tids, bounds[1:] - bounds[:-1], output_size=n)


def _row_refs(ops, ids, tids, index, row_of_slot, rows, bucket_capacity, num_tables):
    """(N,) row references of the lookups (``row_ref.h``): row r of ``rows``, or -1."""
    num_buckets = index[4].shape[0]
    memory = TableMemory([index[0][:, 0], index[0][:, 1], *index[1:]], rows, num_buckets,
                         num_buckets, bucket_capacity)
    slots = ops.find(memory=memory, keys=ids, table_ids=tids, one_table=num_tables == 1)
    return row_of_slot[slots]  # slot -1 reads the sentinel -1: one gather, no mask


def _sources(rows, dim, init) -> RowSources:
    """A lookup's ``RowSources``: the stored rows in place as the words of
    ``RowFormat(rows.dtype, dim, 0)``."""
    fmt = RowFormat(rows.dtype, dim, 0)
    padded = fmt.storage_width * 4 // fmt.elem_bytes
    if rows.dim() != 2 or rows.shape[1] != padded or not rows.is_contiguous():
        raise ValueError(f"rows must be contiguous (R, {padded}) {rows.dtype} for dim {dim}, "
                         f"got {tuple(rows.shape)}")
    words = rows.view(torch.float32)  # (R, storage_width): the tiers' float32 words
    none = torch.empty(0, dim, dtype=torch.float32, device=rows.device)
    return RowSources(words, words[:0], none, fmt, init)
