"""Where a group's rows live beside the host store: ``OneTier``, ``HostOnly`` (no device
memory), ``Cache`` (every row a batch uses is promoted) and ``Placement`` (new rows land
in the device tier while it has room)."""

import abc
from typing import List, Optional

import torch

from dynamicemb.ops import for_device
from dynamicemb.ops.interface import HOST_ROW_BIT, Entries, InsertStatus, RowSources, Upserted
from dynamicemb.storage.metrics import TierCounts
from dynamicemb.table import ScoredHashTable

__all__ = ["Cache", "Crossing", "HostOnly", "Layout", "OneTier", "Placement"]


class Crossing:
    """The host store's device and the device tier's; tensors cross between them here."""

    def __init__(self, host: torch.device, device: torch.device) -> None:
        self.host, self.device = host, device
        self.two = host != device

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.host) if self.two else t

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if self.two else t


class Layout:
    """The host store as the one tier (``OneTier``): its slots are the references.
    ``counts``: the group's ``TierCounts``; ``crossing``: the two devices."""

    #: the device tier (a ``ScoredHashTable`` of copies), or None
    tier: Optional[ScoredHashTable] = None

    def __init__(self, host: ScoredHashTable, counts: TierCounts, crossing: Crossing) -> None:
        self.host, self.counts, self.crossing = host, counts, crossing
        self.moves = 0  # promotions and write-backs: a key's row of record moved
        # the absent tier of ``sources``: on the kernels' device like the other one
        self._empty = torch.empty(0, host.value_dim, dtype=host.value_dtype,
                                  device=crossing.device)

    def describe(self, host: str) -> str:
        return f"one tier: {host}"

    def sources(self, transient: torch.Tensor, format, init=None) -> RowSources:
        """The row arrays the kernels read references from, rows of ``format``."""
        return RowSources(self.host.values, self._empty, transient, format, init)

    def refs(self, host_slots: torch.Tensor, all_stored: bool = False) -> torch.Tensor:
        """Device references of host slots (-1: not stored; ``all_stored``: none is -1)."""
        return self.crossing.to_device(host_slots)

    def resolve(self, keys: torch.Tensor, tids: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
        """``refs`` with the device tier's rows where it holds a live copy."""
        return refs

    def take(self, keys, tids, counts, host_slots, status, upserted: Upserted,
             several: bool) -> torch.Tensor:
        """After the host store's insert of a batch's unique keys: its victims and expired
        rows leave the device tier, the batch's rows reach it; returns the references.
        ``several``: counted per table (else ``settle`` counts from the totals)."""
        if several:
            self.counts.where("hits", tids, host_slots >= 0)
        return self.refs(host_slots)

    def settle(self, stored: int) -> None:
        """A one-table group's ``stored`` keys since the last read as hits or misses."""
        self.counts.add("hits", stored)

    def overlay(self, entries: Entries) -> None:
        """``entries`` (on the host store's device) with the device tier's current rows."""

    def drop(self, keys: torch.Tensor, tids: torch.Tensor) -> None:
        """Erases the device tier's copies of keys (never written back)."""

    def tables(self) -> List[ScoredHashTable]:
        """The tables holding rows: the host store, and the device tier if any."""
        return [self.host] if self.tier is None else [self.host, self.tier]

    @property
    def generation(self) -> int:
        return 0


OneTier = Layout


class HostOnly(Layout):
    """No device memory: references are host references."""

    def describe(self, host: str) -> str:
        return f"host store only: {host}"

    def sources(self, transient: torch.Tensor, format, init=None) -> RowSources:
        return RowSources(self._empty, self.host.values, transient, format, init)

    def refs(self, host_slots: torch.Tensor, all_stored: bool = False) -> torch.Tensor:
        host_slots = self.crossing.to_device(host_slots)
        if all_stored:
            return host_slots + HOST_ROW_BIT
        return torch.where(host_slots >= 0, host_slots + HOST_ROW_BIT, host_slots)

    def take(self, keys, tids, counts, host_slots, status, upserted, several):
        if several:
            self.counts.where("misses", tids, host_slots >= 0)
        return self.refs(host_slots)

    def settle(self, stored: int) -> None:
        self.counts.add("misses", stored)


class _DeviceTier(HostOnly, abc.ABC):
    """A device table of copies of host rows (``tier``), referenced by device slot."""

    kind = ""

    def __init__(self, host: ScoredHashTable, counts: TierCounts, crossing: Crossing,
                 tier: ScoredHashTable) -> None:
        super().__init__(host, counts, crossing)
        self.tier = tier

    def describe(self, host: str) -> str:
        cap = self.tier.capacity()
        row_bytes = self.host.value_dim * self.host.values.element_size()
        return f"device {self.kind} of {cap} rows ({cap * row_bytes} B) over a {host}"

    def sources(self, transient: torch.Tensor, format, init=None) -> RowSources:
        return RowSources(self.tier.values, self.host.values, transient, format, init)

    def resolve(self, keys, tids, refs):
        found = self.tier.find(keys, tids, checked=True)
        # A cached copy of a row the host store holds no more (expired) is dead.
        return torch.where((found >= 0) & (refs >= 0), found, refs)

    def take(self, keys, tids, counts, host_slots, status, upserted, several):
        self.tier.erase_where(upserted.ev_keys, upserted.ev_tids, status,
                              InsertStatus.EVICTED_AND_INSERTED)
        if self.host.ttl is not None:  # a cached copy of an expired row is dead
            self.tier.erase_where(keys, tids, status, InsertStatus.INSERTED)
        return self._take(keys, tids, counts, host_slots, status, several)

    @abc.abstractmethod
    def _take(self, keys, tids, counts, host_slots, status, several) -> torch.Tensor:
        """Places the batch's rows in the tier; returns the references."""

    def settle(self, stored: int) -> None:
        hits, inserted, evicted, *_ = self.tier.outcome_totals().take("metrics")
        self.counts.add("hits", hits)
        self.counts.add("misses", stored - hits)
        self.counts.add("evictions", evicted)
        self.counts.add("host_writes", evicted)  # a victim is still in the host store
        self.counts.add("host_reads", inserted + evicted)

    def overlay(self, entries: Entries) -> None:
        if entries.keys.numel() == 0:
            return
        cross = self.crossing
        found = self.tier.find(cross.to_device(entries.keys), cross.to_device(entries.table_ids),
                               checked=True)
        cached = (found >= 0).nonzero().squeeze(1)
        entries.values[cross.to_host(cached)] = cross.to_host(self.tier.values[found[cached]])

    def drop(self, keys, tids):
        if keys.numel():
            self.tier.erase(self.crossing.to_device(keys), self.crossing.to_device(tids))

    @property
    def generation(self) -> int:
        return self.tier.generation


class Cache(_DeviceTier):
    """Every row a batch uses is promoted into the device tier (``cache_policy.h``, CUSTOMIZED
    scores mirroring the host's); victims go back to the host store."""

    kind = "cache"

    def _take(self, keys, tids, counts, host_slots, status, several):
        """The promotion, on the device: the plan, one cache call over the keys in its order,
        then one kernel that writes victims back, copies new rows in and writes references."""
        tier, ops = self.tier, for_device(self.crossing.device)
        plan = ops.promotion_plan(cache=tier.memory, keys=keys, table_ids=tids, counts=counts,
                                  host_slots=host_slots, one_table=self.host.num_tables == 1,
                                  cache_size=tier.size_on_device())
        order = plan.order
        ckeys, ctids, scores, buckets = ops.promotion_order(
            order=order, keys=keys, table_ids=tids, host_slots=host_slots,
            host=self.host.memory, plan=plan, cache=tier.memory)
        cached = tier.upsert_where(ckeys, ctids, scores, buckets)
        refs = torch.empty_like(host_slots)
        ops.promote_rows(host=self.host.memory, cache=tier.memory, order=order,
                         host_slots=host_slots, cached=cached, refs=refs)
        self.moves += 1  # rows may have moved between the tiers (not read)
        if several:
            status = cached.status
            hit = status == InsertStatus.HIT
            evicted = status == InsertStatus.EVICTED_AND_INSERTED
            victims = torch.where(evicted, cached.ev_tids, 0)
            self.counts.where("hits", ctids, hit)
            self.counts.where("misses", ctids, (host_slots[order] >= 0) & ~hit)
            self.counts.where("evictions", victims, evicted)
            self.counts.where("host_writes", victims, evicted)
            self.counts.where("host_reads", ctids, (status == InsertStatus.INSERTED) | evicted)
        return refs


class Placement(_DeviceTier):
    """New rows land in the device tier while it has room; the others are read in host memory."""

    kind = "placement tier (no promotion)"

    def _take(self, keys, tids, counts, host_slots, status, several):
        """Hits are found in the tier; the host store's new keys land in it while it has room."""
        tier, ops = self.tier, for_device(self.crossing.device)
        new = (status - InsertStatus.INSERTED).view(torch.uint8) < 2  # INSERTED or EVICTED_...
        taken = (host_slots >= 0) & ((tier.find(keys, tids, checked=True) >= 0) | new)
        placed = tier.upsert_where(keys, tids, None, tier.buckets_where(keys, tids, taken))
        refs = torch.empty_like(host_slots)
        ops.promote_rows(host=self.host.memory, cache=tier.memory,
                         order=torch.arange(keys.numel(), device=self.crossing.device),
                         host_slots=host_slots, cached=placed, refs=refs)
        self.moves += 1  # new rows may have moved to the tier (not read)
        if several:
            hit = placed.status == InsertStatus.HIT
            self.counts.where("hits", tids, hit)
            self.counts.where("misses", tids, (host_slots >= 0) & ~hit)
            self.counts.where("host_reads", tids, placed.status == InsertStatus.INSERTED)
        return refs
