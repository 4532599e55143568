"""Frequency admission: a key gets a stored row once seen ``threshold`` times (until
then its lookups read the rows an initializer computes). Counts live in a bounded
``Counter`` that forgets the least recently seen (LRU, ``counter_capacity``) or the
lowest (``KVCounter``) counts first."""

import abc
from typing import List, Optional

import torch

from dynamicemb.ops.interface import Entries, InsertStatus
from dynamicemb.options import DynamicEmbInitializerArgs, FrequencyAdmissionStrategy, KVCounter
from dynamicemb.table import ScoredHashTable
from dynamicemb.types import DynamicEmbScoreStrategy

__all__ = ["Admission", "Counter", "HashCounter"]


class Counter(abc.ABC):
    """Occurrence counts of keys per logical table (upstream's ``Counter``). Shapes: ``keys``
    (n,) int64, ``table_ids`` (n,) int16/int32/int64 local table ids."""

    @abc.abstractmethod
    def counts(self, keys: torch.Tensor, table_ids: torch.Tensor) -> torch.Tensor:
        """(n,) float64 counts of unique keys (0 where not counted); read-only."""

    @abc.abstractmethod
    def add(self, keys: torch.Tensor, table_ids: torch.Tensor,
            frequencies: torch.Tensor) -> torch.Tensor:
        """Adds ``frequencies`` (n,) to the counts of unique keys (a key that finds no
        slot is not counted); returns the (n,) float64 counts after the addition."""

    @abc.abstractmethod
    def erase(self, keys: torch.Tensor, table_ids: torch.Tensor) -> None:
        """Forgets the counts of keys."""

    @abc.abstractmethod
    def add_where(self, keys: torch.Tensor, table_ids: torch.Tensor,
                  frequencies: torch.Tensor, mask: torch.Tensor) -> None:
        """``add`` of the unique keys where ``mask`` (n,) bool; no host read (``table_ids``
        int16, from a step's dedup)."""

    @abc.abstractmethod
    def erase_where(self, keys: torch.Tensor, table_ids: torch.Tensor,
                    mask: torch.Tensor) -> None:
        """``erase`` of the unique keys where ``mask`` (n,) bool; no host read."""

    @abc.abstractmethod
    def memory_usage(self) -> int:
        """Bytes held."""

    @abc.abstractmethod
    def export(self, table_id: int) -> Entries:
        """The counts of one table: keys, scores and ``values`` (m, 1) float64 counts."""

    @abc.abstractmethod
    def restore(self, table_id: int, keys: torch.Tensor, counts: torch.Tensor,
                scores: torch.Tensor) -> None:
        """Writes counts of one table with their saved scores (``export``'s)."""

    @abc.abstractmethod
    def clear_table(self, table_id: int) -> None:
        """Forgets every count of one table."""


