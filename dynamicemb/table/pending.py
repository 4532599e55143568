"""The two-phase insert (``ScoredHashTable.prepare_find_or_insert``): the prepared
call, and its commit (the value rows and the call's result) or abort.

A ``PendingInsert`` reaches its table only through ``InsertingTable``, the table's
small interface for it."""

from typing import NamedTuple, Optional, Protocol, Tuple

import torch

from dynamicemb.ops.interface import (COMPOUND_TIME_MASK, Entries, InsertStatus, TableMemory,
                                      Upserted)
from dynamicemb.table.results import InsertResult, TableStats

__all__ = ["InsertingTable", "PaddedCall", "PendingInsert"]


class PaddedCall(NamedTuple):
    """What a padded call (``prepare_dedup_find_or_insert(padded=True)``) needs to be
    undone: its input-check word (None: none) and its dedup's counts (N,), 0 for
    padding; with ``admit``, ``admitted`` (N,) bool: the keys its pass took (the
    others are not in it, like padding), else None."""

    error: Optional[torch.Tensor]
    counts: torch.Tensor
    admitted: Optional[torch.Tensor] = None


class InsertingTable(Protocol):
    """What a ``PendingInsert`` asks of its table (``ScoredHashTable``): its memory and
    time, and the bookkeeping of a commit or an abort, which the table owns."""

    device: torch.device
    value_dim: int

    @property
    def memory(self) -> TableMemory: ...

    @property
    def stats(self) -> TableStats: ...

    @property
    def compound_scores(self) -> bool: ...

    def expired_before(self, time: int) -> int: ...

    def time_of(self, scores: torch.Tensor) -> torch.Tensor: ...

    def no_new_keys(self, n: int) -> torch.Tensor: ...

    def record_commit(self, pending: "PendingInsert", num_inserted: Optional[int],
                      num_evicted: Optional[int]) -> None: ...

    def record_expired_hits(self, num: int) -> None: ...

    def undo_insert(self, pending: "PendingInsert") -> None: ...


def _inserted_mask(upserted: Upserted) -> torch.Tensor:
    """Status INSERTED or EVICTED_AND_INSERTED (1 or 2): status - 1 seen as uint8
    is below 2 (HIT wraps to 255): two ops where two compares and an or are three."""
    return (upserted.status - InsertStatus.INSERTED).view(torch.uint8) < 2


