"""What upstream dynamicemb's own clients and tests import and call, called as they
call it: ``dynamicemb.dump_load``'s walkers, ``export_keys_values(name, device,
batch_size)``, ``dynamicemb.types``, ``dynamicemb.get_planner``, ``dynamicemb.utils``,
``admission_counter`` without ``admit_strategy`` and ``enforce_hbm=True``. Each one
works (checked against a reference) or is refused by name with its replacement."""

import importlib

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbgemmEmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.storage_reservations import HeuristicalStorageReservation
from torchrec.distributed.types import BoundsCheckMode, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import dynamicemb
import dynamicemb.optimizer
from dynamicemb import (
    DynamicEmbInitializerArgs,
    DynamicEmbTableOptions,
    FrequencyAdmissionStrategy,
    KVCounter,
)
from dynamicemb.batched_dynamicemb_tables import BatchedDynamicEmbeddingTablesV2
from dynamicemb.dump_load import find_sharded_modules, get_dynamic_emb_module
from dynamicemb.get_planner import get_planner
from dynamicemb.planner import (
    DynamicEmbeddingEnumerator,
    DynamicEmbeddingShardingPlanner,
    DynamicEmbParameterConstraints,
)
from dynamicemb.shard import DynamicEmbeddingBagCollectionSharder, DynamicEmbeddingCollectionSharder
from dynamicemb.utils import TORCHREC_TYPES

DIM = 4


def _table(**options) -> BatchedDynamicEmbeddingTablesV2:
    init = DynamicEmbInitializerArgs(mode="normal", std_dev=0.1, seed=7)
    return BatchedDynamicEmbeddingTablesV2(
        [DynamicEmbTableOptions(dim=DIM, max_capacity=256, initializer_args=init, **options)],
        table_names=["t0"], pooling_mode=2, learning_rate=0.1)  # upstream's 2: NONE


def _looked_up(module, ids) -> torch.Tensor:
    """Looks ``ids`` up (one id per row, NONE pooling): inserts them, returns the rows."""
    ids = torch.tensor(ids)
    return module(ids, torch.arange(ids.numel() + 1)).detach()


# ------------------------------------------------------------ export_keys_values
def test_export_keys_values_in_upstreams_form():
    """``keys, embeddings = m.export_keys_values(name, device, batch_size)``: every
    stored key once, with the row a lookup returned; any batch size gives the same."""
    module = _table()
    ids = list(range(0, 300, 3))
    rows = dict(zip(ids, _looked_up(module, ids)))
    for call in (lambda: module.export_keys_values("t0", device=torch.device("cpu")),
                 lambda: module.export_keys_values("t0", torch.device("cpu"), batch_size=16),
                 lambda: module.export_keys_values("t0", "cpu", 1)):
        keys, embeddings = call()
        assert keys.dtype == torch.int64 and embeddings.shape == (len(ids), DIM)
        assert sorted(keys.tolist()) == ids
        torch.testing.assert_close(embeddings, torch.stack([rows[k] for k in keys.tolist()]),
                                   rtol=0, atol=0)
    keys, embeddings = _table().export_keys_values("t0", torch.device("cpu"))  # empty table
    assert keys.shape == (0,) and embeddings.shape == (0, DIM)
    assert isinstance(module.export_keys_values("t0"), dynamicemb.ExportedRows)  # ours, unchanged
    # an uncached module: upstream's cache statistics find no cache (its cache is None);
    # HSTU's table warm-up (fill_tables) is absent
    assert module.cache is None and not hasattr(module, "fill_tables")
    assert module.cache_metrics()["t0"].lookups == len(ids)
    with pytest.raises(ValueError, match="batch_size"):
        module.export_keys_values("t0", torch.device("cpu"), batch_size=0)
    with pytest.raises(TypeError, match="iter_keys_values"):
        module.export_keys_values("t0", batch_size=16)
    with pytest.raises(KeyError, match="t9"):
        module.export_keys_values("t9", torch.device("cpu"))


# ----------------------------------------------------------------- admission
def test_admission_counter_without_admit_strategy_admits_every_key():
    """Upstream accepts it and its counter counts nothing: the table is the table
    without a counter (same rows), and no counts are kept."""
    with_counter, plain = _table(admission_counter=KVCounter(capacity=64)), _table()
    ids = [5, 6, 5, 9]
    torch.testing.assert_close(_looked_up(with_counter, ids), _looked_up(plain, ids), rtol=0, atol=0)
    assert with_counter.table_size("t0") == 3
    assert with_counter.export_admission_counters("t0").keys.numel() == 0
    counted = _table(admission_counter=KVCounter(capacity=64),
                     admit_strategy=FrequencyAdmissionStrategy(threshold=2))
    _looked_up(counted, ids)
    assert counted.table_size("t0") == 1  # with admit_strategy it decides, as before


