"""Upstream's names its unit tests and HSTU import, and the module members its tests
and tools read (``tables``, ``cache``, ``get_score``, ``incremental_dump``,
``_admission_counter``), each checked against this package's own calls; upstream's
internal modules are refused on import with what to use instead."""

import importlib
import warnings

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingConfig

import dynamicemb
from dynamicemb import (DynamicEmbInitializerArgs, DynamicEmbScoreStrategy, DynamicEmbTableOptions,
                        FrequencyAdmissionStrategy)
from dynamicemb.batched_dynamicemb_tables import BatchedDynamicEmbeddingTablesV2

DIM = 4


def _module(names=("t0",), **options) -> BatchedDynamicEmbeddingTablesV2:
    init = DynamicEmbInitializerArgs(mode="normal", std_dev=0.1, seed=7)
    return BatchedDynamicEmbeddingTablesV2(
        [DynamicEmbTableOptions(dim=DIM, max_capacity=256, initializer_args=init, **options)
         for _ in names], table_names=list(names), pooling_mode=2, learning_rate=0.1)


def _train(module, ids, table_count: int = 1) -> None:
    """One training step over ``ids`` in every table (NONE pooling, one id per row)."""
    ids = torch.tensor(list(ids) * table_count)
    module(ids, torch.arange(ids.numel() + 1)).sum().backward()


# ------------------------------------------------------------------------------ names
PROVIDED = [  # (module, name, what it is here)
    ("dynamicemb", "ScoreStrategy", dynamicemb.types.ScoreStrategy),
    ("dynamicemb.dynamicemb_config", "ScoreStrategy", dynamicemb.types.ScoreStrategy),
    ("dynamicemb", "AdmissionStrategy", dynamicemb.options.AdmissionStrategy),
    ("dynamicemb.types", "AdmissionStrategy", dynamicemb.options.AdmissionStrategy),
    ("dynamicemb.dynamicemb_config", "DEFAULT_BUCKET_CAPACITY", 128),
    ("dynamicemb.dynamicemb_config", "BATCH_SIZE_PER_DUMP", 65536),
    ("dynamicemb", "BATCH_SIZE_PER_DUMP", 65536),
    ("dynamicemb.dynamicemb_config", "DEBUG_EMB_INITIALIZER_MOD", 100_000),
]


@pytest.mark.parametrize("module,name,value", PROVIDED, ids=[f"{m}.{n}" for m, n, _ in PROVIDED])
def test_upstream_names_are_provided(module, name, value):
    assert getattr(importlib.import_module(module), name) == value


def test_provided_names_behave_as_upstreams():
    from dynamicemb.dynamicemb_config import DEBUG_EMB_INITIALIZER_MOD
    from dynamicemb.optimizer import EmbOptimType, get_optimizer_state_dim
    from dynamicemb.types import MAX_BUCKET_CAPACITY, AdmissionStrategy
    from dynamicemb.utils import DTYPE_NUM_BYTES

    assert isinstance(FrequencyAdmissionStrategy(threshold=2), AdmissionStrategy)
    # the DEBUG initializer's rows are key % DEBUG_EMB_INITIALIZER_MOD
    debug = BatchedDynamicEmbeddingTablesV2(
        [DynamicEmbTableOptions(dim=DIM, max_capacity=256, initializer_args=DynamicEmbInitializerArgs(
            mode="debug"))], pooling_mode=2)
    out = debug(torch.tensor([7, 100_003]), torch.arange(3))
    assert out.tolist() == [[7.0] * DIM, [3.0] * DIM]
    assert DEBUG_EMB_INITIALIZER_MOD == 100_000
    # state columns: the module's own
    for optimizer, states in ((EmbOptimType.ADAM, 2 * DIM), (EmbOptimType.EXACT_SGD, 0),
                              (EmbOptimType.EXACT_ROWWISE_ADAGRAD, 1)):
        module = BatchedDynamicEmbeddingTablesV2(
            [DynamicEmbTableOptions(dim=DIM, max_capacity=64)], optimizer=optimizer)
        assert get_optimizer_state_dim(optimizer, DIM, torch.float32) == \
            module.optimizer_state_dim("t_0" if "t_0" in module.table_names
                                       else module.table_names[0]) == states
    with pytest.raises(ValueError, match="float32"):
        get_optimizer_state_dim(EmbOptimType.ADAM, DIM, torch.float16)
    assert DTYPE_NUM_BYTES[torch.float32] == 4 and DTYPE_NUM_BYTES[torch.bfloat16] == 2
    # upstream's one-bucket sizing: the share rounded up to 16 slots
    config = EmbeddingConfig(name="t", num_embeddings=1001, embedding_dim=DIM, feature_names=["f"])
    assert dynamicemb.get_sharded_table_capacity(config, 2, MAX_BUCKET_CAPACITY) == 512
    assert dynamicemb.get_table_value_bytes(config, EmbOptimType.ADAM, 2, MAX_BUCKET_CAPACITY) \
        == 2 * 512 * (DIM + 2 * DIM) * 4


