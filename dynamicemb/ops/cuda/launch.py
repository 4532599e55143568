"""Launching ``csrc/cuda``'s kernels: geometry, argument packing and ``KernelLauncher``."""

from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from dynamicemb.ops.cuda.program import _KERNELS, kernel_program

__all__ = ["KernelLauncher", "MAX_DIM", "PIECE_ENTRIES"]

_BLOCK = 256
_WARPS_PER_BLOCK = _BLOCK // 32
# Dynamic shared memory a block may take without the opt-in attribute: the fused
# update keeps dim floats per warp there, so the widest row one warp can update.
_SHARED_LIMIT = 48 * 1024
MAX_DIM = _SHARED_LIMIT // 4
_NUM_OUTCOMES = 4
# Lookups of one row summed by one warp; hotter rows are split into pieces of
# this many, summed in parallel, then added in order (csrc/cuda/embedding.cu).
PIECE_ENTRIES = 128
# kMaxBucketWords * 64 in csrc/cuda/hash_table.cu: the inserting kernel keeps a
# bucket's bits in registers.
_MAX_BUCKET_CAPACITY = 1024


def _ptr(t: Optional[torch.Tensor]) -> np.uint64:
    return np.uint64(0 if t is None or t.numel() == 0 else t.data_ptr())


def _i64(x) -> np.int64:
    return np.int64(int(x))


