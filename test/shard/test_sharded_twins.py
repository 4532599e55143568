"""Dynamic tables under TorchRec DMP (2 gloo ranks) against native TorchRec tables."""

import pytest

from dist_utils import run_distributed
import workers


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_dynamic_tables_train_like_native_tables(optimizer):
    run_distributed(workers.twin_models, 2, optimizer)


def test_debug_rows_and_dedup_counters():
    run_distributed(workers.debug_init_and_dedup, 2)
