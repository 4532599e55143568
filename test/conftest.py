"""Shared test setup: factories and the device axis.

The helpers live in the ``dynamicemb_testing`` package (``test/`` is on the path
through pytest's ``pythonpath`` setting in pyproject.toml).
"""

import functools

import pytest
import torch

from dynamicemb_testing.devices import devices
from dynamicemb_testing.table_testing import Pair
from dynamicemb_testing.table_testing import make_table as _make_table


@pytest.fixture(params=devices())
def device(request) -> torch.device:
    """Each backend the suites run on (ids ``cpu``, ``cuda``)."""
    return torch.device(request.param)


@pytest.fixture
def make_table(device):
    """``make_table(**kw)`` -> ``ScoredHashTable`` on ``device``; strategy/check mode may be
    given by name."""
    return functools.partial(_make_table, device=device)


@pytest.fixture
def make_pair(device):
    """``make_pair(**kw)`` -> ``Pair`` of a real table on ``device`` and its reference model."""
    return functools.partial(Pair, device=device)

