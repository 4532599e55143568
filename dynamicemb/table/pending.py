"""The two-phase insert: a prepared call (``PendingInsert``) and its commit or abort."""

from typing import List, Optional, Protocol

import torch

from dynamicemb.ops.interface import Entries, InsertStatus, TableMemory, Upserted
from dynamicemb.table.results import InsertResult, inserted_mask

__all__ = ["InsertingTable", "PendingInsert"]


class InsertingTable(Protocol):
    """What a ``PendingInsert`` asks of its ``ScoredHashTable``."""

    device: torch.device
    value_dim: int

    @property
    def memory(self) -> TableMemory: ...

    def record_commit(self, pending: "PendingInsert") -> None: ...

    def undo_insert(self, pending: "PendingInsert") -> None: ...


class PendingInsert:
    """A prepared inserting call: keys, scores and slots decided, value rows not yet.
    ``commit()`` finishes it, ``abort()`` undoes it; until then its table's other verbs
    raise. Its table is reached only through ``InsertingTable``.

    Args:
        ticked_step: the call advanced the step with the clock (``abort`` takes both back).
        counts_of_dedup: (n,) a dedup's counts (0: padding, not in the pass), or None.
        admitted: (n,) bool, the keys an admission let into the pass, or None.
        outcomes: (5,) int64 on the device, the call's own counts, or None (a step's
            call adds to the table's running totals).
        rows: rows to write at the keys' slots (a repeated key's last wins), or None.
    """

    def __init__(self, table: InsertingTable, upserted: Upserted, *,
                 error: Optional[torch.Tensor] = None, ticked_step: bool = False,
                 counts_of_dedup: Optional[torch.Tensor] = None, admitted: Optional[torch.Tensor] = None,
                 outcomes: Optional[torch.Tensor] = None,
                 rows: Optional[torch.Tensor] = None, zero_new: bool = False,
                 read_evicted: bool = False) -> None:
        self.table = table
        self.upserted = upserted
        self.error = error
        self.ticked_step = ticked_step
        self.counts_of_dedup = counts_of_dedup
        self.admitted = admitted
        self.outcomes = outcomes
        self.rows = rows
        self.zero_new = zero_new
        self.read_evicted = read_evicted
        self._done = False
        self._counts: Optional[List[int]] = None

    @property
    def slots(self) -> torch.Tensor:
        """(n,) int64 slots decided by the call, -1 where the insert failed."""
        return self.upserted.slots

    def taken(self, mask: torch.Tensor) -> torch.Tensor:
        """``mask`` over the keys the pass took (not padding, not left out by admission)."""
        if self.counts_of_dedup is not None:
            mask = mask & (self.counts_of_dedup > 0)
        return mask if self.admitted is None else mask & self.admitted

    def counts(self) -> List[int]:
        """Hits, inserted (into empty slots), evicted and inserted, failed, and hits on
        expired rows, among the keys the pass took: read on the host once (a GPU sync)."""
        if self._counts is None and self.outcomes is not None:
            self._counts = self.outcomes.tolist()
        elif self._counts is None:
            status = self.upserted.status.long()
            if self.counts_of_dedup is not None or self.admitted is not None:
                status = torch.where(self.taken(torch.ones_like(status, dtype=torch.bool)),
                                     status, InsertStatus.FAILED + 1)
            expired = self.taken((self.upserted.status == InsertStatus.INSERTED)
                                 & (self.upserted.prev_scores >= 0))
            counts = torch.zeros(6, dtype=torch.int64, device=status.device)
            counts.index_add_(0, status, torch.ones_like(status))  # no size read: no sync
            counts[4] = expired.sum()
            counts[InsertStatus.INSERTED] -= counts[4]
            self._counts = counts[:5].tolist()
        return self._counts

    @property
    def num_failed(self) -> int:
        """Keys the pass took that found no slot."""
        return self.counts()[InsertStatus.FAILED]

    @property
    def num_new(self) -> int:
        """Keys new to the table (inserted, evicting or not, or over an expired row)."""
        _, inserted, evicted, _, expired = self.counts()
        return inserted + evicted + expired

    def new_keys(self) -> torch.Tensor:
        """(n,) bool, True where the key is new to the table (or its row expired)."""
        return self.taken(inserted_mask(self.upserted.status))

    def evicted(self) -> Entries:
        """The entries this call evicts, with rows (read before ``commit`` overwrites them)."""
        upserted = self.upserted
        positions = self._positions(
            self.taken(upserted.status == InsertStatus.EVICTED_AND_INSERTED),
            InsertStatus.EVICTED_AND_INSERTED)
        slots = upserted.slots[positions]
        return Entries(keys=upserted.ev_keys[positions],
                       table_ids=upserted.ev_tids[positions].long(),
                       scores=upserted.ev_scores[positions], slots=slots,
                       values=self.table.memory.values[slots])

    def _positions(self, mask: torch.Tensor, *counted: int) -> torch.Tensor:
        """The positions of ``mask``, sized by ``counts()`` where read (no second sync)."""
        if self._counts is None:
            return mask.nonzero().squeeze(1)
        size = sum(self._counts[c] for c in counted)
        return torch.nonzero_static(mask, size=size).squeeze(1)

    def _finish(self) -> None:
        if self._done:
            raise RuntimeError("this insert was already committed or aborted")
        self._done = True

    def commit(self) -> InsertResult:
        """Writes the value rows (as the call asked) and returns the call's result."""
        self._finish()
        table, upserted = self.table, self.upserted
        evicted = self.evicted() if self.read_evicted else None
        table.record_commit(self)
        values = table.memory.values
        if self.rows is not None:
            self._assign_rows(upserted.slots, self.rows)
        elif self.zero_new and table.value_dim:
            new = self._positions(self.new_keys(), InsertStatus.INSERTED,
                                  InsertStatus.EVICTED_AND_INSERTED, 4)
            values.index_fill_(0, upserted.slots[new], 0)
        return InsertResult(slots=upserted.slots, status=upserted.status,
                            prev_scores=upserted.prev_scores, evicted=evicted)

    def abort(self) -> None:
        """Undoes the call."""
        self._finish()
        self.table.undo_insert(self)

    def _assign_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """values[slots[i]] = rows[i] where the key landed; the last duplicate wins."""
        positions = (slots >= 0).nonzero().squeeze(1)
        if positions.numel() == 0 or self.table.value_dim == 0:
            return
        unique, inverse = torch.unique(slots[positions], return_inverse=True)
        last = torch.full_like(unique, -1).scatter_reduce_(0, inverse, positions, "amax")
        self.table.memory.values[unique] = rows[last]
