"""The backends the table, module and storage suites run on."""

import contextlib
import re
from typing import Iterator, List, Optional

import torch


def cuda_ready() -> bool:
    """A CUDA device, PyTorch built with CUDA, and CuPy (the CUDA kernels' runtime)."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def devices() -> List[str]:
    """``["cpu"]``, plus ``"cuda"`` where the CUDA backend can run."""
    return ["cpu", "cuda"] if cuda_ready() else ["cpu"]


#: The CUDA backend's code on CPU tensors, its kernels emulated (``cuda_emulation``):
#: suites that take it as a device check the GPU step's Python where no GPU is.
EMULATED = "cuda-emulated"
#: The same with the kernels' own source run on the CPU (``simt.SimtCudaKernels``):
#: the warp code of ``csrc/cuda`` itself, in CI.
SIMT = "cuda-simt"


@contextlib.contextmanager
def backend_device(name: str) -> Iterator[torch.device]:
    """The device of ``name`` (a ``devices()`` entry; ``EMULATED``: the CPU under
    ``emulated_cuda``, for the block; ``SIMT``: the same running the kernels' source)."""
    if name not in (EMULATED, SIMT):
        yield torch.device(name)
        return
    from dynamicemb_testing.cuda_emulation import emulated_cuda  # noqa: PLC0415

    kernels = None
    if name == SIMT:
        from dynamicemb_testing.simt import SimtCudaKernels  # noqa: PLC0415

        kernels = SimtCudaKernels()
    with emulated_cuda(kernels):
        yield torch.device("cpu")


def reads_values_on_host(device) -> bool:
    """Whether the backend ``device`` takes (the CUDA path under ``emulated_cuda``
    included) checks a batch's values on the host: only where that costs no sync."""
    from dynamicemb.ops import for_device  # noqa: PLC0415 (after emulated_cuda applies)

    return for_device(torch.device(device)).free_host_reads


def expect_refused(module, bad: tuple, error: type, match: Optional[str],
                   next_call: tuple) -> None:
    """``module(*bad)`` is refused with ``error``: at once (what the host sees:
    dtypes, shapes; and bad offsets where host reads are free), or for bad offsets
    by ``module(*next_call)``, the bad call having returned zeros (``InputErrors``);
    either way no table changed (the caller checks)."""
    import pytest  # noqa: PLC0415

    try:
        out = module(*bad)
    except error as e:  # found on the host
        assert match is None or re.search(match, str(e)), str(e)
        return
    assert not bool(out.detach().cpu().any()), "a refused batch's output is zeros"
    with pytest.raises(error, match=match):
        module(*next_call)