class HashCounter(Counter):
    """A ``Counter`` in a ``ScoredHashTable`` of ``capacity`` slots (fixed) for
    ``num_tables`` logical tables. A full bucket forgets the lowest count (``lowest_first``:
    LFU, score = count, as upstream's ``KVCounter``), else the least recently counted key."""

    def __init__(self, capacity: int, bucket_capacity: int, lowest_first: bool,
                 num_tables: int, device: torch.device) -> None:
        self.lowest_first = lowest_first
        strategy = DynamicEmbScoreStrategy.LFU if lowest_first else DynamicEmbScoreStrategy.LRU
        self.table = ScoredHashTable(num_tables=num_tables, capacity=capacity,
                                     bucket_capacity=bucket_capacity, score_strategy=strategy,
                                     max_load_factor=1.0, value_dim=1,
                                     value_dtype=torch.float64, device=device)

    @property
    def clock(self) -> int:
        """The counter table's clock (its LRU scores)."""
        return self.table.clock

    def set_clock(self, clock: int) -> None:
        """Restores ``clock`` (from a checkpoint)."""
        self.table.set_clock(clock)

    def counts(self, keys, table_ids):
        slots = self.table.find(keys, table_ids, checked=True)  # a dedup's table ids
        return torch.where(slots >= 0, self.table.values[slots.clamp(min=0), 0],
                           torch.zeros((), dtype=torch.float64, device=keys.device))

    def add(self, keys, table_ids, frequencies):
        scores = frequencies.to(torch.int64) if self.lowest_first else None
        counted = self.table.find_or_insert(keys, table_ids, scores)
        ok = counted.slots >= 0
        self.table.values[counted.slots[ok], 0] += frequencies[ok].double()
        out = torch.zeros(keys.shape, dtype=torch.float64, device=keys.device)
        out[ok] = self.table.values[counted.slots[ok], 0]
        return out

    def add_where(self, keys, table_ids, frequencies, mask):
        table = self.table
        # an inserting call of the table's own (its clock ticks) when any key is added
        upserted = table.upsert_where(
            keys, table_ids, frequencies if self.lowest_first else None,
            table.buckets_where(keys, table_ids, mask), tick=mask.any().to(torch.int64))
        # count += frequency (a new key: = frequency, over the row of the key it
        # replaced): index_add_ of integers in float64 is exact in any order, and a
        # key left out adds 0 to slot 0
        column = table.values[:, 0]
        slots = upserted.slots.clamp(min=0)
        added = frequencies.to(torch.float64)
        status = upserted.status
        new = (status - InsertStatus.INSERTED).view(torch.uint8) < 2  # INSERTED, EVICTED_...
        delta = torch.where(status == InsertStatus.HIT, added,
                            torch.where(new, added - column[slots], 0.0))
        column.index_add_(0, slots, delta)

    def erase(self, keys, table_ids):
        self.table.erase(keys, table_ids)

    def erase_where(self, keys, table_ids, mask):
        # the mask as a status whose erased value is 1
        self.table.erase_where(keys, table_ids, mask.to(torch.int8), InsertStatus.INSERTED)

    def memory_usage(self) -> int:
        return sum(self.table.memory_bytes().values())

    def export(self, table_id):
        entries = self.table.export_batch()
        mine = entries.table_ids == table_id
        return Entries(*(t[mine] for t in entries))

    def restore(self, table_id, keys, counts, scores):
        tids = torch.full(keys.shape, table_id, dtype=torch.int64, device=keys.device)
        self.table.insert_or_assign(keys, counts.to(torch.float64).reshape(-1, 1), tids,
                                    scores, exact_scores=True)

    def clear_table(self, table_id):
        entries = self.table.export_batch()
        mine = entries.table_ids == table_id
        if self.table.num_tables == 1:
            self.table.clear()
        elif bool(mine.any()):
            self.table.erase(entries.keys[mine], entries.table_ids[mine])


class Admission:
    """The occurrence counters of one group's keys not stored yet: with ``counters`` (each
    logical table's ``KVCounter``), one LFU counter of their summed capacity (as upstream's
    multi-table counter); with all None, ``strategy``'s LRU counter of ``counter_capacity``."""

    def __init__(self, strategy: FrequencyAdmissionStrategy,
                 counters: List[Optional[KVCounter]], device: torch.device) -> None:
        self.threshold = strategy.threshold
        self.initializer_args: Optional[DynamicEmbInitializerArgs] = strategy.initializer_args
        num_tables = len(counters)
        if counters[0] is None:
            self.counter = HashCounter(strategy.counter_capacity, 128, False, num_tables, device)
        else:
            self.counter = HashCounter(sum(c.capacity for c in counters),
                                       counters[0].bucket_capacity, True, num_tables, device)

    def admitted(self, stored: torch.Tensor, keys: torch.Tensor, tids: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
        """(n,) bool mask of unique keys that may be stored: those ``stored`` ((n,) bool) and
        new ones whose counted occurrences plus this batch's ``counts`` ((n,) int64) reach the
        threshold. ``keys`` (n,) int64 and ``tids`` (n,) int16 are from a dedup. Read-only;
        no host read."""
        seen = self.counter.counts(keys, tids)
        return stored | (seen + counts.double() >= self.threshold)

    def count_on_device(self, keys: torch.Tensor, tids: torch.Tensor, counts: torch.Tensor,
                        admitted: torch.Tensor, status: torch.Tensor) -> None:
        """After a step's insert, no host read: forgets the counters of keys it stored
        (``status`` (N,) INSERTED or EVICTED_AND_INSERTED) and adds ``counts`` (N,) of keys
        still waiting (``admitted`` False, ``counts`` > 0: not padding)."""
        stored_now = (status - InsertStatus.INSERTED).view(torch.uint8) < 2
        self.counter.erase_where(keys, tids, stored_now)
        self.counter.add_where(keys, tids, counts, (counts > 0) & ~admitted)

    # ---------------------------------------------------------- checkpoints
    def export(self, tid: int) -> Entries:
        """Counters of local table ``tid``: keys, scores, ``values`` (m, 1) float64 counts."""
        return self.counter.export(tid)

    def restore(self, tid: int, keys: torch.Tensor, counts: torch.Tensor,
                scores: torch.Tensor) -> None:
        """Writes counters of local table ``tid``: ``keys`` (m,) int64, ``counts`` (m,)
        float64, ``scores`` (m,) int64 (``export``'s)."""
        self.counter.restore(tid, keys, counts, scores)

    def clear_table(self, tid: int) -> None:
        """Forgets every counter of local table ``tid``."""
        self.counter.clear_table(tid)
