"""The table's padded calls: inserts and erases that keep every count in device
memory (the training step's), mixed into ``ScoredHashTable``.

A padded call reads nothing on the host, so what decides growth and reports failed
inserts reaches the host late (``SizeWatch``): the table grows ahead of need, by an
upper bound of its size, and while it may still grow a full bucket fails its key
instead of evicting (the key's row is computed for the step, the failure makes the
next call grow, and the key is inserted at its next lookup). docs/ARCHITECTURE.md,
"Growth and failed inserts on the padded step".
"""

import logging
from typing import Callable, List, Optional, Tuple

import torch

from dynamicemb.ops.interface import KNO_BUCKET, Deduplicated, InsertStatus, ScoreRule, Upserted
from dynamicemb.table.device_counts import CountsCopy, DeviceTotals, capturing
from dynamicemb.table.pending import PaddedCall, PendingInsert
from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbScoreStrategy

__all__ = ["DEVICE_TOTALS", "PaddedCalls", "SizeWatch", "expired_hits"]

logger = logging.getLogger("dynamicemb.table.scored_hash_table")  # the table's messages

# The padded calls' totals in device memory: hits, inserted, evicted, failed (an
# upsert's InsertStatus counts), hits on expired rows (status INSERTED, counted
# apart), then keys erased.
DEVICE_TOTALS = 6
_OUTCOMES = slice(0, 5)  # what an inserting call adds to
_ERASED = slice(5, 6)


