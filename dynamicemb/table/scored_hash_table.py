"""``ScoredHashTable``: (table id, int64 key) -> slot, with a score per slot.

The contract (geometry, hash, score rules, the inserting procedure) is written
out in ``docs/ARCHITECTURE.md``, "The scored hash table". This module owns the
tensors and the policy; the kernels in ``csrc/`` only walk them.
"""

import logging
import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch

from dynamicemb.ops import huge_pages
from dynamicemb.ops import ops_for, resolve_device
from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbScoreStrategy

__all__ = [
    "Deduplicated",
    "Evicted",
    "Exported",
    "InsertResult",
    "MAX_TABLES",
    "PendingInsert",
    "ScoredHashTable",
    "TableStats",
    "hash_keys",
]

logger = logging.getLogger(__name__)

#: Table ids are stored as int16 per slot.
MAX_TABLES = 32767

# Kernel outcome codes (csrc/dynamicemb/hash_primitives.h, InsertStatus).
_HIT, _INSERTED, _EVICTED_AND_INSERTED, _FAILED = 0, 1, 2, 3

# What an inserting pass writes per key (the kernels' upsert outputs).
_PER_KEY_OUTPUTS = {
    "slots": torch.int64,
    "status": torch.int8,
    "prev_scores": torch.int64,
    "ev_keys": torch.int64,
    "ev_tids": torch.int16,
    "ev_scores": torch.int64,
}


@dataclass(frozen=True)
class _ScorePolicy:
    """How a strategy maps onto the kernels: a score rule and whether it evicts."""

    rule: int  # 0: the call's clock/step, 1: count (LFU), 2: the caller's score
    evicts: bool


_POLICIES = {
    DynamicEmbScoreStrategy.LRU: _ScorePolicy(rule=0, evicts=True),
    DynamicEmbScoreStrategy.STEP: _ScorePolicy(rule=0, evicts=True),
    DynamicEmbScoreStrategy.LFU: _ScorePolicy(rule=1, evicts=True),
    DynamicEmbScoreStrategy.CUSTOMIZED: _ScorePolicy(rule=2, evicts=True),
    DynamicEmbScoreStrategy.NO_EVICTION: _ScorePolicy(rule=0, evicts=False),
}


@dataclass
class TableStats:
    """Running counts of what the table did (never reset by ``clear``)."""

    inserts: int = 0
    evictions: int = 0
    failed_inserts: int = 0
    erases: int = 0
    growths: int = 0


class Evicted(NamedTuple):
    """Entries an inserting call pushed out, in input order of the keys that did.

    Shape:
        keys, table_ids, scores, slots: (m,) int64; values: (m, value_dim).
    """

    keys: torch.Tensor
    table_ids: torch.Tensor
    scores: torch.Tensor
    slots: torch.Tensor
    values: torch.Tensor


class InsertResult(NamedTuple):
    """Outcome of an inserting call.

    Shape:
        slots: (n,) int64, -1 where the insert failed; inserted: (n,) bool, True
        where the key was new. ``evicted`` is None for ``insert_or_assign``.
        ``num_inserted`` and ``num_failed`` count them (the kernel's own counts).
    """

    slots: torch.Tensor
    inserted: torch.Tensor
    evicted: Optional[Evicted]
    num_inserted: int  # inserted.sum()
    num_failed: int  # (slots < 0).sum()


class Deduplicated(NamedTuple):
    """The unique (table id, key) pairs of a batch, in first-occurrence order.

    Shape:
        keys: (U,) int64; table_ids: (U,) int16; inverse: (N,) int64, the unique
        index of each of the batch's N keys; counts: (U,) int64, the summed
        frequencies of each pair's keys (1 per key when none are given);
        starts: (U + 1,) int64 and rank: (N,) int64, the batch's keys grouped by
        pair (a stable sort by ``inverse``): the keys of pair u have ranks
        ``starts[u]`` to ``starts[u + 1] - 1``, in input order (what a fused
        backward walks).
    """

    keys: torch.Tensor
    table_ids: torch.Tensor
    inverse: torch.Tensor
    counts: torch.Tensor
    starts: torch.Tensor
    rank: torch.Tensor


