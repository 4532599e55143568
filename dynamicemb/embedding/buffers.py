"""Recycled CPU buffers: a fresh large CPU tensor costs thousands of page faults.

``OutputBuffers`` reuses a buffer only when nothing else holds its storage (no reference,
view or autograd save); without torch's private storage use count it allocates fresh.
"""

from typing import Dict, List, Tuple

import torch

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _storage_refs(t: torch.Tensor) -> int:
    return _use_count(t.untyped_storage()._cdata)


class OutputBuffers:
    """A ring of ``per_shape`` buffers for each of the ``shapes`` latest (shape, dtype):
    ``out = module(x)`` keeps the previous output alive while the next is computed."""

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
    """Working memory a call needs only while it runs (the backward's summed gradients),
    kept between calls as one flat float32 buffer handed out as views. Not for tensors that
    outlive the call: the next call overwrites them."""

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
