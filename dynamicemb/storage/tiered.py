"""Where a group's rows live: a host store and, optionally, a device tier (a cache or a
placement tier) and an external tier below (docs/ARCHITECTURE.md, "Storage tiers").
The host store is the index of record and takes the same calls as a single tier
would, so training is bit-identical whatever the cache size. Tensors cross between
the tiers' devices only here; references are on ``device``."""

from typing import Iterator, List, NamedTuple, Optional, Tuple

import torch

from dynamicemb.ops import for_device, resolve_device
from dynamicemb.ops.interface import HOST_ROW_BIT, InsertStatus, NewRows, RowFormat, RowSources
from dynamicemb.kvstore.store import ExternalStorageError
from dynamicemb.storage.external.tier import Staged
from dynamicemb.storage.layouts import Cache, Crossing, HostOnly, Layout, OneTier, Placement
from dynamicemb.storage.metrics import TierCounts, TierMetrics
from dynamicemb.table import (Deduplicated, Entries, InsertResult, PendingInsert,
                              ScoredHashTable, expired_hits)
from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbScoreStrategy

__all__ = ["NothingBelow", "TierMetrics", "TieredStorage"]


class NothingBelow:
    """The tier below the host store when there is none: no rows, no upkeep."""

    holds_rows = False

    def over(self) -> str:
        return ""

    def flush(self) -> None:
        pass

    def export_chunks(self, chunk: int, min_score: Optional[int] = None) -> Iterator[Entries]:
        return iter(())

    def clear_table(self, tid: int, only_table: bool) -> None:
        pass


class _Prepared(NamedTuple):
    """A batch's insert between its phases, and what phase one fetched from below."""

    pending: PendingInsert
    staged: Optional[Staged]