def _grid(threads: int, block: int = _BLOCK) -> Tuple[int]:
    return (max(1, (int(threads) + block - 1) // block),)


def _on_kernel_device(t: torch.Tensor) -> bool:
    """Whether kernels take ``t`` as device memory (the CPU emulation replaces this)."""
    return t.is_cuda


def _host_readable(t: torch.Tensor) -> bool:
    return _on_kernel_device(t) or t.is_pinned()


def _expect(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if not _on_kernel_device(t):
        raise ValueError(f"{name} must be a CUDA tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _expect_batch(keys: torch.Tensor, tids: torch.Tensor) -> None:
    _expect(keys, torch.int64, "keys")
    _expect(tids, torch.int16, "table_ids")
    if keys.dim() != 1 or tids.shape != keys.shape:
        raise ValueError("keys and table_ids must be 1-D of one length")


def _warps_per_update_block(dim: int) -> int:
    """Warps per fused-update block (at most 8) whose accumulators fit ``_SHARED_LIMIT``."""
    if not 1 <= dim <= MAX_DIM:
        raise ValueError(f"the CUDA backend updates rows of at most {MAX_DIM} floats "
                         f"(dim={dim})")
    return max(1, min(_WARPS_PER_BLOCK, _SHARED_LIMIT // (4 * int(dim))))


def _table_args(meta: Sequence[torch.Tensor], bc: int) -> list:
    """The DEMB_TABLE_PARAMS of csrc/cuda/common.cuh."""
    if len(meta) != 6:
        raise ValueError(f"meta must hold 6 tensors, got {len(meta)}")
    keys, scores = meta[0], meta[1]
    if keys.stride(0) != 2 or scores.data_ptr() != keys.data_ptr() + 8:
        raise ValueError("keys and scores must be the two columns of one (capacity, 2) array")
    _expect(meta[2], torch.int16, "tids")
    _expect(meta[3], torch.uint8, "digests")
    _expect(meta[4], torch.int64, "occupied")
    _expect(meta[5], torch.int64, "pinned")
    num_buckets = keys.numel() // bc
    return [_ptr(keys), _ptr(meta[2]), _ptr(meta[3]), _ptr(meta[4]), _ptr(meta[5]),
            np.int64(num_buckets), np.int32(bc)]


def _row_format_args(values: torch.Tensor, dim: int, row_format=None) -> list:
    """``row_dtype, state_offset`` of the kernels (csrc/cuda/embedding.cu) for stored rows
    ``values`` (C, width) of ``row_format`` (``(code, state_offset)``, ``RowFormat``'s; None:
    float32), checked against the rows' width in 4-byte words."""
    row_bytes = 4 * values.size(1)
    if row_format is None or int(row_format[0]) == 0:
        if values.size(1) < dim:
            raise ValueError(f"value rows ({values.size(1)} wide) are narrower than dim {dim}")
        return [np.int32(0), np.int64(4 * dim)]
    code, state_offset = (int(x) for x in row_format)
    if code not in (1, 2):
        raise ValueError(f"row format code must be 0 (float32), 1 (float16) or 2 (bfloat16), "
                         f"got {code}")
    if not (2 * dim <= state_offset <= row_bytes and state_offset % 4 == 0):
        raise ValueError(f"a 16-bit row's state offset must be 4-byte aligned, within the row "
                         f"and after its {dim} embedding elements, got {state_offset} of "
                         f"{row_bytes}")
    return [np.int32(code), np.int64(state_offset)]


def _row_args(tiers: Sequence[torch.Tensor], transient: torch.Tensor,
              row_ref: torch.Tensor, dim: int, init=None, row_format=None) -> list:
    """The DEMB_ROW_PARAMS of csrc/cuda/embedding.cu; a host tier must be pinned or
    empty. ``init`` (``InitRows``): negative references' rows computed, not read;
    ``row_format``: the stored rows' ``(code, state_offset)`` (None: float32)."""
    if len(tiers) != 2:
        raise ValueError("tiers must be [device values, host values]")
    device, host = tiers
    _expect(device, torch.float32, "device values")
    if host.numel() and not _host_readable(host):
        raise ValueError("a host tier read by CUDA kernels must be in pinned memory")
    if host.numel() and host.size(1) != device.size(1):
        raise ValueError("both tiers must have one row width")
    row_format_args = _row_format_args(device, dim, row_format)
    _expect(row_ref, torch.int64, "row_ref")
    computed = [_ptr(None)] * 4
    if init is not None:
        _expect_batch(init.keys, init.table_ids)
        _expect_init_spec(init.spec)
        if init.keys.numel() != row_ref.numel():
            raise ValueError("init keys must have one entry per row reference")
        computed = [_ptr(init.keys), _ptr(init.table_ids), _ptr(init.spec.ints),
                    _ptr(init.spec.floats)]
    return ([_ptr(device), _ptr(host), np.int64(device.size(1))] + row_format_args +
            [_ptr(transient), np.int64(dim), _ptr(row_ref)] + computed)


def _expect_init_spec(spec) -> None:
    _expect(spec.ints, torch.int64, "init ints")
    _expect(spec.floats, torch.float32, "init floats")
    if spec.ints.dim() != 2 or spec.ints.size(1) != 3 or spec.floats.shape != (
            spec.ints.size(0), 5):
        raise ValueError("an InitSpec holds (T, 3) ints and (T, 5) floats")


def _error_arg(error: Optional[torch.Tensor]) -> np.uint64:
    if error is not None:
        _expect(error, torch.int64, "error")
        if error.numel() != 1:
            raise ValueError("the error word is one int64")
    return _ptr(error)


class _StreamHandle:
    """A raw CUDA stream in the CUDA stream protocol (``__cuda_stream__``)."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> Tuple[int, int]:
        return (0, self.ptr)


class KernelLauncher:
    """Compiles kernels (once per device and source file) and launches them on PyTorch's
    current stream; ``CudaKernels.__init__`` sets its state."""

    def _module(self, device: int, source: str):
        key = (device, source)
        if key not in self._modules:
            code, options = kernel_program(self._root, self._digest, source)
            with self._cupy.cuda.Device(device):
                self._modules[key] = self._cupy.RawModule(code=code, options=options)
        return self._modules[key]

    def _function(self, device: int, name: str):
        key = (device, name)
        if key not in self._functions:
            module = self._module(device, _KERNELS[name])
            # CuPy compiles and loads a module at its first get_function, on the
            # current device: the table's, not whichever device is current.
            with self._cupy.cuda.Device(device):
                self._functions[key] = module.get_function(name)
        return self._functions[key]

    def _stream(self, device: torch.device):
        """CuPy's view of PyTorch's current stream on ``device`` (cached per stream)."""
        ptr = torch.cuda.current_stream(device).cuda_stream
        if ptr not in self._streams:
            cuda = self._cupy.cuda
            try:  # CuPy 14: the CUDA stream protocol
                self._streams[ptr] = cuda.Stream.from_external(_StreamHandle(ptr))
            except (AttributeError, TypeError):
                self._streams[ptr] = cuda.ExternalStream(ptr)
        return self._streams[ptr]

    def _launch(self, name: str, device: torch.device, threads: int, args: list,
                shared_mem: int = 0, block: int = _BLOCK) -> None:
        if threads <= 0:
            return
        index = device.index if device.index is not None else torch.cuda.current_device()
        kernel = self._function(index, name)
        with self._cupy.cuda.Device(index), self._stream(device):
            kernel(_grid(threads, block), (block,), tuple(args), shared_mem=shared_mem)
