"""Recycled output buffers.

A fresh 32 MB CPU tensor costs ~8,000 page faults every time it is allocated (the
allocator hands large blocks back to the OS), which at 65,536 x 128 outputs was a
quarter of a training step. ``OutputBuffers`` hands out a view of a buffer it keeps,
and reuses the buffer only when nothing else holds its storage any more: no user
reference, no view, no tensor saved by autograd. Without the storage use count
(a private torch API) it allocates fresh each time.
"""

from typing import Dict, List, Tuple

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _storage_refs(t: torch.Tensor) -> int:
    return _use_count(t.untyped_storage()._cdata)


class OutputBuffers:
    """A ring of a few buffers per recent (shape, dtype): ``out = module(x)`` keeps the
    previous output alive while the next is computed, so one buffer is not enough.

    Args:
        shapes: how many distinct (shape, dtype) to keep buffers for.
        per_shape: buffers per (shape, dtype).
    """

    def __init__(self, shapes: int = 2, per_shape: int = 3) -> None:
        self._shapes = shapes
        self._per_shape = per_shape
        self._buffers: Dict[Tuple, List[Tuple[torch.Tensor, int]]] = {}

    def empty(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized tensor of ``shape``, recycled when safe."""
        if _use_count is None or device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        key = (tuple(shape), dtype)
        ring = self._buffers.pop(key, [])
        self._buffers[key] = ring  # most recent last
        while len(self._buffers) > self._shapes:
            self._buffers.pop(next(iter(self._buffers)))
        for buffer, idle in ring:
            if _storage_refs(buffer) == idle:
                return buffer.view(shape)
        buffer = torch.empty(shape, dtype=dtype, device=device)
        if len(ring) < self._per_shape:
            ring.append((buffer, _storage_refs(buffer)))
        return buffer.view(shape)


class Scratch:
    """Working memory that a call needs only while it runs (the backward's summed
    gradients), kept between calls: one flat float32 buffer, grown by half again
    when a call needs more, handed out as views. A fresh buffer of the backward's
    size (U x dim floats, 13 MB at 65,536 lookups of dim 128) would cost thousands
    of page faults on every step.

    Not for tensors that outlive the call: the next call overwrites them.
    """

    _ALIGN = 16  # floats: each view starts on a 64-byte line

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.float32)

    def views(self, shapes: List[Tuple[int, int]], device: torch.device) -> List[torch.Tensor]:
        """One uninitialized (rows, cols) float32 view per shape, not overlapping."""
        starts, total = [], 0
        for rows, cols in shapes:
            starts.append(total)
            total += -(-rows * cols // self._ALIGN) * self._ALIGN
        if self._buffer.numel() < total or self._buffer.device != device:
            self._buffer = torch.empty(total + total // 2, dtype=torch.float32, device=device)
        return [self._buffer[s:s + rows * cols].view(rows, cols)
                for s, (rows, cols) in zip(starts, shapes)]
