"""``ScoredHashTable``: the policy (growth, clock, failures, stats) over the backend's verbs.
The contract is docs/ARCHITECTURE.md, "The scored hash table"."""

import logging
from typing import Callable, Optional, Tuple

import torch

from dynamicemb.ops import for_device, resolve_device
from dynamicemb.ops.interface import (ALL_BITS, COMPOUND_TIME_MASK, KNO_BUCKET, BatchPart,
                                      Deduplicated, Entries, InsertStatus, ScoreRule,
                                      TableMemory, Upserted, num_buckets_for, score_rule)
from dynamicemb.options import check_ttl
from dynamicemb.table.checks import (TableInputs, check_frequencies, check_keys,
                                     table_ids_as_int16)
from dynamicemb.table.device_counts import DeviceCounters, DeviceTotals, capturing
from dynamicemb.table.growth import DEVICE_TOTALS, ERASED, OUTCOMES, GrowthWatch
from dynamicemb.table.pending import PendingInsert
from dynamicemb.table.time import TableTime
from dynamicemb.table.results import Expired, InsertResult, TableStats, expired_hits
from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbScoreStrategy

__all__ = ["MAX_TABLES", "ScoredHashTable", "hash_keys"]

logger = logging.getLogger(__name__)

#: Table ids are stored as int16 per slot.
MAX_TABLES = 32767


def hash_keys(keys: torch.Tensor, table_ids: torch.Tensor) -> torch.Tensor:
    """(n,) int64: the table's 64-bit hash (bit-cast) of (n,) int64 ``keys`` in tables
    ``table_ids`` (n,) int16/int32/int64 in [0, MAX_TABLES)."""
    check_keys(keys)
    tids = table_ids_as_int16(table_ids, keys.numel(), MAX_TABLES)
    return for_device(keys.device).hash_keys(keys=keys.contiguous(), table_ids=tids)


