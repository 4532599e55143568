"""Upstream's planner calls: ``DynamicEmbeddingShardingPlanner(eb_configs, topology,
...)`` with its other keywords and a ``DynamicEmbeddingEnumerator``, cross-checked
against the model; fused params the dynamic kernels cannot honour stop the plan."""

import dataclasses
import math
import pickle

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import DataType, EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.embedding_types import ShardedEmbeddingTable
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.planner.types import CacheParams
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.types import ShardedTensorMetadata, ShardMetadata

from dynamicemb import DynamicEmbTableOptions
from dynamicemb.planner import (
    DynamicEmbeddingEnumerator,
    DynamicEmbeddingShardingPlanner,
    DynamicEmbParameterConstraints,
    DynamicEmbParameterSharding,
)
from dynamicemb.planner.estimators import dynamic_table_bytes
from dynamicemb.shard import DynamicEmbeddingCollectionSharder
from dynamicemb.shard.kernel import _rank_options

ROWS, DIM = 4096, 8


def _configs(rows=ROWS, dim=DIM, data_type=DataType.FP32):
    return [EmbeddingConfig(name="user", num_embeddings=rows, embedding_dim=dim, feature_names=["u"],
                            data_type=data_type),
            EmbeddingConfig(name="age", num_embeddings=100, embedding_dim=DIM, feature_names=["a"])]


class Model(nn.Module):
    def __init__(self, configs=None):
        super().__init__()
        self.embedding_module = EmbeddingCollection(tables=configs or _configs(),
                                                    device=torch.device("meta"))


def _constraints():
    return {"user": DynamicEmbParameterConstraints(
        use_dynamicemb=True, sharding_types=["row_wise"],
        dynamicemb_options=DynamicEmbTableOptions(global_hbm_for_values=1 << 16)),
        "age": ParameterConstraints(compute_kernels=["fused"])}


TOPOLOGY = Topology(world_size=2, local_world_size=2, compute_device="cpu")


def _sharders(**fused):
    return [DynamicEmbeddingCollectionSharder(fused_params={"optimizer": EmbOptimType.ADAM, **fused})]


def _plan(planner, model=None, **fused):
    return planner.plan(model or Model(), _sharders(**fused))


def test_upstream_call_form_plans_like_ours():
    """eb_configs first, TorchRec's positional order after it, upstream's keywords and
    enumerator: the same plan as the plain call."""
    constraints = _constraints()
    enumerator = DynamicEmbeddingEnumerator(topology=TOPOLOGY, constraints=constraints)
    upstream = DynamicEmbeddingShardingPlanner(
        _configs(), TOPOLOGY, 32, enumerator, HeuristicalStorageReservation(percentage=0.05),
        constraints=constraints, debug=True)
    plain = DynamicEmbeddingShardingPlanner(TOPOLOGY, batch_size=32, constraints=_constraints())
    keyword = DynamicEmbeddingShardingPlanner(eb_configs=_configs(), topology=TOPOLOGY,
                                              batch_size=32, constraints=_constraints())
    plans = [pickle.loads(pickle.dumps(_plan(p))) for p in (upstream, plain, keyword)]
    user = [p.plan["embedding_module"]["user"] for p in plans]
    assert all(isinstance(u, DynamicEmbParameterSharding) for u in user)
    assert user[0] == user[1] == user[2]
    assert user[0].dynamicemb_options.max_capacity == ROWS  # the global capacity
    assert user[0].sharding_type == "row_wise" and plans[0].plan["embedding_module"]["age"] \
        .compute_kernel == "fused"


@pytest.mark.parametrize("field,value", [("embedding_dim", 16), ("num_embeddings", 8),
                                         ("data_type", DataType.FP16), ("name", "other")])
def test_eb_configs_are_cross_checked_with_the_model(field, value):
    configs = _configs()
    configs[0] = dataclasses.replace(configs[0], **{field: value})
    planner = DynamicEmbeddingShardingPlanner(configs, TOPOLOGY, constraints=_constraints())
    with pytest.raises(ValueError, match="eb_configs"):
        _plan(planner)
    with pytest.raises(ValueError, match="unique"):
        DynamicEmbeddingShardingPlanner(_configs() + _configs()[:1], TOPOLOGY)
    with pytest.raises(TypeError, match="eb_configs given twice"):
        DynamicEmbeddingShardingPlanner(_configs(), TOPOLOGY, eb_configs=_configs())
    with pytest.raises(TypeError, match="topology given twice"):
        DynamicEmbeddingShardingPlanner(_configs(), TOPOLOGY, topology=TOPOLOGY)


@pytest.mark.parametrize("data_type,dtype", [(DataType.FP16, torch.float16),
                                             (DataType.BF16, torch.bfloat16)])
