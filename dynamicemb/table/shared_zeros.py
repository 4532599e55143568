"""Read-only zero vectors without a fill per call."""

import torch

__all__ = ["SharedZeros"]


class SharedZeros:
    """Read-only zero vectors, views of one buffer that grows by doubling: an all-zero
    answer costs no fill (on a GPU, a launch). Callers never write them."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self._buffer = torch.zeros(0, dtype=dtype, device=device)

    def take(self, n: int) -> torch.Tensor:
        """(n,) zeros, a view of the shared buffer."""
        if self._buffer.numel() < n:
            self._buffer = torch.zeros(max(n, 2 * self._buffer.numel()),
                                       dtype=self._buffer.dtype, device=self._buffer.device)
        return self._buffer[:n]