class ScoredHashTable:
    """A bucketed hash table from (table id, int64 key) to a slot and a score.

    Several logical tables share one physical table; value rows live in ``values``
    (``[capacity, value_dim]``) by slot.

    Args:
        num_tables: logical tables sharing this one (1 to 32767).
        capacity: initial slots; rounded up to ``bucket_capacity * 2**k``.
        bucket_capacity: slots per bucket, a positive multiple of 16.
        score_strategy: how scores are set and whether full buckets evict.
        max_load_factor: the table doubles before a call when size exceeds this
            fraction of capacity (up to ``max_capacity``), in (0, 1].
        max_capacity: the most slots growth may reach (default ``capacity``),
            rounded up like ``capacity``.
        value_dim, value_dtype: a value row's width (0: keys only) and dtype.
        check_mode: what a failed insert does (see ``DynamicEmbCheckMode``).
        device: where the tensors live (CPU or CUDA).
        values_in_host_memory: value rows in host memory that the device's kernels
            use in place (CUDA: pinned and mapped; the index stays on the GPU).
        ttl: row lifetime in ticks of ``now`` (None: none); a row last accessed more
            than ``ttl`` ticks before a call's time is absent to it (an insert gives
            it a fresh row). Needs LRU, STEP, NO_EVICTION or LRU_LFU scores.

    Example::

        table = ScoredHashTable(capacity=1024, value_dim=4)
        result = table.find_or_insert(torch.tensor([7, 42, 7]))
        table.values[result.slots] += 1.0
        assert (table.find(torch.tensor([42])) == result.slots[1]).all()
    """

    def __init__(
        self,
        num_tables: int = 1,
        capacity: int = 1024,
        bucket_capacity: int = 128,
        score_strategy: DynamicEmbScoreStrategy = DynamicEmbScoreStrategy.LRU,
        max_load_factor: float = 0.5,
        max_capacity: Optional[int] = None,
        value_dim: int = 0,
        value_dtype: torch.dtype = torch.float32,
        check_mode: DynamicEmbCheckMode = DynamicEmbCheckMode.IGNORE,
        device: torch.device = torch.device("cpu"),
        ttl: Optional[int] = None,
        values_in_host_memory: bool = False,
    ) -> None:
        if not 1 <= num_tables <= MAX_TABLES:
            raise ValueError(f"num_tables must be in [1, {MAX_TABLES}], got {num_tables}")
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if bucket_capacity <= 0 or bucket_capacity % 16 != 0:
            raise ValueError(
                f"bucket_capacity must be a positive multiple of 16, got {bucket_capacity}"
            )
        max_capacity = capacity if max_capacity is None else max_capacity
        if max_capacity < capacity:
            raise ValueError(
                f"max_capacity ({max_capacity}) must not be below capacity ({capacity})"
            )
        if not 0.0 < max_load_factor <= 1.0:
            raise ValueError(f"max_load_factor must be in (0, 1], got {max_load_factor}")
        if value_dim < 0:
            raise ValueError(f"value_dim must be >= 0, got {value_dim}")
        self.num_tables = num_tables
        self.bucket_capacity = bucket_capacity
        self.score_strategy = DynamicEmbScoreStrategy(score_strategy)
        check_ttl(ttl, self.score_strategy)
        self.ttl = ttl
        self.check_mode = DynamicEmbCheckMode(check_mode)
        # A step's call reads its failed inserts, grows and reruns (as ERROR mode does):
        # set where every key must be stored (an external tier's host store).
        self.grows_for_failures = False
        self.max_load_factor = float(max_load_factor)
        self.value_dim = value_dim
        self.value_dtype = value_dtype
        self.device = resolve_device(device)
        self._stats = TableStats()
        self._ops = for_device(self.device)
        self._rule, self._evicts = score_rule(self.score_strategy)
        self._inputs = TableInputs(self.device, num_tables, self.score_strategy, self._rule,
                                   value_dim, value_dtype)
        self._memory = self._ops.new_table(
            num_buckets=num_buckets_for(capacity, bucket_capacity),
            max_num_buckets=num_buckets_for(max_capacity, bucket_capacity),
            bucket_capacity=bucket_capacity, value_dim=value_dim, value_dtype=value_dtype,
            device=self.device, values_in_host_memory=values_in_host_memory)
        # set on the host, advanced on the device by the kernels (and a graph's replays)
        self._stored = DeviceCounters([0], self.device)
        self._time = TableTime(self.score_strategy, ttl, self.device)
        # made here: a CUDA graph capturing the first call would zero them at each replay
        self._outcome_totals = DeviceTotals(DEVICE_TOTALS, self.device)
        self._watch = GrowthWatch(self._memory, self._stored, self._outcome_totals,
                                  self.check_mode, self._evicts, self.max_load_factor,
                                  self._ops.free_host_reads, self._grow, self._failure_message)
        self._generation = 0
        self._pending: Optional[PendingInsert] = None

    # ----------------------------------------------------------------- state
    @property
    def stats(self) -> TableStats:
        """Running counts (never reset by ``clear``); reading them is a sync."""
        self._settle_device_counts()
        return self._stats

    @property
    def _size(self) -> int:
        return self._stored.value(0)  # read from the device after inserting calls

    @_size.setter
    def _size(self, value: int) -> None:
        self._stored.set(0, value)

    @property
    def memory(self) -> TableMemory:
        """The table's arrays, for the storage's kernels (growth replaces them: hold the table)."""
        return self._memory

    @property
    def values(self) -> torch.Tensor:
        """Value rows, ``[capacity, value_dim]``, indexed by slot."""
        return self._memory.values

    @property
    def values_in_host_memory(self) -> bool:
        """Whether the value rows are in host memory the device reads in place."""
        return self._memory.values_in_host_memory

    @property
    def clock(self) -> int:
        """The logical clock: advanced by one at the start of every inserting call."""
        return self._time.clock

    @property
    def generation(self) -> int:
        """Changes when a slot returned earlier may hold another key or none."""
        return self._generation

    @property
    def step(self) -> int:
        """The score of the ``STEP`` strategy (see ``set_step``)."""
        return self._time.step

    @property
    def num_buckets(self) -> int:
        return self._memory.num_buckets

    def size(self) -> int:
        """Number of keys stored."""
        return self._size

    def capacity(self) -> int:
        """Slots now (a power-of-two number of buckets)."""
        return self._memory.capacity

    def max_capacity(self) -> int:
        """The most slots growth may reach."""
        return self._memory.max_num_buckets * self.bucket_capacity

    def load_factor(self) -> float:
        return self._size / self.capacity()

    def scores_at(self, slots: torch.Tensor) -> torch.Tensor:
        """(n,) int64 scores of (n,) int64 occupied slots (e.g. ``find``'s)."""
        self._check_idle()
        return self._memory.scores[slots]

    def set_scores_at(self, slots: torch.Tensor, scores: torch.Tensor) -> None:
        """Overwrites the (n,) int64 scores of (n,) int64 occupied slots."""
        self._check_idle()
        self._memory.scores[slots] = self._inputs.here(scores, "scores").to(torch.int64)

    def memory_bytes(self) -> dict:
        """Bytes held: ``metadata`` (keys, scores, ids, digests, bits) and ``values``."""
        meta = sum(t.numel() * t.element_size() for t in self._memory.meta)
        values = self._memory.values
        return {"metadata": meta, "values": values.numel() * values.element_size()}

    @property
    def now(self) -> int:
        """The time scores record and ``ttl`` counts: the step with STEP scores, else the clock."""
        return self._time.now

    @property
    def next_time(self) -> int:
        """The time the next inserting call will record (``now`` after its tick)."""
        return self._time.next_time

    def time_of(self, scores: torch.Tensor) -> torch.Tensor:
        """(n,) int64 last-access times of scores: the score, or LRU_LFU's low 32 bits."""
        return self._time.time_of(scores)

    def expired_before(self, time: int) -> int:
        """Rows whose last access is below this have expired at ``time`` (0: none)."""
        return self._time.expired_before(time)

    def set_step(self, step: int) -> None:
        """Sets the score that the ``STEP`` strategy gives to the keys it touches."""
        self._time.set_step(step)

    def set_clock(self, clock: int) -> None:
        """Sets the clock (restoring a checkpoint): the next call scores LRU keys ``clock + 1``."""
        self._check_idle()
        self._time.set_clock(clock)

    def clear(self) -> None:
        """Empties every slot. The clock, the step and ``stats`` stay."""
        self._check_idle()
        for array in self._memory.meta[3:]:  # digests (0: empty), occupied, pinned bits
            array.zero_()
        self._size = 0
        self._generation += 1

    # ----------------------------------------------------------------- verbs
    def find(self, keys: torch.Tensor, table_ids: Optional[torch.Tensor] = None, *,
             checked: bool = False, at_time: Optional[int] = None) -> torch.Tensor:
        """Slot of each key; never inserts and never changes a score.

        Args:
            keys (Tensor): (n,) int64.
            table_ids (Tensor, optional): (n,) int32/int64; None means table 0.
            checked: ``table_ids`` are int16 and in range, built by the caller (skips the
                range check, a host sync on a GPU).
            at_time: with a ``ttl``, rows expired at this time are absent (default
                ``now``; ``next_time``: what the next inserting call will see).

        Returns:
            (n,) int64 slots, -1 where the key is absent.
        """
        self._check_idle()
        keys = self._inputs.keys(keys)
        tids = self._inputs.table_ids(table_ids, keys.numel(), checked)
        slots = self._ops.find(memory=self._memory, keys=keys, table_ids=tids,
                               one_table=self.num_tables == 1)
        if self.ttl is None:  # nothing expires: no need of the time (on the device)
            return slots
        if at_time is None:  # ``now``, read where the kernels keep it: no sync
            before = self._time.expired_before_now()
        else:
            before = self.expired_before(at_time)
        found = slots.clamp(min=0)
        dead = (slots >= 0) & (self.time_of(self._memory.scores[found]) < before)
        return torch.where(dead, -1, slots)

    def find_or_insert(
        self,
        keys: torch.Tensor,
        table_ids: Optional[torch.Tensor] = None,
        scores: Optional[torch.Tensor] = None,
        *,
        checked: bool = False,
    ) -> InsertResult:
        """Slot of each key, inserting absent keys (their value rows are zeroed).

        Args:
            keys (Tensor): (n,) int64.
            table_ids (Tensor, optional): (n,) int32/int64; None means table 0.
            scores (Tensor, optional): (n,) int64 >= 0, only with CUSTOMIZED.
            checked: ``table_ids`` (int16) and ``scores`` were built in range by the
                caller: not read on the host.

        Returns:
            ``InsertResult`` with the evicted entries read out.
        """
        return self._prepare(keys, table_ids, scores, None, checked=checked, zero_new=True,
                             read_evicted=True).commit()

    def insert_or_assign(
        self,
        keys: torch.Tensor,
        values: Optional[torch.Tensor],
        table_ids: Optional[torch.Tensor] = None,
        scores: Optional[torch.Tensor] = None,
        *,
        exact_scores: bool = False,
    ) -> InsertResult:
        """Inserts or overwrites keys with ``values``; evictions are only counted.

        Args:
            keys (Tensor): (n,) int64.
            values (Tensor): (n, value_dim) of ``value_dtype`` (None if value_dim is 0).
            table_ids (Tensor, optional): (n,) int32/int64; None means table 0.
            scores (Tensor, optional): (n,) int64 >= 0, only with CUSTOMIZED (LFU:
                counts added), unless ``exact_scores``.
            exact_scores: store ``scores`` as given whatever the strategy (restoring
                saved rows); the call still advances the clock.

        Returns:
            ``InsertResult`` with ``evicted=None``.
        """
        return self._prepare(keys, table_ids, scores, values, assign=True,
                             exact=exact_scores).commit()

    def insert_and_evict(
        self,
        keys: torch.Tensor,
        values: Optional[torch.Tensor],
        table_ids: Optional[torch.Tensor] = None,
        scores: Optional[torch.Tensor] = None,
        *,
        exact_scores: bool = False,
    ) -> InsertResult:
        """As ``insert_or_assign``, and returns the evicted entries with their rows."""
        return self._prepare(keys, table_ids, scores, values, assign=True,
                             exact=exact_scores, read_evicted=True).commit()

    def erase(self, keys: torch.Tensor, table_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Removes (n,) int64 keys (``table_ids`` as ``find``'s); returns (n,) bool,
        True where the key was present (its first occurrence only)."""
        self._check_idle()
        keys = self._inputs.keys(keys)
        tids = self._inputs.table_ids(table_ids, keys.numel())
        erased = self._ops.erase(memory=self._memory, keys=keys, table_ids=tids)
        count = int(erased.sum())
        self._generation += count > 0
        self._size -= count
        self.stats.erases += count
        return erased

    def export_batch(
        self, start: int = 0, count: Optional[int] = None, min_score: Optional[int] = None,
        *, include_expired: bool = False,
    ) -> Entries:
        """Occupied slots of ``[start, start + count)``, rows expired at ``now`` left out.

        Args:
            start: first slot.
            count: slots to scan (default: to the end).
            min_score: keep only entries scoring at least this (default: all); LRU_LFU
                compares the score's time (``time_of``).
            include_expired: also rows expired but not swept yet (to erase them).

        Returns:
            ``Entries`` in slot order; value rows are copies.
        """
        self._check_idle()
        if start < 0 or (count is not None and count < 0):
            raise ValueError(f"start and count must be >= 0, got {start}, {count}")
        end = self.capacity() if count is None else min(self.capacity(), start + count)
        memory = self._memory
        slots = self._ops.occupied_slots(memory=memory, start=start, end=max(start, end))
        floor = max(0 if include_expired else self.expired_before(self.now),
                    0 if min_score is None else int(min_score))
        if floor > 0 or min_score is not None:
            slots = slots[self.time_of(memory.scores[slots]) >= floor]
        return Entries(
            keys=memory.keys[slots],
            table_ids=memory.table_ids[slots].long(),
            scores=memory.scores[slots],
            slots=slots,
            values=memory.values[slots],
        )

    def expire(self) -> Expired:
        """TTL sweep: frees every row last accessed more than ``ttl`` ticks before ``now``.

        Returns:
            ``Expired``, in slot order.

        Raises:
            ValueError: the table has no ``ttl``.
        """
        self._check_idle()
        if self.ttl is None:
            raise ValueError("expire() needs a table built with a ttl")
        memory = self._memory
        before = self.expired_before(self.now)
        if before == 0:
            slots = torch.empty(0, dtype=torch.int64, device=self.device)
        else:
            mask = self._ops.expire(memory=memory, before=before,
                                    time_mask=COMPOUND_TIME_MASK if self._time.compound else ALL_BITS)
            slots = mask.nonzero().squeeze(1)
        n = slots.numel()
        self._size -= n
        self._generation += n > 0
        self.stats.expired += n
        return Expired(keys=memory.keys[slots], table_ids=memory.table_ids[slots].long(),
                       scores=memory.scores[slots], slots=slots)

    # ----------------------------------------------------------------- growth
    def release_graphs(self) -> None:
        """No CUDA graph captured over this table replays any more: it may grow again."""
        self._watch.captured = False

    def _grow(self) -> None:
        if self._watch.captured:
            raise RuntimeError(
                "this table must grow, but a CUDA graph captured it and its replays use "
                "the table's arrays, which growth replaces (and frees): re-capture after "
                "growth (release_graphs(), an eager step, then capture again), or give the "
                "table init_capacity == max_capacity so that it never grows")
        self._ops.grow(memory=self._memory)
        self._generation += 1
        self._stats.growths += 1

    # -------------------------------------------------------- two-phase insert
    def prepare_find_or_insert(
        self,
        keys: torch.Tensor,
        table_ids: Optional[torch.Tensor] = None,
        scores: Optional[torch.Tensor] = None,
        *,
        checked: bool = False,
    ) -> "PendingInsert":
        """First phase of ``find_or_insert``: keys, scores and slots decided, value rows not
        yet, so a caller can make several tables' inserts atomic (``commit()`` all, or
        ``abort()`` all, newest first). Until then the table's other verbs raise
        ``RuntimeError``. ERROR mode undoes and raises here.

        Returns:
            ``PendingInsert``; ``commit()`` returns what ``find_or_insert`` returns.
        """
        return self._prepare(keys, table_ids, scores, None, checked=checked, zero_new=True,
                             read_evicted=True)

    def prepare_dedup_find_or_insert(
        self,
        keys: torch.Tensor,
        table_ids: Optional[torch.Tensor] = None,
        frequencies: Optional[torch.Tensor] = None,
        *,
        checked: bool = False,
        error: Optional[torch.Tensor] = None,
        part: Optional[BatchPart] = None,
        table_scores: Optional[torch.Tensor] = None,
    ) -> Tuple[Deduplicated, PendingInsert]:
        """The training step's insert: dedup of a batch, then ``prepare_find_or_insert`` of
        its unique pairs, nothing read on the host (clock and step advance on the device,
        counts go to ``outcome_totals``, new keys' rows are the caller's). LFU adds each
        pair's count to its score.

        Args:
            keys (Tensor): (N,) int64.
            table_ids (Tensor, optional): (N,) int16/int32/int64; None means table 0.
            frequencies (Tensor, optional): (N,) int64 >= 1, occurrences each key stands
                for (summed into ``counts``); None means 1 each.
            checked: ``table_ids`` (int16) and ``frequencies`` were built or checked by
                the caller: not read on the host.
            error (Tensor, optional): (1,) int64, the step's input-check word: when set,
                the call changes nothing.
            part (``BatchPart``, optional): the call takes only these keys.
            table_scores (Tensor, optional): (num_tables,) int64 >= 0, each logical
                table's score (CUSTOMIZED only, and then required).

        Returns:
            (``Deduplicated``, ``PendingInsert`` over its keys), padded to N entries.

        Raises:
            ValueError: ``table_scores`` missing with CUSTOMIZED or given without it.
        """
        self._check_idle()
        table_scores = self._table_scores(table_scores, checked)
        keys, tids, frequencies = self._step_inputs(keys, table_ids, frequencies, checked)
        return self._prepare_step(keys, tids, frequencies, error, part, table_scores)

    def dedup_batch(self, keys: torch.Tensor, table_ids: Optional[torch.Tensor] = None,
                    frequencies: Optional[torch.Tensor] = None, *, checked: bool = False,
                    error: Optional[torch.Tensor] = None,
                    part: Optional[BatchPart] = None) -> Deduplicated:
        """The first half of ``prepare_dedup_find_or_insert`` (same arguments): the grouped
        dedup. Clock and step advance on the device, so ``find`` answers at the time of
        the ``prepare_insert`` to come."""
        keys, tids, frequencies = self._step_inputs(keys, table_ids, frequencies, checked)
        return self._dedup_step(keys, tids, frequencies, error, part)

    def prepare_insert(self, unique: Deduplicated, admitted: torch.Tensor, *,
                       error: Optional[torch.Tensor] = None,
                       table_scores: Optional[torch.Tensor] = None) -> PendingInsert:
        """The second half of ``prepare_dedup_find_or_insert``: the insert of the keys of
        ``dedup_batch``'s ``unique`` that ``admitted`` (N,) bool takes; the others find no
        slot and are counted nowhere. ``error`` and ``table_scores`` as there."""
        table_scores = self._table_scores(table_scores, checked=True)
        return self._prepare_admitted(unique, admitted, error, table_scores)

    def _step_inputs(self, keys, table_ids, frequencies, checked: bool):
        keys = self._inputs.keys(keys)
        n = keys.numel()
        tids = self._inputs.table_ids(table_ids, n, checked)
        if not checked:
            frequencies = check_frequencies(frequencies, n, self.device)
        return keys, tids, frequencies

    def _table_scores(self, table_scores: Optional[torch.Tensor],
                      checked: bool) -> Optional[torch.Tensor]:
        customized = self.score_strategy == DynamicEmbScoreStrategy.CUSTOMIZED
        if table_scores is None:
            if customized:
                raise ValueError("with CUSTOMIZED scores, prepare_dedup_find_or_insert needs "
                                 "table_scores: the score of each logical table")
            return None
        if not customized:
            raise ValueError(f"table_scores are only accepted with the CUSTOMIZED strategy, "
                             f"this table uses {self.score_strategy.name}")
        if (not isinstance(table_scores, torch.Tensor) or table_scores.dtype != torch.int64
                or table_scores.shape != (self.num_tables,)):
            raise ValueError(f"table_scores must be a ({self.num_tables},) int64 tensor")
        self._inputs.here(table_scores, "table_scores")
        if not checked and int(table_scores.min()) < 0:
            raise ValueError("scores must be >= 0")
        return table_scores.contiguous()

    def _check_idle(self) -> None:
        if self._pending is not None:
            raise RuntimeError(
                "the table has a prepared insert: commit() or abort() it before another call")

    def _prepare(self, keys, table_ids, scores, values: Optional[torch.Tensor] = None, *,
                 assign: bool = False, exact: bool = False, checked: bool = False,
                 zero_new: bool = False, read_evicted: bool = False) -> PendingInsert:
        """The table's own inserting verbs: one pass at the next tick, rerun after growth."""
        self._check_idle()
        keys = self._inputs.keys(keys)
        n = keys.numel()
        tids = self._inputs.table_ids(table_ids, n, checked)
        given = self._inputs.given_scores(scores, n, exact, checked)
        rows = self._inputs.rows(values, n) if assign else None
        while True:
            evicts = self._watch.before_insert(n, exact=True)
            time = self._time.on_device()
            time[:1].add_(1)  # the call's tick (its clock; a STEP score is the step)
            outcomes = torch.zeros(DEVICE_TOTALS - 1, dtype=torch.int64, device=self.device)
            upserted = self._ops.upsert(
                memory=self._memory, keys=keys, table_ids=tids, scores=given,
                rule=ScoreRule.GIVEN if exact else self._rule, evicts=evicts,
                one_table=self.num_tables == 1, outcomes=outcomes,
                size=self._stored.on_device(), time=time, now_index=self._time.index,
                ttl=self.ttl or 0)
            pending = PendingInsert(self, upserted, outcomes=outcomes, rows=rows,
                                    zero_new=zero_new, read_evicted=read_evicted)
            self._pending = pending
            if not self._grown_for_failures(pending, lambda: n):
                break
        self._watch.after_insert()
        failed = pending.num_failed
        if failed and self.check_mode == DynamicEmbCheckMode.WARNING:
            logger.warning(self._failure_message(failed, n))
        return pending

    def _failure_message(self, failed: int, n: int) -> str:
        return (
            f"{failed} of {n} keys found no slot: every slot of their bucket is in use "
            f"by this call, or the table is full at max_capacity={self.max_capacity()} "
            f"with {self.score_strategy.name}"
        )

    # --------------------------------------------------- the step's calls
    def outcome_totals(self) -> DeviceTotals:
        """Inserting calls' counts (hits, inserted, evicted, failed, expired, erased)."""
        return self._outcome_totals

    def size_on_device(self) -> torch.Tensor:
        """(1,) int64: the number of keys stored, in device memory."""
        return self._stored.on_device()

    def _settle_device_counts(self) -> None:
        _, inserted, evicted, failed, expired, erased = self._outcome_totals.take("table")
        self._stats.inserts += inserted + evicted
        self._stats.evictions += evicted
        self._stats.failed_inserts += failed
        self._stats.expired += expired
        self._stats.erases += erased

    def _prepare_step(self, keys, tids, frequencies, error, part,
                      table_scores: Optional[torch.Tensor] = None
                      ) -> Tuple[Deduplicated, PendingInsert]:
        """A step's fused dedup and pass, counted on the device."""
        self._check_step_call()
        while True:
            evicts = self._watch.before_insert(keys.numel())
            unique, upserted = self._ops.dedup_upsert(
                memory=self._memory, keys=keys, table_ids=tids, frequencies=frequencies,
                rule=self._rule, time=self._time.on_device(), now_index=self._time.index,
                evicts=evicts, one_table=self.num_tables == 1, error=error,
                outcomes=self._outcome_totals.tensor[OUTCOMES],
                size=self._stored.on_device(), part=part, table_scores=table_scores,
                ttl=self.ttl or 0)
            pending = PendingInsert(self, upserted, error=error, ticked_step=True,
                                    counts_of_dedup=unique.counts)
            self._pending = pending
            if not self._rerun_for_failures(pending, unique):
                break
        self._watch.after_insert()
        return unique, pending

    def _check_step_call(self) -> None:
        self._check_idle()
        if self.check_mode == DynamicEmbCheckMode.ERROR and capturing():
            raise RuntimeError(
                "safe_check_mode ERROR reads each insert's failures on the host, which a "
                "CUDA graph cannot capture: capture a table in WARNING or IGNORE mode")

    def _rerun_for_failures(self, pending: PendingInsert, unique: Deduplicated) -> bool:
        if not (self.check_mode == DynamicEmbCheckMode.ERROR or self.grows_for_failures):
            return False
        return self._grown_for_failures(pending, lambda: int((unique.counts > 0).sum()))

    def _grown_for_failures(self, pending: PendingInsert, num_keys: Callable[[], int]) -> bool:
        """After a call that read its failures: True if undone and grown (run it again)."""
        failed = pending.num_failed
        if not failed or not (self.check_mode == DynamicEmbCheckMode.ERROR
                              or self._memory.can_grow):
            return False
        pending.abort()
        if not self._memory.can_grow:
            self._stats.failed_inserts += failed  # (what the abort took back)
            raise RuntimeError(self._failure_message(failed, num_keys())
                               + "; the call was undone")
        self._grow()  # the keys of full buckets get room: the call again
        return True

    def _dedup_step(self, keys, tids, frequencies, error, part) -> Deduplicated:
        self._check_step_call()
        return self._ops.dedup(keys=keys, table_ids=tids, error=error, part=part,
                               frequencies=frequencies, group=True,
                               time=self._time.on_device())

    def _prepare_admitted(self, unique: Deduplicated, admitted: torch.Tensor, error,
                          table_scores: Optional[torch.Tensor]) -> PendingInsert:
        """The pass after ``_dedup_step`` over the ``admitted`` keys, as the fused call's (the
        others get ``KNO_BUCKET``); a rerun ticks again the time its undo took back."""
        self._check_step_call()
        admitted = admitted & (unique.counts > 0)  # padding: count 0
        time = self._time.on_device()
        while True:
            evicts = self._watch.before_insert(unique.keys.numel())  # (may grow: buckets after)
            upserted = self._ops.upsert(
                memory=self._memory, keys=unique.keys, table_ids=unique.table_ids,
                scores=self._pass_scores(unique, table_scores),
                buckets=self.buckets_where(unique.keys, unique.table_ids, admitted),
                rule=self._rule, evicts=evicts,
                one_table=self.num_tables == 1,
                outcomes=self._outcome_totals.tensor[OUTCOMES], size=self._stored.on_device(),
                time=time, now_index=self._time.index, ttl=self.ttl or 0)
            pending = PendingInsert(self, upserted, error=error, ticked_step=True,
                                    counts_of_dedup=unique.counts, admitted=admitted)
            self._pending = pending
            if not self._rerun_for_failures(pending, unique):
                break
            time.add_(1 if error is None else (error == 0).to(torch.int64))
        self._watch.after_insert()
        return pending

    def _pass_scores(self, unique: Deduplicated,
                     table_scores: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if self._rule == ScoreRule.CLOCK:
            return None
        if self._rule == ScoreRule.GIVEN:
            return table_scores.index_select(0, unique.table_ids.long())
        return unique.counts

    def buckets_where(self, keys: torch.Tensor, table_ids: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
        """(n,) int32: each key's bucket where ``mask`` (n,) bool, else ``KNO_BUCKET`` (what
        ``upsert_where`` skips); ``table_ids`` int16."""
        home = torch.bitwise_and(self._ops.hash_keys(keys=keys, table_ids=table_ids),
                                 self._memory.num_buckets - 1)
        return torch.where(mask, home, KNO_BUCKET).to(torch.int32)

    def upsert_where(self, keys: torch.Tensor, table_ids: torch.Tensor,
                     scores: Optional[torch.Tensor], buckets: torch.Tensor,
                     tick: Optional[torch.Tensor] = None) -> Upserted:
        """One inserting pass over unique ``keys`` (int16 ``table_ids``) into ``buckets``
        (``buckets_where``), counted on the device; scores by the table's rule (``scores``:
        CUSTOMIZED's, or counts) at time 0, or after the clock advanced by ``tick`` ((1,)
        int64, 0 or 1)."""
        if (self._memory.can_grow or self.ttl is not None
                or self.check_mode == DynamicEmbCheckMode.ERROR):
            raise ValueError("upsert_where needs a table without a ttl that cannot grow "
                             "(its buckets are given) and does not raise failed inserts")
        self._check_idle()
        given = self._inputs.given_scores(scores, keys.numel(), checked=True)
        time = None
        if tick is not None:
            time = self._time.on_device()
            time[:1].add_(tick)
        evicts = self._watch.before_insert(keys.numel())
        upserted = self._ops.upsert(
            memory=self._memory, keys=keys, table_ids=table_ids, scores=given, buckets=buckets,
            rule=self._rule, evicts=evicts, one_table=self.num_tables == 1,
            outcomes=self._outcome_totals.tensor[OUTCOMES], size=self._stored.on_device(),
            time=time, now_index=self._time.index)
        self._generation += 1  # whether it evicted or moved a key is not read
        self._watch.after_insert()
        return upserted

    def erase_where(self, keys: torch.Tensor, table_ids: torch.Tensor, status: torch.Tensor,
                     which: InsertStatus) -> None:
        """Erases ``keys[i]`` where ``status[i] == which`` (distinct keys); counts on the device."""
        self._check_idle()
        self._ops.erase_where(memory=self._memory, keys=keys, table_ids=table_ids,
                               status=status, which=int(which),
                               erased=self._outcome_totals.tensor[ERASED],
                               size=self._stored.on_device())
        self._generation += 1

    def _undo_counts(self, pending: PendingInsert) -> None:
        """Takes back what an undone call advanced on the device (time, totals, size)."""
        upserted = pending.upserted
        status = upserted.status
        done = 1 if pending.error is None else (pending.error == 0).to(torch.int64)
        time = self._time.on_device()
        (time if pending.ticked_step else time[:1]).sub_(done)
        if pending.outcomes is not None:  # its own counts: only the size to take back
            self._stored.on_device().sub_(pending.outcomes[InsertStatus.INSERTED])
            return
        added = [pending.taken(status == s).sum() for s in range(4)]
        expired = pending.taken(expired_hits(upserted)).sum()
        added[InsertStatus.INSERTED] = added[InsertStatus.INSERTED] - expired
        added = torch.stack(added + [expired])
        self._outcome_totals.tensor[OUTCOMES].sub_(added)  # (a view: the totals themselves)
        self._stored.on_device().sub_(added[InsertStatus.INSERTED])

    # ------------------------------------ what a PendingInsert asks of its table
    def record_commit(self, pending: PendingInsert) -> None:
        """Ends ``pending``; bumps ``generation`` if a slot may have changed key."""
        self._pending = None
        if pending.outcomes is None:  # a step's call: its counts stay on the device
            self._generation += self._evicts or self.ttl is not None
            return
        _, inserted, evicted, failed, expired = pending.counts()
        self._stats.inserts += inserted + evicted
        self._stats.evictions += evicted
        self._stats.failed_inserts += failed
        self._stats.expired += expired
        self._generation += evicted > 0 or expired > 0

    def undo_insert(self, pending: PendingInsert) -> None:
        """Ends ``pending`` and undoes it (growth stays)."""
        self._pending = None
        self._ops.undo_upsert(memory=self._memory, upserted=pending.upserted)
        self._undo_counts(pending)

    def __repr__(self) -> str:
        return (
            f"ScoredHashTable(num_tables={self.num_tables}, size={self._size}, "
            f"capacity={self.capacity()}, max_capacity={self.max_capacity()}, "
            f"bucket_capacity={self.bucket_capacity}, "
            f"score_strategy={self.score_strategy.name}, value_dim={self.value_dim})"
        )
