"""What crosses the backend seam: a table's memory, the verbs' results, kernel arguments."""

from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import torch

from dynamicemb.options import DynamicEmbOptimType

__all__ = [
    "BatchPart",
    "Deduplicated",
    "DeviceSchedule",
    "Entries",
    "InitRows",
    "InitSpec",
    "NewRows",
    "OptimizerUpdate",
    "PromotionPlan",
    "RowSources",
    "TableMemory",
    "Upserted",
]


@dataclass
class TableMemory:
    """The tensors of one hash table (``csrc/dynamicemb/hash_primitives.h``); ``grow``
    replaces them: hold the ``TableMemory``, not its tensors, across calls.

    Attributes:
        meta: [keys, scores, tids, digests, occupied, pinned]; keys and scores are the
            two columns of one (capacity, 2) int64 array.
        values: (capacity, value_dim) value rows, indexed by slot.
        num_buckets: a power of two; max_num_buckets: the most growth may reach.
        bucket_capacity: slots per bucket, a multiple of 16.
        values_in_host_memory: ``values`` is host memory the kernels use in place.
    """

    meta: List[torch.Tensor]
    values: torch.Tensor
    num_buckets: int
    max_num_buckets: int
    bucket_capacity: int
    values_in_host_memory: bool = False

    def __post_init__(self) -> None:
        # The probes load 16 digests at a time (the CPU's SIMD match, the GPU's
        # 16-byte loads) from a 16-slot group of a bucket.
        if len(self.meta) != 6:
            raise ValueError(f"meta must hold 6 tensors, got {len(self.meta)}")
        if self.meta[3].data_ptr() % 16:
            raise ValueError("the digests array must be 16-byte aligned (the probes load "
                             "16 digests at a time)")

    @property
    def capacity(self) -> int:
        return self.num_buckets * self.bucket_capacity

    @property
    def can_grow(self) -> bool:
        return self.num_buckets < self.max_num_buckets

    @property
    def keys(self) -> torch.Tensor:
        return self.meta[0]

    @property
    def scores(self) -> torch.Tensor:
        return self.meta[1]

    @property
    def table_ids(self) -> torch.Tensor:
        return self.meta[2]

    @property
    def digests(self) -> torch.Tensor:
        return self.meta[3]


class Upserted(NamedTuple):
    """What an inserting pass decided, per key (its counts: the caller's ``outcomes``).

    Shape:
        slots: (n,) int64, -1 where the insert failed; status: (n,) int8
        ``InsertStatus``; prev_scores: (n,) the score a hit replaced (new key: -1; a
        hit on an expired row: its old score); ev_keys, ev_tids, ev_scores: (n,) the
        evicted entry, where status is EVICTED_AND_INSERTED.
    """

    slots: torch.Tensor
    status: torch.Tensor
    prev_scores: torch.Tensor
    ev_keys: torch.Tensor
    ev_tids: torch.Tensor
    ev_scores: torch.Tensor


class Deduplicated(NamedTuple):
    """The unique (table id, key) pairs of a batch, in first-occurrence order.

    Shape:
        keys: (N,) int64, table_ids: (N,) int16, counts: (N,) int64 (summed
        frequencies, default 1 per key): the first U entries are the pairs (U stays on
        the device), the rest padding (key 0, table 0, count 0: a pass gives it slot -1
        and counts nothing). inverse: (N,) int64, each key's unique index (-1: left
        out). starts: (N + 1,) int64, rank: (N,) int64: the keys grouped by pair
        (stable), pair u's ranks ``starts[u]`` to ``starts[u + 1] - 1``; None unless
        grouping was asked.
    """

    keys: torch.Tensor
    table_ids: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    starts: Optional[torch.Tensor]
    rank: Optional[torch.Tensor]


class Entries(NamedTuple):
    """Stored entries with their rows: an insert's victims (in input order of the keys
    that evicted them) or an export (in slot order).

    Shape:
        keys, table_ids, scores, slots: (m,) int64; values: (m, value_dim).
    """

    keys: torch.Tensor
    table_ids: torch.Tensor
    scores: torch.Tensor
    slots: torch.Tensor
    values: torch.Tensor


class InitSpec(NamedTuple):
    """The initializers of a group's logical tables, packed for the kernels.

    Shape:
        ints: (T, 3) int64 (stream, mode code, seed) and floats: (T, 5) float32
        (mean, std_dev, lower, upper, value), one row per local table id.
    """

    ints: torch.Tensor
    floats: torch.Tensor


class NewRows(NamedTuple):
    """What a key's stored row starts as: ``spec``'s initializer in its first ``dim``
    columns, ``state`` in each optimizer-state column after them."""

    spec: InitSpec
    dim: int
    state: float


class InitRows(NamedTuple):
    """Rows the kernels compute where they read them: on a backend that counts on the
    device, a unique key without a stored row (a negative reference) reads its table's
    initializer's row.

    Shape:
        keys: (U,) int64, table_ids: (U,) int16: the keys the references belong to;
        spec: their tables' initializers.
    """

    keys: torch.Tensor
    table_ids: torch.Tensor
    spec: InitSpec


class RowSources(NamedTuple):
    """Where the rows a lookup references live (``row_ref.h``).

    Shape:
        device: (C, width) the device tier's values; host: (H, width) the host store's
        (empty with one tier); transient: (T, dim) the batch's transient rows; init:
        rows computed from the initializers instead (``InitRows``), or None.
    """

    device: torch.Tensor
    host: torch.Tensor
    transient: torch.Tensor
    init: Optional[InitRows] = None


class BatchPart(NamedTuple):
    """The keys of a batch that one of a module's groups takes (the groups share a batch).

    Attributes:
        groups: (N,) int64, each key's group.
        group: the call's group; other keys are left out (inverse -1, no lookup).
    """

    groups: torch.Tensor
    group: int


class PromotionPlan(NamedTuple):
    """A step batch's promotion into a cache, on the device (``Backend.promotion_plan``).

    Shape:
        cache_slots: (n,) int64, each unique key's cache slot before (-1: absent);
        plan: (4,) int64, hits, misses, hot misses and the keys the cache call takes;
        rank: (n,) int64, promotion order (larger first, ties in batch order); order:
        (n,) int64, the positions sorted by rank (the cache call's order).
    """

    cache_slots: torch.Tensor
    plan: torch.Tensor
    rank: torch.Tensor
    order: torch.Tensor


class DeviceSchedule(NamedTuple):
    """An update's per-step scalars in device memory, so that a replayed CUDA graph follows
    them (the kernel derives Adam's step size, bias correction and decay scale in double).

    Attributes:
        lr: (1,) float64. step: (1,) int64, the optimizer's step count, advanced first
            when ``advance`` (Adam) unless the batch was refused.
        beta1, beta2: Adam's betas, exactly. decoupled_decay: 0.0 for none.
    """

    lr: torch.Tensor
    step: torch.Tensor
    advance: bool
    beta1: float
    beta2: float
    decoupled_decay: float


class OptimizerUpdate(NamedTuple):
    """One backward's optimizer settings (``optimizer_params``, optimizer_primitives.h).

    ``step_size`` and ``bias_correction2_sqrt``: Adam's for this step (else lr and 1.0).
    Weight decay is L2 through ``weight_decay`` or decoupled through ``decay_scale``
    (``1 - lr * weight_decay``, applied to the row first); the unused one is 0.0 or 1.0.
    """

    optimizer: DynamicEmbOptimType
    lr: float
    eps: float
    beta1: float
    beta2: float
    weight_decay: float
    step_size: float
    bias_correction2_sqrt: float
    decay_scale: float = 1.0
