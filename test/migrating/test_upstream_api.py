"""Upstream dynamicemb's names, module paths, enum values and table options: each one
importable as ours, and each option honoured (against a reference) or refused with
its name. The end-to-end script in upstream's style is ``test_upstream_flow.py``."""

import dataclasses
import importlib
import math

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType as FbgemmOptimType

import dynamicemb
from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbCheckMode,
    DynamicEmbEvictStrategy,
    DynamicEmbInitializerArgs,
    DynamicEmbOptimType,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    DynamicEmbWeightDecayMode,
    FrequencyAdmissionStrategy,
    KVCounter,
    ScoredHashTable,
)
from dynamicemb.ops.interface import optimizer_state_dim
from dynamicemb.types import MAX_BUCKET_CAPACITY

# (module path, name, our object): upstream's spelling -> what it is here
UPSTREAM_NAMES = [
    ("dynamicemb", "DynamicEmbDump", "dynamicemb.checkpoint.DynamicEmbDump"),
    ("dynamicemb", "DynamicEmbLoad", "dynamicemb.checkpoint.DynamicEmbLoad"),
    ("dynamicemb", "KVCounter", "dynamicemb.options.KVCounter"),
    ("dynamicemb", "Counter", "dynamicemb.embedding.admission.Counter"),
    ("dynamicemb", "get_sharded_table_capacity", "dynamicemb.sizing.get_sharded_table_capacity"),
    ("dynamicemb", "get_table_value_bytes", "dynamicemb.sizing.get_table_value_bytes"),
    ("dynamicemb", "align_to_table_size", "dynamicemb.sizing.align_to_table_size"),
    ("dynamicemb", "DynamicEmbEvictStrategy", "dynamicemb.types.DynamicEmbEvictStrategy"),
    ("dynamicemb", "EmbOptimType", "dynamicemb.options.DynamicEmbOptimType"),
    ("dynamicemb", "OptimizerArgs", "dynamicemb.options.DynamicEmbOptimizerArgs"),
    ("dynamicemb.optimizer", "EmbOptimType", "dynamicemb.options.DynamicEmbOptimType"),
    ("dynamicemb.optimizer", "OptimizerArgs", "dynamicemb.options.DynamicEmbOptimizerArgs"),
    ("dynamicemb.incremental_dump", "incremental_dump", None),
    ("dynamicemb.incremental_dump", "get_score", None),
    ("dynamicemb.planner", "DynamicEmbeddingEnumerator",
     "dynamicemb.planner.planner.DynamicEmbeddingEnumerator"),
    ("dynamicemb.planner", "DynamicEmbeddingShardingPlanner",
     "dynamicemb.planner.planner.DynamicEmbeddingShardingPlanner"),
    ("dynamicemb.planner", "DynamicEmbParameterConstraints",
     "dynamicemb.planner.types.DynamicEmbParameterConstraints"),
    ("dynamicemb.planner", "DynamicEmbParameterSharding",
     "dynamicemb.planner.types.DynamicEmbParameterSharding"),
    ("dynamicemb.shard", "DynamicEmbeddingCollectionSharder",
     "dynamicemb.shard.embedding.DynamicEmbeddingCollectionSharder"),
    ("dynamicemb.batched_dynamicemb_tables", "BatchedDynamicEmbeddingTablesV2",
     "dynamicemb.embedding.module.BatchedDynamicEmbeddingTables"),
    ("dynamicemb.dynamicemb_config", "DynamicEmbTableOptions", "dynamicemb.options.DynamicEmbTableOptions"),
    ("dynamicemb.dynamicemb_config", "get_sharded_table_capacity",
     "dynamicemb.sizing.get_sharded_table_capacity"),
    ("dynamicemb.embedding_admission", "KVCounter", "dynamicemb.options.KVCounter"),
    ("dynamicemb.embedding_admission", "FrequencyAdmissionStrategy",
     "dynamicemb.options.FrequencyAdmissionStrategy"),
    ("dynamicemb.dump_load", "DynamicEmbDump", "dynamicemb.checkpoint.DynamicEmbDump"),
]


def _resolve(dotted: str):
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("module,name,ours", UPSTREAM_NAMES, ids=[f"{m}.{n}" for m, n, _ in UPSTREAM_NAMES])
def test_upstream_name_is_ours(module, name, ours):
    obj = getattr(importlib.import_module(module), name)
    if ours is not None:
        assert obj is _resolve(ours)


