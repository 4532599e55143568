"""``Backend``: the verbs every kernel backend offers over tensors of one device type."""

import abc
from typing import Optional, Sequence, Tuple

import torch

from dynamicemb.ops.codes import ScoreRule
from dynamicemb.ops.records import (BatchPart, Deduplicated, DeviceSchedule, InitSpec,
                                    OptimizerUpdate, PromotionPlan, Rounding, RowFormat,
                                    RowSources, TableMemory, Upserted)
from dynamicemb.options import DynamicEmbInitializerMode

__all__ = ["Backend"]


class Backend(abc.ABC):
    """The kernels of one device type. Every verb takes keyword arguments only; the
    batch tensors must be on the backend's device and contiguous, ids int64, table
    ids int16. Validation of user input happens above (the table and the module);
    a backend checks only what would corrupt memory."""

    #: The widest embedding row its kernels update, or None for no limit.
    max_dim: Optional[int] = None
    #: The embedding dtypes of the stored rows its kernels read and write (``RowFormat``).
    row_dtypes: Tuple[torch.dtype, ...] = (torch.float32,)
    #: Whether reading a value of its tensors on the host costs nothing (the CPU) or
    #: waits for the device (a GPU: checks of data that need one are left out of a step).
    free_host_reads: bool = True

    # ------------------------------------------------------------ allocation
    @abc.abstractmethod
    def zeros(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Zeroed memory for a table's arrays (the backend picks how: huge pages...)."""

    def host_zeros(self, shape: Sequence[int], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
        """Zeroed host memory that this backend's kernels and torch ops on ``device`` read
        and write in place (a host store's rows); on the CPU, ``zeros``."""
        return self.zeros(shape, dtype, device)

    def new_table(self, *, num_buckets: int, max_num_buckets: int, bucket_capacity: int,
                  value_dim: int, value_dtype: torch.dtype, device: torch.device,
                  values_in_host_memory: bool = False) -> TableMemory:
        """An empty table; value rows in host memory when ``values_in_host_memory``."""
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
               scores: Optional[torch.Tensor], rule: ScoreRule, evicts: bool, one_table: bool,
               outcomes: torch.Tensor, size: torch.Tensor,
               buckets: Optional[torch.Tensor] = None, time: Optional[torch.Tensor] = None,
               now_index: int = 0, ttl: int = 0) -> Upserted:
        """One inserting pass (docs/ARCHITECTURE.md, steps 4-6): a bucket's keys in input
        order (a repeated key hits its first occurrence's slot); a full bucket evicts
        where ``evicts``, else fails the key. Every count stays on the device.

        Args:
            scores: (n,) int64, the given or counted scores (None: the clock rule).
            outcomes: (5,) int64, += the InsertStatus counts, then the hits on rows
                expired under ``ttl`` (0: none), which are inserts.
            size: (1,) int64, += the inserts into empty slots.
            buckets: (n,) int32, each key's bucket (``buckets_where``; ``KNO_BUCKET``:
                skipped, slot -1, FAILED, counted nowhere); None: by hash.
            time: (2,) int64 clock and step, read on the device: the call's time is
                ``time[now_index]``; None: 0.
        """

    @abc.abstractmethod
    def dedup_upsert(self, *, memory: TableMemory, keys: torch.Tensor,
                     table_ids: torch.Tensor, frequencies: Optional[torch.Tensor],
                     rule: ScoreRule, time: torch.Tensor, now_index: int, evicts: bool,
                     one_table: bool, error: Optional[torch.Tensor], outcomes: torch.Tensor,
                     size: torch.Tensor, part: Optional["BatchPart"] = None,
                     table_scores: Optional[torch.Tensor] = None,
                     ttl: int = 0) -> Tuple[Deduplicated, Upserted]:
        """``dedup(group=True)`` then ``upsert`` of its unique keys (a backend may overlap
        them); nothing is read on the host.

        Args:
            rule: CLOCK; a count rule (scores: the dedup's counts); or GIVEN
                (CUSTOMIZED: scores ``table_scores``, read by table id).
            time: (2,) int64 clock and step: advanced by one, then ``time[now_index]``
                is the call's time.
            error: (1,) int64 or None: a batch whose word is set has no unique key and
                changes nothing (not even ``time``).
            outcomes, size, ttl: as ``upsert``'s.
            part: only the keys of one group (``BatchPart``).
            table_scores: (T,) int64, each logical table's score (GIVEN).
        """

    @abc.abstractmethod
    def dedup(self, *, keys: torch.Tensor, table_ids: torch.Tensor,
              error: Optional[torch.Tensor], part: Optional["BatchPart"] = None,
              frequencies: Optional[torch.Tensor] = None, group: bool = False,
              time: Optional[torch.Tensor] = None) -> Deduplicated:
        """The unique (table id, key) pairs of a batch (``Deduplicated``, padded to N), the
        unique count left on the device; ``error`` and ``part`` as ``dedup_upsert``'s.

        Args:
            frequencies (Tensor, optional): (N,) int64, summed into the counts.
            group: also group the lookups by unique key (``starts`` (N + 1,), past U the
                lookup count; ``rank`` (N,)); else both None.
            time (Tensor, optional): (2,) int64 clock and step, advanced by one unless
                ``error`` refuses the batch.
        """

    @abc.abstractmethod
    def erase_where(self, *, memory: TableMemory, keys: torch.Tensor,
                     table_ids: torch.Tensor, status: torch.Tensor, which: int,
                     erased: torch.Tensor, size: torch.Tensor) -> None:
        """Erases ``keys[i]`` where ``status[i] == which`` (distinct keys); ``erased``
        (1,) += and ``size`` (1,) -= the keys found."""

    @abc.abstractmethod
    def promotion_plan(self, *, cache: TableMemory, keys: torch.Tensor,
                       table_ids: torch.Tensor, counts: torch.Tensor,
                       host_slots: torch.Tensor, one_table: bool,
                       cache_size: torch.Tensor) -> "PromotionPlan":
        """Which of a step batch's unique keys a cache takes, on the device (``counts`` 0:
        padding; ``host_slots`` -1: not stored): hits first; every miss if all fit in the
        free slots, else the misses seen more than once, hottest first, as many as fit."""

    @abc.abstractmethod
    def promotion_order(self, *, order: torch.Tensor, keys: torch.Tensor,
                        table_ids: torch.Tensor, host_slots: torch.Tensor,
                        host: TableMemory, plan: "PromotionPlan",
                        cache: TableMemory) -> Tuple[torch.Tensor, ...]:
        """The cache call's (keys, table ids, scores, buckets) in ``order`` (descending
        ``plan.rank``): the host store's scores; ``KNO_BUCKET`` past the keys the plan takes."""

    @abc.abstractmethod
    def promote_rows(self, *, host: TableMemory, cache: TableMemory, order: torch.Tensor,
                     host_slots: torch.Tensor, cached: Upserted,
                     refs: torch.Tensor) -> None:
        """After the cache call ``cached`` (in ``order``): victims written back to the host
        store, new keys' rows copied in, and refs (n,) = each unique key's reference (cache
        slot, else host slot | HOST_ROW_BIT, else -1)."""

    @abc.abstractmethod
    def init_rows(self, *, values: torch.Tensor, slots: torch.Tensor,
                  status: Optional[torch.Tensor], keys: torch.Tensor, table_ids: torch.Tensor,
                  dim: int, spec: InitSpec, format: RowFormat,
                  state_value: float = 0.0) -> None:
        """values[slots[i]] = the initial row of keys[i]: table ``table_ids[i]``'s initializer
        in ``spec`` for the first ``dim`` columns, ``state_value`` after; with ``status``,
        only for keys INSERTED or EVICTED_AND_INSERTED. ``format``: the rows'; a 16-bit
        row stores its initializer rounded to nearest."""

    @abc.abstractmethod
    def undo_upsert(self, *, memory: TableMemory, upserted: Upserted) -> None:
        """Reverts an ``upsert``'s contents and scores (growth stays)."""

    @abc.abstractmethod
    def grow(self, *, memory: TableMemory) -> None:
        """Doubles the buckets in place; every entry keeps its offset in its bucket and its row."""

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

    # ------------------------------------------------------------- embedding
    @abc.abstractmethod
    def check_offsets(self, *, offsets: torch.Tensor, num_indices: int,
                      error: Optional[torch.Tensor] = None) -> Optional[int]:
        """0 if ``offsets`` go from 0 to ``num_indices`` without decreasing; 1 or 2 if the
        first or last is wrong; 3 if they decrease. With ``error`` ((1,) int64 word): the
        problem goes into the word (``offsets_problem``), None is returned, no host read."""

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
                       sums: Optional[torch.Tensor] = None,
                       rounding: Optional[Rounding] = None) -> int:
        """Sums each stored row's gradient and applies the optimizer in place (``offsets``
        None: sequence lookups); padding and rows not stored are skipped. ``schedule``:
        lr and step count read from device memory, not ``update``. ``sums`` (where
        ``free_host_reads``): (>= U, dim) float32 from ``sum_gradients`` for this batch,
        read instead of summing ``grad`` again. ``rounding``: how 16-bit rows
        (``sources.format``) are written back, required for them; computed in float32.

        Returns:
            Where ``free_host_reads``: how many unique rows' sums (of those not in
            ``sums``) held NaN or inf; those rows and their state are left unchanged.
            Elsewhere 0 (values unchecked: a check would wait for the device).
        """

    def sum_gradients(self, *, starts: torch.Tensor, rank: torch.Tensor,
                      offsets: Optional[torch.Tensor], weights: Optional[torch.Tensor],
                      feature_col: torch.Tensor, batch: int, mean: bool,
                      grad: torch.Tensor, out: torch.Tensor,
                      error: Optional[torch.Tensor] = None) -> int:
        """The backward's first half, where ``free_host_reads``: out[u] = the summed
        gradient of unique row u (U = starts.numel() - 1, grouped as ``fused_backward``).

        Args:
            out (Tensor): (>= U, dim) float32, written.
            error (Tensor): the module's (1,) int64 error word, or None; set: nothing is
                written and 0 returned.

        Returns:
            How many rows' sums hold NaN or inf. A non-finite ``grad`` or weight reaches
            every row that reads it, so a caller can refuse the batch on this alone.

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
