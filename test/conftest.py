"""Shared test setup: makes the table test helpers importable and offers factories."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "table"))


@pytest.fixture
def make_table():
    """``make_table(**kw)`` -> ``ScoredHashTable``; strategy/check mode may be given by name."""
    from table_testing import make_table as factory

    return factory


@pytest.fixture
def make_pair():
    """``make_pair(**kw)`` -> ``Pair`` of a real table and its reference model."""
    from table_testing import Pair

    return Pair