class TieredStorage:
    """The rows of one physical group (``build`` makes one).

    Args:
        host: the host store (index of record).
        layout: where rows live beside it (``dynamicemb.storage.layouts``).
        row_format: the stored rows' ``RowFormat`` (every tier's).
        counts, crossing: the group's traffic counts, and the host store's and device
            tier's devices.
        new_rows: what a new key's row starts as (``commit``); None: zeros.
        external: the ``ExternalTier`` below the host store (None: ``NothingBelow``).
    """

    def __init__(self, host: ScoredHashTable, layout: Layout, row_format: RowFormat,
                 counts: TierCounts, crossing: Crossing, new_rows: Optional[NewRows] = None,
                 external=None) -> None:
        self.host = host
        self.layout = layout
        self.row_format = row_format
        self.counts = counts
        self.crossing = crossing
        self.device = crossing.device
        self.external = NothingBelow() if external is None else external
        # a key without a slot could not take its row back from below
        host.grows_for_failures = self.external.holds_rows
        self.new_rows = new_rows
        self.ops = for_device(host.device)
        self._prepared: Optional[_Prepared] = None  # the batch's insert until its commit

    @property
    def device_tier(self) -> Optional[ScoredHashTable]:
        """The device tier's table (a cache's or a placement tier's), or None."""
        return self.layout.tier

    @staticmethod
    def host_store_off_device(caching: bool, device_rows: Optional[int], host_rows: int) -> bool:
        """Whether ``build`` leaves rows to the host store alone for a budget of ``device_rows``
        (None: unlimited) over up to ``host_rows``: then its rows belong in host memory."""
        return device_rows is not None and (caching or device_rows < host_rows)

    @classmethod
    def build(cls, host: ScoredHashTable, row_format: RowFormat, caching: bool,
              device_rows: Optional[int], device: Optional[torch.device] = None,
              new_rows: Optional[NewRows] = None, external=None) -> "TieredStorage":
        """The layout for a device budget of ``device_rows`` rows (None: unlimited), the device
        tier on ``device`` (default: the host store's), over an ``external`` tier or none;
        rows of ``row_format``, whose ``storage_width`` is the host store's ``value_dim``."""
        if host.value_dim != row_format.storage_width or \
                host.value_dtype != row_format.storage_dtype:
            raise ValueError(f"{row_format.tag} rows are {row_format.storage_width} "
                             f"{row_format.storage_dtype} columns, the host store's "
                             f"{host.value_dim} {host.value_dtype}")
        crossing = Crossing(host.device, host.device if device is None
                            else resolve_device(device))
        counts = TierCounts(host.num_tables, crossing.device)

        def made(layout: Layout) -> "TieredStorage":
            return cls(host, layout, row_format, counts, crossing, new_rows, external)
        if not cls.host_store_off_device(caching, device_rows, host.max_capacity()):
            return made(OneTier(host, counts, crossing))
        if device_rows < 16:  # smaller than one bucket: no device tier at all
            return made(HostOnly(host, counts, crossing))
        # a cache never holds more rows than the table can
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
            device=crossing.device,
        )
        return made((Cache if caching else Placement)(host, counts, crossing, tier))

    def describe(self) -> str:
        return self._describe_memory() + self.external.over()

    def _describe_memory(self) -> str:
        row_bytes = self.host.value_dim * self.host.values.element_size()
        where = " in host memory" if self.host.values_in_host_memory else ""
        return self.layout.describe(f"host store up to {self.host.max_capacity()} rows "
                                    f"({self.host.max_capacity() * row_bytes} B{where})")

    # ---------------------------------------------------------------- access
    def sources(self, transient: torch.Tensor, init=None) -> RowSources:
        """The row arrays kernels read references from, with a batch's transient rows
        (``init``: ``InitRows``, rows computed from the initializers instead)."""
        return self.layout.sources(transient, self.row_format, init)

    @property
    def generation(self) -> Tuple[int, int, int]:
        """Changes when a reference handed out earlier may be stale (slot reused, row moved)."""
        return (self.host.generation, self.layout.generation, self.layout.moves)

    def _on_host(self, t: torch.Tensor) -> torch.Tensor:
        return self.crossing.to_host(t)

    def _on_device(self, t: torch.Tensor) -> torch.Tensor:
        return self.crossing.to_device(t)

    def resolve(self, keys: torch.Tensor, tids: torch.Tensor) -> torch.Tensor:
        """Read-only references of keys (-1: absent), the device tier's row first."""
        refs = self.layout.refs(self.host.find(self._on_host(keys), self._on_host(tids),
                                               checked=True))
        return self.layout.resolve(keys, tids, refs)

    def resolve_unique(self, keys: torch.Tensor, tids: torch.Tensor,
                       error: Optional[torch.Tensor], part=None
                       ) -> Tuple[Deduplicated, torch.Tensor]:
        """A batch's unique pairs (``Backend.dedup``) and their ``resolve`` references."""
        unique = self.ops.dedup(keys=keys, table_ids=tids, error=error, part=part)
        return unique, self.resolve(unique.keys, unique.table_ids)

    def states_of(self, refs: torch.Tensor, fill: float) -> torch.Tensor:
        """(n, state_dim) float32 on ``device``: the optimizer states of the rows ``refs``
        name, ``fill`` where a reference names none."""
        sources = self.sources(torch.empty(0, 0, device=self.device))
        out = torch.full((refs.numel(), self.row_format.state_dim), fill,
                         dtype=torch.float32, device=self.device)
        on_host = refs >= HOST_ROW_BIT
        first = (refs >= 0) & ~on_host  # the first source: device tier, or the one tier
        for mask, rows, offset in ((first, sources.device, 0),
                                   (on_host, sources.host, HOST_ROW_BIT)):
            if bool(mask.any()):
                at = (refs[mask] - offset).to(rows.device)
                out[mask] = self.row_format.states(rows[at]).to(self.device)
        return out

    # ----------------------------------------------------------- training
    # A batch's insert is prepared (``prepare_dedup``; or ``dedup``, ``stored`` and
    # ``prepare_insert`` around a choice of keys), kept here, then committed
    # (``commit``) or undone (``abort``).

    def prepare_dedup(self, keys, tids, frequencies, error: Optional[torch.Tensor] = None,
                      part=None, table_scores: Optional[torch.Tensor] = None) -> Deduplicated:
        """Phase one: the dedup and the host store's insert of its unique keys (kept until
        ``commit`` or ``abort``, ``ScoredHashTable.prepare_dedup_find_or_insert``); returns
        the dedup on ``device``."""
        unique, pending = self.host.prepare_dedup_find_or_insert(
            self._on_host(keys), self._on_host(tids), self._maybe_on_host(frequencies),
            checked=True, error=error, part=part,
            table_scores=self._maybe_on_host(table_scores))
        self._keep(pending, unique)
        return self._dedup_on_device(unique)

    def dedup(self, keys, tids, frequencies, error: Optional[torch.Tensor] = None,
              part=None) -> Deduplicated:
        """``prepare_dedup``'s first half (``ScoredHashTable.dedup_batch``), on ``device``."""
        unique = self.host.dedup_batch(self._on_host(keys), self._on_host(tids),
                                       self._maybe_on_host(frequencies), checked=True,
                                       error=error, part=part)
        return self._dedup_on_device(unique)

    def stored(self, unique: Deduplicated) -> torch.Tensor:
        """(N,) bool: the keys of ``dedup``'s ``unique`` that a tier stores, here or below
        (padding: False), at the time of the insert that follows."""
        keys, tids = self._on_host(unique.keys), self._on_host(unique.table_ids)
        real = self._on_host(unique.counts) > 0
        stored = real & (self.host.find(keys, tids, checked=True) >= 0)
        return self._on_device(self.or_below(keys, tids, stored, real))

    def prepare_insert(self, unique: Deduplicated, admitted: torch.Tensor,
                       error: Optional[torch.Tensor] = None,
                       table_scores: Optional[torch.Tensor] = None) -> None:
        """``prepare_dedup``'s second half (``ScoredHashTable.prepare_insert``), kept."""
        unique = Deduplicated(*(self._maybe_on_host(t) for t in unique))
        pending = self.host.prepare_insert(unique, self._on_host(admitted), error=error,
                                           table_scores=self._maybe_on_host(table_scores))
        self._keep(pending, unique)

    def _maybe_on_host(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else self._on_host(t)

    def _dedup_on_device(self, unique: Deduplicated) -> Deduplicated:
        if not self.crossing.two:
            return unique
        return Deduplicated(*(None if t is None else t.to(self.device) for t in unique))

    def _keep(self, pending: PendingInsert, unique: Deduplicated) -> None:
        """Keeps the prepared insert; with an external tier, its victims go down and its new
        keys' rows come up first (a failing store aborts it and raises)."""
        staged = None
        if self.external.holds_rows:  # (reading the victims would sync)
            try:
                staged = self._stage_below(pending, unique.keys, unique.table_ids)
            except BaseException:
                pending.abort()
                raise
        self._prepared = _Prepared(pending, staged)

    def _stage_below(self, pending: PendingInsert, keys, tids) -> Staged:
        victims = pending.evicted()
        self.layout.overlay(victims)
        new = pending.new_keys() if pending.num_new else None
        return self.external.stage(keys, tids, new, pending.num_failed, victims)

    def abort(self) -> None:
        """Undoes the prepared insert, if one is kept."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            prepared.pending.abort()

    def commit(self, keys: torch.Tensor, tids: torch.Tensor,
               counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Phase two, counted on the device: commits the prepared insert, writes new keys'
        rows (``new_rows``; a hit on an expired row is one), restores the rows found below
        and places the batch in the layout's tiers (``Layout.take``).

        Args:
            keys, tids, counts: (N,) the prepared dedup's unique keys, table ids and
                counts (padding: count 0).

        Returns:
            (N,) row references (``row_ref.h``; -1: the insert failed, a lookup computes
            the initializer's row) and (N,) ``InsertStatus``, on ``device``.

        Raises:
            RuntimeError: no insert is prepared.
        """
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            raise RuntimeError("commit() without a prepared insert (prepare_dedup or "
                               "prepare_insert)")
        pending = prepared.pending
        upserted, admitted = pending.upserted, pending.admitted
        result = pending.commit()
        host_slots = result.slots
        if self.new_rows is not None:  # (else the rows of new keys stay zero)
            spec, dim, state = self.new_rows
            self.ops.init_rows(values=self.host.values, slots=host_slots, status=result.status,
                               keys=keys, table_ids=tids, dim=dim, spec=spec,
                               format=self.row_format, state_value=state)
        if prepared.staged is not None:  # over the new rows
            self._restore_below(prepared.staged, host_slots, keys, tids)
        several = self.host.num_tables > 1  # then counted per table with masks
        if several:
            self.counts.where("lookups", tids, counts > 0)
            evicted = result.status == InsertStatus.EVICTED_AND_INSERTED
            self.counts.where("host_evictions", torch.where(evicted, upserted.ev_tids, 0),
                              evicted)
            if self.host.ttl is not None:
                self.counts.where("expired", tids, expired_hits(upserted))
        elif admitted is not None:  # lookups the host store's totals do not count
            self.counts.where("lookups", tids, (counts > 0) & ~admitted)
        refs = self.layout.take(keys, tids, counts, host_slots, result.status, upserted,
                                several)
        return refs, self._on_device(result.status)

    def _restore_below(self, staged: Staged, slots, keys, tids) -> None:
        """After the commit: the rows found below take their host slots."""
        self.external.restore(slots, staged, self._on_host(keys), self._on_host(tids))
        self._count_below("external_reads", tids, staged.at)
        self._count_below("external_writes", staged.written, None)

    def expire(self) -> torch.Tensor:
        """TTL sweep: the host store frees its expired rows; the device tier drops its copies.

        Returns:
            (num_tables,) int64: rows freed per local table.
        """
        gone = self.host.expire()
        self._drop_expired(gone.keys, gone.table_ids)
        return torch.bincount(gone.table_ids.cpu(), minlength=self.host.num_tables)

    def _drop_expired(self, keys: torch.Tensor, tids: torch.Tensor) -> None:
        self.counts.each("expired", tids)
        self.layout.drop(keys, tids)

    def _write_back(self, keys, tids, rows) -> None:
        if keys.numel() == 0:
            return
        keys, tids, rows = self._on_host(keys), self._on_host(tids), self._on_host(rows)
        slots = self.host.find(keys, tids, checked=True)
        ok = (slots >= 0).nonzero().squeeze(1)
        self.host.values[slots[ok]] = rows[ok]
        self.counts.each("host_writes", tids[ok])

    # ------------------------------------------------------------ upkeep
    def flush(self) -> None:
        """Writes every device-tier row back to the host store; makes the external tier durable."""
        for tier in self.layout.tables()[1:]:
            rows = tier.export_batch()
            self._write_back(rows.keys, rows.table_ids, rows.values)
        self.external.flush()

    def release_graphs(self) -> None:
        """Every tier's table may grow again (``ScoredHashTable.release_graphs``)."""
        for table in self.layout.tables():
            table.release_graphs()

    def reset_cache_states(self) -> None:
        """Flushes, then empties the device tier (a cold cache)."""
        self.flush()
        for tier in self.layout.tables()[1:]:
            tier.clear()

    def export(self, start: int = 0, count: Optional[int] = None,
               min_score: Optional[int] = None) -> Entries:
        """Rows of host slots ``[start, start + count)`` (default: all) scoring at least
        ``min_score``, device-tier copies winning, on the host store's device."""
        rows = self.host.export_batch(start, count, min_score)
        self.layout.overlay(rows)
        return rows

    def import_rows(self, keys, tids, rows, scores, exact_scores: bool = False) -> None:
        """Writes rows into the host store (``exact_scores``: ``scores`` as given) and drops
        stale device-tier copies; over an external tier, a quarter of the host store at a time."""
        chunk = max(self.host.bucket_capacity, self.host.max_capacity() // 4)
        below = self.external.holds_rows
        if below and keys.numel() > chunk:
            for at in range(0, keys.numel(), chunk):
                part = slice(at, at + chunk)
                self.import_rows(keys[part], tids[part], rows[part],
                                 None if scores is None else scores[part], exact_scores)
            return
        scores = None if scores is None else self._on_host(scores)
        keys, tids = self._on_host(keys), self._on_host(tids)
        if below:
            scores, exact_scores = self._imported_scores(keys, tids, scores, exact_scores)
        result = self.host.insert_and_evict(keys, self._on_host(rows), tids, scores,
                                            exact_scores=exact_scores)
        if below:
            self._import_below(keys, tids, result)
        self.layout.drop(keys, tids)  # stale copies
        self.layout.drop(result.evicted.keys, result.evicted.table_ids)

    def _imported_scores(self, keys, tids, scores, exact_scores):
        """LFU counts add to the count of a row below, as to one in the host store."""
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
        """After ``import_rows``: victims go down, imported keys' rows below are deleted."""
        evicted = result.evicted
        if result.num_failed:
            raise ExternalStorageError(
                f"{result.num_failed} of {keys.numel()} imported keys found no slot in the "
                f"host store of {self.host.max_capacity()} rows in front of "
                f"{self.external.describe()}: raise local_host_for_values")
        self.layout.overlay(evicted)
        self.external.put(evicted)
        self.counts.each("external_writes", evicted.table_ids)
        landed = self.host.find(keys, tids) >= 0
        self.external.delete(keys[landed], tids[landed])

    def export_chunks(self, chunk_slots: int = 1 << 16,
                      min_score: Optional[int] = None) -> Iterator[Entries]:
        """Every row of every tier scoring at least ``min_score``, at most ``chunk_slots`` per
        item: the host store's (as ``export``), then the external tier's (``slots`` -1)."""
        start = 0
        while start < self.host.capacity():
            yield self.export(start, chunk_slots, min_score)
            start += chunk_slots
        yield from self.external.export_chunks(chunk_slots, min_score)

    def or_below(self, keys: torch.Tensor, tids: torch.Tensor, stored: torch.Tensor,
                 asked: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``stored`` (n,) bool, or also where the external tier holds the key, among the keys
        ``asked`` (default all); the store is asked from the host."""
        if not self.external.holds_rows:
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

    def rows_below(self, keys: torch.Tensor, tids: torch.Tensor
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Positions among ``keys`` (absent from the host store) whose row the external tier
        holds, and those rows' embeddings in float32 (exact), on ``device``."""
        found, below = self.external.get(self._on_host(keys), self._on_host(tids))
        at = found.nonzero().squeeze(1).to(self.device)
        rows = self.row_format.embeddings(below.rows)
        return at, rows.to(self.device, torch.float32).contiguous()

    def clear_table(self, tid: int, chunk_slots: int = 1 << 20) -> None:
        """Removes every row of local table ``tid`` from every tier."""
        self.external.clear_table(tid, only_table=self.host.num_tables == 1)
        if self.host.num_tables == 1:
            for table in self.layout.tables():
                table.clear()
            return
        for table in self.layout.tables():
            start = 0
            while start < table.capacity():  # erasing never moves other keys
                entries = table.export_batch(start, chunk_slots, include_expired=True)
                mine = entries.table_ids == tid
                if bool(mine.any()):
                    table.erase(entries.keys[mine], entries.table_ids[mine])
                start += chunk_slots

    @property
    def metrics(self) -> List[TierMetrics]:
        """Per logical table, the traffic between the tiers so far (a sync on a GPU)."""
        self._settle_step_outcomes()
        return self.counts.read()

    def _settle_step_outcomes(self) -> None:
        """A one-table group's step totals (``commit``) as metrics."""
        if self.host.num_tables > 1:
            return
        hits, inserted, evicted, failed, expired, _ = self.host.outcome_totals().take("metrics")
        lookups = hits + inserted + evicted + failed + expired
        self.counts.add("lookups", lookups)
        self.counts.add("host_evictions", evicted)
        self.counts.add("expired", expired)
        self.layout.settle(lookups - failed)

    def _count_below(self, field: str, tids: torch.Tensor, at: Optional[torch.Tensor]) -> None:
        if at is not None:
            tids = tids[at.to(tids.device)]
        self.counts.each(field, tids)
