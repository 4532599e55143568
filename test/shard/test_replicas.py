"""Hot-row replicas (``DynamicEmbTableOptions.replicas``, ``refresh_replicas``) under
DMP on 2, 3 and 4 gloo ranks, EC and EBC: outputs and trained rows equal training
without replicas (bit for bit with dedup; ``replica_workers.ROUNDING`` without),
fewer ids cross the all-to-all, checkpoints' rows are owner rows only; the option's
refusals."""

import pytest
import torch
from torchrec.distributed.types import ParameterSharding

from dynamicemb import DynamicEmbTableOptions
from dynamicemb.planner import to_dynamic_sharding
from dynamicemb.shard.replicas import check_replica_plan
from dynamicemb_testing import replica_workers
from dynamicemb_testing.dist_utils import SharedSpawns

# (optimizer, dedup, collection)
TWO_RANKS = [("rowwise_adagrad", True, "ec"), ("adam", True, "ec"), ("rowwise_adagrad", False, "ec"),
             ("rowwise_adagrad", True, "ebc")]


@pytest.fixture(scope="module")
def spawns(tmp_path_factory):
    spawns = SharedSpawns(str(tmp_path_factory.mktemp("replicas")))
    spawns.run(2, [(f"train-{o}-{d}-{c}", replica_workers.replicas_train_like_no_replicas, (o, d, 6, c))
                   for o, d, c in TWO_RANKS]
               + [("eval", replica_workers.eval_and_refusals, ()),
                  ("checkpoint", replica_workers.checkpoints_hold_owner_rows,
                   (str(tmp_path_factory.mktemp("ckpt")),))])
    spawns.run(3, [("train-3-ranks", replica_workers.replicas_train_like_no_replicas,
                    ("adam", True))])
    spawns.run(4, [("train-4-ranks", replica_workers.replicas_train_like_no_replicas,
                    ("rowwise_adagrad", True)),
                   ("train-4-ranks-ebc", replica_workers.replicas_train_like_no_replicas,
                    ("adam", True, 6, "ebc"))])
    return spawns


@pytest.mark.parametrize("optimizer, dedup, collection", TWO_RANKS)
def test_replicas_train_like_no_replicas_on_two_ranks(spawns, optimizer, dedup, collection):
    spawns.check(f"train-{optimizer}-{dedup}-{collection}")


@pytest.mark.parametrize("case", ["train-3-ranks", "train-4-ranks", "train-4-ranks-ebc"])
def test_replicas_train_like_no_replicas_on_more_ranks(spawns, case):
    spawns.check(case)


def test_eval_with_replicas_and_refused_refreshes(spawns):
    spawns.check("eval")


def test_checkpoints_hold_owner_rows_only(spawns):
    spawns.check("checkpoint")


@pytest.mark.parametrize("replicas", [-1, 1.5, 1.0, True, "8", None])
def test_bad_replicas_option_is_refused(replicas):
    with pytest.raises(ValueError, match="replicas"):
        DynamicEmbTableOptions(dim=8, replicas=replicas)


@pytest.mark.parametrize("replicas", [0, 0.0, 3, 0.01])
def test_good_replicas_option(replicas):
    assert DynamicEmbTableOptions(dim=8, replicas=replicas).replicas == replicas


def _sharding(sharding_type: str, replicas) -> ParameterSharding:
    plain = ParameterSharding(sharding_type=sharding_type, compute_kernel="fused", ranks=[0, 1])
    return to_dynamic_sharding(plain, DynamicEmbTableOptions(dim=8, replicas=replicas))


def test_replicas_are_refused_for_tables_that_are_not_row_wise():
    check_replica_plan({"t": _sharding("row_wise", 4)})
    check_replica_plan({"t": _sharding("table_wise", 0)})
    with pytest.raises(ValueError, match="row_wise"):
        check_replica_plan({"t": _sharding("table_wise", 4)})
