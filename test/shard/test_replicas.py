"""Hot-row replicas (``DynamicEmbTableOptions.replicas``, ``refresh_replicas``) under
DMP on 2, 3 and 4 gloo ranks: outputs and trained rows equal training without
replicas (bit for bit with dedup; ``replica_workers.ROUNDING`` without), fewer ids cross the
all-to-all, checkpoints' rows are owner rows only; the option's refusals."""

import pytest
import torch
from torchrec.distributed.types import ParameterSharding

from dynamicemb import DynamicEmbTableOptions
from dynamicemb.planner import to_dynamic_sharding
from dynamicemb.shard.replicas import check_replica_plan
from dynamicemb_testing import replica_workers
from dynamicemb_testing.dist_utils import SharedSpawns

TWO_RANKS = [("rowwise_adagrad", True), ("adam", True), ("rowwise_adagrad", False)]


@pytest.fixture(scope="module")
def spawns(tmp_path_factory):
    spawns = SharedSpawns(str(tmp_path_factory.mktemp("replicas")))
    spawns.run(2, [(f"train-{o}-{d}", replica_workers.replicas_train_like_no_replicas, (o, d))
                   for o, d in TWO_RANKS]
               + [("eval", replica_workers.eval_and_refusals, ()),
                  ("checkpoint", replica_workers.checkpoints_hold_owner_rows,
                   (str(tmp_path_factory.mktemp("ckpt")),))])
    spawns.run(3, [("train-3-ranks", replica_workers.replicas_train_like_no_replicas,
                    ("adam", True))])
    spawns.run(4, [("train-4-ranks", replica_workers.replicas_train_like_no_replicas,
                    ("rowwise_adagrad", True))])
    return spawns


@pytest.mark.parametrize("optimizer, dedup", TWO_RANKS)
def test_replicas_train_like_no_replicas_on_two_ranks(spawns, optimizer, dedup):
    spawns.check(f"train-{optimizer}-{dedup}")


@pytest.mark.parametrize("ranks", [3, 4])
def test_replicas_train_like_no_replicas_on_more_ranks(spawns, ranks):
    spawns.check(f"train-{ranks}-ranks")


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


def test_replicas_are_refused_where_not_built():
    check_replica_plan({"t": _sharding("row_wise", 4)}, pooled=False)
    check_replica_plan({"t": _sharding("table_wise", 0)}, pooled=True)
    with pytest.raises(NotImplementedError, match="EmbeddingCollection tables only"):
        check_replica_plan({"t": _sharding("row_wise", 4)}, pooled=True)
    with pytest.raises(ValueError, match="row_wise"):
        check_replica_plan({"t": _sharding("table_wise", 4)}, pooled=False)