def test_incremental_dump_names_keep_their_meaning():
    """The package's ``incremental_dump`` stays the function (by table) after upstream's
    module path ``dynamicemb.incremental_dump`` (by collection path) is imported."""
    from dynamicemb.checkpoint.incremental import incremental_dump as by_table
    from dynamicemb.incremental_dump import incremental_dump as by_path
    assert dynamicemb.incremental_dump is by_table and by_path is not by_table
    from dynamicemb import incremental_dump
    assert incremental_dump is by_table


# (enum, upstream's integer order)
INT_ENUMS = [
    (DynamicEmbScoreStrategy, ["LRU", "STEP", "CUSTOMIZED", "LFU", "NO_EVICTION"]),
    (DynamicEmbCheckMode, ["ERROR", "WARNING", "IGNORE"]),
    (DynamicEmbPoolingMode, ["SUM", "MEAN", "NONE"]),
    (DynamicEmbEvictStrategy, ["LRU", "LFU", "EPOCH_LRU", "EPOCH_LFU", "CUSTOMIZED"]),
    (DynamicEmbWeightDecayMode, ["NONE", "L2", "DECOUPLE"]),
]


@pytest.mark.parametrize("enum,order", INT_ENUMS, ids=[e.__name__ for e, _ in INT_ENUMS])
def test_enums_take_upstream_integers(enum, order):
    for i, name in enumerate(order):
        assert enum(i) is enum[name]
    for bad in (len(order), -1, True, "nonsense", 1.0):
        with pytest.raises(ValueError, match=enum.__name__):
            enum(bad)


def test_integer_values_in_options_and_module():
    options = DynamicEmbTableOptions(dim=2, max_capacity=64, score_strategy=1, safe_check_mode=0)
    assert (options.score_strategy, options.safe_check_mode) == (
        DynamicEmbScoreStrategy.STEP, DynamicEmbCheckMode.ERROR)
    module = BatchedDynamicEmbeddingTables([options], pooling_mode=2)
    assert module.pooling_mode == DynamicEmbPoolingMode.NONE
    with pytest.raises(ValueError, match="DynamicEmbScoreStrategy"):
        DynamicEmbTableOptions(dim=2, max_capacity=64, score_strategy=9)


def test_sgd_is_exact_sgd():
    from dynamicemb.optimizer import EmbOptimType
    assert EmbOptimType.SGD is DynamicEmbOptimType.EXACT_SGD
    for value in (EmbOptimType.SGD, FbgemmOptimType.SGD, "sgd", "exact_sgd", FbgemmOptimType.EXACT_SGD):
        assert DynamicEmbOptimType.of(value) is DynamicEmbOptimType.EXACT_SGD
    for bad in (FbgemmOptimType.LAMB, FbgemmOptimType.ROWWISE_ADAGRAD, "adagrad_w", 3):
        with pytest.raises(ValueError, match="optimizer"):
            DynamicEmbOptimType.of(bad)


# ------------------------------------------------------------------------- table options
def _options(**kw) -> DynamicEmbTableOptions:
    return DynamicEmbTableOptions(**{"dim": 4, "max_capacity": 256, **kw})


REFUSED_OPTIONS = [
    (dict(dist_type="continuous"), "dist_type"),
    (dict(dist_type="random"), "dist_type"),
    (dict(external_storage=object()), "external_storage"),
    (dict(embedding_dtype=torch.int8), "embedding_dtype"),
    (dict(embedding_dtype=torch.float64), "embedding_dtype"),
    (dict(index_type=torch.float32), "index_type"),
    (dict(index_type=torch.uint8), "index_type"),
    (dict(admit_strategy=object()), "FrequencyAdmissionStrategy"),
    (dict(score_strategy=(1, 3)), "compound score_strategy"),
    (dict(admission_counter=64, admit_strategy=FrequencyAdmissionStrategy(2)), "admission_counter"),
    (dict(local_hbm_for_values=10, global_hbm_for_values=10), "global_hbm_for_values"),
    (dict(global_hbm_for_values=-1), "global_hbm_for_values"),
    (dict(bucket_capacity=100), "MAX_BUCKET_CAPACITY"),
    (dict(device_id=-1), "device_id"),
    (dict(device_id="cuda:0"), "device_id"),
]


@pytest.mark.parametrize("kw,name", REFUSED_OPTIONS, ids=[n for _, n in REFUSED_OPTIONS])
def test_unsupported_upstream_options_are_refused_by_name(kw, name):
    with pytest.raises(ValueError, match=name):
        _options(**kw)
    with pytest.raises(ValueError, match="KVCounter"):
        KVCounter(64, key_type=torch.int32)


