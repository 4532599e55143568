"""Shared test setup: factories and the device axis.

The helpers live in the ``dynamicemb_testing`` package (``test/`` is on the path
through pytest's ``pythonpath`` setting in pyproject.toml).
"""

import pytest

from dynamicemb_testing.table_testing import Pair
from dynamicemb_testing.table_testing import make_table as _make_table


@pytest.fixture
def make_table():
    """``make_table(**kw)`` -> ``ScoredHashTable``; strategy/check mode may be given by name."""
    return _make_table


@pytest.fixture
def make_pair():
    """``make_pair(**kw)`` -> ``Pair`` of a real table and its reference model."""
    return Pair
