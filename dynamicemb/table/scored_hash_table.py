"""``ScoredHashTable``: (table id, int64 key) -> slot, with a score per slot.

The contract (geometry, hash, score rules, the inserting procedure) is written
out in ``docs/ARCHITECTURE.md``, "The scored hash table". This module owns the
policy (growth for load, the clock, failures, stats); the backend's verbs
(``dynamicemb.ops``) own the table's memory layout and walk it. The prepared insert
and its commit are ``table/pending.py``, the inserting calls ``table/inserts.py``, the
argument checks ``table/checks.py``.
"""

import logging
from typing import Callable, Optional, Tuple

import torch

from dynamicemb.ops import for_device, resolve_device
from dynamicemb.ops.interface import (ALL_BITS, COMPOUND_TIME_MASK, BatchPart, Deduplicated,
                                      Entries, InsertStatus, ScoreRule, TableMemory,
                                      num_buckets_for, score_rule)
from dynamicemb.options import check_ttl
from dynamicemb.table.checks import (TableInputs, check_frequencies, check_keys,
                                     table_ids_as_int16)
from dynamicemb.table.device_counts import DeviceCounters, DeviceTotals
from dynamicemb.table.inserts import DEVICE_TOTALS, InsertCalls, SizeWatch
from dynamicemb.table.pending import PendingInsert
from dynamicemb.table.results import Expired, InsertResult, TableStats
from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbScoreStrategy

__all__ = ["MAX_TABLES", "ScoredHashTable", "hash_keys"]

logger = logging.getLogger(__name__)

#: Table ids are stored as int16 per slot.
MAX_TABLES = 32767


def hash_keys(keys: torch.Tensor, table_ids: torch.Tensor) -> torch.Tensor:
    """The table's 64-bit hash of (table id, key), bit-cast to int64.

    Args:
        keys (Tensor): (n,) int64.
        table_ids (Tensor): (n,) int16/int32/int64, in [0, MAX_TABLES).

    Returns:
        (n,) int64 hashes (the uint64 bits).
    """
    check_keys(keys)
    tids = table_ids_as_int16(table_ids, keys.numel(), MAX_TABLES)
    return for_device(keys.device).hash_keys(keys=keys.contiguous(), table_ids=tids)