def test_disagreeing_evict_strategy_is_overwritten_with_a_warning_as_upstream():
    """HSTU's --evict lfu with an LRU score: upstream overwrites evict_strategy, so
    does this package, and the warning names the score_strategy to set instead."""
    for kw, derived in ((dict(evict_strategy=DynamicEmbEvictStrategy.LFU), "LRU"),
                        (dict(evict_strategy=2, score_strategy="step"), "CUSTOMIZED")):
        with pytest.warns(UserWarning, match=f"evict_strategy is set to {derived}.*set "
                                             f"score_strategy="):
            options = _options(**kw)
        assert options.evict_strategy == DynamicEmbEvictStrategy[derived]


def test_supported_upstream_options():
    for score, evict in ((0, "lru"), (3, 1), (1, 4), (2, "customized"), (4, 4)):
        assert _options(score_strategy=score, evict_strategy=evict).evict_strategy == \
            DynamicEmbEvictStrategy(evict)
    assert _options(score_strategy=(1,)).score_strategy == DynamicEmbScoreStrategy.STEP
    for compound in ((0, 3), (3, 0)):  # upstream's (TIMESTAMP, LFU), either order
        assert _options(score_strategy=compound, evict_strategy="lfu").score_strategy == \
            DynamicEmbScoreStrategy.LRU_LFU
    for dist in ("roundrobin", "hash_roundrobin"):
        _options(dist_type=dist)
    _options(index_type=torch.int32, embedding_dtype=torch.float32)
    # upstream's 16-bit tables: the rows are stored in that dtype
    for dtype in (torch.float16, torch.bfloat16):
        half = BatchedDynamicEmbeddingTables([_options(embedding_dtype=dtype)], learning_rate=0.1)
        half(torch.tensor([5, 7]), torch.tensor([0, 1, 2])).sum().backward()
        assert half.export_keys_values("t0").embeddings.dtype == dtype
    # upstream's scripts pass None for tables they keep static: the default, LRU
    assert _options(score_strategy=None).score_strategy == DynamicEmbScoreStrategy.LRU
    # device_id (upstream's CUDA index, its module fills it): the module's device places rows
    placed = BatchedDynamicEmbeddingTables([_options(device_id=0)], learning_rate=0.1)
    assert placed.device == torch.device("cpu") and placed.table_options[0].device_id == 0
    module = BatchedDynamicEmbeddingTables([_options(index_type=torch.int32)], learning_rate=0.1)
    out = module(torch.tensor([5, 7], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32))
    assert out.shape == (2, 4)


def _cache_run(options: DynamicEmbTableOptions):
    module = BatchedDynamicEmbeddingTables([options], learning_rate=0.1)
    g = torch.Generator().manual_seed(5)
    for _ in range(6):
        ids = torch.randint(0, 200, (40,), generator=g)
        module(ids, torch.arange(0, 41, 4)).sum().backward()
    return module.cache_metrics()["t0"], module.export_keys_values("t0")


def test_global_hbm_for_values_is_split_over_the_ranks_holding_the_table():
    """On one rank (no planner) the global budget is the local one; on W ranks each gets
    ceil(global / W) (``device_budget``; the kernel and the planner's estimate use it)."""
    from dynamicemb.planner import dynamic_table_bytes
    row_bytes = 4 * 4
    budget = 24 * row_bytes + 3
    got = _cache_run(_options(caching=True, global_hbm_for_values=budget))
    want = _cache_run(_options(caching=True, local_hbm_for_values=budget))
    assert got[0] == want[0] and got[0].evictions > 0
    assert torch.equal(got[1].embeddings, want[1].embeddings)
    options = _options(global_hbm_for_values=1001)
    assert [options.device_budget(w) for w in (1, 2, 3)] == [1001, 501, 334]
    assert dynamic_table_bytes(options, 128, num_shards=2) == dynamic_table_bytes(
        _options(local_hbm_for_values=501), 128)
    with pytest.raises(ValueError, match="caching"):
        _options(caching=True)


# ----------------------------------------------------------------------------- admission
def _admission_module(**strategy) -> BatchedDynamicEmbeddingTables:
    init = DynamicEmbInitializerArgs(mode="constant", value=0.25)
    return BatchedDynamicEmbeddingTables([_options(
        initializer_args=init, admit_strategy=FrequencyAdmissionStrategy(**strategy))],
        learning_rate=0.0)