class SizeWatch:
    """What the host knows of a padded table without waiting for the device: an
    upper bound of its size and the failed inserts it has learnt of.

    After a padded call the size and the outcome totals (hits, inserted, evicted,
    failed) go to host memory (``CountsCopy``); a later call reads them once they
    arrived (on the CPU, where reads are free, the call itself). The bound is the
    size read plus every key given to padded calls since the copy was taken, or
    the host's own count where the host set it since.

    Args:
        device: the table's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.copy = CountsCopy(1 + 5, device)  # the size, the outcome totals
        self.bound = 0
        self.since_copy = 0  # keys given to padded calls since the copy on the way
        self.copy_stale = False  # the host set the size since the copy was taken
        self.totals: List[int] = [0] * 5  # the outcome totals read last
        self.failed = 0  # keys that failed (read) and that no growth answered yet


class PaddedCalls:
    """The padded calls of ``ScoredHashTable`` (whose state they use: its backend,
    memory, device counters and totals)."""

    def outcome_totals(self) -> Optional[DeviceTotals]:
        """What padded calls counted (hits, inserted, evicted, failed, expired,
        erased), in device memory; None before the first padded call."""
        return self._outcome_totals if self._padded else None

    def size_on_device(self) -> torch.Tensor:
        """(1,) int64: the number of keys stored, in device memory, for kernels that
        read it in a padded step (the host's count is written there first)."""
        return self._stored.on_device()

    def _settle_device_counts(self) -> None:
        """Adds what padded calls counted on the device to the stats."""
        if not self._padded:
            return
        _, inserted, evicted, failed, expired, erased = self._outcome_totals.take("table")
        self._stats.inserts += inserted + evicted
        self._stats.evictions += evicted
        self._stats.failed_inserts += failed
        self._stats.expired += expired
        self._stats.erases += erased

    @property
    def _watched(self) -> bool:
        """Whether padded calls need what ``SizeWatch`` learns: the table may grow,
        or failed inserts are reported."""
        return self._memory.can_grow or self.check_mode != DynamicEmbCheckMode.IGNORE

    def _before_padded(self, n: int) -> bool:
        """Before a padded call of ``n`` keys: reads the counts an earlier call copied
        if they arrived (nothing waits), grows once for failed inserts it learnt of
        and while the size's bound plus ``n`` exceeds ``max_load_factor`` of the
        capacity (growth reads the device: once per doubling). Returns whether a full
        bucket evicts: never while the table may grow (the key fails instead)."""
        if not self._watched:
            return self._evicts
        watch = self._watch
        if capturing():
            self._captured = True
        else:  # a graph's replays run no Python: nothing is read or grown
            self._read_watch()
            if self._stored.held_on_host():  # the host's count: exact, and read for free
                watch.bound = self._size
                watch.copy_stale = watch.copy.on_the_way
            if watch.failed and self._memory.can_grow:
                self._grow()
            watch.failed = 0
            while (self._memory.can_grow
                   and watch.bound + n > self.max_load_factor * self.capacity()):
                self._grow()
        watch.bound += n
        if watch.copy.on_the_way:
            watch.since_copy += n
        return self._evicts and not self._memory.can_grow

    def _after_padded(self) -> None:
        """After a padded call's kernels: its size and totals start for the host
        (unless a copy is on the way still); on the CPU they are read at once."""
        watch = self._watch
        if not self._watched or capturing() or watch.copy.on_the_way:
            return
        watch.copy.start(self._stored.on_device(), self._outcome_totals.tensor[_OUTCOMES])
        watch.since_copy, watch.copy_stale = 0, False
        if self._ops.free_host_reads:
            self._read_watch()

    def _read_watch(self) -> None:
        """Takes the copied counts if they arrived: the size's bound, and the failed
        inserts since the last copy (logged in WARNING mode)."""
        watch = self._watch
        arrived = watch.copy.arrived()
        if arrived is None:
            return
        size, totals = arrived[0], arrived[1:]
        if not watch.copy_stale:
            watch.bound = size + watch.since_copy
        keys = sum(totals) - sum(watch.totals)
        failed = totals[InsertStatus.FAILED] - watch.totals[InsertStatus.FAILED]
        watch.totals = totals
        if failed <= 0:  # (an abort takes back what its call counted)
            return
        watch.failed += failed
        if self.check_mode == DynamicEmbCheckMode.WARNING:
            grows = ("; the table grows at its next call and inserts them at their next "
                     "lookup" if self._memory.can_grow else "")
            logger.warning(self._failure_message(failed, keys) + grows)

    def _prepare_padded(self, keys, tids, frequencies, error, part,
                        admit: Optional[Callable] = None,
                        table_scores: Optional[torch.Tensor] = None
                        ) -> Tuple[Deduplicated, PendingInsert]:
        """A padded call: its kernels advance the clock and the step in device memory
        (unless ``error`` refuses the batch) and read its time there, and add their
        outcome counts to the device totals; hits on rows expired at that time
        (``ttl``) are inserts. Nothing is read on the host, but in
        ERROR mode the call's failed inserts (one sync): then it is undone, and the
        table grows and runs it again, or raises when it cannot grow. ``admit``: the
        pass takes only the keys it admits (``prepare_dedup_find_or_insert``)."""
        self._check_idle()
        if self.check_mode == DynamicEmbCheckMode.ERROR and capturing():
            raise RuntimeError(
                "safe_check_mode ERROR reads each insert's failures on the host, which a "
                "CUDA graph cannot capture: capture a table in WARNING or IGNORE mode")
        while True:
            evicts = self._before_padded(keys.numel())
            self._padded = True
            if admit is not None:
                unique, pending = self._prepare_admitted(keys, tids, frequencies, error, part,
                                                         admit, evicts, table_scores)
            else:
                unique, upserted = self._ops.padded_dedup_upsert(
                    memory=self._memory, keys=keys, table_ids=tids, frequencies=frequencies,
                    rule=self._rule, time=self._time.on_device(), now_index=self._now_index,
                    evicts=evicts, one_table=self.num_tables == 1, error=error,
                    outcomes=self._outcome_totals.tensor[_OUTCOMES],
                    size=self._stored.on_device(), part=part, table_scores=table_scores,
                    ttl=self.ttl or 0)
                pending = PendingInsert(self, upserted, None, None, read_evicted=False,
                                        assign=False, padded=PaddedCall(error, unique.counts))
            self._pending = pending
            raises = self.check_mode == DynamicEmbCheckMode.ERROR
            if not (raises or self.grows_for_failures):
                break
            failed = pending.num_failed  # a sync (padding and keys not admitted aside)
            if not failed or not (raises or self._memory.can_grow):
                break  # (a caller that needs every key stored reads the failures)
            pending.abort()
            if not self._memory.can_grow:
                raise RuntimeError(self._failure_message(failed, int((unique.counts > 0).sum()))
                                   + "; the call was undone")
            self._grow()  # the keys of full buckets get room: the call again
        self._after_padded()
        return unique, pending

    def _prepare_admitted(self, keys, tids, frequencies, error, part, admit: Callable,
                          evicts: bool, table_scores: Optional[torch.Tensor]
                          ) -> Tuple[Deduplicated, PendingInsert]:
        """``_prepare_padded`` with an admission between the dedup and the pass: the
        pass is the fused call's (same time, scores and order of keys per bucket)
        over the admitted keys; the others get bucket ``KNO_BUCKET`` (slot -1,
        FAILED, counted nowhere). ``evicts``: whether a full bucket may evict;
        ``table_scores``: CUSTOMIZED scores by table id. The find of stored keys
        and the pass take rows expired at the call's time (``ttl``) as absent."""
        time = self._time.on_device()
        unique = self._ops.padded_dedup(keys=keys, table_ids=tids, error=error, part=part,
                                        frequencies=frequencies, group=True, time=time)
        one_table = self.num_tables == 1
        real = unique.counts > 0  # padding: count 0
        # stored: in the table at the call's time (a row expired then is absent)
        stored = real & (self.find(unique.keys, unique.table_ids, checked=True) >= 0)
        admitted = real & admit(unique, stored)
        upserted = self._ops.padded_upsert(
            memory=self._memory, keys=unique.keys, table_ids=unique.table_ids,
            scores=self._pass_scores(unique, table_scores),
            buckets=self.buckets_where(unique.keys, unique.table_ids, admitted),
            rule=self._rule, evicts=evicts, one_table=one_table,
            outcomes=self._outcome_totals.tensor[_OUTCOMES], size=self._stored.on_device(),
            time=time, now_index=self._now_index, ttl=self.ttl or 0)
        pending = PendingInsert(self, upserted, None, None, read_evicted=False, assign=False,
                                padded=PaddedCall(error, unique.counts, admitted))
        self._pending = pending
        return unique, pending

    def _pass_scores(self, unique: Deduplicated,
                     table_scores: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The scores a padded pass over ``unique`` gives: none (the clock rule), the
        counts (a count rule) or CUSTOMIZED's by table id (gathered on the device)."""
        if self._rule == ScoreRule.CLOCK:
            return None
        if self._rule == ScoreRule.GIVEN:
            return table_scores.index_select(0, unique.table_ids.long())
        return unique.counts

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
        if (self._memory.can_grow or self.ttl is not None
                or self.check_mode == DynamicEmbCheckMode.ERROR):
            raise ValueError("a padded upsert needs a table without a ttl that cannot grow "
                             "(its buckets are given) and does not raise failed inserts")
        self._check_idle()
        given = self._given_scores(scores, keys.numel(), checked=True)
        time = None
        if tick is not None:
            time = self._time.on_device()
            time[:1].add_(tick)
        evicts = self._before_padded(keys.numel())
        self._padded = True
        upserted = self._ops.padded_upsert(
            memory=self._memory, keys=keys, table_ids=table_ids, scores=given, buckets=buckets,
            rule=self._rule, evicts=evicts, one_table=self.num_tables == 1,
            outcomes=self._outcome_totals.tensor[_OUTCOMES], size=self._stored.on_device(),
            time=time, now_index=self._now_index)
        self._generation += 1  # whether it evicted or moved a key is not read
        self._after_padded()
        return upserted

    def erase_where(self, keys: torch.Tensor, table_ids: torch.Tensor, status: torch.Tensor,
                     which: InsertStatus) -> None:
        """Erases ``keys[i]`` wherever ``status[i] == which`` (e.g. the victims of
        another table's call, by its status: distinct keys), with every count on
        the device."""
        self._check_idle()
        self._padded = True
        self._ops.erase_where(memory=self._memory, keys=keys, table_ids=table_ids,
                               status=status, which=int(which),
                               erased=self._outcome_totals.tensor[_ERASED],
                               size=self._stored.on_device())
        self._generation += 1

    def _undo_padded(self, pending: PendingInsert) -> None:
        """Takes back what a padded call advanced on the device (the time and the
        totals; a refused batch advanced nothing); its slots are undone already."""
        padded, upserted = pending.padded, pending.upserted
        status = upserted.status
        done = 1 if padded.error is None else (padded.error == 0).to(torch.int64)
        self._time.on_device().sub_(done)
        real = padded.counts > 0  # padding: count 0, counted nowhere
        if padded.admitted is not None:  # nor were the keys left out of the pass
            real = real & padded.admitted
        added = [((status == s) & real).sum() for s in range(4)]
        expired = (expired_hits(upserted) & real).sum()
        added[InsertStatus.INSERTED] = added[InsertStatus.INSERTED] - expired
        added = torch.stack(added + [expired])
        self._outcome_totals.tensor[_OUTCOMES].sub_(added)  # (a view: the totals themselves)
        self._stored.on_device().sub_(added[InsertStatus.INSERTED])


def expired_hits(upserted: Upserted) -> torch.Tensor:
    """(n,) bool: the keys of a padded call that hit a row expired at its time
    (status INSERTED with a previous score: a new key's is -1)."""
    return (upserted.status == InsertStatus.INSERTED) & (upserted.prev_scores >= 0)
