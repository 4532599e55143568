"""A group's traffic between its tiers: ``TierMetrics`` per table, counted by ``TierCounts``."""

from dataclasses import dataclass, fields
from typing import List

import torch

__all__ = ["TierCounts", "TierMetrics"]


@dataclass
class TierMetrics:
    """Counts of one table's traffic between the tiers (unique keys per batch).

    Attributes:
        lookups: keys looked up; hits, misses: those whose row was, or was not, in the
            device tier.
        evictions: rows the device tier pushed out (written back to the host store).
        host_evictions: rows the full host store evicted (gone from the table).
        host_reads, host_writes: rows copied from the host store into the device tier,
            and written back.
        expired: rows past ``ttl``: swept, or found expired by a training lookup.
        external_reads, external_writes: rows that came back from the external tier,
            and that the host store evicted down to it.
    """

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    host_evictions: int = 0
    host_reads: int = 0
    host_writes: int = 0
    expired: int = 0
    external_reads: int = 0
    external_writes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def __str__(self) -> str:
        counts = ", ".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self))
        return f"{counts}, hit_rate={self.hit_rate:.3f}"


_FIELDS = tuple(f.name for f in fields(TierMetrics))


class TierCounts:
    """``TierMetrics``' fields per logical table: counted on the host what the host knows,
    on the device what only the device knows (no per-batch sync); ``read`` adds them up."""

    def __init__(self, num_tables: int, device: torch.device) -> None:
        self.device = device
        self.one_table = num_tables == 1
        self._on_device = torch.zeros(num_tables, len(_FIELDS), dtype=torch.int64,
                                      device=device)
        self._on_host = [0] * len(_FIELDS)  # table 0's, of a one-table group

    def add(self, field: str, count: int) -> None:
        """Adds ``count`` (known on the host) to table 0's ``field``."""
        self._on_host[_FIELDS.index(field)] += count

    def where(self, field: str, tids: torch.Tensor, mask: torch.Tensor) -> None:
        """Counts the keys of ``mask`` for their tables (no sync)."""
        self._on_device[:, _FIELDS.index(field)].index_add_(
            0, tids.to(self.device).long(), mask.to(self.device).to(torch.int64))

    def each(self, field: str, tids: torch.Tensor) -> None:
        """Counts every key of ``tids`` for its table."""
        if tids.numel() == 0:
            return
        if self.one_table:
            self.add(field, tids.numel())
            return
        self.where(field, tids, torch.ones(tids.numel(), dtype=torch.bool, device=self.device))

    def read(self) -> List[TierMetrics]:
        """Per logical table, the counts so far (a sync on a GPU)."""
        rows = self._on_device.tolist()
        rows[0] = [a + b for a, b in zip(rows[0], self._on_host)]
        return [TierMetrics(*row) for row in rows]
