"""Pinned host memory mapped into the GPU's address space, seen as CUDA tensors."""

import sys
from typing import Tuple

import torch

__all__ = ["mapped_host_zeros"]


class _PinnedHostMemory:
    """Owns one ``cudaHostAlloc`` allocation; freed when the last tensor over it goes."""

    def __init__(self, runtime, nbytes: int) -> None:
        self._runtime = runtime
        # Portable: every device maps it; mapped: kernels may read it (implied by UVA).
        self.ptr = runtime.hostAlloc(max(nbytes, 1), runtime.hostAllocPortable
                                     | runtime.hostAllocMapped)

    def __del__(self) -> None:
        # at interpreter exit the CUDA context may be gone: the process frees it all
        if getattr(self, "ptr", 0) and not sys.is_finalizing():
            self._runtime.freeHost(self.ptr)
            self.ptr = 0


def mapped_host_zeros(shape: Tuple[int, ...], dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """A zeroed tensor of ``shape`` in pinned host memory, as a tensor on ``device``
    (CUDA) whose pointer is the host memory's address in the unified address space.

    Raises:
        MemoryError: when the pinned memory cannot be had (the message gives the size).
    """
    try:
        import cupy
    except ImportError as e:  # pragma: no cover - CudaKernels has already imported it
        raise ImportError(f"host memory for CUDA tables needs CuPy: {e}") from e
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    try:
        owner = _PinnedHostMemory(cupy.cuda.runtime, nbytes)
    except cupy.cuda.runtime.CUDARuntimeError as e:
        raise MemoryError(f"could not allocate {nbytes} bytes of pinned host memory for a "
                          f"host store's rows ({e}); lower max_capacity or raise the "
                          f"device budget (local_hbm_for_values)") from e
    index = device.index if device.index is not None else torch.cuda.current_device()
    memory = cupy.cuda.UnownedMemory(owner.ptr, max(nbytes, 1), owner, device_id=index)
    array = cupy.ndarray((max(nbytes, 1),), dtype=cupy.uint8,
                         memptr=cupy.cuda.MemoryPointer(memory, 0))
    flat = torch.from_dlpack(array)[:nbytes]
    values = flat.view(dtype).view(shape)
    values.zero_()
    return values
