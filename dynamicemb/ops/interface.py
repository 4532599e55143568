"""The backend contract: what every kernel backend offers, and every code it shares.

A backend (``dynamicemb.ops.cpu``, ``dynamicemb.ops.cuda``) implements ``Backend``
over tensors of one device type. Everything above it (table, storage, module) calls
these verbs by keyword and reads their NamedTuple results; nothing above it knows
kernel signatures, status codes or row-reference bits. The codes here mirror the
shared headers of ``csrc/dynamicemb`` (named beside each) and are defined nowhere
else in Python.
"""

import abc
from dataclasses import dataclass
from enum import IntEnum
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from dynamicemb.options import DynamicEmbInitializerMode, DynamicEmbOptimType
from dynamicemb.types import DynamicEmbScoreStrategy

__all__ = [
    "Backend",
    "BatchPart",
    "Deduplicated",
    "DeviceSchedule",
    "Entries",
    "HOST_ROW_BIT",
    "InitRows",
    "InitSpec",
    "InsertStatus",
    "KNO_BUCKET",
    "OptimizerUpdate",
    "PromotionPlan",
    "RowSources",
    "ScoreRule",
    "TableMemory",
    "Upserted",
    "init_mode_code",
    "metadata_bytes_per_slot",
    "num_buckets_for",
    "offsets_problem",
    "optimizer_code",
    "optimizer_state_dim",
    "score_rule",
]


class InsertStatus(IntEnum):
    """What an inserting verb did with one key (``InsertStatus``, hash_primitives.h)."""

    HIT = 0
    INSERTED = 1
    EVICTED_AND_INSERTED = 2
    FAILED = 3
    DEFERRED = 4  # inside a verb only: the bucket was full and the table may grow


class ScoreRule(IntEnum):
    """How an inserting verb scores the keys it touches (``ScoreRule``, hash_primitives.h)."""

    CLOCK = 0  # the call's clock or step
    COUNT = 1  # old score + the key's count (LFU)
    GIVEN = 2  # the caller's score
    COUNT_THEN_CLOCK = 3  # LRU_LFU: count (bits 62..32) + key's count, stamped with the clock


#: LRU_LFU scores keep the last access in their low 32 bits (``CountThenClockScore``,
#: hash_primitives.h), the count above it; clock and step scores are the time itself.
COMPOUND_COUNT_SHIFT = 32
COMPOUND_TIME_MASK = (1 << COMPOUND_COUNT_SHIFT) - 1
ALL_BITS = -1  # the time mask of clock and step scores: the whole score


#: Row references >= HOST_ROW_BIT name host-store slots; < 0 name transient rows
#: (``csrc/dynamicemb/row_ref.h``).
HOST_ROW_BIT = 1 << 62

_RULES = {
    DynamicEmbScoreStrategy.LRU: (ScoreRule.CLOCK, True),
    DynamicEmbScoreStrategy.STEP: (ScoreRule.CLOCK, True),
    DynamicEmbScoreStrategy.LFU: (ScoreRule.COUNT, True),
    DynamicEmbScoreStrategy.CUSTOMIZED: (ScoreRule.GIVEN, True),
    DynamicEmbScoreStrategy.NO_EVICTION: (ScoreRule.CLOCK, False),
    DynamicEmbScoreStrategy.LRU_LFU: (ScoreRule.COUNT_THEN_CLOCK, True),
}


def score_rule(strategy: DynamicEmbScoreStrategy) -> Tuple[ScoreRule, bool]:
    """(score rule, whether a full bucket evicts) of a score strategy."""
    return _RULES[DynamicEmbScoreStrategy(strategy)]


_OPTIMIZER_CODES = {  # OptimizerKind, optimizer_primitives.h
    DynamicEmbOptimType.EXACT_SGD: 0,
    DynamicEmbOptimType.ADAM: 1,
    DynamicEmbOptimType.EXACT_ADAGRAD: 2,
    DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD: 3,
}