class Exported(NamedTuple):
    """Occupied slots of a range, in slot order (same fields as ``Evicted``)."""

    keys: torch.Tensor
    table_ids: torch.Tensor
    scores: torch.Tensor
    slots: torch.Tensor
    values: torch.Tensor


class PendingInsert:
    """A prepared inserting call (``ScoredHashTable.prepare_find_or_insert``)."""

    def __init__(self, table, out, clock_before, rows, read_evicted, assign) -> None:
        self.table = table
        self.out = out
        self.clock_before = clock_before
        self.rows = rows
        self.read_evicted = read_evicted
        self.assign = assign
        self._done = False

    @property
    def slots(self) -> torch.Tensor:
        """(n,) int64 slots decided by the call, -1 where the insert failed."""
        return self.out["slots"]

    def _finish(self) -> None:
        if self._done:
            raise RuntimeError("this insert was already committed or aborted")
        self._done = True

    def commit(self) -> InsertResult:
        """Writes the value rows and returns the call's result."""
        self._finish()
        return self.table._commit(self)

    def abort(self) -> None:
        """Undoes the call."""
        self._finish()
        self.table._abort(self)


def hash_keys(keys: torch.Tensor, table_ids: torch.Tensor) -> torch.Tensor:
    """The table's 64-bit hash of (table id, key), bit-cast to int64.

    Args:
        keys (Tensor): (n,) int64.
        table_ids (Tensor): (n,) int16/int32/int64, in [0, MAX_TABLES).

    Returns:
        (n,) int64 hashes (the uint64 bits).
    """
    _check_keys(keys)
    tids = _table_ids_as_int16(table_ids, keys.numel(), MAX_TABLES)
    return ops_for(keys.device).hash_keys(keys.contiguous(), tids)


def _check_keys(keys: torch.Tensor) -> None:
    if not isinstance(keys, torch.Tensor):
        raise TypeError(f"keys must be a torch.Tensor, got {type(keys).__name__}")
    if keys.dtype != torch.int64:
        raise TypeError(f"keys must be int64, got {keys.dtype}")
    if keys.dim() != 1:
        raise ValueError(f"keys must be 1-D, got shape {tuple(keys.shape)}")


