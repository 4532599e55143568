"""When a table grows, decided on the host without waiting for the device
(docs/ARCHITECTURE.md, "Growth and failed inserts")."""

import logging
from typing import Callable, List

from dynamicemb.ops.interface import InsertStatus, TableMemory
from dynamicemb.table.device_counts import CountsCopy, DeviceCounters, DeviceTotals, capturing
from dynamicemb.types import DynamicEmbCheckMode

__all__ = ["DEVICE_TOTALS", "GrowthWatch", "OUTCOMES", "ERASED"]

logger = logging.getLogger("dynamicemb.table.scored_hash_table")  # the table's messages

# The inserting calls' totals in device memory: the InsertStatus counts, hits on
# expired rows (status INSERTED, counted apart), then keys erased.
DEVICE_TOTALS = 6
OUTCOMES = slice(0, 5)  # what an inserting call adds to
ERASED = slice(5, 6)


class GrowthWatch:
    """A table's growth policy: an upper bound of its size (the size read plus keys given
    since the copy, or the host's own count) and the failed inserts it learnt of.
    ``stored`` and ``totals`` are the table's device counts; ``free_host_reads``: read
    them at once (the CPU); ``failure_message(failed, keys)`` for WARNING's log."""

    def __init__(self, memory: TableMemory, stored: DeviceCounters, totals: DeviceTotals,
                 check_mode: DynamicEmbCheckMode, evicts: bool, max_load_factor: float,
                 free_host_reads: bool, grow: Callable[[], None],
                 failure_message: Callable[[int, int], str]) -> None:
        self.memory, self.stored, self.totals = memory, stored, totals
        self.check_mode, self.evicts, self.max_load_factor = check_mode, evicts, max_load_factor
        self.free_host_reads, self.grow, self.failure_message = (free_host_reads, grow,
                                                                 failure_message)
        self.copy = CountsCopy(1 + 5, stored.on_device().device)  # the size, the totals
        self.bound = 0
        self.since_copy = 0  # keys given to inserting calls since the copy on the way
        self.copy_stale = False  # the host set the size since the copy was taken
        self.totals_read: List[int] = [0] * 5  # the outcome totals read last
        self.failed = 0  # keys that failed (read) and that no growth answered yet
        # a CUDA graph captured a call: its replays use the arrays' addresses, so
        # growth (which replaces them) is refused until the table's release_graphs
        self.captured = False

    @property
    def watched(self) -> bool:
        """Whether the table may grow or reports failed inserts."""
        return self.memory.can_grow or self.check_mode != DynamicEmbCheckMode.IGNORE

    def before_insert(self, n: int, exact: bool = False) -> bool:
        """Before an inserting call of ``n`` keys: takes arrived counts (no wait), grows for
        failed inserts and while the size's bound plus ``n`` (``exact``: the size itself)
        exceeds ``max_load_factor`` of the capacity. Returns whether a full bucket evicts:
        never while the table may grow (the key fails instead)."""
        memory = self.memory
        if not self.watched:
            return self.evicts
        if capturing():
            self.captured = True
        else:  # a graph's replays run no Python: nothing is read or grown
            self.read()
            if self.stored.held_on_host():  # the host's count: exact, and read for free
                self.bound = self.stored.value(0)
                self.copy_stale = self.copy.on_the_way
            if self.failed and memory.can_grow:
                self.grow()
            self.failed = 0
            while memory.can_grow and (self.stored.value(0) if exact else self.bound + n) \
                    > self.max_load_factor * memory.capacity:
                self.grow()
        self.bound += n
        if self.copy.on_the_way:
            self.since_copy += n
        return self.evicts and not memory.can_grow

    def after_insert(self) -> None:
        """After an inserting call's kernels: its size and totals start for the host (unless
        a copy is on the way); on the CPU they are read at once."""
        if not self.watched or capturing() or self.copy.on_the_way:
            return
        self.copy.start(self.stored.on_device(), self.totals.tensor[OUTCOMES])
        self.since_copy, self.copy_stale = 0, False
        if self.free_host_reads:
            self.read()

    def read(self) -> None:
        """Takes the copied counts if they arrived (failed inserts logged in WARNING mode)."""
        arrived = self.copy.arrived()
        if arrived is None:
            return
        size, totals = arrived[0], arrived[1:]
        if not self.copy_stale:
            self.bound = size + self.since_copy
        keys = sum(totals) - sum(self.totals_read)
        failed = totals[InsertStatus.FAILED] - self.totals_read[InsertStatus.FAILED]
        self.totals_read = totals
        if failed <= 0:  # (an abort takes back what its call counted)
            return
        self.failed += failed
        if self.check_mode == DynamicEmbCheckMode.WARNING:
            grows = ("; the table grows at its next call and inserts them at their next "
                     "lookup" if self.memory.can_grow else "")
            logger.warning(self.failure_message(failed, keys) + grows)
