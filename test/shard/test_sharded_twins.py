"""Dynamic tables under TorchRec DMP (2 gloo ranks) against native TorchRec tables."""

import pytest

from dynamicemb_testing.dist_utils import run_distributed
from dynamicemb_testing import shard_workers as workers


@pytest.mark.parametrize("optimizer, dedup", [("sgd", True), ("adagrad", True), ("rowwise_adagrad", True),
                                              ("sgd", False)])
def test_dynamic_tables_train_like_native_tables(optimizer, dedup):
    run_distributed(workers.twin_models, 2, optimizer, 10, dedup)


def test_debug_rows_dedup_counters_and_planned_model():
    run_distributed(workers.debug_init_dedup_and_planner, 2)


def test_single_rank():
    run_distributed(workers.twin_models, 1, "sgd", 2)


def test_data_parallel_static_table_beside_dynamic_tables():
    run_distributed(workers.data_parallel_beside_dynamic, 2)