def test_a_16_bit_config_plans_a_16_bit_dynamic_table(data_type, dtype):
    """A config's FP16/BF16 ``data_type`` is the dynamic table's ``embedding_dtype``, and
    the storage estimate counts its 2-byte elements."""
    def plan_of(data_type):
        model = Model(_configs(data_type=data_type))
        plan = _plan(DynamicEmbeddingShardingPlanner(TOPOLOGY, constraints=_constraints()), model)
        return plan.plan["embedding_module"]["user"]
    half, full = plan_of(data_type), plan_of(DataType.FP32)
    assert half.dynamicemb_options.embedding_dtype == dtype
    assert full.dynamicemb_options.row_dtype == torch.float32
    # what the planner's storage estimate counts: 2-byte elements, float32 state
    sizes = [dynamic_table_bytes(p.dynamicemb_options, ROWS // 2)[0] for p in (half, full)]
    assert sizes[0] < 0.7 * sizes[1], sizes
    constraints = _constraints()
    constraints["user"].dynamicemb_options = DynamicEmbTableOptions(
        global_hbm_for_values=1 << 16, embedding_dtype=torch.float32)
    with pytest.raises(ValueError, match=f"embedding_dtype=torch.float32 but data_type="
                                         f"{data_type.name}"):
        _plan(DynamicEmbeddingShardingPlanner(TOPOLOGY, constraints=constraints),
              Model(_configs(data_type=data_type)))
    # a config's FP32 is its default: the options' 16 bits stand
    constraints["user"].dynamicemb_options = DynamicEmbTableOptions(
        global_hbm_for_values=1 << 16, embedding_dtype=dtype)
    plan = _plan(DynamicEmbeddingShardingPlanner(TOPOLOGY, constraints=constraints), Model())
    assert plan.plan["embedding_module"]["user"].dynamicemb_options.embedding_dtype == dtype


def test_another_data_type_of_a_dynamic_table_is_refused():
    model = Model(_configs(data_type=DataType.INT8))
    planner = DynamicEmbeddingShardingPlanner(TOPOLOGY, constraints=_constraints())
    with pytest.raises(ValueError, match="data_type=INT8"):
        _plan(planner, model)


def test_enumerator_must_be_dynamic():
    with pytest.raises(ValueError, match="DynamicEmbeddingEnumerator"):
        DynamicEmbeddingShardingPlanner(TOPOLOGY, constraints=_constraints(), enumerator=EmbeddingEnumerator(
            topology=TOPOLOGY, batch_size=32, constraints=_constraints()))


@pytest.mark.parametrize("name,value", [("max_norm", 1.0), ("cache_load_factor", 0.5),
                                        ("weight_decay_mode", 3), ("bogus", 1)])
def test_fused_params_dynamic_kernels_cannot_honour_stop_the_plan(name, value):
    planner = DynamicEmbeddingShardingPlanner(TOPOLOGY, constraints=_constraints())
    with pytest.raises((ValueError, TypeError), match=name if name != "weight_decay_mode" else "COUNTER"):
        _plan(planner, **{name: value})
    _plan(planner, weight_decay=0.1, gradient_clipping=True, initial_accumulator_value=0.1,
          prefetch_pipeline=True)


def _sharded_table(rows_per_rank: int, world: int) -> ShardedEmbeddingTable:
    shards = [ShardMetadata(shard_offsets=[r * rows_per_rank, 0], shard_sizes=[rows_per_rank, DIM],
                            placement=f"rank:{r}/cpu") for r in range(world)]
    return ShardedEmbeddingTable(
        num_embeddings=rows_per_rank * world, embedding_dim=DIM, name="user", feature_names=["u"],
        embedding_names=["u"], local_rows=rows_per_rank, local_cols=DIM,
        global_metadata=ShardedTensorMetadata(shards_metadata=shards))


def test_per_rank_meaning_of_capacities_and_budgets():
    """init_capacity is per rank (upstream's), capped to the rank's capacity with a
    warning; max_capacity becomes the rank's share of num_embeddings;
    global_hbm_for_values becomes ceil(global / ranks) per rank."""
    table = _sharded_table(ROWS // 2, 2)
    options = _rank_options(DynamicEmbTableOptions(init_capacity=256, global_hbm_for_values=1001),
                            table)
    assert (options.init_capacity, options.max_capacity) == (256, ROWS // 2)
    assert (options.local_hbm_for_values, options.global_hbm_for_values) == (math.ceil(1001 / 2), None)
    with pytest.warns(UserWarning, match="init_capacity"):
        capped = _rank_options(DynamicEmbTableOptions(init_capacity=ROWS), table)
    assert capped.init_capacity == ROWS // 2
    local = _rank_options(DynamicEmbTableOptions(local_hbm_for_values=640), table)
    assert local.local_hbm_for_values == 640


def test_constraints_default_to_default_options():
    """Upstream's ``DynamicEmbParameterConstraints(use_dynamicemb=True)`` without options."""
    constraints = {"user": DynamicEmbParameterConstraints(use_dynamicemb=True),
                   "age": ParameterConstraints(compute_kernels=["fused"])}
    plan = _plan(DynamicEmbeddingShardingPlanner(TOPOLOGY, constraints=constraints))
    options = plan.plan["embedding_module"]["user"].dynamicemb_options
    assert (options.dim, options.max_capacity) == (DIM, ROWS)
    assert dataclasses.replace(options, dim=None, max_capacity=None) == DynamicEmbTableOptions()


@pytest.mark.parametrize("field,value,refused", [
    ("cache_params", CacheParams(load_factor=0.5), "cache_load_factor"),
    ("cache_params", CacheParams(precision=DataType.FP16), "cache_precision"),
    ("output_dtype", DataType.INT8, "output_dtype")])
def test_table_params_of_a_dynamic_constraint_stop_the_plan(field, value, refused):
    """What TorchRec adds to a table's kernel from its constraint is checked by ``plan``
    (not first when DMP builds the kernel); ``enforce_hbm`` is accepted (upstream's
    planner sets it)."""
    constraints = _constraints()
    constraints["user"] = dataclasses.replace(constraints["user"], **{field: value})
    with pytest.raises(ValueError, match=f"'user'.*{refused}"):
        _plan(DynamicEmbeddingShardingPlanner(TOPOLOGY, constraints=constraints))
    constraints["user"] = dataclasses.replace(_constraints()["user"], enforce_hbm=True)
    plan = _plan(DynamicEmbeddingShardingPlanner(TOPOLOGY, constraints=constraints))
    assert plan.plan["embedding_module"]["user"].enforce_hbm is True