def test_rejected_keys_get_the_admission_initializer():
    """``initializer_args`` of FrequencyAdmissionStrategy (upstream's): rows of keys not
    admitted yet; admitted keys start from the table's initializer."""
    module = _admission_module(threshold=2, initializer_args=DynamicEmbInitializerArgs(
        mode="constant", value=-1.0))
    offsets = torch.tensor([0, 1, 2])
    first = module(torch.tensor([11, 12]), offsets)
    torch.testing.assert_close(first, torch.full((2, 4), -1.0))
    second = module(torch.tensor([11, 13]), offsets)  # 11 reaches the threshold
    torch.testing.assert_close(second, torch.tensor([[0.25] * 4, [-1.0] * 4]))
    plain = _admission_module(threshold=2)  # without: the table's initializer
    torch.testing.assert_close(plain(torch.tensor([11, 12]), offsets), torch.full((2, 4), 0.25))
    everyone = _admission_module(threshold=0)  # upstream's 0 admits every key
    everyone(torch.tensor([11, 12]), offsets)
    assert everyone.table_size("t0") == 2


def _counter_module(counter) -> BatchedDynamicEmbeddingTables:
    return BatchedDynamicEmbeddingTables([_options(
        admit_strategy=FrequencyAdmissionStrategy(threshold=10, counter_capacity=16),
        admission_counter=counter)])


def _count(module, ids) -> None:
    module(torch.tensor(ids), torch.tensor([0, len(ids)]))


