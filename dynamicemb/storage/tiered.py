"""Where a group's rows live: a host store and, optionally, a device tier.

The **host store** is a ``ScoredHashTable`` with the table's own strategy and
capacity. It is the index of record: every key and score of the table, and a
row for every key (stale while the key is in the device tier). It receives the
same inserting calls a single-tier table would, so scores, growth and
evictions do not depend on the device tier at all: that is what makes training
with any cache size bit-identical.

The **device tier** holds rows in accelerator memory:

- a *cache* (``caching=True``): every row a batch uses is promoted into it
  (CUSTOMIZED scores mirroring the host's, so LRU/LFU eviction follows the
  table's policy); evicted rows are written back to the host store;
- a *placement tier* (``caching=False`` with a byte budget): a new row lands in
  it while it has room and stays; other rows are used where they are, in host
  memory, without promotion.

With no budget the host store itself is the device tier (one tier). Below the
host store an **external tier** (``dynamicemb.storage.external``) may take the
rows the host store evicts and give them back when their keys return: the host
store is then the index of the rows in memory, the external store of the rest.
 Kernels
address rows by reference (``csrc/dynamicemb/row_ref.h``): a device slot, a host
slot tagged with ``HOST_ROW_BIT``, or a transient row. A batch that does not fit
in the cache is served from the host store for the rest.

Each tier has its own device: the host store lives where its ``ScoredHashTable``
was made, the device tier on ``device``. Keys, references and rows cross between
them here and nowhere else (``to`` is a no-op where both are on one device); row
references and everything ``place``/``resolve`` return are on ``device``.
"""

import logging
from dataclasses import dataclass, fields
from typing import Callable, Iterator, List, Optional, Tuple

import torch

from dynamicemb.ops import for_device, resolve_device
from dynamicemb.ops.interface import HOST_ROW_BIT, InsertStatus, RowSources
from dynamicemb.kvstore.store import ExternalStorageError
from dynamicemb.table import (Deduplicated, Entries, InsertResult, PendingInsert,
                              ScoredHashTable, expired_hits)
from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbScoreStrategy

__all__ = ["TierMetrics", "TieredStorage"]

logger = logging.getLogger(__name__)


