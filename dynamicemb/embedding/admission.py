"""Frequency admission: a key gets a stored row once it was seen ``threshold`` times.

Until then its lookups get transient rows (``FrequencyAdmissionStrategy``). The
counts live in a small ``ScoredHashTable`` of their own, bounded by
``counter_capacity`` (LRU: the least recently seen counters go first).
"""

import torch

from dynamicemb.options import FrequencyAdmissionStrategy
from dynamicemb.ops.interface import Entries
from dynamicemb.table import ScoredHashTable

__all__ = ["Admission"]


class Admission:
    """The occurrence counters of one group's keys that are not stored yet.

    Args:
        strategy: threshold and counter capacity.
        num_tables: logical tables of the group.
        device: where the counters live (the group's device).
    """

    def __init__(self, strategy: FrequencyAdmissionStrategy, num_tables: int,
                 device: torch.device) -> None:
        self.threshold = strategy.threshold
        self.counter = ScoredHashTable(num_tables=num_tables,
                                       capacity=strategy.counter_capacity,
                                       max_load_factor=1.0, value_dim=1,
                                       value_dtype=torch.float64, device=device)

    def admitted(self, stored: torch.Tensor, keys: torch.Tensor, tids: torch.Tensor,
                 counts: torch.Tensor) -> torch.Tensor:
        """Mask of unique keys that may be stored (read-only): those already ``stored``
        (a bool mask), and new ones whose counted occurrences, with this batch's,
        reach the threshold."""
        admitted = stored.clone()
        new = (~admitted).nonzero().squeeze(1)
        if new.numel():
            slots = self.counter.find(keys[new], tids[new])
            seen = torch.where(slots >= 0, self.counter.values[slots.clamp(min=0), 0],
                               torch.zeros((), dtype=torch.float64, device=keys.device))
            admitted[new] = seen + counts[new].double() >= self.threshold
        return admitted

    def count(self, keys: torch.Tensor, tids: torch.Tensor, counts: torch.Tensor,
              admitted: torch.Tensor, stored_now: torch.Tensor) -> None:
        """After a committed insert: forget the counters of keys just stored (positions
        ``stored_now``) and add this batch's occurrences of keys still waiting."""
        self.counter.erase(keys[stored_now], tids[stored_now])
        waiting = (~admitted).nonzero().squeeze(1)
        if waiting.numel():
            counted = self.counter.find_or_insert(keys[waiting], tids[waiting])
            ok = counted.slots >= 0
            self.counter.values[counted.slots[ok], 0] += counts[waiting][ok].double()

    # ---------------------------------------------------------- checkpoints
    def export(self, tid: int) -> Entries:
        """The counters of local table ``tid``: keys, scores and ``values`` (m, 1)
        float64 counts."""
        entries = self.counter.export_batch()
        mine = entries.table_ids == tid
        return Entries(*(t[mine] for t in entries))

    def restore(self, tid: int, keys: torch.Tensor, counts: torch.Tensor,
                scores: torch.Tensor) -> None:
        """Writes counters of local table ``tid`` with their saved scores.

        Args:
            keys (Tensor): (m,) int64.
            counts (Tensor): (m,) float64 occurrences counted.
            scores (Tensor): (m,) int64 the counters' LRU scores.
        """
        tids = torch.full(keys.shape, tid, dtype=torch.int64, device=keys.device)
        self.counter.insert_or_assign(keys, counts.to(torch.float64).reshape(-1, 1), tids,
                                      scores, exact_scores=True)

    def clear_table(self, tid: int) -> None:
        """Forgets every counter of local table ``tid``."""
        entries = self.counter.export_batch()
        mine = entries.table_ids == tid
        if self.counter.num_tables == 1:
            self.counter.clear()
        elif bool(mine.any()):
            self.counter.erase(entries.keys[mine], entries.table_ids[mine])
