"""Plan generators against HugeCTR's notebook generators and a hand-checked greedy placement."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamicemb.plan.format import LookupPlacement, PlanGroup, load_plan
from dynamicemb.plan.generators import distributed, dp_and_localized, greedy
from dynamicemb_testing.plan_testing import CRITEO_SIZES


def notebook_dp_and_localized(sizes, num_gpus):
    """The plan object HugeCTR's notebook writes for "data parallel + localized"."""
    mp = [t for t, size in enumerate(sizes) if size > 6000]
    dp = [t for t, size in enumerate(sizes) if size <= 6000]
    local = [[t for i, t in enumerate(mp) if i % num_gpus == gpu] for gpu in range(num_gpus)]
    return [[{"local_embedding_list": local[gpu], "global_embedding_list": local,
              "table_placement_strategy": "mp"},
             {"local_embedding_list": dp, "global_embedding_list": [dp] * num_gpus,
              "table_placement_strategy": "dp"}]
            for gpu in range(num_gpus)]


def notebook_distributed(sizes, num_gpus):
    """The plan object HugeCTR's notebook writes for "distributed" (older shard keys)."""
    tables = list(range(len(sizes)))
    return [[{"local_embedding_list": tables, "global_embedding_list": [tables] * num_gpus,
              "table_placement_strategy": "mp", "sharding_id": gpu, "num_sharding": num_gpus}]
            for gpu in range(num_gpus)]


def test_dp_and_localized_criteo():
    plan = dp_and_localized(CRITEO_SIZES, 8)
    mp, dp = plan.groups(0)
    assert mp == PlanGroup("mp", (0, 11))
    assert dp == PlanGroup("dp", (5, 7, 8, 12, 13, 15, 16, 17, 18, 24, 25))
    # The global list the notebook prints.
    assert plan.to_obj()[0][0]["global_embedding_list"] == [
        [0, 11], [1, 14], [2, 19], [3, 20], [4, 21], [6, 22], [9, 23], [10]]
    assert plan.to_obj() == notebook_dp_and_localized(CRITEO_SIZES, 8)
    placements = plan.validate(world_size=8, num_lookups=26)
    assert placements[10] == LookupPlacement("table_wise", (7,))
    assert placements[5] == LookupPlacement("data_parallel", tuple(range(8)))


def test_distributed_criteo():
    plan = distributed(CRITEO_SIZES, 8)
    assert [plan.groups(gpu)[0].shard_id for gpu in range(8)] == list(range(8))
    assert {plan.groups(gpu)[0].shard_count for gpu in range(8)} == {8}
    assert plan.to_obj("old") == notebook_distributed(CRITEO_SIZES, 8)
    assert plan.validate(world_size=8, num_lookups=26) == {
        t: LookupPlacement("row_wise", tuple(range(8))) for t in range(26)}


@pytest.mark.parametrize("num_gpus", [1, 2, 3, 8])
def test_generators_match_notebook(num_gpus):
    sizes = CRITEO_SIZES[:7]
    assert dp_and_localized(sizes, num_gpus) == load_plan(notebook_dp_and_localized(sizes, num_gpus))
    assert distributed(sizes, num_gpus) == load_plan(notebook_distributed(sizes, num_gpus))


def test_one_gpu_distributed_is_table_wise():
    assert distributed([10, 20], 1).placements() == {0: LookupPlacement("table_wise", (0,)),
                                                     1: LookupPlacement("table_wise", (0,))}


@pytest.mark.parametrize("threshold, mp_tables", [(0, [0, 1, 2]), (15, [1, 2]), (10 ** 9, [])])
def test_dp_threshold(threshold, mp_tables):
    plan = dp_and_localized([10, 20, 30], 2, dp_threshold=threshold)
    kinds = plan.placements(num_lookups=3)
    assert [t for t in range(3) if kinds[t].kind == "table_wise"] == mp_tables
    assert plan.num_groups == 2  # both groups always, as the notebook writes them


@pytest.mark.parametrize("table_bytes, num_gpus, memory, expected", [
    # ceil(5/2) = 3 per GPU; 50 -> GPU 0 (tie), 40 -> 1, 30 -> 1 (60 free > 50), 20 -> 0, 10 -> 0 (tie 30/30).
    ([50, 40, 30, 20, 10], 2, 100, [(0, 3, 4), (1, 2)]),
    # ceil(4/2) = 2 per GPU: GPU 1 is full after two small tables, so the last goes to GPU 0.
    ([100, 1, 1, 1], 2, 1000, [(0, 3), (1, 2)]),
    # Order of the input does not matter, sizes do: the largest (table 2) first.
    ([5, 7, 9], 3, 9, [(2,), (1,), (0,)]),
])
def test_greedy_hand_checked(table_bytes, num_gpus, memory, expected):
    plan = greedy(table_bytes, num_gpus, memory)
    assert [plan.groups(gpu)[0].lookups for gpu in range(num_gpus)] == expected
    assert plan.num_groups == 1 and plan.groups(0)[0].strategy == "mp"


@pytest.mark.parametrize("table_bytes, num_gpus, memory, message", [
    ([60, 60, 60], 2, 100, r"^table 2 \(60 bytes\) fits on no GPU: .* GPU 0, has 40 of 100 bytes free"),
    ([200], 4, 100, r"^table 0 \(200 bytes\) fits on no GPU"),
])
def test_greedy_does_not_fit(table_bytes, num_gpus, memory, message):
    with pytest.raises(ValueError, match=message):
        greedy(table_bytes, num_gpus, memory)


@pytest.mark.parametrize("call, message", [
    (lambda: dp_and_localized([10, 0], 2), r"table 1: table size must be a positive integer, got 0"),
    (lambda: dp_and_localized([10], 0), r"num_gpus must be a positive integer, got 0"),
    (lambda: dp_and_localized([10], 1, dp_threshold=-1), r"dp_threshold must be a non-negative number"),
    (lambda: distributed([], 2), r"no tables"),
    (lambda: distributed([1.5], 2), r"table 0: table size must be a positive integer"),
    (lambda: greedy([10, -3], 2, 100), r"table 1: table bytes must be a positive integer, got -3"),
    (lambda: greedy([10], 2, 0), r"memory_per_gpu must be a positive integer"),
])
def test_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=20), st.integers(1, 6), st.integers(1, 400))
def test_greedy_invariants(table_bytes, num_gpus, memory):
    try:
        plan = greedy(table_bytes, num_gpus, memory)
    except ValueError as error:
        assert "fits on no GPU" in str(error)
        return
    plan.validate(world_size=num_gpus, num_lookups=len(table_bytes))
    for gpu in range(num_gpus):
        tables = plan.groups(gpu)[0].lookups
        assert len(tables) <= math.ceil(len(table_bytes) / num_gpus)
        assert sum(table_bytes[t] for t in tables) <= memory