def test_kv_counter_forgets_the_lowest_counts():
    """A full KVCounter bucket forgets a key counted once, never one counted more; the
    LRU counter (without KVCounter) forgets the least recently counted key instead."""
    # (counter, slots): one bucket each (the LRU counter's buckets hold 128 slots)
    for counter, slots in ((KVCounter(capacity=16, bucket_capacity=16), 16), (None, 128)):
        heavy = list(range(1000, 1000 + slots // 2))
        light = list(range(5000, 5000 + slots // 2))
        survivor = heavy if counter is not None else light
        module = _counter_module(counter)
        _count(module, heavy * 3)  # counted 3 times each, first
        _count(module, light)  # counted once each, later: the bucket is full
        _count(module, [999])  # a new key must evict one
        counts = module.export_admission_counters("t0")
        kept = dict(zip(counts.keys.tolist(), counts.counts.tolist()))
        assert len(kept) == slots and kept[999] == 1.0
        assert all(k in kept for k in survivor), counter
        expected = {k: 3.0 for k in heavy} if survivor is heavy else {k: 1.0 for k in light}
        assert {k: kept[k] for k in survivor} == expected


def test_kv_counter_is_saved_by_checkpoints(tmp_path):
    module = _counter_module(KVCounter(capacity=64))
    _count(module, [1, 1, 2, 3, 3, 3])
    dynamicemb.DynamicEmbDump(str(tmp_path / "ckpt"), module)
    fresh = _counter_module(KVCounter(capacity=64))
    dynamicemb.DynamicEmbLoad(str(tmp_path / "ckpt"), fresh)
    for got, want in zip(fresh.export_admission_counters("t0"), module.export_admission_counters("t0")):
        assert torch.equal(got.sort().values, want.sort().values)
    assert dict(zip(*[t.tolist() for t in fresh.export_admission_counters("t0")[:2]])) == {
        1: 2.0, 2: 1.0, 3: 3.0}


# ------------------------------------------------------------------------------- sizing
class _Config:
    def __init__(self, num_embeddings, embedding_dim, data_type="FP32"):
        self.name, self.num_embeddings, self.embedding_dim = "t", num_embeddings, embedding_dim
        self.data_type = data_type


@pytest.mark.parametrize("rows,world,bucket", [(1000, 2, 128), (10_000, 8, 16), (5, 4, 128)])
def test_sizing_helpers_match_the_tables_built(rows, world, bucket):
    """Per rank: the slots of the hash table a rank builds for its share; in total: the
    value bytes of those tables."""
    config = _Config(rows, 8)
    share = math.ceil(rows / world)
    for opt in (DynamicEmbOptimType.EXACT_SGD, DynamicEmbOptimType.ADAM, FbgemmOptimType.EXACT_ADAGRAD):
        width = 8 + optimizer_state_dim(DynamicEmbOptimType.of(opt), 8)
        table = ScoredHashTable(capacity=share, bucket_capacity=bucket, value_dim=width)
        assert dynamicemb.get_sharded_table_capacity(config, world, bucket) == table.capacity()
        assert dynamicemb.get_table_value_bytes(config, opt, world, bucket) == \
            world * table.memory_bytes()["values"]
    with pytest.raises(ValueError, match="bucket_capacity"):
        dynamicemb.get_sharded_table_capacity(config, world, 24)
    # upstream's MAX_BUCKET_CAPACITY (one bucket per rank): its size, the share rounded to 16
    assert dynamicemb.get_sharded_table_capacity(config, world, 2**63 - 1) == -(-share // 16) * 16
    with pytest.raises(ValueError, match="data_type"):
        dynamicemb.get_table_value_bytes(_Config(rows, 8, "INT8"), FbgemmOptimType.ADAM, world)
    # FP16 rows: 2-byte elements, float32 states (dim 8 SGD: 16 B against 32 B a row)
    assert 2 * dynamicemb.get_table_value_bytes(_Config(rows, 8, "FP16"), FbgemmOptimType.SGD,
                                                world, bucket) == \
        dynamicemb.get_table_value_bytes(config, FbgemmOptimType.SGD, world, bucket)
    assert [dynamicemb.align_to_table_size(n) for n in (0, 1, 16, 17)] == [16, 16, 16, 32]


def test_optimizer_args_alias_takes_upstream_fields():
    from dynamicemb.optimizer import OptimizerArgs
    args = OptimizerArgs(learning_rate=0.1, gradient_clipping=True, max_gradient=0.5,
                         weight_decay=0.01, weight_decay_mode=2, initial_accumulator_value=0.1)
    assert args.decay_mode == DynamicEmbWeightDecayMode.DECOUPLE
    assert dataclasses.replace(args, weight_decay=0.0).decay_mode == DynamicEmbWeightDecayMode.NONE


def test_checkpoint_table_names_in_upstreams_form(tmp_path):
    """DynamicEmbDump/DynamicEmbLoad take upstream's ``{collection path: names}``."""
    def module():
        options = [DynamicEmbTableOptions(dim=2, max_capacity=64) for _ in range(2)]
        return BatchedDynamicEmbeddingTables(options, table_names=["a", "b"], learning_rate=0.1)
    saved = module()
    saved(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 3])).sum().backward()
    path = str(tmp_path / "ckpt")
    dynamicemb.DynamicEmbDump(path, saved, table_names={"model": ["b"]}, optim=True)
    loaded = module()
    dynamicemb.DynamicEmbLoad(path, loaded, table_names={"model": ["b"]}, optim=True)
    assert loaded.table_size("a") == 0
    got, want = loaded.export_keys_values("b"), saved.export_keys_values("b")
    assert torch.equal(got.keys, want.keys) and torch.equal(got.embeddings, want.embeddings)


def test_max_bucket_capacity_is_one_bucket_per_table_as_upstream():
    """Upstream's ``bucket_capacity=MAX_BUCKET_CAPACITY`` (its dump/load, LFU and
    admission tests use it): one bucket of the table's capacity rounded up to 16,
    allocated at once, sized as ``get_sharded_table_capacity`` and the planner size
    it; eviction takes the table's lowest scores (LRU: the oldest rows)."""
    from dynamicemb.planner.estimators import dynamic_table_bytes

    options = _options(max_capacity=30, bucket_capacity=MAX_BUCKET_CAPACITY)
    config = _Config(30, 4)
    assert dynamicemb.get_sharded_table_capacity(config, 1, MAX_BUCKET_CAPACITY) == 32
    assert dynamic_table_bytes(options, 30)[0] == dynamic_table_bytes(
        _options(max_capacity=32, bucket_capacity=32), 32)[0]
    module = BatchedDynamicEmbeddingTables([options], learning_rate=0.1, pooling_mode=2)
    resolved = module.table_options[0]
    assert (resolved.bucket_capacity, resolved.max_capacity, resolved.init_capacity) == (32, 32, 32)

    def step(ids):
        ids = torch.tensor(ids)
        module(ids, torch.arange(ids.numel() + 1)).sum().backward()

    step(range(16))
    step(range(16, 32))  # the bucket is full
    step(range(8))  # 0..7 touched again: 8..15 are now the oldest
    step(range(100, 108))  # 8 new rows evict the 8 oldest
    assert sorted(module.export_keys_values("t0").keys.tolist()) == \
        [*range(8), *range(16, 32), *range(100, 108)]
