"""CUDA tests: skipped cleanly where there is no GPU or no CuPy."""

import pytest

from dynamicemb_testing.devices import cuda_ready


def pytest_collection_modifyitems(config, items):
    if cuda_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU, PyTorch with CUDA and CuPy")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
