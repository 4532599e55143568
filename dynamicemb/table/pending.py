"""The two-phase insert (``ScoredHashTable.prepare_find_or_insert``): the prepared
call, and its commit (the value rows and the call's result) or abort.

A ``PendingInsert`` reaches its table only through ``InsertingTable``, the table's
small interface for it."""

from typing import List, Optional, Protocol

import torch

from dynamicemb.ops.interface import Entries, InsertStatus, TableMemory, Upserted
from dynamicemb.table.results import InsertResult, inserted_mask

__all__ = ["InsertingTable", "PendingInsert"]


class InsertingTable(Protocol):
    """What a ``PendingInsert`` asks of its table (``ScoredHashTable``): its memory,
    and the bookkeeping of a commit or an abort, which the table owns."""

    device: torch.device
    value_dim: int

    @property
    def memory(self) -> TableMemory: ...

    def record_commit(self, pending: "PendingInsert") -> None: ...

    def undo_insert(self, pending: "PendingInsert") -> None: ...


class PendingInsert:
    """A prepared inserting call: keys, scores and slots are decided, value rows not
    yet. ``commit()`` finishes it, ``abort()`` undoes it; until then every other verb
    of its table raises.

    Args:
        table: the ``ScoredHashTable`` it belongs to (``InsertingTable``).
        upserted: what the pass decided.
        error: the step's input-check word (a refused batch changed nothing), or
            None.
        ticked_step: the call advanced the table's step with its clock (a
            deduplicating call's kernels do; ``abort`` takes both back).
        counts_of_dedup: (n,) a dedup's counts (0: padding, not in the pass), or None.
        admitted: (n,) bool, the keys an admission let into the pass, or None.
        outcomes: (5,) int64 in device memory, the call's own counts (hits,
            inserted, evicted, failed, expired hits: the table's verbs), or None
            (a step's call, which adds to the table's running totals).
        rows: the rows to write at the keys' slots (``insert_or_assign``; the last
            of a repeated key wins), else None.
        zero_new: zero the rows of new keys (``find_or_insert``); False: the caller
            writes them (``Backend.init_rows``).
        read_evicted: the result carries the evicted entries with their rows.
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
        """``mask`` over the keys the pass took: not a dedup's padding (count 0) nor
        a key the admission left out."""
        if self.counts_of_dedup is not None:
            mask = mask & (self.counts_of_dedup > 0)
        return mask if self.admitted is None else mask & self.admitted

    def counts(self) -> List[int]:
        """How many keys the pass took were hits, inserted (into empty slots),
        evicted and inserted, failed, and hits on expired rows: read on the host
        (one sync on a GPU, the first time: only a caller that must know asks)."""
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
        """The entries this call evicts, with their rows, read before ``commit`` (which
        overwrites them); in input order of the keys that evict them."""
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
        """The positions of ``mask``; sized by the ``counted`` entries of ``counts()``
        where the call read them already (no second sync on a GPU)."""
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
        """values[slots[i]] = rows[i] for landed keys; the last of duplicates wins."""
        positions = (slots >= 0).nonzero().squeeze(1)
        if positions.numel() == 0 or self.table.value_dim == 0:
            return
        unique, inverse = torch.unique(slots[positions], return_inverse=True)
        last = torch.full_like(unique, -1).scatter_reduce_(0, inverse, positions, "amax")
        self.table.memory.values[unique] = rows[last]
