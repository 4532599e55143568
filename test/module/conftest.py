"""The module suites run on each backend and, besides, on the CUDA backend's code with
its kernels emulated on the CPU (``cuda-emulated``): the training step that keeps its
counts on the device (``docs/ARCHITECTURE.md``, "Host synchronizations of a training
step") meets every semantic check in CI, where no GPU is."""

import pytest

from dynamicemb_testing.devices import EMULATED, SIMT, backend_device, devices


@pytest.fixture(params=devices() + [EMULATED, SIMT])
def device(request):
    """A backend (ids ``cpu``, ``cuda``), or the CPU under ``emulated_cuda``."""
    with backend_device(request.param) as d:
        yield d
