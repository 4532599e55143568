"""The table's padded calls: inserts and erases that keep every count in device
memory (a padded step, where ``counts_on_device``), mixed into ``ScoredHashTable``."""

from typing import Callable, Optional, Tuple

import torch

from dynamicemb.ops.interface import KNO_BUCKET, Deduplicated, InsertStatus, ScoreRule, Upserted
from dynamicemb.table.device_counts import DeviceTotals
from dynamicemb.table.pending import PaddedCall, PendingInsert
from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbScoreStrategy

__all__ = ["DEVICE_TOTALS", "PaddedCalls"]

# The padded calls' totals in device memory: hits, inserted, evicted, failed (an
# upsert's InsertStatus counts), then keys erased.
DEVICE_TOTALS = 5


class PaddedCalls:
    """The padded calls of ``ScoredHashTable`` (whose state they use: its backend,
    memory, device counters and totals)."""

    def outcome_totals(self) -> Optional[DeviceTotals]:
        """What padded calls counted (hits, inserted, evicted, failed, erased), in
        device memory; None before the first padded call."""
        return self._outcome_totals if self._padded else None

    def size_on_device(self) -> torch.Tensor:
        """(1,) int64: the number of keys stored, in device memory, for kernels that
        read it in a padded step (the host's count is written there first)."""
        return self._stored.on_device()

    def _settle_device_counts(self) -> None:
        """Adds what padded calls counted on the device to the stats."""
        if not self._padded:
            return
        _, inserted, evicted, failed, erased = self._outcome_totals.take("table")
        self._stats.inserts += inserted + evicted
        self._stats.evictions += evicted
        self._stats.failed_inserts += failed
        self._stats.erases += erased

    @property
    def counts_on_device(self) -> bool:
        """Whether ``prepare_dedup_find_or_insert(padded=True)`` may run: the backend
        keeps counts on the device, and nothing the call decides needs them on the
        host: the table cannot grow (no key waits for a growth), failed inserts are
        ignored (IGNORE: neither raised nor logged) and rows do not expire."""
        return (not self._memory.can_grow
                and self.check_mode == DynamicEmbCheckMode.IGNORE and self.ttl is None)

    def _prepare_padded(self, keys, tids, frequencies, error, part,
                        admit: Optional[Callable] = None) -> Tuple[Deduplicated, PendingInsert]:
        """A padded call: its kernels advance the clock and the step in device memory
        (unless ``error`` refuses the batch) and read its time there, and add their
        outcome counts to the device totals. Nothing is read on the host. ``admit``:
        the pass takes only the keys it admits (``prepare_dedup_find_or_insert``)."""
        if not self.counts_on_device:
            raise ValueError(
                "a padded insert needs a backend that counts on the device and a table "
                "that cannot grow, ignores failed inserts and has no ttl")
        self._check_idle()
        self._padded = True
        if admit is not None:
            return self._prepare_admitted(keys, tids, frequencies, error, part, admit)
        unique, upserted = self._ops.padded_dedup_upsert(
            memory=self._memory, keys=keys, table_ids=tids, frequencies=frequencies,
            rule=self._rule, time=self._time.on_device(),
            now_index=self._now_index, evicts=self._evicts, one_table=self.num_tables == 1,
            error=error, outcomes=self._outcome_totals.tensor[:4], size=self._stored.on_device(),
            part=part)
        pending = PendingInsert(self, upserted, None, None, read_evicted=False, assign=False,
                                padded=PaddedCall(error, unique.counts))
        self._pending = pending
        return unique, pending

    def _prepare_admitted(self, keys, tids, frequencies, error, part,
                          admit: Callable) -> Tuple[Deduplicated, PendingInsert]:
        """``_prepare_padded`` with an admission between the dedup and the pass: the
        pass is the fused call's (same time, scores and order of keys per bucket)
        over the admitted keys; the others get bucket ``KNO_BUCKET`` (slot -1,
        FAILED, counted nowhere)."""
        time = self._time.on_device()
        unique = self._ops.padded_dedup(keys=keys, table_ids=tids, error=error, part=part,
                                        frequencies=frequencies, group=True, time=time)
        one_table = self.num_tables == 1
        real = unique.counts > 0  # padding: count 0
        stored = real & (self._ops.find(memory=self._memory, keys=unique.keys,
                                        table_ids=unique.table_ids, one_table=one_table) >= 0)
        admitted = real & admit(unique, stored)
        upserted = self._ops.padded_upsert(
            memory=self._memory, keys=unique.keys, table_ids=unique.table_ids,
            scores=None if self._rule == ScoreRule.CLOCK else unique.counts,
            buckets=self.buckets_where(unique.keys, unique.table_ids, admitted),
            rule=self._rule, evicts=self._evicts, one_table=one_table,
            outcomes=self._outcome_totals.tensor[:4], size=self._stored.on_device(), time=time,
            now_index=self._now_index)
        pending = PendingInsert(self, upserted, None, None, read_evicted=False, assign=False,
                                padded=PaddedCall(error, unique.counts, admitted))
        self._pending = pending
        return unique, pending

    @property
    def _now_index(self) -> int:
        """Which of the device's (clock, step) is a call's time (``now``)."""
        return 1 if self.score_strategy == DynamicEmbScoreStrategy.STEP else 0

    def buckets_where(self, keys: torch.Tensor, table_ids: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
        """(n,) int32: each key's bucket where ``mask`` (n,) bool, else ``KNO_BUCKET``
        (what ``padded_upsert`` skips); ``table_ids`` int16."""
        home = torch.bitwise_and(self._ops.hash_keys(keys=keys, table_ids=table_ids),
                                 self._memory.num_buckets - 1)
        return torch.where(mask, home, KNO_BUCKET).to(torch.int32)

    def padded_upsert(self, keys: torch.Tensor, table_ids: torch.Tensor,
                      scores: Optional[torch.Tensor], buckets: torch.Tensor,
                      tick: Optional[torch.Tensor] = None) -> Upserted:
        """One inserting pass over unique keys whose buckets the caller computed (a
        padded step's promotion into a cache, ``buckets_where``), with every count on
        the device: keys whose bucket is ``kNoBucket`` (0x7FFFFFFF) are skipped (slot
        -1, status FAILED, counted nowhere). Scores by the table's rule (CUSTOMIZED:
        ``scores``; a count rule: ``scores`` are the counts) at time 0, or with
        ``tick`` at the table's time after its clock advanced by ``tick``, as an
        inserting call of its own. Nothing is read on the host; the size and the
        totals advance on the device.

        Args:
            keys (Tensor): (n,) int64, unique; table_ids (Tensor): (n,) int16 (checked
                by the caller).
            scores (Tensor, optional): (n,) int64.
            buckets (Tensor): (n,) int32.
            tick (Tensor, optional): (1,) or () int64, 0 or 1 (e.g. whether any key
                has a bucket: a call with no key does not tick).

        Returns:
            ``Upserted`` of the n keys (its four counts None).
        """
        if not self.counts_on_device:
            raise ValueError("a padded insert needs a backend that counts on the device and "
                             "a table that cannot grow, ignores failed inserts and has no ttl")
        self._check_idle()
        self._padded = True
        given = self._given_scores(scores, keys.numel(), checked=True)
        time = None
        if tick is not None:
            time = self._time.on_device()
            time[:1].add_(tick)
        upserted = self._ops.padded_upsert(
            memory=self._memory, keys=keys, table_ids=table_ids, scores=given, buckets=buckets,
            rule=self._rule, evicts=self._evicts, one_table=self.num_tables == 1,
            outcomes=self._outcome_totals.tensor[:4], size=self._stored.on_device(), time=time,
            now_index=self._now_index)
        self._generation += 1  # whether it evicted or moved a key is not read
        return upserted

    def padded_erase(self, keys: torch.Tensor, table_ids: torch.Tensor, status: torch.Tensor,
                     which: InsertStatus) -> None:
        """Erases ``keys[i]`` wherever ``status[i] == which`` (e.g. the victims of
        another table's call, by its status: distinct keys), with every count on
        the device (where ``counts_on_device``)."""
        if not self.counts_on_device:
            raise ValueError("a padded erase needs a backend that counts on the device")
        self._check_idle()
        self._padded = True
        self._ops.padded_erase(memory=self._memory, keys=keys, table_ids=table_ids,
                               status=status, which=int(which),
                               erased=self._outcome_totals.tensor[4:],
                               size=self._stored.on_device())
        self._generation += 1

    def _undo_padded(self, pending: PendingInsert) -> None:
        """Takes back what a padded call advanced on the device (the time and the
        totals; a refused batch advanced nothing); its slots are undone already."""
        padded, status = pending.padded, pending.upserted.status
        done = 1 if padded.error is None else (padded.error == 0).to(torch.int64)
        self._time.on_device().sub_(done)
        real = padded.counts > 0  # padding: count 0, counted nowhere
        if padded.admitted is not None:  # nor were the keys left out of the pass
            real = real & padded.admitted
        added = torch.stack([((status == s) & real).sum() for s in range(4)])
        self._outcome_totals.tensor[:4].sub_(added)  # (a view: the totals themselves)
        self._stored.on_device().sub_(added[InsertStatus.INSERTED])
