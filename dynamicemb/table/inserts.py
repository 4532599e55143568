"""The table's inserting calls, mixed into ``ScoredHashTable``: every pass keeps its
counts in device memory; the step's calls read nothing on the host, the table's
own verbs (``find_or_insert`` and the others) read their statuses once.

What decides growth and reports failed inserts reaches the host late
(``SizeWatch``): the table grows ahead of need, by an upper bound of its size, and
while it may still grow a full bucket fails its key instead of evicting. A call
that reads its failures (the table's verbs, ERROR mode, ``grows_for_failures``)
then undoes itself, grows and runs again; a step's call computes the key's row
for the step, the failure makes the next call grow, and the key is inserted at
its next lookup. docs/ARCHITECTURE.md, "Growth and failed inserts".
"""

import logging
from typing import Callable, List, Optional, Tuple

import torch

from dynamicemb.ops.interface import KNO_BUCKET, Deduplicated, InsertStatus, ScoreRule, Upserted
from dynamicemb.table.device_counts import CountsCopy, DeviceTotals, capturing
from dynamicemb.table.pending import PendingInsert
from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbScoreStrategy

__all__ = ["DEVICE_TOTALS", "InsertCalls", "SizeWatch", "expired_hits"]

logger = logging.getLogger("dynamicemb.table.scored_hash_table")  # the table's messages

# The inserting calls' totals in device memory: hits, inserted, evicted, failed
# (an upsert's InsertStatus counts), hits on expired rows (status INSERTED, counted
# apart), then keys erased.
DEVICE_TOTALS = 6
_OUTCOMES = slice(0, 5)  # what an inserting call adds to
_ERASED = slice(5, 6)