class ScoredHashTable(TableInputs, InsertCalls):
    """A bucketed hash table from (table id, int64 key) to a slot and a score.

    Several logical tables share one physical table. Value rows live in
    ``values`` (``[capacity, value_dim]``), indexed by slot. Semantics in detail:
    ``docs/ARCHITECTURE.md``, "The scored hash table".

    Args:
        num_tables: logical tables sharing this one (1 to 32767).
        capacity: initial slots; rounded up to ``bucket_capacity * 2**k``.
        bucket_capacity: slots per bucket, a positive multiple of 16.
        score_strategy: how scores are set and whether full buckets evict.
        max_load_factor: the table doubles before a call when size exceeds this
            fraction of capacity (up to ``max_capacity``), in (0, 1].
        max_capacity: the most slots growth may reach (default ``capacity``),
            rounded up like ``capacity``.
        value_dim: width of a value row (0: keys only).
        value_dtype: dtype of the value rows.
        check_mode: what a failed insert does (see ``DynamicEmbCheckMode``).
        device: where the tensors live (CPU or CUDA).
        values_in_host_memory: keep the value rows in host memory that the device's
            kernels read and write in place (on CUDA: pinned and mapped into the
            GPU's address space; the index stays on the GPU). Lets a table's rows
            exceed the GPU's memory. The same as the default on CPU.
        ttl: row lifetime in ticks of the table's time (``now``; None: no expiry).
            A row whose last access is more than ``ttl`` ticks before a call's time
            is absent to that call: ``find`` misses it, an inserting call gives it a
            fresh row (reported as inserted and in ``expired``), ``export_batch``
            skips it; ``expire()`` frees such rows. Needs LRU, STEP, NO_EVICTION or
            LRU_LFU scores.

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
        self._compound = self.score_strategy == DynamicEmbScoreStrategy.LRU_LFU
        self.check_mode = DynamicEmbCheckMode(check_mode)
        # Whether a step's call reads its failed inserts in the call and, while the
        # table may grow, grows and runs again (as ERROR mode does): set by a caller
        # that needs every key stored (an external tier's host store: a key without
        # a slot could not take its row back from below).
        self.grows_for_failures = False
        self.max_load_factor = float(max_load_factor)
        self.value_dim = value_dim
        self.value_dtype = value_dtype
        self.device = resolve_device(device)
        self._stats = TableStats()
        self._ops = for_device(self.device)
        self._rule, self._evicts = score_rule(self.score_strategy)
        self._memory = self._ops.new_table(
            num_buckets=num_buckets_for(capacity, bucket_capacity),
            max_num_buckets=num_buckets_for(max_capacity, bucket_capacity),
            bucket_capacity=bucket_capacity, value_dim=value_dim, value_dtype=value_dtype,
            device=self.device, values_in_host_memory=values_in_host_memory)
        # the keys stored, and the clock and the step: set on the host, advanced in
        # device memory by the inserting calls' kernels (so that a CUDA graph's
        # replays advance them)
        self._stored = DeviceCounters([0], self.device)
        self._time = DeviceCounters([0, 0], self.device)
        # what the calls counted on the device (hits, inserted, evicted, failed,
        # expired, erased), which the stats take when read (made here: a CUDA graph
        # capturing the first call would otherwise zero them at every replay)
        self._outcome_totals = DeviceTotals(DEVICE_TOTALS, self.device)
        self._watch = SizeWatch(self.device)  # what the calls tell the host, late
        self._generation = 0
        # a CUDA graph captured a call: its replays use the arrays' addresses, so
        # growth (which replaces them) is refused until ``release_graphs``
        self._captured = False
        self._pending: Optional[PendingInsert] = None

    # ----------------------------------------------------------------- state
    @property
    def stats(self) -> TableStats:
        """Running counts of what the table did (never reset by ``clear``). Reading
        them reads what the calls counted on the device (one sync)."""
        self._settle_device_counts()
        return self._stats

    @property
    def _size(self) -> int:
        return self._stored.value(0)  # read from the device after inserting calls

    @_size.setter
    def _size(self, value: int) -> None:
        self._stored.set(0, value)

    @property
    def _clock(self) -> int:
        return self._time.value(0)

    @_clock.setter
    def _clock(self, value: int) -> None:
        self._time.set(0, value)

    @property
    def _step(self) -> int:
        return self._time.value(1)

    @_step.setter
    def _step(self, value: int) -> None:
        self._time.set(1, value)

    @property
    def memory(self) -> TableMemory:
        """The table's arrays, for the storage's kernels (a call that grows the table
        replaces them: hold the table, not this)."""
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
        return self._clock

    @property
    def generation(self) -> int:
        """Changes whenever a slot returned earlier may now hold another key or none:
        on growth, eviction, erase and clear. Equal generations: slots still valid."""
        return self._generation

    @property
    def step(self) -> int:
        """The score of the ``STEP`` strategy (see ``set_step``)."""
        return self._step

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
        """Scores of occupied slots (e.g. returned by ``find``).

        Args:
            slots (Tensor): (n,) int64 slots, each holding a key.

        Returns:
            (n,) int64 scores.
        """
        self._check_idle()
        return self._memory.scores[slots]

    def set_scores_at(self, slots: torch.Tensor, scores: torch.Tensor) -> None:
        """Overwrites the scores of occupied slots (restoring rows that come back from
        a tier below).

        Args:
            slots (Tensor): (n,) int64 slots, each holding a key.
            scores (Tensor): (n,) int64.
        """
        self._check_idle()
        self._memory.scores[slots] = self._here(scores, "scores").to(torch.int64)

    def memory_bytes(self) -> dict:
        """Bytes held: ``metadata`` (keys, scores, ids, digests, bits) and ``values``."""
        meta = sum(t.numel() * t.element_size() for t in self._memory.meta)
        values = self._memory.values
        return {"metadata": meta, "values": values.numel() * values.element_size()}

    @property
    def now(self) -> int:
        """The table's time, which scores record and ``ttl`` counts: the step with
        STEP scores, else the clock (the latest inserting call's)."""
        return self._step if self.score_strategy == DynamicEmbScoreStrategy.STEP else self._clock

    @property
    def next_time(self) -> int:
        """The time the next inserting call will record (``now`` after its tick)."""
        return self._step if self.score_strategy == DynamicEmbScoreStrategy.STEP else self._clock + 1

    def time_of(self, scores: torch.Tensor) -> torch.Tensor:
        """Last-access times of scores: the score itself, or LRU_LFU's low 32 bits.

        Args:
            scores (Tensor): (n,) int64.

        Returns:
            (n,) int64.
        """
        return scores & COMPOUND_TIME_MASK if self._compound else scores

    def expired_before(self, time: int) -> int:
        """Rows whose last access is below this have expired at ``time`` (0: none)."""
        return 0 if self.ttl is None else max(0, int(time) - self.ttl)

    def set_step(self, step: int) -> None:
        """Sets the score that the ``STEP`` strategy gives to the keys it touches."""
        if int(step) < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._step = int(step)

    def set_clock(self, clock: int) -> None:
        """Sets the logical clock (restoring a checkpoint): the next inserting call
        scores LRU keys ``clock + 1``."""
        if int(clock) < 0:
            raise ValueError(f"clock must be >= 0, got {clock}")
        if self._compound and int(clock) >= COMPOUND_TIME_MASK:
            raise ValueError(f"LRU_LFU scores hold a clock below 2^32 - 1, got {clock}")
        self._check_idle()
        self._clock = int(clock)

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
            checked: ``table_ids`` are int16 and in range, built by the caller
                (skips the range check, a host sync on a GPU).
            at_time: with a ``ttl``, rows expired at this time are absent (default
                ``now``; ``next_time`` asks what the next inserting call will see).

        Returns:
            (n,) int64 slots, -1 where the key is absent.
        """
        self._check_idle()
        keys = self._keys(keys)
        tids = self._table_ids(table_ids, keys.numel(), checked)
        slots = self._ops.find(memory=self._memory, keys=keys, table_ids=tids,
                               one_table=self.num_tables == 1)
        if self.ttl is None:  # nothing expires: no need of the time (on the device)
            return slots
        if at_time is None:  # ``now``, read where the kernels keep it: no sync
            index = 1 if self.score_strategy == DynamicEmbScoreStrategy.STEP else 0
            before = (self._time.on_device()[index] - self.ttl).clamp_(min=0)
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
                caller: not read on the host (see ``find``).

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
                saved rows: an LRU key keeps its saved clock value, an LFU key its
                count). The call still advances the clock (see ``set_clock``).

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
        """Removes keys.

        Args:
            keys (Tensor): (n,) int64.
            table_ids (Tensor, optional): (n,) int32/int64; None means table 0.

        Returns:
            (n,) bool, True where the key was present (first occurrence only).
        """
        self._check_idle()
        keys = self._keys(keys)
        tids = self._table_ids(table_ids, keys.numel())
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
        """Occupied slots of ``[start, start + count)`` whose score is >= ``min_score``;
        rows expired at ``now`` (``ttl``) are skipped.

        Args:
            start: first slot.
            count: number of slots to scan (default: to the end).
            min_score: keep only entries scoring at least this (default: all); with
                LRU_LFU, whose time at least this (``time_of``: upstream's incremental
                dump thresholds on the timestamp too).
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
        """TTL sweep: frees every row whose last access is more than ``ttl`` ticks
        before ``now`` (one kernel pass over the slots).

        Returns:
            ``Expired``: the freed keys, table ids, scores and slots, in slot order.

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
                                    time_mask=COMPOUND_TIME_MASK if self._compound else ALL_BITS)
            slots = mask.nonzero().squeeze(1)
        n = slots.numel()
        self._size -= n
        self._generation += n > 0
        self.stats.expired += n
        return Expired(keys=memory.keys[slots], table_ids=memory.table_ids[slots].long(),
                       scores=memory.scores[slots], slots=slots)

    # ----------------------------------------------------------------- growth
    def release_graphs(self) -> None:
        """Declares that no CUDA graph captured over this table replays any more: it
        may grow again (capture anew after growth)."""
        self._captured = False

    def _grow(self) -> None:
        """Doubles the buckets; every entry keeps its offset in the bucket.

        Raises:
            RuntimeError: a CUDA graph captured a call of this table (growth would
                free the arrays its replays use) and ``release_graphs`` was not called.
        """
        if self._captured:
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
        """First phase of ``find_or_insert``: keys, scores and slots are decided, value
        rows are not touched yet. Lets a caller make several tables' inserts atomic:
        ``commit()`` every pending insert, or ``abort()`` them all (newest first).

        Until the returned insert is committed or aborted, every other verb of this
        table raises ``RuntimeError``. Failed inserts are reported here (ERROR mode
        undoes and raises).

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
        """The training step's insert: ``prepare_find_or_insert`` of the unique pairs
        of a batch that may repeat keys, returning the dedup too, with nothing read
        on the host. The dedup and the insert may overlap (the CPU: one thread finds
        the unique pairs while another inserts them). LFU adds each pair's count to
        its score; CUSTOMIZED gives each pair its table's score (``table_scores``).
        ``dedup_batch`` then ``prepare_insert`` is the same call with a choice of
        keys between its two halves (an admission).

        The dedup's arrays and the insert's per-key arrays have N entries (padding
        past the unique pairs: ``Deduplicated``); the clock and the step advance in
        device memory, where the call reads its time; the commit leaves the rows of
        new keys to the caller (``Backend.init_rows``); the call's counts go to the
        device totals (``outcome_totals``), which ``stats`` take when read.

        Args:
            keys (Tensor): (N,) int64.
            table_ids (Tensor, optional): (N,) int16/int32/int64; None means table 0.
            frequencies (Tensor, optional): (N,) int64 >= 1, occurrences each key
                stands for (summed into ``counts``); None means 1 each.
            checked: ``table_ids`` (int16) and ``frequencies`` were built or checked
                by the caller: not read on the host (see ``find``).
            error (Tensor, optional): (1,) int64, the step's input-check word
                (``Backend.check_offsets``): when set, the batch has no unique key
                and the call changes nothing.
            part (``BatchPart``, optional): the call takes only these keys of the
                batch (the others: inverse -1, no lookup).
            table_scores (Tensor, optional): (num_tables,) int64 >= 0, CUSTOMIZED only
                (and then required): the score of each logical table's keys, read
                by table id (by the kernel).

        Returns:
            (``Deduplicated``, ``PendingInsert`` over ``Deduplicated.keys``).

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
        """The first half of ``prepare_dedup_find_or_insert`` (same arguments): the
        batch's unique pairs, its lookups grouped by pair; the clock and the step
        advance in device memory, so that ``find`` answers at the time of the
        ``prepare_insert`` that follows."""
        keys, tids, frequencies = self._step_inputs(keys, table_ids, frequencies, checked)
        return self._dedup_step(keys, tids, frequencies, error, part)

    def prepare_insert(self, unique: Deduplicated, admitted: torch.Tensor, *,
                       error: Optional[torch.Tensor] = None,
                       table_scores: Optional[torch.Tensor] = None) -> PendingInsert:
        """The second half of ``prepare_dedup_find_or_insert``: the insert of the keys
        of ``dedup_batch``'s ``unique`` that ``admitted`` (N,) bool takes; the others
        find no slot and are counted nowhere (``PendingInsert.admitted``). ``error``
        and ``table_scores`` as given to ``dedup_batch`` and
        ``prepare_dedup_find_or_insert``."""
        table_scores = self._table_scores(table_scores, checked=True)
        return self._prepare_admitted(unique, admitted, error, table_scores)

    def _step_inputs(self, keys, table_ids, frequencies, checked: bool):
        keys = self._keys(keys)
        n = keys.numel()
        tids = self._table_ids(table_ids, n, checked)
        if not checked:
            frequencies = check_frequencies(frequencies, n, self.device)
        return keys, tids, frequencies

    def _table_scores(self, table_scores: Optional[torch.Tensor],
                      checked: bool) -> Optional[torch.Tensor]:
        """CUSTOMIZED: the (num_tables,) int64 scores of a deduplicating call
        (required; values read only unless ``checked``); otherwise none."""
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
        self._here(table_scores, "table_scores")
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
        """The table's own inserting verbs: one pass at the next clock tick, its
        statuses read once (the failures); a full bucket of a table that may grow
        undoes the call, grows the table and runs it again. ``assign``: the rows
        of ``values`` go to the keys' slots at the commit."""
        self._check_idle()
        keys = self._keys(keys)
        n = keys.numel()
        tids = self._table_ids(table_ids, n, checked)
        given = self._given_scores(scores, n, exact, checked)
        rows = self._rows(values, n) if assign else None
        while True:
            evicts = self._before_insert(n, exact=True)
            time = self._time.on_device()
            time[:1].add_(1)  # the call's tick (its clock; a STEP score is the step)
            outcomes = torch.zeros(DEVICE_TOTALS - 1, dtype=torch.int64, device=self.device)
            upserted = self._ops.upsert(
                memory=self._memory, keys=keys, table_ids=tids, scores=given,
                rule=ScoreRule.GIVEN if exact else self._rule, evicts=evicts,
                one_table=self.num_tables == 1, outcomes=outcomes,
                size=self._stored.on_device(), time=time, now_index=self._now_index,
                ttl=self.ttl or 0)
            pending = PendingInsert(self, upserted, outcomes=outcomes, rows=rows,
                                    zero_new=zero_new, read_evicted=read_evicted)
            self._pending = pending
            if not self._grown_for_failures(pending, lambda: n):
                break
        self._after_insert()
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

    # ------------------------------------ what a PendingInsert asks of its table
    def record_commit(self, pending: PendingInsert) -> None:
        """Ends ``pending`` (the table takes other calls again): a slot returned
        earlier may hold another key if the call evicted (where it read its counts)
        or may have (a rule that evicts), or gave an expired row a fresh one."""
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
        """Ends ``pending`` and undoes it: contents, scores, time and counts as
        before it (growth stays)."""
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
