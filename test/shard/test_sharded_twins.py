"""Dynamic tables under TorchRec DMP (2 gloo ranks) against native TorchRec tables.

The 2-rank bodies share one spawn (``SharedSpawns``: the ranks' imports are most of a
spawn's cost); each test checks its own body's outcome on every rank.
"""

import pytest

from dynamicemb_testing.dist_utils import SharedSpawns, run_distributed
from dynamicemb_testing import shard_workers as workers

TWINS = [("sgd", True), ("adagrad", True), ("rowwise_adagrad", True), ("sgd", False)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    spawns = SharedSpawns(str(tmp_path_factory.mktemp("twins")))
    spawns.run(2, [(f"twins-{optimizer}-{dedup}", workers.twin_models, (optimizer, 10, dedup))
                   for optimizer, dedup in TWINS]
               + [("debug-planner", workers.debug_init_dedup_and_planner, ()),
                  ("data-parallel", workers.data_parallel_beside_dynamic, ())])
    return spawns


@pytest.mark.parametrize("optimizer, dedup", TWINS)
def test_dynamic_tables_train_like_native_tables(two_ranks, optimizer, dedup):
    two_ranks.check(f"twins-{optimizer}-{dedup}")


def test_debug_rows_dedup_counters_and_planned_model(two_ranks):
    two_ranks.check("debug-planner")


def test_single_rank():
    run_distributed(workers.twin_models, 1, "sgd", 2)


def test_data_parallel_static_table_beside_dynamic_tables(two_ranks):
    two_ranks.check("data-parallel")