# -------------------------------------------------------------- dynamicemb.types
# upstream's dynamicemb.types name -> this package's object of that name
TYPES_NAMES = {
    "DynamicEmbInitializerArgs": dynamicemb.DynamicEmbInitializerArgs,
    "DynamicEmbInitializerMode": dynamicemb.DynamicEmbInitializerMode,
    "Counter": dynamicemb.Counter,
    "BUCKET_ALIGNMENT": dynamicemb.BUCKET_ALIGNMENT,
    "DEMB_TABLE_ALIGN_SIZE": dynamicemb.DEMB_TABLE_ALIGN_SIZE,
    "KEY_TYPE": torch.int64,
    "EMBEDDING_TYPE": torch.float32,
    "SCORE_TYPE": torch.int64,
    "OPT_STATE_TYPE": torch.float32,
    "MAX_BUCKET_CAPACITY": 2**63 - 1,
}
# upstream's name -> a word of the replacement the refusal names
TYPES_REFUSED = {"MemoryType": "memory_usage",
                 "COUNTER_TYPE": "float64", "torch_dtype_to_np_dtype": "numpy",
                 "Storage": "KVStore", "Cache": "caching", "CopyMode": "caching",
                 "OptionsT": "KVStore", "OptimizerT": "KVStore"}
UTILS_REFUSED = {"torch_to_dyn_emb": "torch dtypes",
                 "tabulate": "format", "assert_tensors_equal": "assert_close"}
CONFIG_REFUSED = {"data_type_to_dyn_emb": "torch dtypes",
                  "dyn_emb_to_torch": "torch dtypes", "torch_to_dyn_emb": "torch dtypes",
                  "data_type_to_dtype": "torchrec.modules.embedding_configs.data_type_to_dtype",
                  "string_to_evict_strategy": "DynamicEmbEvictStrategy"}
REFUSED = ([("dynamicemb.types", n, r) for n, r in TYPES_REFUSED.items()]
           + [("dynamicemb.utils", n, r) for n, r in UTILS_REFUSED.items()]
           + [("dynamicemb.dynamicemb_config", n, r) for n, r in CONFIG_REFUSED.items()]
           + [("dynamicemb", n, r) for n, r in CONFIG_REFUSED.items()]
           + [("dynamicemb.dynamicemb_config", "_sharded_table_bucket_layout",
               "get_sharded_table_capacity")]
           + [("dynamicemb.optimizer", n, "fused_params") for n in (
               "BaseDynamicEmbeddingOptimizer", "SGDDynamicEmbeddingOptimizer")]
           + [("dynamicemb.optimizer", "get_optimizer_ckpt_state_dim", "get_optimizer_state_dim")]
           + [("dynamicemb.batched_dynamicemb_tables", n, "docs/CHECKPOINTS.md") for n in (
               "encode_checkpoint_file_path", "encode_meta_json_file_path")])


def _import(module: str, name: str):
    namespace = {}
    exec(f"from {module} import {name}", namespace)  # the import statement itself
    return namespace[name]


@pytest.mark.parametrize("name", sorted(TYPES_NAMES))
def test_types_names_are_ours(name):
    assert _import("dynamicemb.types", name) is TYPES_NAMES[name] or \
        _import("dynamicemb.types", name) == TYPES_NAMES[name]


def test_types_values_are_the_tables():
    """The dtypes named are those of exported rows; MAX_BUCKET_CAPACITY is one
    bucket per table (checked in test_upstream_api)."""
    from dynamicemb.types import (EMBEDDING_TYPE, KEY_TYPE, MAX_BUCKET_CAPACITY, OPT_STATE_TYPE,
                                  SCORE_TYPE)
    module = _table()
    _looked_up(module, [1, 2])
    rows = module.export_keys_values("t0")
    assert (rows.keys.dtype, rows.embeddings.dtype, rows.scores.dtype,
            rows.optimizer_states.dtype) == (KEY_TYPE, EMBEDDING_TYPE, SCORE_TYPE, OPT_STATE_TYPE)
    assert dynamicemb.MAX_BUCKET_CAPACITY == MAX_BUCKET_CAPACITY
    one_bucket = DynamicEmbTableOptions(dim=DIM, max_capacity=64,
                                        bucket_capacity=MAX_BUCKET_CAPACITY).in_one_bucket()
    assert one_bucket.bucket_capacity == one_bucket.max_capacity == 64


