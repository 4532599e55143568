"""Read-only zero vectors without a fill per call."""

import torch

__all__ = ["SharedZeros"]


class SharedZeros:
    """Zero vectors of one dtype on one device, cut from one buffer that grows by
    doubling: a batch whose answer is all zeros (no key inserted, every lookup in
    local table 0) gets one without a fill (on a GPU, a launch a step).

    The vectors share memory: callers read them and never write them.

    Args:
        dtype: the vectors' dtype.
        device: where they live.
    """

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self._buffer = torch.zeros(0, dtype=dtype, device=device)

    def take(self, n: int) -> torch.Tensor:
        """(n,) zeros, a view of the shared buffer."""
        if self._buffer.numel() < n:
            self._buffer = torch.zeros(max(n, 2 * self._buffer.numel()),
                                       dtype=self._buffer.dtype, device=self._buffer.device)
        return self._buffer[:n]
