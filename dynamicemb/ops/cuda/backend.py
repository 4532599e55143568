"""``CudaKernels`` (the CPU extension's functions over CUDA tensors) and ``CudaBackend``."""

import torch

from dynamicemb.ops.cuda.cache import CacheKernels
from dynamicemb.ops.cuda.dedup import DedupKernels
from dynamicemb.ops.cuda.embedding import EmbeddingKernels
from dynamicemb.ops.cuda.hash_table import HashTableKernels
from dynamicemb.ops.cuda.launch import MAX_DIM
from dynamicemb.ops.cuda.memory import mapped_host_zeros
from dynamicemb.ops.cuda.program import _source_digest, cuda_source_root
from dynamicemb.ops.kernels import KernelBackend
from dynamicemb.ops.streams import CudaStreams

__all__ = ["CudaBackend", "CudaKernels"]


class CudaKernels(HashTableKernels, CacheKernels, DedupKernels, EmbeddingKernels):
    """The CPU extension's functions over CUDA tensors; ImportError without CuPy."""

    def __init__(self) -> None:
        try:
            import cupy  # noqa: PLC0415 (an optional dependency)
        except ImportError as err:
            raise ImportError(
                "dynamicemb's CUDA backend needs CuPy: pip install 'dynamicemb[cuda]' "
                "(or cupy-cuda12x / cupy-cuda13x matching your CUDA driver)") from err
        self._cupy = cupy
        self._root = cuda_source_root()
        self._digest = _source_digest(self._root)
        self._modules = {}  # (device index, source) -> cupy.RawModule
        self._functions = {}  # (device index, name) -> cupy.RawKernel
        self._streams = {}  # torch stream pointer -> cupy stream
        self.stream_api = CudaStreams()

    def retire(self, tensors) -> None:
        """Tensors the current stream's kernels may still read (other streams' uses are ordered
        before it: ``StreamOrder``): their memory is reused only after that stream's work."""
        if self.stream_api is None:
            return
        for t in tensors:
            self.stream_api.record_stream(t, self.stream_api.current_stream(t.device))


class CudaBackend(KernelBackend):
    """Kernels over CUDA tensors; ImportError without CuPy (the message says what to install)."""

    #: The widest embedding a group may have (the fused update's shared memory).
    max_dim = MAX_DIM
    row_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    free_host_reads = False

    def __init__(self) -> None:
        super().__init__(CudaKernels())

    def zeros(self, shape, dtype, device):
        return torch.zeros(tuple(shape), dtype=dtype, device=device)

    def _retire(self, tensors) -> None:
        self.kernels.retire(tensors)

    def host_zeros(self, shape, dtype, device):
        """Zeroed pinned host memory mapped into the GPU's address space, as a CUDA tensor:
        kernels and torch ops use it in place over the bus; it counts against host memory."""
        return mapped_host_zeros(tuple(shape), dtype, device)