class PendingInsert:
    """A prepared inserting call: keys, scores and slots are decided, value rows not
    yet. ``commit()`` finishes it, ``abort()`` undoes it; until then every other verb
    of its table raises.

    Args:
        table: the ``ScoredHashTable`` it belongs to (``InsertingTable``).
        upserted: what the backend decided.
        clock_before: the table's clock before the call (restored by ``abort``).
        rows: the rows to assign (``insert_or_assign``), else None.
        read_evicted: whether the result reads evicted entries out.
        assign: write ``rows`` (True) or zero the rows of new keys (False).
        now: the call's time (its clock or step), which decides what has expired.
        given: (n,) the scores or counts given to the kernel (None: none, or exact).
        padded: a padded call's ``PaddedCall`` (its clock is on the device:
            ``clock_before`` and ``now`` are None), else None.
    """

    def __init__(self, table: InsertingTable, upserted: Upserted, clock_before: Optional[int],
                 rows: Optional[torch.Tensor], read_evicted: bool, assign: bool,
                 now: Optional[int] = 0, given: Optional[torch.Tensor] = None,
                 padded: Optional[PaddedCall] = None) -> None:
        self.table = table
        self.upserted = upserted
        self.clock_before = clock_before
        self.rows = rows
        self.read_evicted = read_evicted
        self.assign = assign
        self.now = now
        self.given = given
        self.padded = padded
        self._done = False

    @property
    def slots(self) -> torch.Tensor:
        """(n,) int64 slots decided by the call, -1 where the insert failed."""
        return self.upserted.slots

    # The counts below are the kernel's own, or, for a padded call, read from its
    # per-key status on the host (a sync: only a caller that must know asks).
    def _real(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` over the keys a padded call's pass took: not its padding (count 0)
        nor, with an admission, the keys it did not admit."""
        if self.padded is None:
            return mask
        mask = mask & (self.padded.counts > 0)
        return mask if self.padded.admitted is None else mask & self.padded.admitted

    @property
    def num_failed(self) -> int:
        """Keys that found no slot."""
        if self.padded is None:
            return self.upserted.failed
        return int(self._real(self.upserted.status == InsertStatus.FAILED).sum())

    @property
    def num_new(self) -> int:
        """Keys new to the table (inserted, evicting or not)."""
        if self.padded is None:
            return self.upserted.inserted + self.upserted.evicted
        return int(self.new_keys().sum())

    def new_keys(self) -> torch.Tensor:
        """(n,) bool, True where the key is new to the table (before ``commit``)."""
        return self._real(_inserted_mask(self.upserted))

    def evicted(self) -> "Entries":
        """The entries this call evicts, with their rows, read before ``commit`` (which
        overwrites them); in input order of the keys that evict them."""
        if self.padded is not None:
            return self._read_evicted(
                self._real(self.upserted.status == InsertStatus.EVICTED_AND_INSERTED).nonzero()
                .squeeze(1))
        if self.upserted.evicted == 0:
            return self._no_evicted()
        return self._read_evicted()

    def _finish(self) -> None:
        if self._done:
            raise RuntimeError("this insert was already committed or aborted")
        self._done = True

    def commit(self) -> InsertResult:
        """Writes the value rows and returns the call's result."""
        self._finish()
        table, upserted = self.table, self.upserted
        slots = upserted.slots
        if self.padded is not None:  # every count stays on the device
            table.record_commit(self, None, None)
            return InsertResult(slots=slots, inserted=None, evicted=None, num_inserted=None,
                                num_failed=None, status=upserted.status)
        num_evicted = upserted.evicted
        num_inserted = upserted.inserted + num_evicted
        table.record_commit(self, num_inserted, num_evicted)

        evicted = None
        if self.read_evicted:
            evicted = (self._read_evicted() if num_evicted else self._no_evicted())
        if num_inserted:
            inserted = _inserted_mask(upserted)
        else:  # the common case of a warm table: every key was found
            inserted = table.no_new_keys(slots.numel())
        expired, num_expired = self._expired_hits()
        if num_expired:
            inserted = inserted | expired
            num_inserted += num_expired
        if self.assign:
            self._assign_rows(slots, self.rows)
        inserted_at = None
        if num_inserted:  # sizes known from the counts: no sync for the compaction
            inserted_at = torch.nonzero_static(inserted, size=num_inserted).squeeze(1)
        if not self.assign and num_inserted:
            table.memory.values.index_fill_(0, slots[inserted_at], 0)
        return InsertResult(slots=slots, inserted=inserted, evicted=evicted,
                            num_inserted=num_inserted, num_failed=upserted.failed,
                            num_expired=num_expired, expired=expired if num_expired else None,
                            inserted_at=inserted_at)

    def abort(self) -> None:
        """Undoes the call."""
        self._finish()
        self.table.undo_insert(self)

    def _expired_hits(self) -> Tuple[Optional[torch.Tensor], int]:
        """(n,) bool: the call's hits on rows expired at its time (they now hold a
        fresh row: a new key's score, zeroed or assigned values), and their count."""
        table = self.table
        before = table.expired_before(self.now)
        upserted = self.upserted
        if before == 0 or upserted.hits == 0:
            return None, 0
        expired = ((upserted.status == InsertStatus.HIT)
                   & (table.time_of(upserted.prev_scores) < before))
        num = int(expired.sum())
        if num == 0:
            return None, 0
        table.record_expired_hits(num)
        if table.compound_scores and self.given is not None:  # a new key's count, not old + new
            at = expired.nonzero().squeeze(1)
            count = self.given[at].clamp(max=COMPOUND_TIME_MASK >> 1)  # 2^31 - 1
            table.memory.scores[upserted.slots[at]] = (
                (count << 32) | (self.now & COMPOUND_TIME_MASK))
        return expired, num

    def _no_evicted(self) -> Entries:
        empty = torch.empty(0, dtype=torch.int64, device=self.table.device)
        return Entries(keys=empty, table_ids=empty, scores=empty, slots=empty,
                       values=self.table.memory.values[:0])

    def _read_evicted(self, positions: Optional[torch.Tensor] = None) -> Entries:
        upserted = self.upserted
        if positions is None:
            positions = torch.nonzero_static(upserted.status == InsertStatus.EVICTED_AND_INSERTED,
                                             size=upserted.evicted).squeeze(1)
        slots = upserted.slots[positions]
        return Entries(
            keys=upserted.ev_keys[positions],
            table_ids=upserted.ev_tids[positions].long(),
            scores=upserted.ev_scores[positions],
            slots=slots,
            values=self.table.memory.values[slots],
        )

    def _assign_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """values[slots[i]] = rows[i] for landed keys; the last of duplicates wins."""
        positions = (slots >= 0).nonzero().squeeze(1)
        if positions.numel() == 0 or self.table.value_dim == 0:
            return
        unique, inverse = torch.unique(slots[positions], return_inverse=True)
        last = torch.full_like(unique, -1).scatter_reduce_(0, inverse, positions, "amax")
        self.table.memory.values[unique] = rows[last]
