"""What the table's verbs return."""

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from dynamicemb.ops.interface import Deduplicated, Entries, InsertStatus, Upserted

__all__ = ["Deduplicated", "Entries", "Expired", "InsertResult", "TableStats", "expired_hits",
           "inserted_mask"]


@dataclass
class TableStats:
    """Running counts of what the table did (never reset by ``clear``)."""

    inserts: int = 0
    evictions: int = 0
    failed_inserts: int = 0
    erases: int = 0
    growths: int = 0
    expired: int = 0  # rows past their ttl: found expired by a lookup, or swept


def inserted_mask(status: torch.Tensor) -> torch.Tensor:
    """(n,) bool: status INSERTED or EVICTED_AND_INSERTED (status - 1 as uint8 < 2: two ops)."""
    return (status - InsertStatus.INSERTED).view(torch.uint8) < 2


class InsertResult(NamedTuple):
    """Outcome of an inserting call, per key.

    Shape:
        slots: (n,) int64, -1 where the insert failed; status: (n,) int8
        ``InsertStatus``; prev_scores: (n,) int64, the score a hit found (-1: a new
        key); evicted: the evicted ``Entries``, None unless the verb reads them.

    The counts below are read on the host (a GPU sync). A deduplicating step's call
    has padding past its unique keys (status FAILED): read statuses, not counts.
    """

    slots: torch.Tensor
    status: torch.Tensor
    prev_scores: torch.Tensor
    evicted: Optional[Entries] = None

    @property
    def inserted(self) -> torch.Tensor:
        """(n,) bool: the key was new, or its row had expired (``expired``)."""
        return inserted_mask(self.status)

    @property
    def expired(self) -> torch.Tensor:
        """(n,) bool: the key's row had expired (``ttl``); it now holds a fresh row."""
        return (self.status == InsertStatus.INSERTED) & (self.prev_scores >= 0)

    @property
    def num_inserted(self) -> int:
        return int(self.inserted.sum())

    @property
    def num_failed(self) -> int:
        return int((self.status == InsertStatus.FAILED).sum())

    @property
    def num_expired(self) -> int:
        return int(self.expired.sum())

    def inserted_positions(self) -> torch.Tensor:
        """The positions where ``inserted`` is True, ascending."""
        return self.inserted.nonzero().squeeze(1)


class Expired(NamedTuple):
    """Rows a TTL sweep freed.

    Shape:
        keys, table_ids, scores, slots: (n,) int64, in slot order.
    """

    keys: torch.Tensor
    table_ids: torch.Tensor
    scores: torch.Tensor
    slots: torch.Tensor


def expired_hits(upserted: Upserted) -> torch.Tensor:
    """(n,) bool: a pass's hits on rows expired at its time (INSERTED, prev score >= 0)."""
    return (upserted.status == InsertStatus.INSERTED) & (upserted.prev_scores >= 0)
