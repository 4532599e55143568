"""The CUDA backend: ``csrc/cuda`` compiled at run time by NVRTC through CuPy, launched on
PyTorch's current stream; results equal the CPU backend's. One module per kernel file,
plus ``launch``, ``program``, ``memory`` and ``backend``. Importing needs no CuPy or GPU."""

# The private names are re-exported for the tests and benchmarks that read or replace
# them (``dynamicemb_testing.cuda_emulation``).
from dynamicemb.ops.cuda.backend import CudaBackend, CudaKernels
from dynamicemb.ops.cuda.launch import (_BLOCK, MAX_DIM, PIECE_ENTRIES, _on_kernel_device,
                                        _ptr)
from dynamicemb.ops.cuda.memory import mapped_host_zeros
from dynamicemb.ops.cuda.program import (_KERNELS, _source_digest, cuda_source_root,
                                         kernel_program)
from dynamicemb.ops.kernels import KernelBackend

__all__ = ["CudaBackend", "CudaKernels", "cuda_source_root", "mapped_host_zeros"]
