"""The table's padded calls: inserts and erases that keep every count in device
memory (a padded step, where ``counts_on_device``), mixed into ``ScoredHashTable``."""

from typing import Optional, Tuple

import torch

from dynamicemb.ops.interface import Deduplicated, InsertStatus, Upserted
from dynamicemb.table.device_counts import DeviceTotals
from dynamicemb.table.pending import PaddedCall, PendingInsert
from dynamicemb.types import DynamicEmbCheckMode, DynamicEmbScoreStrategy

__all__ = ["DEVICE_TOTALS", "PaddedCalls", "expired_hits"]

# The padded calls' totals in device memory: hits, inserted, evicted, failed (an
# upsert's InsertStatus counts), hits on expired rows (status INSERTED, counted
# apart), then keys erased.
DEVICE_TOTALS = 6
_OUTCOMES = slice(0, 5)  # what an inserting call adds to
_ERASED = slice(5, 6)


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
    def counts_on_device(self) -> bool:
        """Whether ``prepare_dedup_find_or_insert(padded=True)`` may run: the backend
        keeps counts on the device, and nothing the call decides needs them on the
        host: the table cannot grow (no key waits for a growth) and failed inserts
        are ignored (IGNORE: neither raised nor logged). Rows that expired (``ttl``)
        are found by the kernels, at the time they read on the device."""
        return not self._memory.can_grow and self.check_mode == DynamicEmbCheckMode.IGNORE

    def _prepare_padded(self, keys, tids, frequencies, error, part,
                        table_scores) -> Tuple[Deduplicated, PendingInsert]:
        """A padded call: its kernels advance the clock and the step in device memory
        (unless ``error`` refuses the batch) and read its time there, take hits on
        rows expired at that time as inserts (``ttl``), and add their outcome counts
        to the device totals. Nothing is read on the host."""
        if not self.counts_on_device:
            raise ValueError(
                "a padded insert needs a backend that counts on the device and a table "
                "that cannot grow and ignores failed inserts")
        self._check_idle()
        self._padded = True
        unique, upserted = self._ops.padded_dedup_upsert(
            memory=self._memory, keys=keys, table_ids=tids, frequencies=frequencies,
            rule=self._rule, time=self._time.on_device(),
            now_index=1 if self.score_strategy == DynamicEmbScoreStrategy.STEP else 0,
            evicts=self._evicts, one_table=self.num_tables == 1, error=error,
            outcomes=self._outcome_totals.tensor[_OUTCOMES], size=self._stored.on_device(),
            part=part, table_scores=table_scores, ttl=self.ttl or 0)
        pending = PendingInsert(self, upserted, None, None, read_evicted=False, assign=False,
                                padded=PaddedCall(error, unique.counts))
        self._pending = pending
        return unique, pending

    def padded_upsert(self, keys: torch.Tensor, table_ids: torch.Tensor,
                      scores: Optional[torch.Tensor], buckets: torch.Tensor) -> Upserted:
        """One inserting pass over unique keys whose buckets the caller computed (a
        padded step's promotion into a cache), with every count on the device: keys
        whose bucket is ``kNoBucket`` (0x7FFFFFFF) are skipped (slot -1, status
        FAILED, counted nowhere). Scores by the table's rule (CUSTOMIZED: ``scores``).
        Nothing is read on the host; the size and the totals advance on the device.

        Args:
            keys (Tensor): (n,) int64, unique; table_ids (Tensor): (n,) int16 (checked
                by the caller).
            scores (Tensor, optional): (n,) int64.
            buckets (Tensor): (n,) int32.

        Returns:
            ``Upserted`` of the n keys (its four counts None).
        """
        if not self.counts_on_device or self.ttl is not None:
            raise ValueError("a padded upsert needs a backend that counts on the device and "
                             "a table that cannot grow, ignores failed inserts and has no ttl")
        self._check_idle()
        self._padded = True
        given = self._given_scores(scores, keys.numel(), checked=True)
        upserted = self._ops.padded_upsert(
            memory=self._memory, keys=keys, table_ids=table_ids, scores=given, buckets=buckets,
            rule=self._rule, evicts=self._evicts, one_table=self.num_tables == 1,
            outcomes=self._outcome_totals.tensor[_OUTCOMES], size=self._stored.on_device())
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