@dataclass
class TierMetrics:
    """Counts of one table's traffic between the tiers (unique keys per batch).

    Attributes:
        lookups: keys looked up.
        hits: keys whose row was in the device tier.
        misses: keys whose row was not (read from the host store, or new).
        evictions: rows the device tier pushed out (written back to the host store).
        host_evictions: rows the full host store evicted (gone from the table).
        host_reads: rows copied from the host store into the device tier.
        host_writes: rows written back from the device tier to the host store.
        expired: rows past the table's ``ttl``: swept by ``expire()``, or found
            expired by a training lookup (which then got a fresh row).
        external_reads: rows that came back from the external tier.
        external_writes: rows the host store evicted down to the external tier.
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


_METRIC_FIELDS = tuple(f.name for f in fields(TierMetrics))


class TieredStorage:
    """The rows of one physical group.

    Args:
        host: the host store (index of record).
        device_tier: the device tier, or None (``host`` is then either the only
            tier, or a host-only store when ``host_only``).
        promote: True for a cache, False for a placement tier.
        host_only: no device memory at all: every reference is a host reference.
        device: where the device tier, the references and the batches are (default:
            the host store's device).
        initialize: ``initialize(values, slots, status, keys, tids)`` writes the
            initial rows of the keys whose status says the host store just inserted
            them (``commit``); None: they stay zero.
    """

    def __init__(
        self,
        host: ScoredHashTable,
        device_tier: Optional[ScoredHashTable] = None,
        promote: bool = True,
        host_only: bool = False,
        device: Optional[torch.device] = None,
        initialize: Optional[Callable] = None,
        external=None,
    ) -> None:
        self.host = host
        self.external = external
        host.grows_for_failures = external is not None  # every key must find its slot
        self._staged = None  # the external tier's part of the prepared insert
        self.initialize = initialize
        self.device = host.device if device is None else resolve_device(device)
        self._two_devices = self.device != host.device
        self.device_tier = device_tier
        self.promote = promote
        self.host_only = host_only
        # TierMetrics' fields per logical table: what the host knows is counted on
        # the host, what only the device knows on the device (reading it every batch
        # would be a sync); ``metrics`` adds them up when someone asks.
        self._metric_counts = torch.zeros(host.num_tables, len(_METRIC_FIELDS),
                                          dtype=torch.int64, device=self.device)
        self._host_metric_counts = [0] * len(_METRIC_FIELDS)  # one-table groups
        self._moves = 0  # promotions and write-backs: a key's row of record moved
        # The absent tier of ``sources()``: on the kernels' device like the other one.
        self._empty = torch.empty(0, host.value_dim, dtype=host.value_dtype, device=self.device)

    @staticmethod
    def host_store_off_device(caching: bool, device_rows: Optional[int], host_rows: int) -> bool:
        """Whether ``build`` leaves rows to the host store alone for a device budget
        of ``device_rows`` (None: unlimited) over a host store of up to ``host_rows``:
        then its value rows belong in host memory (``values_in_host_memory``)."""
        return device_rows is not None and (caching or device_rows < host_rows)

    @classmethod
    def build(cls, host: ScoredHashTable, caching: bool, device_rows: Optional[int],
              device: Optional[torch.device] = None,
              initialize: Optional[Callable] = None, external=None) -> "TieredStorage":
        """The layout for a device budget of ``device_rows`` rows (None: unlimited),
        with the device tier on ``device`` (default: the host store's), over an
        ``external`` tier or none."""
        device = host.device if device is None else device
        if not cls.host_store_off_device(caching, device_rows, host.max_capacity()):
            return cls(host, device=device, initialize=initialize, external=external)
        if device_rows < 16:  # smaller than one bucket: no device tier at all
            return cls(host, host_only=True, device=device, initialize=initialize,
                       external=external)
        # a cache never holds more rows than the table can: a budget beyond that
        # (a typo, or a global budget split over few rows) allocates no more
        device_rows = min(device_rows, host.max_capacity())
        bucket = min(host.bucket_capacity, 16 * (device_rows // 16))
        buckets = 1 << ((device_rows // bucket).bit_length() - 1)  # round down: stay in budget
        tier = ScoredHashTable(
            num_tables=host.num_tables,
            capacity=buckets * bucket,
            bucket_capacity=bucket,
            score_strategy=(DynamicEmbScoreStrategy.CUSTOMIZED if caching
                            else DynamicEmbScoreStrategy.NO_EVICTION),
            max_load_factor=1.0,
            value_dim=host.value_dim,
            value_dtype=host.value_dtype,
            check_mode=DynamicEmbCheckMode.IGNORE,  # a full device tier is normal
            device=device,
        )
        return cls(host, tier, promote=caching, device=device, initialize=initialize,
                   external=external)

    def describe(self) -> str:
        below = "" if self.external is None else f", over {self.external.describe()}"
        return self._describe_memory() + below

    def _describe_memory(self) -> str:
        row_bytes = self.host.value_dim * self.host.values.element_size()
        where = " in host memory" if self.host.values_in_host_memory else ""
        host = (f"host store up to {self.host.max_capacity()} rows "
                f"({self.host.max_capacity() * row_bytes} B{where})")
        if self.device_tier is None:
            return f"host store only: {host}" if self.host_only else f"one tier: {host}"
        kind = "cache" if self.promote else "placement tier (no promotion)"
        cap = self.device_tier.capacity()
        return f"device {kind} of {cap} rows ({cap * row_bytes} B) over a {host}"

    # ---------------------------------------------------------------- access
    def sources(self, transient: torch.Tensor, init=None) -> RowSources:
        """The row arrays the kernels read references from, with a batch's transient
        rows (or ``InitRows``: rows computed from the initializers instead)."""
        if self.device_tier is not None:
            return RowSources(self.device_tier.values, self.host.values, transient, init)
        if self.host_only:
            return RowSources(self._empty, self.host.values, transient, init)
        return RowSources(self.host.values, self._empty, transient, init)

    @property
    def generation(self) -> Tuple[int, int, int]:
        """Changes when a reference handed out earlier may be stale: a slot was reused
        (growth, eviction, erase, clear) or a row moved between tiers (a promotion
        into a free slot changes where a key's current row is)."""
        tier = self.device_tier.generation if self.device_tier is not None else 0
        return (self.host.generation, tier, self._moves)

    def _on_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.host.device) if self._two_devices else t

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if self._two_devices else t

    def _host_refs(self, host_slots: torch.Tensor, all_stored: bool = False) -> torch.Tensor:
        """References (on ``device``) of host slots (-1: not stored; ``all_stored``:
        the caller knows none is -1)."""
        host_slots = self._on_device(host_slots)
        if self.device_tier is None and not self.host_only:
            return host_slots
        if all_stored:
            return host_slots + HOST_ROW_BIT
        return torch.where(host_slots >= 0, host_slots + HOST_ROW_BIT, host_slots)

    def resolve(self, keys: torch.Tensor, tids: torch.Tensor) -> torch.Tensor:
        """Read-only references of keys (-1 where absent): the device tier's row
        where it holds one, else the host store's."""
        refs = self._host_refs(self.host.find(self._on_host(keys), self._on_host(tids), checked=True))
        if self.device_tier is not None:
            found = self.device_tier.find(keys, tids, checked=True)
            # A cached copy of a row the host store holds no more (expired) is dead.
            refs = torch.where((found >= 0) & (refs >= 0), found, refs)
        return refs

    # ----------------------------------------------------------- training
    def prepare_dedup(self, keys, tids, frequencies, error: Optional[torch.Tensor] = None,
                      part=None, admit=None, table_scores: Optional[torch.Tensor] = None
                      ) -> Tuple[Deduplicated, PendingInsert]:
        """Phase one of a batch with repeated keys: its dedup and the host store's
        insert of the unique keys (``ScoredHashTable.prepare_dedup_find_or_insert``,
        whose ``error``, ``part``, ``admit`` and ``table_scores`` these are);
        ``commit`` follows. The dedup is returned on ``device``."""
        frequencies = None if frequencies is None else self._on_host(frequencies)
        table_scores = None if table_scores is None else self._on_host(table_scores)
        unique, pending = self.host.prepare_dedup_find_or_insert(
            self._on_host(keys), self._on_host(tids), frequencies, checked=True,
            error=error, part=part, admit=admit, table_scores=table_scores)
        self._stage_below(pending, unique.keys, unique.table_ids)
        if self._two_devices:
            unique = Deduplicated(*(None if t is None else t.to(self.device) for t in unique))
        return unique, pending

    def _stage_below(self, pending: PendingInsert, keys, tids) -> None:
        """With an external tier: the insert's victims (current rows: a device-tier
        copy wins) go down and the rows of its new keys come up now; a failing store
        aborts ``pending`` and raises."""
        if self.external is None:
            return
        try:
            victims = pending.evicted()
            if victims.keys.numel() and self.device_tier is not None:
                found = self.device_tier.find(self._on_device(victims.keys),
                                              self._on_device(victims.table_ids), checked=True)
                cached = (found >= 0).nonzero().squeeze(1)
                victims.values[self._on_host(cached)] = self._on_host(
                    self.device_tier.values[found[cached]])
            self._staged = self.external.stage(pending, keys, tids, victims)
        except BaseException:
            self._staged = None
            pending.abort()
            raise

    def _restore_below(self, pending: PendingInsert, slots, keys, tids) -> Optional[torch.Tensor]:
        """After ``pending`` committed: the rows its first phase found below take their
        host slots (``ExternalTier.restore``); returns their positions among ``keys``
        (None without an external tier's part in ``pending``)."""
        staged, self._staged = self._staged, None
        if staged is None or staged.pending is not pending:
            return None
        came_back = self.external.restore(slots, staged, self._on_host(keys), self._on_host(tids))
        self._count_below("external_reads", tids, staged.at)
        self._count_below("external_writes", staged.written, None)
        return came_back

    def commit(self, pending: PendingInsert, keys: torch.Tensor, tids: torch.Tensor,
                      counts: torch.Tensor) -> torch.Tensor:
        """Phase two of the insert (``prepare_dedup``), every count on
        the device: commits, initializes the rows of new keys (by status: a hit on
        an expired row is one), drops the host store's victims and expired rows
        from a cache and promotes the batch into it (``_promote``).

        Args:
            pending: from ``prepare_dedup``.
            keys, tids, counts: (N,) its dedup's unique keys, table ids and counts
                (padding: count 0).

        Returns:
            (N,) row references (``row_ref.h``): -1 where a key's insert failed (a
            lookup reads its initializer's row there).
        """
        upserted, admitted = pending.upserted, pending.admitted
        result = pending.commit()
        host_slots = result.slots
        if self.initialize is not None:  # (else the rows of new keys stay zero)
            self.initialize(self.host.values, host_slots, result.status, keys, tids)
        self._restore_below(pending, host_slots, keys, tids)  # over the new rows
        several = self.host.num_tables > 1  # then counted per table with masks
        if several:
            self._count_where("lookups", tids, counts > 0)
            evicted = result.status == InsertStatus.EVICTED_AND_INSERTED
            self._count_where("host_evictions", torch.where(evicted, upserted.ev_tids, 0),
                              evicted)
            if self.host.ttl is not None:
                self._count_where("expired", tids, expired_hits(upserted))
        elif admitted is not None:  # lookups the host store's totals do not count
            self._count_where("lookups", tids, (counts > 0) & ~admitted)
        if self.device_tier is not None:
            self.device_tier.erase_where(upserted.ev_keys, upserted.ev_tids, result.status,
                                          InsertStatus.EVICTED_AND_INSERTED)
            if self.host.ttl is not None:  # a cached copy of an expired row is dead
                self.device_tier.erase_where(keys, tids, result.status, InsertStatus.INSERTED)
            if not self.promote:
                return self._place(keys, tids, host_slots, result.status, several)
            return self._promote(keys, tids, counts, host_slots, several)
        if several:
            self._count_where("misses" if self.host_only else "hits", tids, host_slots >= 0)
        return self._host_refs(host_slots)

    def _place(self, keys, tids, host_slots, status, several: bool) -> torch.Tensor:
        """``place``'s placement tier for a step's batch, on the device: the keys it
        holds are found there (a hit of its call), and the host store's new keys land
        in it while it has room (an insert, the row copied in); the others are read
        in host memory."""
        tier, ops = self.device_tier, for_device(self.device)
        new = (status - InsertStatus.INSERTED).view(torch.uint8) < 2  # INSERTED or EVICTED_...
        taken = (host_slots >= 0) & ((tier.find(keys, tids, checked=True) >= 0) | new)
        placed = tier.upsert_where(keys, tids, None, tier.buckets_where(keys, tids, taken))
        refs = torch.empty_like(host_slots)
        ops.promote_rows(host=self.host.memory, cache=tier.memory,
                         order=torch.arange(keys.numel(), device=self.device),
                         host_slots=host_slots, cached=placed, refs=refs)
        self._moves += 1  # new rows may have moved to the tier (not read)
        if several:
            hit = placed.status == InsertStatus.HIT
            self._count_where("hits", tids, hit)
            self._count_where("misses", tids, (host_slots >= 0) & ~hit)
            self._count_where("host_reads", tids, placed.status == InsertStatus.INSERTED)
        return refs

    def _promote(self, keys, tids, counts, host_slots, several: bool) -> torch.Tensor:
        """The promotion of a batch into the cache (``cache_policy.h``), on the device: the plan
        (which keys the cache takes, in which order), one cache call over the keys
        sorted by it, then victims written back and new rows copied in by one
        kernel, which also writes the references."""
        tier, ops = self.device_tier, for_device(self.device)
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
        self._moves += 1  # rows may have moved between the tiers (not read)
        if several:
            status = cached.status
            hit = status == InsertStatus.HIT
            evicted = status == InsertStatus.EVICTED_AND_INSERTED
            victims = torch.where(evicted, cached.ev_tids, 0)
            self._count_where("hits", ctids, hit)
            self._count_where("misses", ctids, (host_slots[order] >= 0) & ~hit)
            self._count_where("evictions", victims, evicted)
            self._count_where("host_writes", victims, evicted)
            self._count_where("host_reads", ctids, (status == InsertStatus.INSERTED) | evicted)
        return refs

    def expire(self) -> torch.Tensor:
        """TTL sweep of every tier: the host store frees its expired rows (one kernel
        pass) and the device tier drops its copies of them.

        Returns:
            (num_tables,) int64: rows freed per local table.
        """
        gone = self.host.expire()
        self._drop_expired(gone.keys, gone.table_ids)
        return torch.bincount(gone.table_ids.cpu(), minlength=self.host.num_tables)

    def _drop_expired(self, keys: torch.Tensor, tids: torch.Tensor) -> None:
        """Counts rows the host store found expired and erases their device-tier
        copies (never written back: the row is dead)."""
        self._count("expired", tids)
        if self.device_tier is not None and keys.numel():
            self.device_tier.erase(self._on_device(keys), self._on_device(tids))

    def _write_back(self, keys, tids, rows) -> None:
        if keys.numel() == 0:
            return
        keys, tids, rows = self._on_host(keys), self._on_host(tids), self._on_host(rows)
        slots = self.host.find(keys, tids, checked=True)
        ok = (slots >= 0).nonzero().squeeze(1)
        self.host.values[slots[ok]] = rows[ok]
        self._count("host_writes", tids[ok])

    # ------------------------------------------------------------ upkeep
    def flush(self) -> None:
        """Writes every device-tier row back to the host store (and makes the external
        tier's writes durable)."""
        if self.device_tier is not None:
            rows = self.device_tier.export_batch()
            self._write_back(rows.keys, rows.table_ids, rows.values)
        if self.external is not None:
            self.external.flush()

    def reset_cache_states(self) -> None:
        """Flushes, then empties the device tier (a cold cache)."""
        self.flush()
        if self.device_tier is not None:
            self.device_tier.clear()

    def export(self, start: int = 0, count: Optional[int] = None,
               min_score: Optional[int] = None) -> Entries:
        """Stored rows of host slots ``[start, start + count)`` (default: all) scoring
        at least ``min_score``, current values (device-tier copies win), on the host
        store's device; ``slots`` are host slots."""
        rows = self.host.export_batch(start, count, min_score)
        if self.device_tier is not None and rows.keys.numel():
            found = self.device_tier.find(self._on_device(rows.keys),
                                          self._on_device(rows.table_ids))
            cached = (found >= 0).nonzero().squeeze(1)
            rows.values[self._on_host(cached)] = self._on_host(
                self.device_tier.values[found[cached]])
        return rows

    def import_rows(self, keys, tids, rows, scores, exact_scores: bool = False) -> None:
        """Writes rows into the host store; stale device-tier copies are dropped.
        ``exact_scores``: store ``scores`` as given whatever the strategy. With an
        external tier, in chunks of a quarter of the host store (its victims go down)."""
        chunk = max(self.host.bucket_capacity, self.host.max_capacity() // 4)
        if self.external is not None and keys.numel() > chunk:
            for at in range(0, keys.numel(), chunk):
                part = slice(at, at + chunk)
                self.import_rows(keys[part], tids[part], rows[part],
                                 None if scores is None else scores[part], exact_scores)
            return
        scores = None if scores is None else self._on_host(scores)
        keys, tids = self._on_host(keys), self._on_host(tids)
        if self.external is not None:
            scores, exact_scores = self._imported_scores(keys, tids, scores, exact_scores)
        result = self.host.insert_and_evict(keys, self._on_host(rows), tids, scores,
                                            exact_scores=exact_scores)
        if self.external is not None:
            self._import_below(keys, tids, result)
        if self.device_tier is not None:
            self.device_tier.erase(self._on_device(keys), self._on_device(tids))
            if result.evicted.keys.numel():
                self.device_tier.erase(self._on_device(result.evicted.keys),
                                       self._on_device(result.evicted.table_ids))

    def _imported_scores(self, keys, tids, scores, exact_scores):
        """LFU counts given to ``import_rows`` add to the count of a row below, as
        they would to a row in the host store."""
        if exact_scores or self.host.score_strategy != DynamicEmbScoreStrategy.LFU:
            return scores, exact_scores
        absent = (self.host.find(keys, tids) < 0).nonzero().squeeze(1)
        found, below = self.external.get(keys[absent], tids[absent])
        if not bool(found.any()):
            return scores, exact_scores
        scores = torch.ones_like(keys) if scores is None else scores.clone()
        scores[absent[found.to(absent.device)]] += below.scores.to(scores.device)
        return scores, True

    def _import_below(self, keys, tids, result: InsertResult) -> None:
        """After ``import_rows``: victims (current rows) go down; rows of imported keys
        below are stale and deleted. Keys that found no host slot fail the import."""
        evicted = result.evicted
        if result.num_failed:
            raise ExternalStorageError(
                f"{result.num_failed} of {keys.numel()} imported keys found no slot in the "
                f"host store of {self.host.max_capacity()} rows in front of "
                f"{self.external.describe()}: raise local_host_for_values")
        if evicted.keys.numel() and self.device_tier is not None:
            found = self.device_tier.find(self._on_device(evicted.keys),
                                          self._on_device(evicted.table_ids))
            cached = (found >= 0).nonzero().squeeze(1)
            evicted.values[self._on_host(cached)] = self._on_host(
                self.device_tier.values[found[cached]])
        self.external.put(evicted)
        self._count_below("external_writes", evicted.table_ids, None)
        landed = self.host.find(keys, tids) >= 0
        self.external.delete(keys[landed], tids[landed])

    def export_chunks(self, chunk_slots: int = 1 << 16,
                      min_score: Optional[int] = None) -> Iterator[Entries]:
        """Every row of every tier scoring at least ``min_score``, at most
        ``chunk_slots`` rows per item: the host store's slots (as ``export``), then
        the external tier's rows (``slots`` -1)."""
        start = 0
        while start < self.host.capacity():
            yield self.export(start, chunk_slots, min_score)
            start += chunk_slots
        if self.external is not None:
            yield from self.external.export_chunks(chunk_slots, min_score)

    def or_below(self, keys: torch.Tensor, tids: torch.Tensor, stored: torch.Tensor,
                 asked: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``stored`` (n,) bool (the host store holds the key), or with an external
        tier also where the store holds it, among the keys ``asked`` (default all):
        the store is asked from the host."""
        if self.external is None:
            return stored
        absent = ~stored if asked is None else asked & ~stored
        absent = absent.nonzero().squeeze(1)
        if absent.numel() == 0:
            return stored
        found, _ = self.external.get(self._on_host(keys)[self._on_host(absent)],
                                     self._on_host(tids)[self._on_host(absent)])
        stored = stored.clone()
        stored[absent] = found.to(stored.device)
        return stored

    def fill_from_below(self, keys: torch.Tensor, tids: torch.Tensor,
                        rows: torch.Tensor) -> None:
        """rows[i] = the first ``rows.shape[1]`` floats of key i's row in the external
        tier, where it holds one (reading keys the host store does not hold)."""
        if self.external is None or keys.numel() == 0:
            return
        found, below = self.external.get(self._on_host(keys), self._on_host(tids))
        at = found.nonzero().squeeze(1).to(rows.device)
        rows[at] = below.rows[:, :rows.shape[1]].to(rows.device, rows.dtype)

    def clear_table(self, tid: int, chunk_slots: int = 1 << 20) -> None:
        """Removes every row of local table ``tid`` from every tier (a group of one
        table is emptied at once; otherwise its keys are erased chunk by chunk)."""
        if self.external is not None:
            self.external.clear_table(tid, only_table=self.host.num_tables == 1)
        if self.host.num_tables == 1:
            self.host.clear()
            if self.device_tier is not None:
                self.device_tier.clear()
            return
        for table in (self.host, self.device_tier):
            if table is None:
                continue
            start = 0
            while start < table.capacity():  # erasing never moves other keys
                entries = table.export_batch(start, chunk_slots, include_expired=True)
                mine = entries.table_ids == tid
                if bool(mine.any()):
                    table.erase(entries.keys[mine], entries.table_ids[mine])
                start += chunk_slots

    @property
    def metrics(self) -> List[TierMetrics]:
        """Per logical table, the traffic between the tiers so far (read from the
        device: a host sync on a GPU, so read it when needed, not every batch)."""
        self._settle_step_outcomes()
        rows = self._metric_counts.tolist()
        rows[0] = [a + b for a, b in zip(rows[0], self._host_metric_counts)]
        return [TierMetrics(*row) for row in rows]

    def _settle_step_outcomes(self) -> None:
        """A one-table group's steps as metrics, from the tables' totals of
        them (``commit``): every unique key is a lookup and, once stored, a
        hit of the one tier, a miss of host rows, or a cache hit or miss by the
        cache's call; its evictions are written back, its inserts read in."""
        totals = self.host.outcome_totals()
        if totals is None or self.host.num_tables > 1:
            return
        hits, inserted, evicted, failed, expired, _ = totals.take("metrics")
        lookups = hits + inserted + evicted + failed + expired
        stored = lookups - failed
        self._add("lookups", lookups)
        self._add("host_evictions", evicted)
        self._add("expired", expired)
        if self.device_tier is None:
            self._add("misses" if self.host_only else "hits", stored)
            return
        cached = self.device_tier.outcome_totals()
        c_hits, c_inserted, c_evicted, *_ = cached.take("metrics") if cached else [0] * 6
        self._add("hits", c_hits)
        self._add("misses", stored - c_hits)
        self._add("evictions", c_evicted)
        self._add("host_writes", c_evicted)  # a victim is still in the host store
        self._add("host_reads", c_inserted + c_evicted)

    def _add(self, field: str, count: int) -> None:
        """Adds ``count`` (known on the host) to the one table's metric ``field``."""
        self._host_metric_counts[_METRIC_FIELDS.index(field)] += count

    def _count_where(self, field: str, tids: torch.Tensor, mask: torch.Tensor) -> None:
        """Counts the keys of ``mask`` for their tables (no compaction, no sync)."""
        self._metric_counts[:, _METRIC_FIELDS.index(field)].index_add_(
            0, self._on_device(tids).long(), self._on_device(mask).to(torch.int64))

    def _count_below(self, field: str, tids: torch.Tensor, at: Optional[torch.Tensor]) -> None:
        """Counts the keys ``tids[at]`` (all of ``tids`` when ``at`` is None)."""
        if at is not None:
            tids = tids[at.to(tids.device)]
        self._count(field, tids)

    def _count(self, field: str, tids: torch.Tensor) -> None:
        if tids.numel() == 0:
            return
        if self.host.num_tables == 1:
            self._add(field, tids.numel())
            return
        self._metric_counts[:, _METRIC_FIELDS.index(field)].index_add_(
            0, self._on_device(tids).long(),
            torch.ones(tids.numel(), dtype=torch.int64, device=self.device))
