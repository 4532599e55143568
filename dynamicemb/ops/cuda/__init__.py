"""The CUDA backend: the kernels of ``csrc/cuda`` compiled at run time by CuPy.

``CudaKernels`` offers the functions of the CPU extension (``csrc/cpu/verbs.h``) with
the same names, arguments and results, over CUDA tensors; ``CudaBackend`` is the
``Backend`` verbs over them (``dynamicemb.ops.kernels``), so the table, storage
and module code run unchanged on a GPU. Kernels are compiled once per process
and device by NVRTC (cached on disk by CuPy, keyed on the sources and headers)
and launched on PyTorch's current stream; tensors are passed as raw pointers
(no copies). Only ``dynamicemb.ops.for_device`` creates it.

Inserting passes sort the pass's keys by bucket and walk each bucket with one
warp, so results equal the CPU backend's (see ``csrc/cuda/hash_table.cu``).

One module per kernel file of ``csrc/cuda``: ``hash_table``, ``cache``, ``dedup``,
``embedding`` (each a class of launches that ``CudaKernels`` combines); ``launch``
(geometry, argument packing, compiling and launching), ``program`` (the sources),
``memory`` (mapped host memory) and ``backend`` (``CudaKernels``, ``CudaBackend``).
Importing it needs neither CuPy nor a GPU.
"""

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
