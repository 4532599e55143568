"""``dist_type`` on 2 gloo ranks: each id lands on the rank its placement function
names (computed by ``placement_reference``), sharded tables train like unsharded
ones, and checkpoints carry the placement (one spawn, ``SharedSpawns``)."""

import pytest

from dynamicemb_testing import placement_workers
from dynamicemb_testing.dist_utils import SharedSpawns

CASES = [("roundrobin", True), ("hash_roundrobin", False), ("roundrobin", False)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    spawns = SharedSpawns(str(tmp_path_factory.mktemp("placement")))
    spawns.run(2, [(f"train-{d}-{dedup}", placement_workers.sharded_trains_like_unsharded,
                    (d, dedup)) for d, dedup in CASES]
               + [("checkpoints", placement_workers.checkpoints_across_placements,
                   (str(tmp_path_factory.mktemp("ckpt")),))])
    return spawns


@pytest.mark.parametrize("dist_type, dedup", CASES)
def test_rows_land_where_dist_type_names_and_train_like_unsharded(two_ranks, dist_type, dedup):
    two_ranks.check(f"train-{dist_type}-{dedup}")


def test_checkpoints_record_and_reshard_the_placement(two_ranks):
    two_ranks.check("checkpoints")
