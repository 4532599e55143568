"""What the table's verbs return."""

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from dynamicemb.ops.interface import Deduplicated, Entries

__all__ = ["Deduplicated", "Entries", "Expired", "InsertResult", "TableStats"]


@dataclass
class TableStats:
    """Running counts of what the table did (never reset by ``clear``)."""

    inserts: int = 0
    evictions: int = 0
    failed_inserts: int = 0
    erases: int = 0
    growths: int = 0
    expired: int = 0  # rows past their ttl: found expired by a lookup, or swept


class InsertResult(NamedTuple):
    """Outcome of an inserting call.

    Shape:
        slots: (n,) int64, -1 where the insert failed; inserted: (n,) bool, True
        where the key was new (or its row had expired: ``expired`` marks those,
        None when nothing expired). ``evicted`` (``Entries``, in input order of the
        keys that evicted them) is None for ``insert_or_assign``. ``num_inserted``
        and ``num_failed`` count them (the kernel's own counts); ``num_expired``
        counts ``expired`` (part of ``num_inserted``). ``inserted_at``:
        (num_inserted,) int64, the positions where ``inserted`` is True, ascending
        (None when none is, or when ``inserted`` was changed after the call).

        A padded call (``prepare_dedup_find_or_insert(padded=True)``) reads nothing
        on the host: ``inserted``, ``evicted``, ``num_inserted`` and ``num_failed``
        are None and ``status`` (n,) int8 tells each key's ``InsertStatus`` (padding:
        FAILED, slot -1); the table's ``outcome_totals`` count it.
    """

    slots: torch.Tensor
    inserted: Optional[torch.Tensor]
    evicted: Optional[Entries]
    num_inserted: Optional[int]  # inserted.sum()
    num_failed: Optional[int]  # (slots < 0).sum()
    num_expired: int = 0
    expired: Optional[torch.Tensor] = None
    inserted_at: Optional[torch.Tensor] = None
    status: Optional[torch.Tensor] = None

    def inserted_positions(self) -> torch.Tensor:
        """(num_inserted,) int64: the positions where ``inserted`` is True, ascending
        (sized by ``num_inserted``: no sync)."""
        if self.inserted_at is not None:
            return self.inserted_at
        return torch.nonzero_static(self.inserted, size=self.num_inserted).squeeze(1)


class Expired(NamedTuple):
    """Rows a TTL sweep freed.

    Shape:
        keys, table_ids, scores, slots: (n,) int64, in slot order.
    """

    keys: torch.Tensor
    table_ids: torch.Tensor
    scores: torch.Tensor
    slots: torch.Tensor