@pytest.mark.parametrize("module,name,replacement", REFUSED, ids=[f"{m}.{n}" for m, n, _ in REFUSED])
def test_upstream_names_not_provided_are_refused_by_name(module, name, replacement):
    with pytest.raises(ImportError, match=rf"{module}\.{name} is upstream.*{replacement}"):
        _import(module, name)
    with pytest.raises(AttributeError):
        getattr(importlib.import_module(module), "no_such_name")


# ------------------------------------------- get_planner, walkers, DMP (one gloo rank)
class SparseArch(nn.Module):
    def __init__(self):
        super().__init__()
        meta = torch.device("meta")
        self.ec = EmbeddingCollection(tables=[
            EmbeddingConfig(name="movies", num_embeddings=1000, embedding_dim=DIM, feature_names=["i"]),
            EmbeddingConfig(name="ages", num_embeddings=50, embedding_dim=DIM, feature_names=["a"])],
            device=meta)
        self.ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
            name="users", num_embeddings=500, embedding_dim=DIM, feature_names=["u"])], device=meta)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.sparse = SparseArch()


OPTIONS = {"movies": DynamicEmbTableOptions(score_strategy=0),
           "users": DynamicEmbTableOptions(global_hbm_for_values=1 << 14)}
FUSED = {"optimizer": dynamicemb.optimizer.EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
SHARDERS = [DynamicEmbeddingCollectionSharder(fused_params=FUSED, use_index_dedup=True),
            DynamicEmbeddingBagCollectionSharder(fused_params=FUSED)]


def _upstream_constraints(topology_configs):
    """The constraints upstream's get_planner writes, ``enforce_hbm=True`` included."""
    constraints = {}
    for config in topology_configs:
        if config.name in OPTIONS:
            constraints[config.name] = DynamicEmbParameterConstraints(
                sharding_types=[ShardingType.ROW_WISE.value], bounds_check_mode=BoundsCheckMode.NONE,
                enforce_hbm=True, use_dynamicemb=True, dynamicemb_options=OPTIONS[config.name])
        else:
            constraints[config.name] = DynamicEmbParameterConstraints(
                sharding_types=[ShardingType.ROW_WISE.value], bounds_check_mode=BoundsCheckMode.NONE,
                use_dynamicemb=False, compute_kernels=["fused", "fused_uvm"])
    return constraints


def _plans(model):
    eb_configs = []  # upstream's clients collect them so (EC: embedding_configs)
    for _, module in model.named_modules():
        if type(module) in TORCHREC_TYPES:
            eb_configs += (module.embedding_configs() if isinstance(module, EmbeddingCollection)
                           else module.embedding_bag_configs())
    assert {c.name for c in eb_configs} == {"movies", "ages", "users"}
    assert TORCHREC_TYPES == {EmbeddingBagCollection, EmbeddingCollection}
    pg = dist.GroupMember.WORLD
    ours = get_planner(eb_configs, set(), OPTIONS, torch.device("cpu"), "native")
    topology = Topology(world_size=1, local_world_size=1, compute_device="cpu")
    constraints = _upstream_constraints(eb_configs)
    theirs = DynamicEmbeddingShardingPlanner(
        eb_configs=eb_configs, topology=topology, constraints=constraints,
        enumerator=DynamicEmbeddingEnumerator(topology=topology, constraints=constraints),
        storage_reservation=HeuristicalStorageReservation(percentage=0.05))
    return ours.collective_plan(model, SHARDERS, pg), theirs.collective_plan(model, SHARDERS, pg)


def _check_plans(ours, theirs):
    for module, table in (("sparse.ec", "movies"), ("sparse.ec", "ages"), ("sparse.ebc", "users")):
        a, b = ours.plan[module][table], theirs.plan[module][table]
        assert (a.sharding_type, a.compute_kernel) == (b.sharding_type, b.compute_kernel), table
        assert a.sharding_type == "row_wise"
        assert getattr(a, "dynamicemb_options", None) == getattr(b, "dynamicemb_options", None)
    assert ours.plan["sparse.ec"]["ages"].compute_kernel == "fused"
    # TorchRec's own table gets FBGEMM's enum for upstream's EmbOptimType name
    assert SHARDERS[0].fused_params["optimizer"] is FbgemmEmbOptimType.EXACT_SGD
    assert theirs.plan["sparse.ec"]["movies"].enforce_hbm is True  # reaches the kernel


def _batch():
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["i", "a", "u"], values=torch.tensor([11, 12, 11, 3, 4, 7, 8, 9]),
        lengths=torch.tensor([2, 1, 1, 1, 2, 1]))


