"""Counts that a device adds up call after call and the host reads only when asked."""

from typing import List, Optional

import torch

__all__ = ["DeviceCounts"]


class DeviceCounts:
    """A running total of (k,) int64 count vectors that stay in device memory.

    ``add`` keeps a reference to each call's counts (no launch, no sync); every
    ``fold_every`` of them are summed on the device (two launches, no sync), so the
    list stays short; ``take`` hands the total to the host (one sync) and starts
    over. A training step that must not wait for the device adds its counts here
    and whoever asks for a size or a statistic pays the one read.

    Args:
        fold_every: how many count vectors to keep before summing them.
    """

    def __init__(self, fold_every: int = 256) -> None:
        self._pending: List[torch.Tensor] = []
        self._total: Optional[torch.Tensor] = None
        self._fold_every = fold_every

    def add(self, counts: torch.Tensor) -> None:
        """Adds one call's counts (k,) int64, on the device (kept, not copied: the
        caller does not write them again)."""
        self._pending.append(counts)
        if len(self._pending) >= self._fold_every:
            self._fold()

    def __bool__(self) -> bool:
        """Whether counts were added since the last ``take``."""
        return bool(self._pending) or self._total is not None

    def take(self) -> Optional[List[int]]:
        """The counts added since the last ``take``, summed, on the host (one sync), or
        None when none were added."""
        if self._pending:
            self._fold()
        if self._total is None:
            return None
        total, self._total = self._total, None
        return total.tolist()

    def _fold(self) -> None:
        summed = torch.stack(self._pending).sum(0)
        self._total = summed if self._total is None else self._total + summed
        self._pending = []