_INIT_MODE_CODES = {  # InitMode, init_primitives.h
    DynamicEmbInitializerMode.NORMAL: 0,
    DynamicEmbInitializerMode.TRUNCATED_NORMAL: 1,
    DynamicEmbInitializerMode.UNIFORM: 2,
    DynamicEmbInitializerMode.CONSTANT: 3,
    DynamicEmbInitializerMode.DEBUG: 4,
}


def optimizer_code(optimizer: DynamicEmbOptimType) -> int:
    """The kernels' code of an optimizer."""
    return _OPTIMIZER_CODES[optimizer]


def init_mode_code(mode: DynamicEmbInitializerMode) -> int:
    """The kernels' code of an initializer mode."""
    return _INIT_MODE_CODES[mode]


def offsets_problem(word: int) -> int:
    """The offsets problem code of ``Backend.check_offsets`` held by an error word
    (the kernel keeps max(4 - code) over the problems, so the smallest code wins;
    a word of 0 holds none)."""
    return 4 - int(word) if word else 0


def optimizer_state_dim(optimizer: DynamicEmbOptimType, dim: int) -> int:
    """Floats of optimizer state stored after the embedding in each value row."""
    return {
        DynamicEmbOptimType.EXACT_SGD: 0,
        DynamicEmbOptimType.ADAM: 2 * dim,
        DynamicEmbOptimType.EXACT_ADAGRAD: dim,
        DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD: 1,
    }[optimizer]


