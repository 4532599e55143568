"""HugeCTR plan files -> TorchRec ShardingPlans and back (dynamicemb.plan.translate)."""

import json

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan

from dynamicemb import DynamicEmbTableOptions
from dynamicemb.plan import from_sharding_plan, load_plan, model_lookups, to_sharding_plan
from dynamicemb.plan.generators import distributed, dp_and_localized
from dynamicemb.planner import DynamicEmbParameterConstraints
from dynamicemb.planner.types import DynamicEmbParameterSharding

from dynamicemb_testing import plan_workers
from dynamicemb_testing.plan_testing import CRITEO_SIZES, EXAMPLE_MIXED
from dynamicemb_testing.dist_utils import run_distributed

CRITEO = CRITEO_SIZES
# The seed's second 2-GPU example: lookups 0, 2 table-wise on GPU 0, lookups 1, 3 (one
# table) on GPU 1, lookup 4 data parallel.
SEED_EXAMPLE = json.loads(EXAMPLE_MIXED)


class Bags(nn.Module):
    def __init__(self, tables):
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def seed_model() -> Bags:
    """4 tables, 5 lookups; lookups 1 and 3 use table 1."""
    features = {"t0": ["l0"], "t1": ["l1", "l3"], "t2": ["l2"], "t3": ["l4"]}
    return Bags([EmbeddingBagConfig(name=n, num_embeddings=100, embedding_dim=8, feature_names=f)
                 for n, f in features.items()])


def criteo_model(dim: int = 16) -> Bags:
    return Bags([EmbeddingBagConfig(name=f"t{i}", num_embeddings=n, embedding_dim=dim,
                                    feature_names=[f"cat_{i}"]) for i, n in enumerate(CRITEO)])


def placement(plan: ShardingPlan, table: str):
    sharding = plan.plan["ebc"][table]
    return sharding.sharding_type, list(sharding.ranks)


def test_seed_example_translates():
    model = seed_model()
    lookups = ["l0", "l1", "l2", "l3", "l4"]
    plan = to_sharding_plan(SEED_EXAMPLE, model, lookups=lookups)
    assert placement(plan, "t0") == ("table_wise", [0])
    assert placement(plan, "t1") == ("table_wise", [1])
    assert placement(plan, "t2") == ("table_wise", [0])
    assert placement(plan, "t3") == ("data_parallel", [0, 1])
    assert plan.plan["ebc"]["t0"].compute_kernel == "fused"
    assert to_sharding_plan(from_sharding_plan(plan, model, lookups=lookups), model,
                            lookups=lookups) == plan