def _check_walkers(dmp):
    found = find_sharded_modules(dmp, "")
    assert [(path, name) for path, name, _ in found] == [("model.sparse.ec", "ec"),
                                                         ("model.sparse.ebc", "ebc")]
    assert [p for p, _, _ in find_sharded_modules(dmp, "top.")] == ["top.model.sparse.ec",
                                                                   "top.model.sparse.ebc"]
    per_collection = [get_dynamic_emb_module(sharded) for _, _, sharded in found]
    assert [[m.table_names for m in mods] for mods in per_collection] == [[["movies"]], [["users"]]]
    whole = get_dynamic_emb_module(dmp)
    assert [m for mods in per_collection for m in mods] == whole
    assert all(isinstance(m, BatchedDynamicEmbeddingTablesV2) for m in whole)
    return whole


def test_upstream_clients_plan_shard_and_export(tmp_path):
    """Upstream's sharding client on one gloo rank: eb_configs from TORCHREC_TYPES,
    get_planner's plan (equal to upstream's constraints with enforce_hbm=True), DMP
    from the enforce_hbm plan, find_sharded_modules / get_dynamic_emb_module, and
    export_keys_values(name, device) giving the rows DMP looked up."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0,
                            world_size=1)
    try:
        model = Model()
        ours, theirs = _plans(model)
        _check_plans(ours, theirs)
        dmp = DistributedModelParallel(model, plan=theirs, sharders=SHARDERS,
                                       device=torch.device("cpu"))
        sequences = dmp.module.sparse.ec(_batch())
        dmp.module.sparse.ebc(_batch())
        movies = next(m for m in _check_walkers(dmp) if m.table_names == ["movies"])
        keys, embeddings = movies.export_keys_values("movies", device=torch.device("cpu"))
        rows = sequences["i"].values().detach()  # ids 11, 12 | 11
        torch.testing.assert_close(rows[2], rows[0], rtol=0, atol=0)
        looked_up = {11: rows[0], 12: rows[1]}
        assert sorted(keys.tolist()) == [11, 12]
        torch.testing.assert_close(embeddings, torch.stack([looked_up[k] for k in keys.tolist()]),
                                   rtol=0, atol=0)
    finally:
        dist.destroy_process_group()


def test_get_planner_refuses_bad_input():
    configs = [EmbeddingConfig(name="movies", num_embeddings=100, embedding_dim=DIM,
                               feature_names=["i"])]
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="init_process_group"):
        get_planner(configs, set(), {}, cpu)
    with pytest.raises(ValueError, match="'prefetch'.*CUDA"):
        get_planner(configs, set(), {}, cpu, "prefetch")
    from dynamicemb.get_planner import get_planner_constraints
    with pytest.raises(ValueError, match="pipeline_type"):
        get_planner_constraints(configs, set(), {}, "eager")
    with pytest.raises(ValueError, match=r"dynamicemb_options_dict.*\['nope'\]"):
        get_planner_constraints(configs, set(), {"nope": DynamicEmbTableOptions()})
    with pytest.raises(ValueError, match="both data-parallel and dynamic"):
        get_planner_constraints(configs, {"movies"}, {"movies": DynamicEmbTableOptions()})
    constraints = get_planner_constraints(configs, {"movies"}, {}, "native")
    assert constraints["movies"].sharding_types == ["data_parallel"]
    assert constraints["movies"].compute_kernels == ["dense"]


NO_TORCHREC = """
import sys
sys.modules["torchrec"] = None  # TorchRec not installed
from dynamicemb.types import DynamicEmbInitializerArgs, KEY_TYPE
from dynamicemb.dump_load import find_sharded_modules, get_dynamic_emb_module
import dynamicemb
assert DynamicEmbInitializerArgs is dynamicemb.DynamicEmbInitializerArgs
module = dynamicemb.BatchedDynamicEmbeddingTablesV2(
    [dynamicemb.DynamicEmbTableOptions(dim=2, max_capacity=64)], table_names=["t"])
assert get_dynamic_emb_module(module) == [module]
for name in ("dynamicemb.utils", "dynamicemb.get_planner"):
    try:
        __import__(name)
    except ImportError as err:
        assert "needs TorchRec" in str(err), err
    else:
        raise AssertionError(name + " imported without TorchRec")
try:
    find_sharded_modules(module)
except ImportError as err:
    assert "needs TorchRec" in str(err), err
else:
    raise AssertionError("find_sharded_modules ran without TorchRec")
assert "torchrec" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
"""


def test_upstream_paths_import_without_torchrec():
    """dynamicemb.types and dynamicemb.dump_load stay TorchRec-free; the TorchRec
    paths say how to install it."""
    from dynamicemb_testing.scripts import run_python  # noqa: PLC0415

    run_python(["-c", NO_TORCHREC], check=True, timeout=120)