@pytest.mark.parametrize("name", ["scored_hashtable", "extendable_tensor",
                                  "index_range_meta", "lookup_meta"])
def test_upstream_internal_modules_are_refused_on_import(name):
    with pytest.raises(ImportError, match=rf"dynamicemb\.{name} is upstream dynamicemb's internal "
                                          rf"module and is not provided here: .+MIGRATING"):
        importlib.import_module(f"dynamicemb.{name}")


UPSTREAM_PATHS = ["dynamicemb", "dynamicemb.types", "dynamicemb.optimizer", "dynamicemb.utils",
                  "dynamicemb.dynamicemb_config", "dynamicemb.batched_dynamicemb_tables",
                  "dynamicemb.key_value_table"]


def test_every_refusal_text_is_raised_by_a_module_path_and_provided_names_are_not_refused():
    """Each of ``REFUSED``'s texts is what some module path raises for that name (no
    stale text for a name since provided)."""
    from dynamicemb._upstream import REFUSED

    modules = [importlib.import_module(path) for path in UPSTREAM_PATHS]
    for name, text in REFUSED.items():
        raised = []
        for module in modules:
            try:
                getattr(module, name)
            except ImportError as err:
                raised.append(str(err))
            except AttributeError:
                pass
        assert raised and all(text in message for message in raised), name
    for module, name, _ in PROVIDED:
        assert name not in REFUSED, f"{module}.{name} is provided, yet has a refusal text"


# ---------------------------------------------------------------------------- members
def test_tables_is_upstreams_storage_class_of_the_layout():
    """``isinstance(m.tables, HybridStorage)`` (upstream's dump/load, LFU and admission
    tests check it): device + host rows without a cache; ``DynamicEmbStorage`` for one
    store (all in device memory, host only, or under a cache)."""
    from dynamicemb.key_value_table import DynamicEmbStorage, HybridStorage

    row = DIM * 4
    for options, kind in ((dict(), DynamicEmbStorage),
                          (dict(caching=True, local_hbm_for_values=16 * row), DynamicEmbStorage),
                          (dict(local_hbm_for_values=0), DynamicEmbStorage),
                          (dict(local_hbm_for_values=16 * row), HybridStorage)):
        module = _module(**options)
        _train(module, range(40))
        assert type(module.tables) is kind, options
        keys = torch.cat([c[0] for c in module.tables.export_keys_values(None, 7)])
        assert sorted(keys.tolist()) == list(range(40))  # every row, in either tier
    with pytest.raises(ImportError, match="DynamicEmbCache is upstream dynamicemb's.+caching"):
        from dynamicemb.key_value_table import DynamicEmbCache  # noqa: F401


def test_tables_exports_as_upstreams_storage_with_the_compound_score_in_its_layout():
    """``module.tables.export_keys_values(device, batch_size, table_id)`` yields upstream's
    4-tuples; a ``(TIMESTAMP, LFU)`` table's scores are ``[timestamp, frequency]``, the
    frequency the true access count (what upstream's LFU test checks)."""
    module = _module(("a", "b"), score_strategy=(DynamicEmbScoreStrategy.TIMESTAMP,
                                                 DynamicEmbScoreStrategy.LFU))
    steps = [[1, 2, 3], [2, 3], [3]]
    for ids in steps:
        _train(module, ids, table_count=2)
    chunks = list(module.tables.export_keys_values(torch.device("cpu"), 2, table_id=1))
    assert [c[0].numel() for c in chunks] == [2, 1]  # batch_size rows at most
    keys, embeddings, states, scores = (torch.cat(part) for part in zip(*chunks))
    ours = module.export_keys_values("b")
    order, mine = keys.argsort(), ours.keys.argsort()
    assert torch.equal(keys[order], ours.keys[mine])
    assert torch.equal(embeddings[order], ours.embeddings[mine])
    assert torch.equal(states[order], ours.optimizer_states[mine])
    assert scores.shape == (3, 2)
    by_key = dict(zip(keys.tolist(), scores.tolist()))
    assert {k: f for k, (_, f) in by_key.items()} == {1: 1, 2: 2, 3: 3}  # frequencies
    assert by_key[1][0] < by_key[2][0] < by_key[3][0]  # last-access timestamps
    assert module.tables.size(1) == 3
    plain = _module(score_strategy=DynamicEmbScoreStrategy.LFU)
    _train(plain, [4, 4, 5])
    [(_, _, _, lfu)] = list(plain.tables.export_keys_values(None, 10, 0))
    assert lfu.dim() == 1
    with pytest.raises(ValueError, match="table_id"):
        next(module.tables.export_keys_values(None, 2, table_id=2))