@pytest.mark.parametrize("local_world_size", ["1", "2"])
def test_cuda_shards_go_to_the_node_local_device(monkeypatch, local_world_size):
    """Without ``local_world_size``, the node size is TorchRec's (``LOCAL_WORLD_SIZE``
    as torchrun sets it): GPU ``rank % LOCAL_WORLD_SIZE`` of the shard's node, never
    a device index past the node's GPUs."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    plan = to_sharding_plan(SEED_EXAMPLE, seed_model(), lookups=["l0", "l1", "l2", "l3", "l4"], device="cuda")
    placed = {(shard.placement.rank(), shard.placement.device())
              for sharding in plan.plan["ebc"].values() if sharding.sharding_spec is not None
              for shard in sharding.sharding_spec.shards}
    assert placed == {(rank, torch.device("cuda", rank % int(local_world_size))) for rank in (0, 1)}


def test_default_lookups_are_the_features_in_module_order():
    names = [(lk.feature, lk.table) for lk in model_lookups(seed_model())]
    assert names == [("l0", "t0"), ("l1", "t1"), ("l3", "t1"), ("l2", "t2"), ("l4", "t3")]


def test_dynamic_tables_get_the_planner_sharding():
    model = seed_model()
    options = DynamicEmbTableOptions(dim=8, max_capacity=100)
    constraints = {"t1": DynamicEmbParameterConstraints(use_dynamicemb=True, dynamicemb_options=options)}
    plan = to_sharding_plan(SEED_EXAMPLE, model, lookups=["l0", "l1", "l2", "l3", "l4"],
                            constraints=constraints)
    sharding = plan.plan["ebc"]["t1"]
    assert isinstance(sharding, DynamicEmbParameterSharding)
    assert sharding.compute_kernel == "customized_kernel" and sharding.dynamicemb_options == options
    assert not isinstance(plan.plan["ebc"]["t0"], DynamicEmbParameterSharding)


def test_dynamic_options_left_unset_come_from_the_table_config():
    constraints = {"t1": DynamicEmbParameterConstraints(use_dynamicemb=True,
                                                        dynamicemb_options=DynamicEmbTableOptions())}
    plan = to_sharding_plan(SEED_EXAMPLE, seed_model(), lookups=["l0", "l1", "l2", "l3", "l4"],
                            constraints=constraints)
    options = plan.plan["ebc"]["t1"].dynamicemb_options
    assert (options.dim, options.max_capacity) == (8, 100)
    conflicting = {"t1": DynamicEmbParameterConstraints(
        use_dynamicemb=True, dynamicemb_options=DynamicEmbTableOptions(dim=16))}
    with pytest.raises(ValueError, match="'t1'.*dim=16.*embedding_dim=8"):
        to_sharding_plan(SEED_EXAMPLE, seed_model(), lookups=["l0", "l1", "l2", "l3", "l4"],
                         constraints=conflicting)


@pytest.mark.parametrize("generator", [dp_and_localized, distributed], ids=lambda g: g.__name__)
def test_criteo_generators_translate_and_round_trip(generator):
    model = criteo_model()
    plan = to_sharding_plan(generator(CRITEO, 8), model)
    kinds = {placement(plan, f"t{i}")[0] for i in range(len(CRITEO))}
    assert kinds == ({"row_wise"} if generator is distributed else {"table_wise", "data_parallel"})
    back = from_sharding_plan(plan, model)
    assert to_sharding_plan(back, model) == plan
    assert to_sharding_plan(load_plan(back.to_json()), model) == plan


def test_dynamic_table_in_a_dp_group_is_refused():
    constraints = {"t3": DynamicEmbParameterConstraints(
        use_dynamicemb=True, dynamicemb_options=DynamicEmbTableOptions(dim=8, max_capacity=100))}
    with pytest.raises(ValueError, match="'t3' is dynamic but placed data parallel"):
        to_sharding_plan(SEED_EXAMPLE, seed_model(), lookups=["l0", "l1", "l2", "l3", "l4"],
                         constraints=constraints)


def test_lookups_of_one_table_placed_differently_are_refused():
    # lookup 1 (l1, table t1) is table-wise on GPU 1, lookup 4 (l3, table t1) data parallel
    with pytest.raises(ValueError, match=r"lookups 1 and 4 use table 't1' but are placed differently"):
        to_sharding_plan(SEED_EXAMPLE, seed_model(), lookups=["l0", "l1", "l2", "l4", "l3"])


def test_unknown_and_ambiguous_lookups_are_refused():
    with pytest.raises(ValueError, match="lookup 2: the model has no feature 'nope'"):
        to_sharding_plan(SEED_EXAMPLE, seed_model(), lookups=["l0", "l1", "nope", "l3", "l4"])
    with pytest.raises(ValueError, match="listed twice"):
        model_lookups(seed_model(), ["l0", "l0"])


def test_row_wise_over_some_ranks_is_refused():
    model = seed_model()
    plan = [[{"local_embedding_list": [0, 1, 2, 3, 4], "table_placement_strategy": "mp",
              "shard_id": 0, "shards_count": 2}] for _ in range(3)]
    plan[2][0] = {"local_embedding_list": [], "table_placement_strategy": "mp"}
    plan[1][0]["shard_id"] = 1
    with pytest.raises(ValueError, match="row-wise over GPUs \\[0, 1\\]"):
        to_sharding_plan(plan, model, lookups=["l0", "l1", "l2", "l3", "l4"])


def test_column_wise_cannot_be_written():
    model = seed_model()
    helpers = {"t0": column_wise(ranks=[0, 1]), **{t: table_wise(rank=0) for t in ("t1", "t2", "t3")}}
    module_plan = construct_module_sharding_plan(
        model.ebc, helpers, local_size=2, world_size=2, device_type="cpu")
    with pytest.raises(ValueError, match="table 't0' is column_wise"):
        from_sharding_plan(ShardingPlan({"ebc": module_plan}), model)


def test_translated_plan_trains_like_the_hand_built_plan():
    """EC and EBC, dynamic row-wise and table-wise, static table-wise and data-parallel
    tables, 2 gloo ranks: same plan, same outputs, losses and rows after 5 steps."""
    run_distributed(plan_workers.translated_plan_trains_like_hand_built, 2, 5)


def test_single_gpu_row_wise_is_written_as_table_wise():
    """Row-wise over one rank is one shard: the file says table-wise, which translates
    back to the same placement on that rank."""
    model = seed_model()
    module_plan = construct_module_sharding_plan(
        model.ebc, {t: row_wise() for t in ("t0", "t1", "t2", "t3")}, local_size=1, world_size=1,
        device_type="cpu")
    back = from_sharding_plan(ShardingPlan({"ebc": module_plan}), model)
    assert {p.kind for p in back.placements().values()} == {"table_wise"}
    plan = to_sharding_plan(back, model)
    assert all(placement(plan, t) == ("table_wise", [0]) for t in ("t0", "t1", "t2", "t3"))
