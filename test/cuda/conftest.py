"""CUDA tests: skipped cleanly where there is no GPU or no CuPy."""

import pytest
import torch


def cuda_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    if cuda_ready():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU, PyTorch with CUDA and CuPy")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
