"""Recycled output buffers.

A fresh 32 MB CPU tensor costs ~8,000 page faults every time it is allocated (the
allocator hands large blocks back to the OS), which at 65,536 x 128 outputs was a
quarter of a training step. ``OutputBuffers`` hands out a view of a buffer it keeps,
and reuses the buffer only when nothing else holds its storage any more: no user
reference, no view, no tensor saved by autograd. Without the storage use count
(a private torch API) it allocates fresh each time.
"""

from typing import Dict, Tuple

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _storage_refs(t: torch.Tensor) -> int:
    return _use_count(t.untyped_storage()._cdata)


class OutputBuffers:
    """A few buffers, one per recent (shape, dtype).

    Args:
        keep: how many distinct shapes to keep.
    """

    def __init__(self, keep: int = 2) -> None:
        self._keep = keep
        self._buffers: Dict[Tuple, Tuple[torch.Tensor, int]] = {}

    def empty(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized tensor of ``shape``, recycled when safe."""
        if _use_count is None or device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        key = (tuple(shape), dtype)
        held = self._buffers.pop(key, None)
        if held is not None and _storage_refs(held[0]) == held[1]:
            buffer, idle = held
        else:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            idle = _storage_refs(buffer)
        self._buffers[key] = (buffer, idle)
        while len(self._buffers) > self._keep:
            self._buffers.pop(next(iter(self._buffers)))
        return buffer.view(shape)