def num_buckets_for(capacity: int, bucket_capacity: int) -> int:
    """The buckets of a table of ``capacity`` slots: the smallest power of two that
    holds them (at least one)."""
    buckets = max(1, -(-capacity // bucket_capacity))
    return 1 << (buckets - 1).bit_length()


def metadata_bytes_per_slot(bucket_capacity: int) -> float:
    """Bytes of a slot besides its value row: key 8, score 8, table id 2, digest 1, and
    its occupied and pinned bits (a 64-bit word each per 64 slots of a bucket)."""
    words = (bucket_capacity + 63) // 64
    return 8 + 8 + 2 + 1 + 2 * 8 * words / bucket_capacity


@dataclass
class TableMemory:
    """The tensors of one hash table (layout: ``csrc/dynamicemb/hash_primitives.h``).

    A backend's ``grow`` replaces them; callers hold the ``TableMemory``, not its
    tensors, across calls that may grow.

    Attributes:
        meta: [keys, scores, tids, digests, occupied, pinned]; keys and scores are
            the two columns of one (capacity, 2) int64 array.
        values: (capacity, value_dim) value rows, indexed by slot.
        num_buckets: a power of two.
        max_num_buckets: the most buckets growth may reach.
        bucket_capacity: slots per bucket, a multiple of 16.
        values_in_host_memory: ``values`` is host memory the backend's kernels read
            and write in place (``Backend.host_zeros``); growth keeps it there.
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
    """What an inserting verb decided, per key, in final slots (after any growth).

    Shape:
        slots: (n,) int64, -1 where the insert failed; status: (n,) int8
        ``InsertStatus``; prev_scores: (n,) the score a hit replaced (for undo);
        ev_keys, ev_tids, ev_scores: (n,) the entry a key evicted, where
        status is EVICTED_AND_INSERTED. hits, inserted, evicted, failed count the
        statuses; growths counts the doublings the verb did for full buckets. A
        padded verb (``Backend.padded_dedup_upsert``) adds them to totals in device
        memory instead: the four ints are then None.
    """

    slots: torch.Tensor
    status: torch.Tensor
    prev_scores: torch.Tensor
    ev_keys: torch.Tensor
    ev_tids: torch.Tensor
    ev_scores: torch.Tensor
    hits: Optional[int]
    inserted: Optional[int]
    evicted: Optional[int]
    failed: Optional[int]
    growths: int


class Deduplicated(NamedTuple):
    """The unique (table id, key) pairs of a batch, in first-occurrence order.

    Shape:
        keys: (U,) int64; table_ids: (U,) int16; inverse: (N,) int64, the unique
        index of each of the batch's N keys; counts: (U,) int64, the summed
        frequencies of each pair's keys (1 per key when none are given);
        starts: (U + 1,) int64 and rank: (N,) int64, the batch's keys grouped by
        pair (a stable sort by ``inverse``): the keys of pair u have ranks
        ``starts[u]`` to ``starts[u + 1] - 1``, in input order (what a fused
        backward walks); None when grouping was not asked for.

        Padded (``Backend.padded_dedup_upsert``): keys, table_ids and counts have N
        entries, the first U the unique pairs and the rest padding (key 0, table 0,
        count 0, no lookup; an inserting pass gives them slot -1 and counts
        nothing), starts N + 1; U stays on the device.
    """

    keys: torch.Tensor
    table_ids: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    starts: Optional[torch.Tensor]
    rank: Optional[torch.Tensor]


class Entries(NamedTuple):
    """Stored entries with their rows: what an inserting call evicted (in input order
    of the keys that evicted them) or what an export read (in slot order).

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


class InitRows(NamedTuple):
    """Rows that kernels compute where they read them: on a backend that counts on
    the device, a unique key without a stored row (a negative row reference: its
    insert failed) reads its table's initializer's row, so a step needs no count of
    such keys and no transient rows.

    Shape:
        keys: (U,) int64 and table_ids: (U,) int16, the unique keys the references
        belong to; spec: their tables' initializers.
    """

    keys: torch.Tensor
    table_ids: torch.Tensor
    spec: InitSpec


class RowSources(NamedTuple):
    """Where the rows a lookup references live (``row_ref.h``).

    Shape:
        device: (C, width) the device tier's values; host: (H, width) the host
        store's values (empty when one tier holds everything); transient: (T, dim)
        this batch's transient rows; init: rows computed from the initializers
        instead (``InitRows``; then there are no transient rows), or None.
    """

    device: torch.Tensor
    host: torch.Tensor
    transient: torch.Tensor
    init: Optional[InitRows] = None


class BatchPart(NamedTuple):
    """The keys of a batch a padded call takes: those of one group of a module (the
    module's groups share one batch, each with its own table).

    Attributes:
        groups: (N,) int64, the group of each key of the batch.
        group: the call's group; the other keys are left out (inverse -1, no lookup).
    """

    groups: torch.Tensor
    group: int


class PromotionPlan(NamedTuple):
    """A padded batch's promotion into a cache, on the device (``Backend.promotion_plan``).

    Shape:
        cache_slots: (n,) int64, each unique key's cache slot before the promotion
        (-1: not there); plan: (4,) int64, the hits, misses and hot misses counted
        and the number of keys the cache call takes; rank: (n,) int64, the
        promotion order (larger first, ties in batch order).
    """

    cache_slots: torch.Tensor
    plan: torch.Tensor
    rank: torch.Tensor


#: The bucket of a key a padded inserting pass skips (``kNoBucket``, common.cuh).
KNO_BUCKET = 0x7FFFFFFF


class DeviceSchedule(NamedTuple):
    """The scalars of an update that change from step to step, in device memory, so
    that a step can be replayed (a CUDA graph) and still follow them: the kernel
    computes Adam's step size and bias correction and the decoupled decay's scale
    from them, in double as the host does (``OptimizerUpdate``).

    Attributes:
        lr: (1,) float64, the learning rate.
        step: (1,) int64, the optimizer's step count; the backward advances it
            first when ``advance`` (Adam), unless its batch was refused.
        advance: whether the backward counts itself in ``step``.
        beta1, beta2: Adam's betas, exactly.
        decoupled_decay: the decoupled weight decay (0.0: none).
    """

    lr: torch.Tensor
    step: torch.Tensor
    advance: bool
    beta1: float
    beta2: float
    decoupled_decay: float


class OptimizerUpdate(NamedTuple):
    """One backward's optimizer settings (``optimizer_params``, optimizer_primitives.h).

    ``step_size`` and ``bias_correction2_sqrt`` are Adam's for this step (lr and 1.0
    for the others). Weight decay is L2 through ``weight_decay`` (added to the
    gradient) or decoupled through ``decay_scale`` (``1 - lr * weight_decay``, the
    row is scaled by it before the update); the unused form is 0.0 or 1.0.
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


class Backend(abc.ABC):
    """The kernels of one device type. Every verb takes keyword arguments only; the
    batch tensors must be on the backend's device and contiguous, ids int64, table
    ids int16. Validation of user input happens above (the table and the module);
    a backend checks only what would corrupt memory."""

    #: The widest embedding row its kernels update, or None for no limit.
    max_dim: Optional[int] = None
    #: Whether reading a value of its tensors on the host costs nothing (the CPU) or
    #: waits for the device (a GPU: checks of data that need one are left out of a step).
    free_host_reads: bool = True
    #: Whether a training step may keep its counts in device memory (the CUDA
    #: backend): a padded ``dedup_upsert``, new rows initialized by status
    #: (``init_new_rows``), rows of failed keys computed where read (``InitRows``)
    #: and the offsets check into an error word that later kernels read.
    counts_on_device: bool = False

    # ------------------------------------------------------------ allocation
    @abc.abstractmethod
    def zeros(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Zeroed memory for a table's arrays (the backend picks how: huge pages...)."""

    def host_zeros(self, shape: Sequence[int], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
        """Zeroed host memory that this backend's kernels and torch ops on ``device``
        read and write in place: a host store's value rows under a device budget.
        Where the device is the host (the CPU), the same as ``zeros``."""
        return self.zeros(shape, dtype, device)

    def new_table(self, *, num_buckets: int, max_num_buckets: int, bucket_capacity: int,
                  value_dim: int, value_dtype: torch.dtype, device: torch.device,
                  values_in_host_memory: bool = False) -> TableMemory:
        """An empty table's memory; its value rows in host memory when
        ``values_in_host_memory`` (``host_zeros``), the index on ``device``."""
        slots = num_buckets * bucket_capacity
        words = (bucket_capacity + 63) // 64
        keys_and_scores = self.zeros((slots, 2), torch.int64, device)
        meta = [
            keys_and_scores[:, 0],
            keys_and_scores[:, 1],
            self.zeros((slots,), torch.int16, device),
            self.zeros((slots,), torch.uint8, device),
            self.zeros((num_buckets, words), torch.int64, device),
            self.zeros((num_buckets, words), torch.int64, device),
        ]
        allocate = self.host_zeros if values_in_host_memory else self.zeros
        values = allocate((slots, value_dim), value_dtype, device)
        return TableMemory(meta, values, num_buckets, max_num_buckets, bucket_capacity,
                           values_in_host_memory)

    # ------------------------------------------------------------ hash table
    @abc.abstractmethod
    def hash_keys(self, *, keys: torch.Tensor, table_ids: torch.Tensor) -> torch.Tensor:
        """(n,) int64: the documented 64-bit hash of each (table id, key)."""

    @abc.abstractmethod
    def find(self, *, memory: TableMemory, keys: torch.Tensor, table_ids: torch.Tensor,
             one_table: bool) -> torch.Tensor:
        """(n,) int64 slots, -1 where absent. Read-only."""

    @abc.abstractmethod
    def upsert(self, *, memory: TableMemory, keys: torch.Tensor, table_ids: torch.Tensor,
               scores: Optional[torch.Tensor], rule: ScoreRule, now: int, evicts: bool,
               one_table: bool) -> Upserted:
        """Finds or inserts every key (the inserting procedure of docs/ARCHITECTURE.md,
        steps 4-6): keys in input order per bucket, growing ``memory`` for full
        buckets while it may. Returns final slots; no slot stays pinned."""

    @abc.abstractmethod
    def dedup_upsert(self, *, memory: TableMemory, keys: torch.Tensor,
                     table_ids: torch.Tensor, frequencies: Optional[torch.Tensor], now: int,
                     evicts: bool, one_table: bool) -> Tuple[Deduplicated, Upserted]:
        """``dedup(group=True)`` then ``upsert`` of the unique keys with the clock rule,
        which a backend may overlap."""

    def padded_dedup_upsert(self, *, memory: TableMemory, keys: torch.Tensor,
                            table_ids: torch.Tensor, frequencies: Optional[torch.Tensor],
                            rule: ScoreRule, time: torch.Tensor, now_index: int,
                            evicts: bool, one_table: bool, error: Optional[torch.Tensor],
                            outcomes: torch.Tensor, size: torch.Tensor,
                            part: Optional["BatchPart"] = None) -> Tuple[Deduplicated, Upserted]:
        """``dedup_upsert`` with every size, count and clock left on the device (only
        where ``counts_on_device``, into a table that cannot grow): the dedup is
        padded to the N keys.

        Args:
            rule: CLOCK, or a count rule whose scores are the dedup's counts.
            time: (2,) int64, the table's clock and step: advanced by one, then
                ``time[now_index]`` is the call's time (its scores).
            error: (1,) int64 or None: a batch whose word is set has no unique key
                and changes nothing (not even ``time``).
            outcomes: (4,) int64 totals the call adds its hits, inserts, evicting
                inserts and failures to (``Upserted``'s four counts are None).
            size: (1,) int64, the table's size, advanced by the inserts into
                empty slots.
            part: only the keys of one group of the batch (``BatchPart``).
        """
        raise NotImplementedError(f"{type(self).__name__} reads its counts on the host")

    def padded_dedup(self, *, keys: torch.Tensor, table_ids: torch.Tensor,
                     error: Optional[torch.Tensor],
                     part: Optional["BatchPart"] = None) -> Deduplicated:
        """``dedup`` (not grouped) padded to the N keys, the unique count left on the
        device; ``error``: a batch whose word is set has no unique key; ``part``:
        only the keys of one group (only where ``counts_on_device``)."""
        raise NotImplementedError(f"{type(self).__name__} reads its counts on the host")

    def padded_upsert(self, *, memory: TableMemory, keys: torch.Tensor,
                      table_ids: torch.Tensor, scores: Optional[torch.Tensor],
                      buckets: torch.Tensor, rule: ScoreRule, evicts: bool, one_table: bool,
                      outcomes: torch.Tensor, size: torch.Tensor) -> Upserted:
        """One inserting pass over unique keys with their buckets given ((n,) int32;
        ``KNO_BUCKET``: skipped, slot -1, FAILED, counted nowhere), into a table that
        cannot grow, every count on the device: ``outcomes`` (4,) += the pass's
        InsertStatus counts, ``size`` (1,) += its inserts into empty slots (only
        where ``counts_on_device``)."""
        raise NotImplementedError(f"{type(self).__name__} reads its counts on the host")

    def padded_erase(self, *, memory: TableMemory, keys: torch.Tensor,
                     table_ids: torch.Tensor, status: torch.Tensor, which: int,
                     erased: torch.Tensor, size: torch.Tensor) -> None:
        """Erases ``keys[i]`` where ``status[i] == which`` (distinct keys); ``erased``
        (1,) += and ``size`` (1,) -= the keys found (only where ``counts_on_device``)."""
        raise NotImplementedError(f"{type(self).__name__} reads its counts on the host")

    def promotion_plan(self, *, cache: TableMemory, keys: torch.Tensor,
                       table_ids: torch.Tensor, counts: torch.Tensor,
                       host_slots: torch.Tensor, one_table: bool,
                       cache_size: torch.Tensor) -> "PromotionPlan":
        """Which of a padded batch's unique keys (``counts`` 0: padding; ``host_slots``
        -1: not stored) a cache takes, on the device: ``TieredStorage``'s policy
        (hits first; every miss when they fit in ``cache``'s free slots, else the
        misses seen more than once, hottest first, as many as fit beside the hits)
        (only where ``counts_on_device``)."""
        raise NotImplementedError(f"{type(self).__name__} reads its counts on the host")

    def promotion_order(self, *, order: torch.Tensor, keys: torch.Tensor,
                        table_ids: torch.Tensor, host_slots: torch.Tensor,
                        host: TableMemory, plan: "PromotionPlan",
                        cache: TableMemory) -> Tuple[torch.Tensor, ...]:
        """The cache call's (keys, table ids, scores, buckets) in ``order`` (the
        keys by descending ``plan.rank``): the host store's scores, and
        ``KNO_BUCKET`` past the keys the plan takes (only where ``counts_on_device``)."""
        raise NotImplementedError(f"{type(self).__name__} reads its counts on the host")

    def promote_rows(self, *, host: TableMemory, cache: TableMemory, order: torch.Tensor,
                     host_slots: torch.Tensor, cached: Upserted,
                     refs: torch.Tensor) -> None:
        """After the cache call ``cached`` (in ``order``): victims' rows written back to
        the host store, new keys' rows copied in from it, and refs (n,) = each unique
        key's row reference (its cache slot, else its host slot with HOST_ROW_BIT,
        else -1) (only where ``counts_on_device``)."""
        raise NotImplementedError(f"{type(self).__name__} reads its counts on the host")

    def init_new_rows(self, *, values: torch.Tensor, slots: torch.Tensor,
                      status: torch.Tensor, keys: torch.Tensor, table_ids: torch.Tensor,
                      dim: int, spec: InitSpec, state_value: float) -> None:
        """values[slots[i]] = the full initial row (initializer, then ``state_value``
        for the optimizer state) of each key whose ``status`` is INSERTED or
        EVICTED_AND_INSERTED (only where ``counts_on_device``)."""
        raise NotImplementedError(f"{type(self).__name__} reads its counts on the host")

    @abc.abstractmethod
    def undo_upsert(self, *, memory: TableMemory, upserted: Upserted) -> None:
        """Reverts an ``upsert``'s contents and scores (growth stays)."""

    @abc.abstractmethod
    def grow(self, *, memory: TableMemory) -> None:
        """Doubles the buckets of ``memory`` in place; every entry keeps its offset in
        its bucket and its row."""

    @abc.abstractmethod
    def erase(self, *, memory: TableMemory, keys: torch.Tensor,
              table_ids: torch.Tensor) -> torch.Tensor:
        """(n,) bool: True where the key was present (its first occurrence only)."""

    @abc.abstractmethod
    def expire(self, *, memory: TableMemory, time_mask: int, before: int) -> torch.Tensor:
        """TTL sweep: empties every slot whose last access (``score & time_mask``) is
        below ``before``; returns (capacity,) bool, the slots it emptied (their key,
        table id and score stay readable until reused)."""

    @abc.abstractmethod
    def occupied_slots(self, *, memory: TableMemory, start: int, end: int) -> torch.Tensor:
        """Occupied slots of [start, end), ascending."""

    @abc.abstractmethod
    def dedup(self, *, keys: torch.Tensor, table_ids: torch.Tensor,
              frequencies: Optional[torch.Tensor], group: bool) -> Deduplicated:
        """Unique pairs in first-occurrence order; ``starts``/``rank`` when ``group``."""

    # ------------------------------------------------------------- embedding
    @abc.abstractmethod
    def check_offsets(self, *, offsets: torch.Tensor, num_indices: int,
                      error: Optional[torch.Tensor] = None) -> Optional[int]:
        """0 if ``offsets`` go from 0 to ``num_indices`` without decreasing; 1 or 2 if
        the first or last is wrong; 3 if they decrease. With ``error`` ((1,) int64
        word, only where ``counts_on_device``): the problem goes into the word
        (``error_code`` reads it) and None is returned, nothing read on the host."""

    @abc.abstractmethod
    def init_rows(self, *, out: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor,
                  stream: int, dim: int, mode: DynamicEmbInitializerMode, mean: float,
                  std_dev: float, lower: float, upper: float, value: float,
                  seed: int) -> None:
        """out[rows[i], :dim] = the initial row of keys[i] in table ``stream``."""

    # The embedding verbs take the module's error word (``check_offsets``) where the
    # backend counts on the device: a batch whose word is set reads no offsets,
    # pools to zeros and updates nothing. None: the batch was checked on the host.

    @abc.abstractmethod
    def pooled_forward(self, *, sources: RowSources, row_ref: torch.Tensor,
                       inverse: torch.Tensor, offsets: torch.Tensor,
                       weights: Optional[torch.Tensor], feature_col: torch.Tensor,
                       batch: int, dim: int, mean: bool, out: torch.Tensor,
                       error: Optional[torch.Tensor] = None) -> None:
        """Writes the pooled bags of one group's features into their columns of ``out``."""

    @abc.abstractmethod
    def sequence_forward(self, *, sources: RowSources, row_ref: torch.Tensor,
                         inverse: torch.Tensor, dim: int, out: torch.Tensor,
                         error: Optional[torch.Tensor] = None) -> None:
        """Writes the row of each of one group's lookups into its row of ``out``."""

    @abc.abstractmethod
    def fused_backward(self, *, sources: RowSources, row_ref: torch.Tensor,
                       starts: torch.Tensor, rank: torch.Tensor,
                       offsets: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                       feature_col: torch.Tensor, batch: int, dim: int, mean: bool,
                       grad: torch.Tensor, update: OptimizerUpdate,
                       error: Optional[torch.Tensor] = None,
                       schedule: Optional[DeviceSchedule] = None,
                       sums: Optional[torch.Tensor] = None) -> int:
        """Sums each stored row's gradient and applies the optimizer to it in place
        (``offsets`` None: sequence lookups). Rows with no lookup (padding) and rows
        not stored are skipped. ``schedule`` (where ``counts_on_device``): the
        learning rate and step count are read from device memory, not from
        ``update``. ``sums`` (where ``free_host_reads``): (>= U, dim) float32, the
        rows' gradients as ``sum_gradients`` wrote them for this batch; the update
        reads them instead of summing ``grad`` again.

        Returns:
            Where ``free_host_reads``: how many unique rows' summed gradients (of
            those not given in ``sums``) held NaN or inf; those rows and their
            optimizer state are left unchanged. Elsewhere 0: gradient values are
            not checked (a check would wait for the device).
        """

    def sum_gradients(self, *, starts: torch.Tensor, rank: torch.Tensor,
                      offsets: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                      feature_col: torch.Tensor, batch: int, mean: bool,
                      grad: torch.Tensor, out: torch.Tensor) -> int:
        """The backward's first half, where ``free_host_reads``: out[u] = the summed
        gradient of unique row u (U = starts.numel() - 1; the grouping of
        ``fused_backward``), for every unique row.

        Args:
            out (Tensor): (>= U, dim) float32, written.

        Returns:
            How many rows' sums hold NaN or inf. A non-finite value of ``grad`` (or
            of a weight) reaches the sum of every row that reads it, so a caller
            that updates nothing when this is non-zero refuses the batch without a
            pass of its own over ``grad``.

        Raises:
            NotImplementedError: on a backend whose count would wait for the device.
        """
        raise NotImplementedError(
            f"{type(self).__name__}: the non-finite count of the summed gradients would "
            "wait for the device; its step does not check gradient values")

    @abc.abstractmethod
    def per_sample_weight_grad(self, *, sources: RowSources, row_ref: torch.Tensor,
                               inverse: torch.Tensor, offsets: torch.Tensor,
                               feature_col: torch.Tensor, batch: int, dim: int,
                               grad: torch.Tensor, out: torch.Tensor,
                               error: Optional[torch.Tensor] = None) -> None:
        """out[j] = <row of lookup j, gradient of its bag> for one group's lookups."""