def test_cache_is_found_for_cached_tables_and_counts_each_batch():
    """Upstream's cache-statistics hook: ``hasattr(m, "cache") and m.cache is not None``
    for a cached table; ``cache.cache_metrics`` is ``[unique, hits]`` per forward."""
    rows = DIM * 4  # bytes of a row: a cache of 16 rows
    cached = _module(caching=True, local_hbm_for_values=16 * rows)
    assert hasattr(cached, "cache") and cached.cache is not None
    cached.set_record_cache_metrics(True)
    cache = cached.cache
    _train(cached, [1, 2, 3])
    assert cache.cache_metrics.tolist() == [3, 0]
    _train(cached, [1, 2, 9])
    assert cache.cache_metrics.tolist() == [3, 2]
    assert cached.cache is cache
    assert _module().cache is None


def test_module_get_score_and_incremental_dump_give_the_rows_touched_since():
    module = _module(("a", "b"), score_strategy=DynamicEmbScoreStrategy.TIMESTAMP)
    _train(module, [1, 2], table_count=2)
    score = module.get_score()
    assert set(score) == {"a", "b"}
    _train(module, [2, 7], table_count=2)
    rows, score = module.incremental_dump(score)
    for name in ("a", "b"):
        keys, embeddings = rows[name]
        assert sorted(keys.tolist()) == [2, 7]
        ours = module.export_keys_values(name)
        want = dict(zip(ours.keys.tolist(), ours.embeddings))
        for key, row in zip(keys.tolist(), embeddings):
            assert torch.equal(row, want[key])
    again, _ = module.incremental_dump(score)
    assert all(keys.numel() == 0 for keys, _ in again.values())
    custom = _module(score_strategy=DynamicEmbScoreStrategy.CUSTOMIZED)
    custom.set_score({"t0": 5})
    assert custom.get_score() == {"t0": 5}
    _train(custom, [1, 2])
    custom.set_score({"t0": 6})  # CUSTOMIZED: rows scoring at least the registered score
    _train(custom, [2, 3])
    rows, score = custom.incremental_dump({"t0": 6})
    assert sorted(rows["t0"][0].tolist()) == [2, 3] and score == {"t0": 6}
    with pytest.raises(ValueError, match="no tables"):
        custom.incremental_dump({"t9": 0})
    # the same threshold through the model-level forms (upstream's unit test calls them)
    from dynamicemb.incremental_dump import get_score, incremental_dump

    assert custom.next_score("t0") == 6 and get_score(custom) == {"model": {"t0": 6}}
    rows, score = incremental_dump(custom, {"model": {"t0": 6}})
    assert sorted(rows["model"]["t0"][0].tolist()) == [2, 3] and score == {"model": {"t0": 6}}
    by_table, _ = dynamicemb.incremental_dump(custom, {"t0": 5})
    assert sorted(by_table["t0"][0].tolist()) == [1, 2, 3]
    with pytest.raises(ValueError, match="LFU"):
        _module(score_strategy=DynamicEmbScoreStrategy.LFU).get_score()


def test_admission_counter_is_the_modules_counter():
    assert _module()._admission_counter is None
    admitted = _module(admit_strategy=FrequencyAdmissionStrategy(threshold=2))
    _train(admitted, [1, 1, 2])
    counter = admitted._admission_counter
    assert isinstance(counter, dynamicemb.Counter)
    counts = admitted.export_admission_counters("t0")
    assert counts.keys.tolist() == [2]  # 1 was admitted (seen twice); 2 is counted


def test_set_score_of_the_incremental_dump_module():
    """Upstream's ``set_score(model, int | {collection: {table: score}})``."""
    from dynamicemb.incremental_dump import set_score

    module = _module(("a", "b"), score_strategy=DynamicEmbScoreStrategy.CUSTOMIZED)
    set_score(module, 3)
    assert module.get_score() == {"a": 3, "b": 3}
    set_score(module, {"model": {"b": 8}})
    assert module.get_score() == {"a": 3, "b": 8}
    with pytest.raises(ValueError, match="no collection 'other'"):
        set_score(module, {"other": {"a": 1}})
    with pytest.raises(ValueError, match="CUSTOMIZED"):
        set_score(_module(), 2)


def test_evict_strategy_of_hstu_is_overwritten_with_a_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        options = DynamicEmbTableOptions(dim=DIM, max_capacity=64, score_strategy="lru",
                                         evict_strategy="lfu")
    assert options.evict_strategy == dynamicemb.DynamicEmbEvictStrategy.LRU
    assert any("score_strategy=LFU" in str(w.message) for w in caught)
