"""A table's clock and step, in device memory so that a CUDA graph's replays advance them."""

from typing import Optional

import torch

from dynamicemb.ops.interface import COMPOUND_TIME_MASK
from dynamicemb.table.device_counts import DeviceCounters
from dynamicemb.types import DynamicEmbScoreStrategy

__all__ = ["TableTime"]


class TableTime:
    """The (clock, step) of a table with ``strategy`` and ``ttl`` on ``device``."""

    def __init__(self, strategy: DynamicEmbScoreStrategy, ttl: Optional[int],
                 device: torch.device) -> None:
        self.counters = DeviceCounters([0, 0], device)
        self.ttl = ttl
        #: which of (clock, step) is a call's time (``now``): STEP scores the step
        self.index = 1 if strategy == DynamicEmbScoreStrategy.STEP else 0
        self.compound = strategy == DynamicEmbScoreStrategy.LRU_LFU

    def on_device(self) -> torch.Tensor:
        """(2,) int64 (clock, step) in device memory, for the kernels."""
        return self.counters.on_device()

    @property
    def clock(self) -> int:
        return self.counters.value(0)

    @property
    def step(self) -> int:
        return self.counters.value(1)

    @property
    def now(self) -> int:
        return self.counters.value(self.index)

    @property
    def next_time(self) -> int:
        return self.step if self.index else self.clock + 1

    def time_of(self, scores: torch.Tensor) -> torch.Tensor:
        return scores & COMPOUND_TIME_MASK if self.compound else scores

    def expired_before(self, time: int) -> int:
        return 0 if self.ttl is None else max(0, int(time) - self.ttl)

    def expired_before_now(self) -> torch.Tensor:
        """``expired_before(now)`` as a () tensor, read on the device (no sync)."""
        return (self.on_device()[self.index] - self.ttl).clamp_(min=0)

    def set_step(self, step: int) -> None:
        if int(step) < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.counters.set(1, int(step))

    def set_clock(self, clock: int) -> None:
        if int(clock) < 0:
            raise ValueError(f"clock must be >= 0, got {clock}")
        if self.compound and int(clock) >= COMPOUND_TIME_MASK:
            raise ValueError(f"LRU_LFU scores hold a clock below 2^32 - 1, got {clock}")
        self.counters.set(0, int(clock))
