"""The planner counts dynamic tables' hash-table bytes and emits dynamic shardings."""

import pickle

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, data_parallel
from torch import nn

from dynamicemb import DynamicEmbTableOptions
from dynamicemb.table import ScoredHashTable
from dynamicemb.planner import (
    DynamicEmbeddingShardingPlanner,
    DynamicEmbParameterConstraints,
    DynamicEmbParameterSharding,
    dynamic_table_bytes,
    external_table_bytes,
    to_dynamic_sharding,
)
from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder

MiB = 1 << 20
ROWS, DIM = 1 << 20, 4


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        meta = torch.device("meta")
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name="big", num_embeddings=ROWS, embedding_dim=DIM, feature_names=["f"]),
            EmbeddingConfig(name="small", num_embeddings=1000, embedding_dim=DIM, feature_names=["g"])], device=meta)
        self.ebc = EmbeddingBagCollection(tables=[
            EmbeddingBagConfig(name="bag", num_embeddings=1000, embedding_dim=DIM, feature_names=["h"])], device=meta)


def _constraints(sharding_types=("row_wise",)):
    return {
        "big": DynamicEmbParameterConstraints(
            use_dynamicemb=True, sharding_types=list(sharding_types),
            dynamicemb_options=DynamicEmbTableOptions(dim=DIM, max_capacity=ROWS)),
        "small": ParameterConstraints(compute_kernels=["fused"]),
        "bag": ParameterConstraints(compute_kernels=["fused"]),
    }


def _topology(ddr_cap):
    return Topology(world_size=2, local_world_size=2, compute_device="cpu", ddr_cap=ddr_cap)


SHARDERS = [DynamicEmbeddingCollectionSharder(), DynamicEmbeddingBagCollectionSharder()]


@pytest.mark.parametrize("sharding_type", ["row_wise", "table_wise"])
def test_plan_marks_dynamic_tables_and_pickles(sharding_type):
    planner = DynamicEmbeddingShardingPlanner(_topology(256 * MiB), batch_size=64,
                                              constraints=_constraints([sharding_type]))
    plan = pickle.loads(pickle.dumps(planner.plan(Model(), SHARDERS)))
    big = plan.plan["ec"]["big"]
    assert isinstance(big, DynamicEmbParameterSharding)
    assert big.sharding_type == sharding_type and big.compute_kernel == "customized_kernel"
    assert big.dynamicemb_options.dim == DIM
    for module, name in (("ec", "small"), ("ebc", "bag")):
        sharding = plan.plan[module][name]
        assert not isinstance(sharding, DynamicEmbParameterSharding) and sharding.compute_kernel == "fused"


def test_storage_estimate_charges_the_hash_table():
    planner = DynamicEmbeddingShardingPlanner(_topology(256 * MiB), batch_size=64, constraints=_constraints())
    options = [o for o in planner._enumerator.enumerate(Model(), SHARDERS) if o.name == "big"]
    assert options and all(o.compute_kernel == "customized_kernel" for o in options)
    rows = options[0].shards[0].size[0]
    options_big = _constraints()["big"].dynamicemb_options
    device, host = dynamic_table_bytes(options_big, rows)
    # What the planner charges is what the table itself holds at that capacity.
    table = ScoredHashTable(capacity=rows, bucket_capacity=options_big.bucket_capacity,
                            value_dim=DIM)
    assert device == sum(table.memory_bytes().values()) and host == 0
    dense = rows * DIM * 4
    for shard in options[0].shards:  # CPU topology: device bytes are DDR, plus I/O buffers
        assert shard.storage.hbm == 0
        assert device <= shard.storage.ddr < device + dense


def test_rows_in_an_external_store_are_charged_to_the_third_tier(tmp_path):
    host_rows = 1 << 12
    constraints = _constraints()
    constraints["big"].dynamicemb_options = DynamicEmbTableOptions(
        dim=DIM, max_capacity=ROWS, external_storage=str(tmp_path),
        local_host_for_values=host_rows * DIM * 4)
    planner = DynamicEmbeddingShardingPlanner(_topology(256 * MiB), batch_size=64,
                                              constraints=constraints)
    options = [o for o in planner._enumerator.enumerate(Model(), SHARDERS) if o.name == "big"]
    rows = options[0].shards[0].size[0]
    table_options = constraints["big"].dynamicemb_options
    device, host = dynamic_table_bytes(table_options, rows)
    table = ScoredHashTable(capacity=host_rows, bucket_capacity=128, value_dim=DIM)
    assert device == sum(table.memory_bytes().values()) and host == 0  # the budget only
    below = external_table_bytes(table_options, rows)
    assert below == (rows - host_rows) * (DIM * 4 + 8)
    for shard in options[0].shards:
        assert shard.storage.ssd >= below and device <= shard.storage.ddr


