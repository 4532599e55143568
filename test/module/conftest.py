"""The module suites run on each backend and, besides, on the CUDA backend's code with
its kernels emulated on the CPU (``cuda-emulated``): the training step that keeps its
counts on the device (``docs/ARCHITECTURE.md``, "Host synchronizations of a training
step") meets every semantic check in CI, where no GPU is."""

import pytest
import torch

from dynamicemb_testing.cuda_emulation import emulated_cuda
from dynamicemb_testing.devices import devices


@pytest.fixture(params=devices() + ["cuda-emulated"])
def device(request):
    """A backend (ids ``cpu``, ``cuda``), or the CPU under ``emulated_cuda``."""
    if request.param != "cuda-emulated":
        yield torch.device(request.param)
        return
    with emulated_cuda():
        yield torch.device("cpu")
