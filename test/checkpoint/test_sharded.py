"""Dump and load of DMP models on gloo ranks: exact round trips, and resharding
(world size and sharding type) followed by training equal to an uninterrupted run."""

import pytest

from dynamicemb_testing import checkpoint_workers as ckpt_workers
from dynamicemb_testing.dist_utils import run_distributed


def test_sharded_round_trip_is_exact(tmp_path):
    run_distributed(ckpt_workers.sharded_round_trip, 2, str(tmp_path))


# (saved world size, loading world size, loading sharding of table "rw")
RESHARDINGS = {
    2: [(1, ["row_wise", "table_wise"]), (4, ["row_wise"])],
    1: [(2, ["row_wise"])],
    4: [(2, ["row_wise"])],
}


@pytest.mark.parametrize("saved_world", sorted(RESHARDINGS))
def test_resharding_then_training_equals_the_uninterrupted_run(tmp_path, saved_world):
    ckpt, record = str(tmp_path / "ck"), str(tmp_path / "record.pt")
    run_distributed(ckpt_workers.save_then_continue, saved_world, ckpt, record, "row_wise")
    for world, kinds in RESHARDINGS[saved_world]:
        run_distributed(ckpt_workers.load_then_continue, world, ckpt, record, kinds, False)


def test_resharding_into_an_external_tier_equals_the_uninterrupted_run(tmp_path):
    """Saved by 2 ranks with every row in memory; loaded by 1 and 2 ranks whose "rw"
    keeps 128 rows per rank in host memory and the rest in RocksDB."""
    ckpt, record = str(tmp_path / "ck"), str(tmp_path / "record.pt")
    run_distributed(ckpt_workers.save_then_continue, 2, ckpt, record, "row_wise")
    for world in (1, 2):
        run_distributed(ckpt_workers.load_then_continue, world, ckpt, record, ["row_wise"],
                        False, str(tmp_path / "rocks"))


def test_documented_recipe_resumes_bit_identically(tmp_path):
    """Train 10 steps, save with the docs' recipe, train 10 more; new processes load
    with the recipe and train the same 10: losses, dense parameters, static rows and
    their fused optimizer state, dynamic rows and the dense Adam state are equal."""
    from dynamicemb_testing import recipe_workers

    path, record = str(tmp_path / "ck"), str(tmp_path / "record.pt")
    run_distributed(recipe_workers.straight_run, 2, path, record)
    run_distributed(recipe_workers.resumed_run, 2, path, record)
