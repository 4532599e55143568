"""Dump and load of DMP models on gloo ranks: exact round trips, and resharding
(world size and sharding type) followed by training equal to an uninterrupted run.

Every load runs in processes other than those that saved its checkpoint. The rank
bodies share four spawns (``SharedSpawns``; a spawn costs 5-15 s of imports on 2 cores,
the 13 separate ones took 125 s): 2 ranks save, then 1 rank and 4 ranks each load the
2-rank checkpoint and save their own, then 2 ranks load those. Each test checks its
own bodies' outcomes on every rank.
"""

import pytest

from dynamicemb_testing import checkpoint_workers as ckpt_workers
from dynamicemb_testing import recipe_workers
from dynamicemb_testing.dist_utils import SharedSpawns

# (saved world size, loading world size, loading sharding of table "rw")
RESHARDINGS = {
    2: [(1, ["row_wise", "table_wise"]), (4, ["row_wise"])],
    1: [(2, ["row_wise"])],
    4: [(2, ["row_wise"])],
}


@pytest.fixture(scope="module")
def spawns(tmp_path_factory):
    """The cases of every test here, run; ``save-W``: W ranks save checkpoint ``ckW``
    (and record the uninterrupted run); ``load-W-V``: V ranks load ``ckW``."""
    tmp = tmp_path_factory.mktemp("sharded")
    recipe, recipe_record = str(tmp / "recipe"), str(tmp / "recipe-record.pt")

    def save(world):
        return (f"save-{world}", ckpt_workers.save_then_continue,
                (str(tmp / f"ck{world}"), str(tmp / f"record{world}.pt"), "row_wise"))

    def load(saved, world, kinds, external=None):
        return (f"load-{saved}-{world}" + ("-external" if external else ""), ckpt_workers.load_then_continue,
                (str(tmp / f"ck{saved}"), str(tmp / f"record{saved}.pt"), kinds, False, external))

    runs = SharedSpawns(str(tmp / "outcomes"))
    # the recipe's straight run first, so that it runs in new processes as documented
    runs.run(2, [("recipe-straight", recipe_workers.straight_run, (recipe, recipe_record)),
                 save(2), ("round-trip", ckpt_workers.sharded_round_trip, (str(tmp / "round-trip"),)),
                 ("incremental-gather", ckpt_workers.incremental_dump_gathers_every_rank, ())])
    runs.run(1, [load(2, 1, RESHARDINGS[2][0][1]), load(2, 1, ["row_wise"], str(tmp / "rocks")), save(1)])
    runs.run(4, [load(2, 4, RESHARDINGS[2][1][1]), save(4)])
    # the recipe's resumed run first: "new processes load with the recipe"; then the
    # loads of the checkpoints saved first, so that a failed 1- or 4-rank spawn stops
    # the fewest cases
    runs.run(2, [("recipe-resumed", recipe_workers.resumed_run, (recipe, recipe_record)),
                 load(2, 2, ["row_wise"], str(tmp / "rocks")), load(1, 2, RESHARDINGS[1][0][1]),
                 load(4, 2, RESHARDINGS[4][0][1])])
    return runs


def test_sharded_round_trip_is_exact(spawns):
    spawns.check("round-trip")


def test_module_incremental_dump_gathers_every_rank(spawns):
    spawns.check("incremental-gather")


@pytest.mark.parametrize("saved_world", sorted(RESHARDINGS))
def test_resharding_then_training_equals_the_uninterrupted_run(spawns, saved_world):
    spawns.check(f"save-{saved_world}")
    for world, _ in RESHARDINGS[saved_world]:
        spawns.check(f"load-{saved_world}-{world}")


def test_resharding_into_an_external_tier_equals_the_uninterrupted_run(spawns):
    """Saved by 2 ranks with every row in memory; loaded by 1 and 2 ranks whose "rw"
    keeps 128 rows per rank in host memory and the rest in RocksDB."""
    spawns.check("save-2")
    for world in (1, 2):
        spawns.check(f"load-2-{world}-external")


def test_documented_recipe_resumes_bit_identically(spawns):
    """Train 10 steps, save with the docs' recipe, train 10 more; new processes load
    with the recipe and train the same 10: losses, dense parameters, static rows and
    their fused optimizer state, dynamic rows and the dense Adam state are equal."""
    spawns.check("recipe-straight")
    spawns.check("recipe-resumed")