class SizeWatch:
    """What the host knows of a table without waiting for the device: an upper bound
    of its size and the failed inserts it has learnt of.

    After an inserting call the size and the outcome totals (hits, inserted,
    evicted, failed) go to host memory (``CountsCopy``); a later call reads them
    once they arrived (on the CPU, where reads are free, the call itself). The
    bound is the size read plus every key given to inserting calls since the copy
    was taken, or the host's own count where the host set it since.

    Args:
        device: the table's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.copy = CountsCopy(1 + 5, device)  # the size, the outcome totals
        self.bound = 0
        self.since_copy = 0  # keys given to inserting calls since the copy on the way
        self.copy_stale = False  # the host set the size since the copy was taken
        self.totals: List[int] = [0] * 5  # the outcome totals read last
        self.failed = 0  # keys that failed (read) and that no growth answered yet


class InsertCalls:
    """The inserting calls of ``ScoredHashTable`` (whose state they use: its backend,
    memory, device counters and totals)."""

    def outcome_totals(self) -> DeviceTotals:
        """What inserting calls counted (hits, inserted, evicted, failed, expired,
        erased), in device memory."""
        return self._outcome_totals

    def size_on_device(self) -> torch.Tensor:
        """(1,) int64: the number of keys stored, in device memory, for kernels that
        read it in a step (the host's count is written there first)."""
        return self._stored.on_device()

    def _settle_device_counts(self) -> None:
        """Adds what inserting calls counted on the device to the stats."""
        _, inserted, evicted, failed, expired, erased = self._outcome_totals.take("table")
        self._stats.inserts += inserted + evicted
        self._stats.evictions += evicted
        self._stats.failed_inserts += failed
        self._stats.expired += expired
        self._stats.erases += erased

    @property
    def _watched(self) -> bool:
        """Whether inserting calls need what ``SizeWatch`` learns: the table may
        grow, or failed inserts are reported."""
        return self._memory.can_grow or self.check_mode != DynamicEmbCheckMode.IGNORE

    def _before_insert(self, n: int, exact: bool = False) -> bool:
        """Before an inserting call of ``n`` keys: reads the counts an earlier call copied
        if they arrived (nothing waits), grows once for failed inserts it learnt of
        and while the size's bound plus ``n`` exceeds ``max_load_factor`` of the
        capacity (growth reads the device: once per doubling); ``exact`` (the
        table's own verbs, which read the device anyway): while the size itself
        exceeds it. Returns whether a full bucket evicts: never while the table may
        grow (the key fails instead)."""
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
            while self._memory.can_grow and (
                    self._size if exact else watch.bound + n) > self.max_load_factor * self.capacity():
                self._grow()
        watch.bound += n
        if watch.copy.on_the_way:
            watch.since_copy += n
        return self._evicts and not self._memory.can_grow

    def _after_insert(self) -> None:
        """After an inserting call's kernels: its size and totals start for the host
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

    def _prepare_step(self, keys, tids, frequencies, error, part,
                      table_scores: Optional[torch.Tensor] = None
                      ) -> Tuple[Deduplicated, PendingInsert]:
        """A step's fused call (dedup and pass): its kernels advance the clock and the
        step in device memory (unless ``error`` refuses the batch) and read its time
        there, and add their outcome counts to the device totals; hits on rows
        expired at that time (``ttl``) are inserts. Nothing is read on the host but
        what ``_rerun_for_failures`` reads."""
        self._check_step_call()
        while True:
            evicts = self._before_insert(keys.numel())
            unique, upserted = self._ops.dedup_upsert(
                memory=self._memory, keys=keys, table_ids=tids, frequencies=frequencies,
                rule=self._rule, time=self._time.on_device(), now_index=self._now_index,
                evicts=evicts, one_table=self.num_tables == 1, error=error,
                outcomes=self._outcome_totals.tensor[_OUTCOMES],
                size=self._stored.on_device(), part=part, table_scores=table_scores,
                ttl=self.ttl or 0)
            pending = PendingInsert(self, upserted, error=error, ticked_step=True,
                                    counts_of_dedup=unique.counts)
            self._pending = pending
            if not self._rerun_for_failures(pending, unique):
                break
        self._after_insert()
        return unique, pending

    def _check_step_call(self) -> None:
        self._check_idle()
        if self.check_mode == DynamicEmbCheckMode.ERROR and capturing():
            raise RuntimeError(
                "safe_check_mode ERROR reads each insert's failures on the host, which a "
                "CUDA graph cannot capture: capture a table in WARNING or IGNORE mode")

    def _rerun_for_failures(self, pending: PendingInsert, unique: Deduplicated) -> bool:
        """In ERROR mode or with ``grows_for_failures``, a step's call reads its failed
        inserts (one sync): then it is undone, and the table grows (True: run it
        again) or raises when it cannot grow."""
        if not (self.check_mode == DynamicEmbCheckMode.ERROR or self.grows_for_failures):
            return False
        return self._grown_for_failures(pending, lambda: int((unique.counts > 0).sum()))

    def _grown_for_failures(self, pending: PendingInsert, num_keys: Callable[[], int]) -> bool:
        """After a call that reads its failures (a sync): with none, or none that
        growth could answer outside ERROR mode, False (the call stands); else the
        call is undone and the table grows (True: run it again), or ERROR mode
        raises (naming ``num_keys()``) when it cannot grow."""
        failed = pending.num_failed
        if not failed or not (self.check_mode == DynamicEmbCheckMode.ERROR
                              or self._memory.can_grow):
            return False
        pending.abort()
        if not self._memory.can_grow:
            self._stats.failed_inserts += failed  # (what the abort took back)
            raise RuntimeError(self._failure_message(failed, num_keys())
                               + "; the call was undone")
        self._grow()  # the keys of full buckets get room: the call again
        return True

    def _dedup_step(self, keys, tids, frequencies, error, part) -> Deduplicated:
        """The dedup of a step whose pass follows apart (``_prepare_admitted``): the
        clock and the step advance in device memory (unless ``error`` refuses the
        batch), so that a ``find`` then sees the pass's time."""
        self._check_step_call()
        return self._ops.dedup(keys=keys, table_ids=tids, error=error, part=part,
                               frequencies=frequencies, group=True,
                               time=self._time.on_device())

    def _prepare_admitted(self, unique: Deduplicated, admitted: torch.Tensor, error,
                          table_scores: Optional[torch.Tensor]) -> PendingInsert:
        """The pass of a step whose dedup ran apart (``_dedup_step``), over the
        ``admitted`` keys: the fused call's pass (same time, scores and order of keys
        per bucket); the others get bucket ``KNO_BUCKET`` (slot -1, FAILED, counted
        nowhere). A rerun (``_rerun_for_failures``) ticks the time the undone call
        took back."""
        self._check_step_call()
        admitted = admitted & (unique.counts > 0)  # padding: count 0
        time = self._time.on_device()
        while True:
            evicts = self._before_insert(unique.keys.numel())  # (may grow: buckets after)
            upserted = self._ops.upsert(
                memory=self._memory, keys=unique.keys, table_ids=unique.table_ids,
                scores=self._pass_scores(unique, table_scores),
                buckets=self.buckets_where(unique.keys, unique.table_ids, admitted),
                rule=self._rule, evicts=evicts,
                one_table=self.num_tables == 1,
                outcomes=self._outcome_totals.tensor[_OUTCOMES], size=self._stored.on_device(),
                time=time, now_index=self._now_index, ttl=self.ttl or 0)
            pending = PendingInsert(self, upserted, error=error, ticked_step=True,
                                    counts_of_dedup=unique.counts, admitted=admitted)
            self._pending = pending
            if not self._rerun_for_failures(pending, unique):
                break
            time.add_(1 if error is None else (error == 0).to(torch.int64))
        self._after_insert()
        return pending

    def _pass_scores(self, unique: Deduplicated,
                     table_scores: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The scores a pass over ``unique`` gives: none (the clock rule), the
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
        (what ``upsert_where`` skips); ``table_ids`` int16."""
        home = torch.bitwise_and(self._ops.hash_keys(keys=keys, table_ids=table_ids),
                                 self._memory.num_buckets - 1)
        return torch.where(mask, home, KNO_BUCKET).to(torch.int32)

    def upsert_where(self, keys: torch.Tensor, table_ids: torch.Tensor,
                     scores: Optional[torch.Tensor], buckets: torch.Tensor,
                     tick: Optional[torch.Tensor] = None) -> Upserted:
        """One inserting pass over unique keys whose buckets the caller computed (a
        step's promotion into a cache, ``buckets_where``), with every count on the
        device: keys whose bucket is ``kNoBucket`` (0x7FFFFFFF) are skipped (slot
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
            ``Upserted`` of the n keys.
        """
        if (self._memory.can_grow or self.ttl is not None
                or self.check_mode == DynamicEmbCheckMode.ERROR):
            raise ValueError("upsert_where needs a table without a ttl that cannot grow "
                             "(its buckets are given) and does not raise failed inserts")
        self._check_idle()
        given = self._given_scores(scores, keys.numel(), checked=True)
        time = None
        if tick is not None:
            time = self._time.on_device()
            time[:1].add_(tick)
        evicts = self._before_insert(keys.numel())
        upserted = self._ops.upsert(
            memory=self._memory, keys=keys, table_ids=table_ids, scores=given, buckets=buckets,
            rule=self._rule, evicts=evicts, one_table=self.num_tables == 1,
            outcomes=self._outcome_totals.tensor[_OUTCOMES], size=self._stored.on_device(),
            time=time, now_index=self._now_index)
        self._generation += 1  # whether it evicted or moved a key is not read
        self._after_insert()
        return upserted

    def erase_where(self, keys: torch.Tensor, table_ids: torch.Tensor, status: torch.Tensor,
                     which: InsertStatus) -> None:
        """Erases ``keys[i]`` wherever ``status[i] == which`` (e.g. the victims of
        another table's call, by its status: distinct keys), with every count on
        the device."""
        self._check_idle()
        self._ops.erase_where(memory=self._memory, keys=keys, table_ids=table_ids,
                               status=status, which=int(which),
                               erased=self._outcome_totals.tensor[_ERASED],
                               size=self._stored.on_device())
        self._generation += 1

    def _undo_counts(self, pending: PendingInsert) -> None:
        """Takes back what an inserting call advanced on the device (the time, the
        totals and the size; a refused batch advanced nothing); its slots are
        undone already."""
        upserted = pending.upserted
        status = upserted.status
        done = 1 if pending.error is None else (pending.error == 0).to(torch.int64)
        time = self._time.on_device()
        (time if pending.ticked_step else time[:1]).sub_(done)
        if pending.outcomes is not None:  # its own counts: only the size to take back
            self._stored.on_device().sub_(pending.outcomes[InsertStatus.INSERTED])
            return
        added = [pending.taken(status == s).sum() for s in range(4)]
        expired = pending.taken(expired_hits(upserted)).sum()
        added[InsertStatus.INSERTED] = added[InsertStatus.INSERTED] - expired
        added = torch.stack(added + [expired])
        self._outcome_totals.tensor[_OUTCOMES].sub_(added)  # (a view: the totals themselves)
        self._stored.on_device().sub_(added[InsertStatus.INSERTED])


def expired_hits(upserted: Upserted) -> torch.Tensor:
    """(n,) bool: the keys of a pass that hit a row expired at its time (status
    INSERTED with a previous score: a new key's is -1)."""
    return (upserted.status == InsertStatus.INSERTED) & (upserted.prev_scores >= 0)