def _frequencies(frequencies: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
    if frequencies is None:
        return None
    if not isinstance(frequencies, torch.Tensor) or frequencies.dtype != torch.int64:
        raise TypeError(
            f"frequencies must be an int64 tensor, got {getattr(frequencies, 'dtype', type(frequencies))}")
    if frequencies.shape != (n,):
        raise ValueError(f"frequencies must have shape ({n},) like keys, got {tuple(frequencies.shape)}")
    if n > 0 and int(frequencies.min()) < 1:
        raise ValueError("frequencies must be >= 1")
    return frequencies.contiguous()


def _table_ids_as_int16(table_ids: torch.Tensor, n: int, num_tables: int) -> torch.Tensor:
    if not isinstance(table_ids, torch.Tensor):
        raise TypeError(f"table_ids must be a torch.Tensor, got {type(table_ids).__name__}")
    if table_ids.dtype not in (torch.int16, torch.int32, torch.int64):
        raise TypeError(f"table_ids must be int32 or int64, got {table_ids.dtype}")
    if table_ids.shape != (n,):
        raise ValueError(
            f"table_ids must have shape ({n},) like keys, got {tuple(table_ids.shape)}"
        )
    if n > 0:
        low, high = (int(x) for x in torch.aminmax(table_ids))
        if low < 0 or high >= num_tables:
            raise ValueError(
                f"table_ids must be in [0, {num_tables}), got values in [{low}, {high}]"
            )
    return table_ids.to(torch.int16).contiguous()


def _num_buckets_for(capacity: int, bucket_capacity: int) -> int:
    """Smallest power of two number of buckets holding ``capacity`` slots."""
    buckets = max(1, math.ceil(capacity / bucket_capacity))
    return 1 << (buckets - 1).bit_length()


class ScoredHashTable:
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
        device: where the tensors live (only CPU kernels exist so far).

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
        self.check_mode = DynamicEmbCheckMode(check_mode)
        self.max_load_factor = float(max_load_factor)
        self.value_dim = value_dim
        self.value_dtype = value_dtype
        self.device = resolve_device(device)
        self.stats = TableStats()
        self._ops = ops_for(self.device)
        self._policy = _POLICIES[self.score_strategy]
        self._max_num_buckets = _num_buckets_for(max_capacity, bucket_capacity)
        self._num_buckets = _num_buckets_for(capacity, bucket_capacity)
        self._meta = self._new_meta(self._num_buckets)
        self._values = self._new_values(self._num_buckets)
        self._size = 0
        self._clock = 0
        self._step = 0
        self._generation = 0
        self._pending: Optional[PendingInsert] = None

    # ----------------------------------------------------------------- state
    def _new_meta(self, num_buckets: int) -> List[torch.Tensor]:
        """[keys, scores, tids, digests, occupied, pinned] for ``num_buckets``.

        Keys and scores are the two columns of one (slots, 2) array, so a probe that
        reads a slot's key has its score in the same cache line.
        """
        slots = num_buckets * self.bucket_capacity
        words = (self.bucket_capacity + 63) // 64
        dev = self.device
        keys_and_scores = huge_pages.zeros((slots, 2), torch.int64, dev)
        return [
            keys_and_scores[:, 0],
            keys_and_scores[:, 1],
            huge_pages.zeros(slots, torch.int16, dev),
            huge_pages.zeros(slots, torch.uint8, dev),
            huge_pages.zeros((num_buckets, words), torch.int64, dev),
            huge_pages.zeros((num_buckets, words), torch.int64, dev),
        ]

    def _new_values(self, num_buckets: int) -> torch.Tensor:
        slots = num_buckets * self.bucket_capacity
        return huge_pages.zeros((slots, self.value_dim), self.value_dtype, self.device)

    @property
    def values(self) -> torch.Tensor:
        """Value rows, ``[capacity, value_dim]``, indexed by slot."""
        return self._values

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
        return self._num_buckets

    def size(self) -> int:
        """Number of keys stored."""
        return self._size

    def capacity(self) -> int:
        """Slots now (a power-of-two number of buckets)."""
        return self._num_buckets * self.bucket_capacity

    def max_capacity(self) -> int:
        """The most slots growth may reach."""
        return self._max_num_buckets * self.bucket_capacity

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
        return self._meta[1][slots]

    def memory_bytes(self) -> dict:
        """Bytes held: ``metadata`` (keys, scores, ids, digests, bits) and ``values``."""
        meta = sum(t.numel() * t.element_size() for t in self._meta)
        return {"metadata": meta, "values": self._values.numel() * self._values.element_size()}

    def set_step(self, step: int) -> None:
        """Sets the score that the ``STEP`` strategy gives to the keys it touches."""
        if int(step) < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._step = int(step)

    def clear(self) -> None:
        """Empties every slot. The clock, the step and ``stats`` stay."""
        self._check_idle()
        self._meta[3].zero_()  # digest 0: empty (csrc/dynamicemb/hash_primitives.h)
        self._meta[4].zero_()
        self._meta[5].zero_()
        self._size = 0
        self._generation += 1

    # ------------------------------------------------------------ validation
    def _table_ids(self, table_ids: Optional[torch.Tensor], n: int) -> torch.Tensor:
        if table_ids is None:
            return torch.zeros(n, dtype=torch.int16, device=self.device)
        return _table_ids_as_int16(table_ids, n, self.num_tables)

    def _keys(self, keys: torch.Tensor) -> torch.Tensor:
        _check_keys(keys)
        if keys.device != self.device:
            raise ValueError(f"keys are on {keys.device}, the table on {self.device}")
        return keys.contiguous()

    def _given_scores(self, scores: Optional[torch.Tensor], n: int) -> Optional[torch.Tensor]:
        """CUSTOMIZED: the scores (required). LFU: occurrence counts to add (default 1)."""
        customized = self.score_strategy == DynamicEmbScoreStrategy.CUSTOMIZED
        lfu = self.score_strategy == DynamicEmbScoreStrategy.LFU
        if scores is None:
            if customized:
                raise ValueError("the CUSTOMIZED score strategy needs scores for every key")
            return torch.ones(n, dtype=torch.int64, device=self.device) if lfu else None
        if not (customized or lfu):
            raise ValueError(
                f"scores are only accepted with the CUSTOMIZED strategy (and as counts with "
                f"LFU), this table uses {self.score_strategy.name}"
            )
        if not isinstance(scores, torch.Tensor) or scores.dtype != torch.int64:
            raise TypeError(f"scores must be an int64 tensor, got {getattr(scores, 'dtype', type(scores))}")
        if scores.shape != (n,):
            raise ValueError(f"scores must have shape ({n},), got {tuple(scores.shape)}")
        if n > 0 and int(scores.min()) < (1 if lfu else 0):
            raise ValueError("LFU counts must be >= 1" if lfu else "scores must be >= 0")
        return scores.contiguous()

    def _rows(self, values: Optional[torch.Tensor], n: int) -> torch.Tensor:
        if values is None:
            if self.value_dim == 0:
                return torch.empty(n, 0, dtype=self.value_dtype, device=self.device)
            raise ValueError(f"values of shape ({n}, {self.value_dim}) are required")
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"values must be a torch.Tensor, got {type(values).__name__}")
        if values.dtype != self.value_dtype:
            raise TypeError(f"values must be {self.value_dtype}, got {values.dtype}")
        if values.shape != (n, self.value_dim):
            raise ValueError(
                f"values must have shape ({n}, {self.value_dim}), got {tuple(values.shape)}"
            )
        return values

    # ----------------------------------------------------------------- verbs
    def find(self, keys: torch.Tensor, table_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Slot of each key; never inserts and never changes a score.

        Args:
            keys (Tensor): (n,) int64.
            table_ids (Tensor, optional): (n,) int32/int64; None means table 0.

        Returns:
            (n,) int64 slots, -1 where the key is absent.
        """
        self._check_idle()
        keys = self._keys(keys)
        tids = self._table_ids(table_ids, keys.numel())
        return self._ops.find(self._meta, self.bucket_capacity, keys, tids, self.num_tables == 1)

    def find_or_insert(
        self,
        keys: torch.Tensor,
        table_ids: Optional[torch.Tensor] = None,
        scores: Optional[torch.Tensor] = None,
    ) -> InsertResult:
        """Slot of each key, inserting absent keys (their value rows are zeroed).

        Args:
            keys (Tensor): (n,) int64.
            table_ids (Tensor, optional): (n,) int32/int64; None means table 0.
            scores (Tensor, optional): (n,) int64 >= 0, only with CUSTOMIZED.

        Returns:
            ``InsertResult`` with the evicted entries read out.
        """
        return self._upsert(keys, table_ids, scores, values=None, read_evicted=True)

    def insert_or_assign(
        self,
        keys: torch.Tensor,
        values: Optional[torch.Tensor],
        table_ids: Optional[torch.Tensor] = None,
        scores: Optional[torch.Tensor] = None,
    ) -> InsertResult:
        """Inserts or overwrites keys with ``values``; evictions are only counted.

        Args:
            keys (Tensor): (n,) int64.
            values (Tensor): (n, value_dim) of ``value_dtype`` (None if value_dim is 0).
            table_ids (Tensor, optional): (n,) int32/int64; None means table 0.
            scores (Tensor, optional): (n,) int64 >= 0, only with CUSTOMIZED.

        Returns:
            ``InsertResult`` with ``evicted=None``.
        """
        return self._upsert(keys, table_ids, scores, values=values, read_evicted=False,
                            assign=True)

    def insert_and_evict(
        self,
        keys: torch.Tensor,
        values: Optional[torch.Tensor],
        table_ids: Optional[torch.Tensor] = None,
        scores: Optional[torch.Tensor] = None,
    ) -> InsertResult:
        """As ``insert_or_assign``, and returns the evicted entries with their rows."""
        return self._upsert(keys, table_ids, scores, values=values, read_evicted=True,
                            assign=True)

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
        erased = self._ops.erase(self._meta, self.bucket_capacity, keys, tids)
        count = int(erased.sum())
        self._generation += count > 0
        self._size -= count
        self.stats.erases += count
        return erased

    def export_batch(
        self, start: int = 0, count: Optional[int] = None, min_score: Optional[int] = None
    ) -> Exported:
        """Occupied slots of ``[start, start + count)`` whose score is >= ``min_score``.

        Args:
            start: first slot.
            count: number of slots to scan (default: to the end).
            min_score: keep only entries scoring at least this (default: all).

        Returns:
            ``Exported`` in slot order; value rows are copies.
        """
        self._check_idle()
        if start < 0 or (count is not None and count < 0):
            raise ValueError(f"start and count must be >= 0, got {start}, {count}")
        end = self.capacity() if count is None else min(self.capacity(), start + count)
        slots = self._ops.occupied_slots(self._meta, self.bucket_capacity, start, max(start, end))
        if min_score is not None:
            slots = slots[self._meta[1][slots] >= int(min_score)]
        return Exported(
            keys=self._meta[0][slots],
            table_ids=self._meta[2][slots].long(),
            scores=self._meta[1][slots],
            slots=slots,
            values=self._values[slots],
        )

    # -------------------------------------------------------------- internals
    def _grow(self) -> None:
        """Doubles the buckets; every entry keeps its offset in the bucket."""
        new_meta = self._new_meta(2 * self._num_buckets)
        moved = self._ops.grow(self._meta, new_meta, self.bucket_capacity)
        new_values = self._new_values(2 * self._num_buckets)
        occupied = (moved >= 0).nonzero().squeeze(1)
        new_values[moved[occupied]] = self._values[occupied]
        self._meta, self._values = new_meta, new_values
        self._num_buckets *= 2
        self._generation += 1
        self.stats.growths += 1

    def _grow_for_load(self) -> None:
        while (
            self._size > self.max_load_factor * self.capacity()
            and self._num_buckets < self._max_num_buckets
        ):
            self._grow()

    def prepare_find_or_insert(
        self,
        keys: torch.Tensor,
        table_ids: Optional[torch.Tensor] = None,
        scores: Optional[torch.Tensor] = None,
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
        return self._prepare(keys, table_ids, scores, values=None, read_evicted=True, assign=False)

    def prepare_dedup_find_or_insert(
        self,
        keys: torch.Tensor,
        table_ids: Optional[torch.Tensor] = None,
        frequencies: Optional[torch.Tensor] = None,
    ) -> Tuple[Deduplicated, "PendingInsert"]:
        """``prepare_find_or_insert`` of the unique pairs of a batch that may repeat
        keys, returning the dedup too. With a clock-scored strategy (LRU, STEP,
        NO_EVICTION) the dedup and the insert overlap: one thread finds the unique
        pairs while another inserts them. LFU adds each pair's count to its score.

        Args:
            keys (Tensor): (N,) int64.
            table_ids (Tensor, optional): (N,) int16/int32/int64; None means table 0.
            frequencies (Tensor, optional): (N,) int64 >= 1, occurrences each key
                stands for (summed into ``counts``); None means 1 each.

        Returns:
            (``Deduplicated``, ``PendingInsert`` over ``Deduplicated.keys``).

        Raises:
            ValueError: with the CUSTOMIZED strategy, whose scores are per key: dedup
                first and call ``prepare_find_or_insert``.
        """
        if self.score_strategy == DynamicEmbScoreStrategy.CUSTOMIZED:
            raise ValueError(
                "prepare_dedup_find_or_insert takes no scores: with CUSTOMIZED, dedup "
                "first and call prepare_find_or_insert with a score per unique key")
        self._check_idle()
        keys = self._keys(keys)
        n = keys.numel()
        tids = self._table_ids(table_ids, n)
        frequencies = _frequencies(frequencies, n)
        if self._policy.rule != 0:  # LFU: the scores are the counts, known after the dedup
            unique = Deduplicated(*self._ops.dedup(keys, tids, frequencies, True))
            return unique, self._prepare(unique.keys, unique.table_ids, unique.counts,
                                         values=None, read_evicted=True, assign=False)
        self._grow_for_load()
        clock_before, now = self._tick()
        out = self._pass_outputs(n)
        *unique, deferred = self._ops.dedup_upsert(
            self._meta, self.bucket_capacity, keys, tids, frequencies, now,
            self._policy.evicts, self._num_buckets < self._max_num_buckets,
            self.num_tables == 1, out["slots"], out["status"], out["prev_scores"],
            out["ev_keys"], out["ev_tids"], out["ev_scores"], out["outcomes"],
        )
        unique = Deduplicated(*unique)
        num_unique = unique.keys.numel()
        for name in _PER_KEY_OUTPUTS:
            out[name] = out[name][:num_unique]
        out["passes"] = 1
        out = self._run_passes(unique.keys, unique.table_ids, None, now, out, deferred)
        return unique, self._pending_insert(out, clock_before, None, read_evicted=True,
                                            assign=False)

    def _check_idle(self) -> None:
        if self._pending is not None:
            raise RuntimeError(
                "the table has a prepared insert: commit() or abort() it before another call")

    def _prepare(self, keys, table_ids, scores, values, read_evicted, assign) -> "PendingInsert":
        self._check_idle()
        keys = self._keys(keys)
        n = keys.numel()
        tids = self._table_ids(table_ids, n)
        given = self._given_scores(scores, n)
        rows = self._rows(values, n) if assign else None

        self._grow_for_load()
        clock_before, now = self._tick()
        everything = torch.arange(n, dtype=torch.int64, device=self.device)
        out = self._run_passes(keys, tids, given, now, self._pass_outputs(n), everything)
        return self._pending_insert(out, clock_before, rows, read_evicted, assign)

    def _tick(self) -> Tuple[int, int]:
        """Advances the clock for an inserting call: (clock before, the call's score)."""
        clock_before = self._clock
        self._clock += 1
        now = self._step if self.score_strategy == DynamicEmbScoreStrategy.STEP else self._clock
        return clock_before, now

    def _pending_insert(self, out, clock_before, rows, read_evicted, assign) -> "PendingInsert":
        """The prepared call of finished passes; reports failed inserts."""
        if out["passes"] > 1:  # a single pass unpins its own slots in the kernel
            self._ops.unpin(self._meta, self.bucket_capacity, out["slots"])
        pending = PendingInsert(self, out, clock_before, rows, read_evicted, assign)
        failed = out["counts"]["failed"]
        if failed:
            self.stats.failed_inserts += failed
            self._report_failures(failed, out["slots"].numel(), pending)
        self._pending = pending
        return pending

    def _commit(self, pending: "PendingInsert") -> InsertResult:
        self._pending = None
        out = pending.out
        slots, status = out["slots"], out["status"]
        num_evicted = out["counts"]["evicted"]
        num_inserted = out["counts"]["inserted"] + num_evicted
        self._size += num_inserted - num_evicted
        self.stats.inserts += num_inserted
        self.stats.evictions += num_evicted
        self._generation += num_evicted > 0

        evicted = None
        if pending.read_evicted:
            evicted = (self._read_evicted(status == _EVICTED_AND_INSERTED, out) if num_evicted
                       else self._no_evicted())
        if num_inserted:
            inserted = (status == _INSERTED) | (status == _EVICTED_AND_INSERTED)
        else:  # the common case of a warm table: every key was found
            inserted = torch.zeros(slots.shape, dtype=torch.bool, device=self.device)
        if pending.assign:
            self._assign_rows(slots, pending.rows)
        elif num_inserted:
            self._values.index_fill_(0, slots[inserted], 0)
        return InsertResult(slots=slots, inserted=inserted, evicted=evicted,
                            num_inserted=num_inserted, num_failed=out["counts"]["failed"])

    def _abort(self, pending: "PendingInsert") -> None:
        """Undoes a prepared call: contents, scores and clock as before it (growth stays)."""
        self._pending = None
        out = pending.out
        self._ops.undo_upsert(
            self._meta, self.bucket_capacity, out["slots"], out["status"],
            out["prev_scores"], out["ev_keys"], out["ev_tids"], out["ev_scores"],
        )
        self._clock = pending.clock_before

    def _upsert(self, keys, table_ids, scores, values, read_evicted, assign=False) -> InsertResult:
        return self._prepare(keys, table_ids, scores, values, read_evicted, assign).commit()

    def _pass_outputs(self, n: int) -> dict:
        """Per-key outputs of inserting passes over n keys, and their counts."""
        out = {name: torch.empty(n, dtype=dtype, device=self.device)
               for name, dtype in _PER_KEY_OUTPUTS.items()}
        # keys that were hits, inserted, evicted and inserted, failed
        out["outcomes"] = torch.zeros(4, dtype=torch.int64)
        out["passes"] = 0
        return out

    def _run_passes(self, keys, tids, given, now, out, pending) -> dict:
        """Inserting passes over keys[pending] until no key is deferred; the table
        grows for deferred keys between passes (also after passes already in ``out``)."""
        while pending.numel():
            if out["passes"]:  # the previous pass deferred keys to grow for
                self._grow()
                done = out["status"] <= _EVICTED_AND_INSERTED
                hashes = self._ops.hash_keys(keys[done], tids[done])
                bucket = torch.bitwise_and(hashes, self._num_buckets - 1)
                out["slots"][done] = (bucket * self.bucket_capacity
                                      + out["slots"][done] % self.bucket_capacity)
            out["passes"] += 1
            pending = self._ops.upsert(
                self._meta, self.bucket_capacity, keys, tids, given,
                self._policy.rule, now, self._policy.evicts,
                self._num_buckets < self._max_num_buckets, self.num_tables == 1, pending,
                out["slots"], out["status"], out["prev_scores"],
                out["ev_keys"], out["ev_tids"], out["ev_scores"], out["outcomes"],
            )
        out["counts"] = dict(zip(("hit", "inserted", "evicted", "failed"),
                                 out["outcomes"].tolist()))
        return out

    def _report_failures(self, failed: int, n: int, pending: "PendingInsert") -> None:
        message = (
            f"{failed} of {n} keys found no slot: every slot of their bucket is in use "
            f"by this call, or the table is full at max_capacity={self.max_capacity()} "
            f"with {self.score_strategy.name}"
        )
        if self.check_mode == DynamicEmbCheckMode.ERROR:
            self._abort(pending)
            raise RuntimeError(message + "; the call was undone")
        if self.check_mode == DynamicEmbCheckMode.WARNING:
            logger.warning(message)

    def _no_evicted(self) -> Evicted:
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        return Evicted(keys=empty, table_ids=empty, scores=empty, slots=empty,
                       values=self._values[:0])

    def _read_evicted(self, evicting: torch.Tensor, out: dict) -> Evicted:
        positions = evicting.nonzero().squeeze(1)
        slots = out["slots"][positions]
        return Evicted(
            keys=out["ev_keys"][positions],
            table_ids=out["ev_tids"][positions].long(),
            scores=out["ev_scores"][positions],
            slots=slots,
            values=self._values[slots],
        )

    def _assign_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """values[slots[i]] = rows[i] for landed keys; the last of duplicates wins."""
        positions = (slots >= 0).nonzero().squeeze(1)
        if positions.numel() == 0 or self.value_dim == 0:
            return
        unique, inverse = torch.unique(slots[positions], return_inverse=True)
        last = torch.full_like(unique, -1).scatter_reduce_(0, inverse, positions, "amax")
        self._values[unique] = rows[last]

    def __repr__(self) -> str:
        return (
            f"ScoredHashTable(num_tables={self.num_tables}, size={self._size}, "
            f"capacity={self.capacity()}, max_capacity={self.max_capacity()}, "
            f"bucket_capacity={self.bucket_capacity}, "
            f"score_strategy={self.score_strategy.name}, value_dim={self.value_dim})"
        )
