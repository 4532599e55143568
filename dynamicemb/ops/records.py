"""What crosses the backend seam: a table's memory, the verbs' results, kernel arguments."""

import operator
from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import torch

from dynamicemb.options import DynamicEmbOptimType
from dynamicemb.types import ROW_DTYPES

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
    "RowFormat",
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


#: A row dtype's code in the kernels (``RowFormat.code``).
_ROW_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
#: The quiet NaN the kernels' round to nearest gives every NaN
#: (``csrc/dynamicemb/rounding_primitives.h``); torch's ``.to()`` varies by device.
_CANONICAL_NAN = {torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}


def _align(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class RowFormat:
    """The byte layout of one stored row: ``dim`` embedding elements of ``dtype``, then
    ``scale_bytes`` (reserved for an 8-bit row's per-row scale; 0 for now), then
    ``state_dim`` float32 optimizer-state columns at a 4-byte aligned offset.

    Every row is a whole number of 4-byte words and every tier stores rows as float32
    words ``(C, row_bytes // 4)``: float32 rows are today's ``(C, dim + state_dim)``
    values, byte for byte; a 16-bit row's words hold its 16-bit embedding and float32
    state, which the table, growth, promotion and row copies move as words. Only column
    slicing (``embeddings``, ``states``, ``pack``) reads the layout; the kernels take
    ``code`` and ``state_offset``.

    Args:
        dtype: torch.float32, torch.float16 or torch.bfloat16 (``types.ROW_DTYPES``).
        dim: embedding columns, at least 1.
        state_dim: float32 optimizer-state columns (SGD 0, row-wise Adagrad 1,
            Adagrad ``dim``, Adam ``2 * dim``).
        scale_bytes: bytes after the embedding; 0 for float32 rows.

    Raises:
        ValueError: another dtype, a non-integer or negative size, ``dim`` 0, or a
            scale on a float32 row.

    Example::

        >>> fmt = RowFormat(torch.bfloat16, dim=128, state_dim=1)
        >>> fmt.state_offset, fmt.row_bytes, fmt.tag
        (256, 260, 'bfloat16[128]+f32[1]')
    """

    dtype: torch.dtype
    dim: int
    state_dim: int
    scale_bytes: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ROW_DTYPES:
            raise ValueError(f"a row's dtype can be {[str(d) for d in ROW_DTYPES]}, got "
                             f"{self.dtype}")
        for name in ("dim", "state_dim", "scale_bytes"):
            value = getattr(self, name)
            try:
                if isinstance(value, bool):
                    raise TypeError
                value = operator.index(value)
            except TypeError:
                raise ValueError(f"{name} must be an int, got {value!r}") from None
            if value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")
            object.__setattr__(self, name, value)
        if self.dim == 0:
            raise ValueError("dim must be positive, got 0")
        if self.dtype == torch.float32 and self.scale_bytes:
            raise ValueError(f"float32 rows carry no scale, got scale_bytes={self.scale_bytes}")

    @property
    def elem_bytes(self) -> int:
        """Bytes of one embedding element."""
        return self.dtype.itemsize

    @property
    def code(self) -> int:
        """The dtype's code in the kernels: 0 float32, 1 float16, 2 bfloat16."""
        return _ROW_CODES[self.dtype]

    @property
    def scale_offset(self) -> int:
        """Byte offset of the reserved scale: right after the embedding."""
        return self.dim * self.elem_bytes

    @property
    def state_offset(self) -> int:
        """Byte offset of the first state column: 4-byte aligned."""
        return _align(self.scale_offset + self.scale_bytes, 4)

    @property
    def row_bytes(self) -> int:
        """Bytes of a row, padded to a 4-byte word: float32 rows ``4 * (dim +
        state_dim)``."""
        return self.state_offset + 4 * self.state_dim

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the values array: float32 words for every row dtype."""
        return torch.float32

    @property
    def storage_width(self) -> int:
        """Columns (4-byte words) of the values array: ``row_bytes // 4``."""
        return self.row_bytes // 4

    @property
    def tag(self) -> str:
        """The layout in a few characters (stores and checkpoints record it), e.g.
        ``"bfloat16[128]+f32[1]"``; a scale shows as ``+scale[<bytes>]``."""
        scale = f"+scale[{self.scale_bytes}]" if self.scale_bytes else ""
        return f"{str(self.dtype)[len('torch.'):]}[{self.dim}]{scale}+f32[{self.state_dim}]"

    def embeddings(self, rows: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``rows``, a view.

        Shape:
            rows: (..., storage_width) ``storage_dtype``; returns (..., dim) ``dtype``.
        """
        self._check_rows(rows)
        if self.dtype == torch.float32:
            return rows[..., :self.dim]
        return rows.view(torch.uint8)[..., :self.scale_offset].view(self.dtype)

    def states(self, rows: torch.Tensor) -> torch.Tensor:
        """The optimizer states of ``rows``, a view (an empty tensor when ``state_dim``
        is 0).

        Shape:
            rows: (..., storage_width) ``storage_dtype``; returns (..., state_dim) float32.
        """
        self._check_rows(rows)
        return rows[..., self.state_offset // 4:]

    def pack(self, embeddings: torch.Tensor, states: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
        """New rows of this format holding ``embeddings`` and ``states``; padding is 0.

        Embeddings of another dtype are taken as float32 values, then rounded to nearest
        (even) into ``dtype`` as the kernels' ``narrow_rn`` does, every NaN becoming its
        canonical quiet NaN (0x7E00 float16, 0x7FC0 bfloat16).

        Shape:
            embeddings: (n, dim) floating; states: (n, state_dim) float32, or None when
            ``state_dim`` is 0. Returns (n, storage_width) ``storage_dtype``.
        """
        n = embeddings.shape[0]
        if embeddings.dim() != 2 or embeddings.shape[1] != self.dim:
            raise ValueError(f"embeddings must be (n, {self.dim}), got "
                             f"{tuple(embeddings.shape)}")
        if states is None and self.state_dim:
            raise ValueError(f"{self.tag} rows need states (n, {self.state_dim})")
        if states is not None and tuple(states.shape) != (n, self.state_dim):
            raise ValueError(f"states must be ({n}, {self.state_dim}), got "
                             f"{tuple(states.shape)}")
        rows = torch.zeros(n, self.storage_width, dtype=self.storage_dtype,
                           device=embeddings.device)
        self.embeddings(rows).copy_(self._narrow(embeddings))
        if self.state_dim:
            self.states(rows).copy_(states)
        return rows

    def _narrow(self, embeddings: torch.Tensor) -> torch.Tensor:
        if embeddings.dtype == self.dtype or self.dtype == torch.float32:
            return embeddings
        wide = embeddings.to(torch.float32)
        narrow = wide.to(self.dtype)
        narrow.view(torch.int16).masked_fill_(wide.isnan(), _CANONICAL_NAN[self.dtype])
        return narrow

    def _check_rows(self, rows: torch.Tensor) -> None:
        if rows.dtype != self.storage_dtype or rows.dim() < 1 or \
                rows.shape[-1] != self.storage_width:
            raise ValueError(f"{self.tag} rows are (..., {self.storage_width}) "
                             f"{self.storage_dtype}, got {tuple(rows.shape)} {rows.dtype}")


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
        (empty with one tier); transient: (T, dim) float32, the batch's transient rows;
        format: the stored rows' ``RowFormat`` (width: its ``storage_width``); init: rows
        computed from the initializers instead (``InitRows``), or None.
    """

    device: torch.Tensor
    host: torch.Tensor
    transient: torch.Tensor
    format: RowFormat
    init: Optional[InitRows] = None


class Rounding(NamedTuple):
    """How an update writes 16-bit rows back (``rounding_primitives.h``).

    Shape:
        keys: (U,) int64 and table_ids: (U,) int16, each unique row's; spec: (T, 2) int64,
        each table's (stream, seed); step: (1,) int64, read after the update's schedule
        advanced its step (it may be that step's tensor).
        stochastic: stochastic rounding (else round to nearest).
    """

    keys: torch.Tensor
    table_ids: torch.Tensor
    spec: torch.Tensor
    step: torch.Tensor
    stochastic: bool


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