def test_topology_too_small_for_the_hash_table_raises():
    # Per rank: 2^19 rows; dense 8 MiB, hash table 2^19 x (16 + 19.25) bytes = 17.6 MiB.
    # 12 MiB per rank fits TorchRec's dense estimate but not the hash table.
    constraints = _constraints()
    DynamicEmbeddingShardingPlanner(_topology(32 * MiB), batch_size=64, constraints=constraints).plan(Model(), SHARDERS)
    dense = {"big": ParameterConstraints(sharding_types=["row_wise"], compute_kernels=["fused"]),
             "small": constraints["small"], "bag": constraints["bag"]}
    EmbeddingShardingPlanner(_topology(12 * MiB), batch_size=64, constraints=dense).plan(Model(), SHARDERS)
    with pytest.raises(PlannerError):
        DynamicEmbeddingShardingPlanner(_topology(12 * MiB), batch_size=64, constraints=constraints).plan(
            Model(), SHARDERS)


def test_data_parallel_dynamic_tables_are_refused():
    with pytest.raises(ValueError, match="data_parallel"):
        DynamicEmbParameterConstraints(use_dynamicemb=True, sharding_types=["data_parallel"],
                                       dynamicemb_options=DynamicEmbTableOptions(dim=DIM, max_capacity=8))
    module_plan = construct_module_sharding_plan(
        Model().ec, {"big": data_parallel(), "small": data_parallel()}, local_size=2, world_size=2,
        device_type="cpu")
    with pytest.raises(ValueError, match="data_parallel"):
        to_dynamic_sharding(module_plan["big"], DynamicEmbTableOptions(dim=DIM, max_capacity=8))


def _one_rank_gloo(tmp_path):
    import torch.distributed as dist  # noqa: PLC0415

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)


def test_planner_fills_unset_dim_and_capacity_and_dmp_builds(tmp_path):
    """EC and EBC dynamic tables with dim/max_capacity left unset: the plan carries the
    configs' values, the user's constraints are untouched, and DMP builds tables of that
    dim on one gloo rank (global capacity = num_embeddings, as for set options)."""
    import torch.distributed as dist  # noqa: PLC0415
    from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: PLC0415

    from dynamicemb.shard import get_dynamic_tables  # noqa: PLC0415

    model = nn.Module()
    model.ec = EmbeddingCollection(tables=[EmbeddingConfig(
        name="seq", num_embeddings=300, embedding_dim=8, feature_names=["s"])], device=torch.device("meta"))
    model.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="pooled", num_embeddings=500, embedding_dim=4, feature_names=["p"])], device=torch.device("meta"))
    unset = {name: DynamicEmbParameterConstraints(use_dynamicemb=True, sharding_types=["row_wise"],
                                                  dynamicemb_options=DynamicEmbTableOptions(init_capacity=64))
             for name in ("seq", "pooled")}
    topology = Topology(world_size=1, local_world_size=1, compute_device="cpu")
    _one_rank_gloo(tmp_path)
    try:
        plan = DynamicEmbeddingShardingPlanner(topology, batch_size=8, constraints=unset).collective_plan(
            model, SHARDERS, dist.GroupMember.WORLD)
        for module, name, dim, rows in (("ec", "seq", 8, 300), ("ebc", "pooled", 4, 500)):
            options = plan.plan[module][name].dynamicemb_options
            assert (options.dim, options.max_capacity, options.init_capacity) == (dim, rows, 64), name
            assert unset[name].dynamicemb_options.dim is None  # the caller's constraints unchanged
        dmp = DistributedModelParallel(model, plan=plan, sharders=SHARDERS, device=torch.device("cpu"))
        tables = get_dynamic_tables(dmp)
        for name, dim, rows in (("seq", 8, 300), ("pooled", 4, 500)):
            options = tables[name].table_options[tables[name].table_names.index(name)]
            assert (options.dim, options.max_capacity) == (dim, rows), name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("field, value, config_value",
                         [("dim", 16, DIM), ("max_capacity", 2 * ROWS, ROWS)])
def test_planner_refuses_options_that_conflict_with_the_config(field, value, config_value):
    options = dict(dim=DIM, max_capacity=ROWS)
    options[field] = value
    constraints = {**_constraints(), "big": DynamicEmbParameterConstraints(
        use_dynamicemb=True, sharding_types=["row_wise"], dynamicemb_options=DynamicEmbTableOptions(**options))}
    planner = DynamicEmbeddingShardingPlanner(_topology(256 * MiB), batch_size=64, constraints=constraints)
    with pytest.raises(ValueError, match=rf"'big'.*{field}={value}.*={config_value}"):
        planner.plan(Model(), SHARDERS)


def test_options_without_dim_are_refused_outside_the_planner():
    from dynamicemb import BatchedDynamicEmbeddingTables  # noqa: PLC0415

    with pytest.raises(ValueError, match="'items'.*needs dim"):
        BatchedDynamicEmbeddingTables([DynamicEmbTableOptions(max_capacity=64)], table_names=["items"])
    with pytest.raises(ValueError, match="'t0'.*needs dim and max_capacity"):
        BatchedDynamicEmbeddingTables([DynamicEmbTableOptions()])
