"""The first phase of a two-phase insert (``ScoredHashTable.prepare_find_or_insert``)."""

from typing import NamedTuple, Optional

import torch

from dynamicemb.ops.interface import Entries, Upserted
from dynamicemb.table.results import InsertResult

__all__ = ["PaddedCall", "PendingInsert"]


class PaddedCall(NamedTuple):
    """What a padded call (``prepare_dedup_find_or_insert(padded=True)``) needs to be
    undone: its input-check word (None: none) and its dedup's counts (N,), 0 for
    padding."""

    error: Optional[torch.Tensor]
    counts: torch.Tensor


class PendingInsert:
    """A prepared inserting call: keys, scores and slots are decided, value rows not
    yet. ``commit()`` finishes it, ``abort()`` undoes it; until then every other verb
    of its table raises.

    Args:
        table: the ``ScoredHashTable`` it belongs to.
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

    def __init__(self, table, upserted: Upserted, clock_before: Optional[int],
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

    @property
    def num_failed(self) -> int:
        """Keys that found no slot."""
        return self.upserted.failed

    @property
    def num_new(self) -> int:
        """Keys new to the table (inserted, evicting or not)."""
        return self.upserted.inserted + self.upserted.evicted

    def new_keys(self) -> torch.Tensor:
        """(n,) bool, True where the key is new to the table (before ``commit``)."""
        return self.table._inserted_mask(self.upserted)

    def evicted(self) -> "Entries":
        """The entries this call evicts, with their rows, read before ``commit`` (which
        overwrites them); in input order of the keys that evict them."""
        if self.upserted.evicted == 0:
            return self.table._no_evicted()
        return self.table._read_evicted(self.upserted)

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
