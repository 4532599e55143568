"""The third tier: a module whose host store holds a small budget of rows over an
external store (RocksDB, Redis) trains bit-identically to one with every row in host
memory; export, dump/load and incremental_dump see every tier; a failing store
fails the step by name and leaves the tiers as they were."""

import pytest
import torch

pytest.importorskip("rocksdict", reason="the external stores are tested against the real rocksdict (requirements.txt pins it)")
pytest.importorskip("redis", reason="the external stores are tested against the real redis (requirements.txt pins it)")

from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbDump, DynamicEmbLoad,
                        DynamicEmbInitializerArgs, DynamicEmbOptimType, DynamicEmbScoreStrategy,
                        FrequencyAdmissionStrategy,
                        DynamicEmbTableOptions, incremental_dump)
from dynamicemb.ops.interface import RowFormat
from dynamicemb.storage.external import ExternalStorageError, RedisStorage, RocksDBStorage
from test_exactness import STATE_FLOATS, assert_identical, power_law_batches, snapshot, train

DIM = 8
HOST_ROWS = 128  # per table: the group's host store holds 256 rows
LRU, LFU = DynamicEmbScoreStrategy.LRU, DynamicEmbScoreStrategy.LFU


def make_module(optimizer, strategy, external=None, host_rows=HOST_ROWS, device_rows=None,
                pooling="sum", admit=None, init_capacity=None, max_load_factor=0.5,
                dtype=torch.float32):
    row_bytes = RowFormat(dtype, DIM, STATE_FLOATS[optimizer]).row_bytes
    options = DynamicEmbTableOptions(
        dim=DIM, max_capacity=8192, bucket_capacity=16, score_strategy=strategy,
        initializer_args=DynamicEmbInitializerArgs(mode="normal", std_dev=0.1, seed=11),
        caching=device_rows is not None,
        local_hbm_for_values=None if device_rows is None else device_rows * row_bytes,
        external_storage=external, admit_strategy=admit, init_capacity=init_capacity,
        max_load_factor=max_load_factor, embedding_dtype=dtype,
        local_host_for_values=None if external is None else host_rows * row_bytes)
    return BatchedDynamicEmbeddingTables(
        [options, options], table_names=["a", "b"], pooling_mode=pooling,
        optimizer=optimizer, learning_rate=0.05, weight_decay=0.01, weight_decay_mode="l2",
        device=torch.device("cpu"))


def batches(seed=3, steps=12):
    return power_law_batches(seed=seed, steps=steps, batch=24)


def below(module):
    """Rows that went down and came back, summed over the tables."""
    m = module.cache_metrics().values()
    return sum(x.external_writes for x in m), sum(x.external_reads for x in m)


@pytest.mark.parametrize("optimizer,strategy,device_rows,pooling,dtype", [
    (DynamicEmbOptimType.EXACT_SGD, LRU, None, "sum", torch.float32),
    (DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD, LFU, None, "none", torch.float32),
    (DynamicEmbOptimType.ADAM, LRU, 64, "sum", torch.float32),
    (DynamicEmbOptimType.EXACT_ADAGRAD, LFU, 64, "sum", torch.float32),
    (DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD, LFU, None, "none", torch.bfloat16),
    (DynamicEmbOptimType.ADAM, LRU, 64, "sum", torch.float16),
], ids=["sgd-lru", "rowwise-lfu-seq", "adam-lru-cache", "adagrad-lfu-cache",
        "bf16-rowwise-lfu-seq", "f16-adam-lru-cache"])
def test_rows_split_with_rocksdb_train_identically(tmp_path, optimizer, strategy, device_rows,
                                                   pooling, dtype):
    data = batches()
    reference = make_module(optimizer, strategy, pooling=pooling, dtype=dtype)
    expected_out = train(reference, data, prefetch=False)
    module = make_module(optimizer, strategy, RocksDBStorage(str(tmp_path / "db")),
                         device_rows=device_rows, pooling=pooling, dtype=dtype)
    outputs = train(module, data, prefetch=False)
    for got, want in zip(outputs, expected_out):
        assert torch.equal(got, want)
    writes, reads = below(module)
    assert writes > 50 and reads > 10  # rows really went down and came back
    assert module.table_size("a") == reference.table_size("a")
    assert_identical(snapshot(module), snapshot(reference))
    # eval reads rows where they are, the external tier's too
    module.eval(), reference.eval()
    probe = batches(seed=4, steps=1)[0]
    with torch.no_grad():
        assert torch.equal(module(*probe), reference(*probe))
    # reads change nothing and find every row, below too (unseen keys: initializers)
    keys = torch.cat([snapshot(reference)["a"][0], torch.arange(10**9, 10**9 + 3)])
    for train_rows in (True, False):
        assert torch.equal(module.read_rows("a", keys, train=train_rows),
                           reference.read_rows("a", keys, train=train_rows))
    assert below(module)[1] == reads


@pytest.mark.parametrize("strategy", [LRU, LFU], ids=["lru", "lfu"])
def test_admission_over_an_external_tier_trains_identically(tmp_path, strategy):
    """A key whose row went down is stored: admission does not count it again
    (the padded step asks the store for the keys the host store lacks)."""
    admit = FrequencyAdmissionStrategy(threshold=2, counter_capacity=1024)
    data = batches(steps=30)
    reference = make_module(DynamicEmbOptimType.EXACT_SGD, strategy, admit=admit)
    expected = train(reference, data, prefetch=False)
    module = make_module(DynamicEmbOptimType.EXACT_SGD, strategy,
                         RocksDBStorage(str(tmp_path / "db")), host_rows=64, admit=admit)
    assert all(torch.equal(a, b) for a, b in zip(train(module, data, prefetch=False), expected))
    writes, reads = below(module)
    assert writes > 0 and reads > 0
    assert module.table_size("a") == reference.table_size("a")
    assert_identical(snapshot(module), snapshot(reference))


def test_a_growing_host_store_over_rocksdb_trains_identically(tmp_path):
    """A host store that starts at one bucket per table and grows to its budget: a
    key that meets a full bucket while it may grow makes the step grow and run again
    (it must find a slot to take its row back from below), as if all rows were in
    memory."""
    data = batches()
    reference = make_module(DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD, LRU)
    expected = train(reference, data, prefetch=False)
    module = make_module(DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD, LRU,
                         RocksDBStorage(str(tmp_path / "db")), init_capacity=16,
                         max_load_factor=1.0)  # grows late: buckets fill before it grows
    assert module._groups[0].table.capacity() < module._groups[0].table.max_capacity()
    assert all(torch.equal(a, b) for a, b in zip(train(module, data, prefetch=False), expected))
    assert module._groups[0].table.capacity() == module._groups[0].table.max_capacity()
    assert below(module)[0] > 0
    assert_identical(snapshot(module), snapshot(reference))


def test_rows_split_with_redis_train_identically(redis_servers):
    (server,) = redis_servers(1)
    spec = RedisStorage(server.address)
    data = batches(steps=6)
    reference = make_module(DynamicEmbOptimType.ADAM, LFU)
    expected = train(reference, data, prefetch=False)
    module = make_module(DynamicEmbOptimType.ADAM, LFU, spec)
    assert all(torch.equal(a, b) for a, b in zip(train(module, data, prefetch=False), expected))
    assert below(module)[0] > 0
    assert_identical(snapshot(module), snapshot(reference))


def test_dump_load_and_incremental_dump_see_every_tier(tmp_path):
    data = batches(steps=6)
    reference = make_module(DynamicEmbOptimType.ADAM, LRU)
    module = make_module(DynamicEmbOptimType.ADAM, LRU, str(tmp_path / "db1"))
    train(reference, data, prefetch=False), train(module, data, prefetch=False)
    threshold = 1 + max(int(module.export_keys_values(t).scores.max()) for t in "ab") - 3
    got, _ = incremental_dump(module, threshold)
    want, _ = incremental_dump(reference, threshold)
    for t in "ab":
        assert sorted(got[t][0].tolist()) == sorted(want[t][0].tolist())
        assert got[t][0].numel() > 0
    DynamicEmbDump(str(tmp_path / "ck"), module)
    # into a module with another split (and the other way round): the same rows
    loaded = make_module(DynamicEmbOptimType.ADAM, LRU, str(tmp_path / "db2"), host_rows=128)
    train(loaded, batches(seed=9, steps=2), prefetch=False)  # contents the load replaces
    DynamicEmbLoad(str(tmp_path / "ck"), loaded)
    plain = make_module(DynamicEmbOptimType.ADAM, LRU)
    DynamicEmbLoad(str(tmp_path / "ck"), plain)
    expected = snapshot(reference)
    assert_identical(snapshot(loaded), expected)
    assert_identical(snapshot(plain), expected)
    more = batches(seed=5, steps=3)
    assert all(torch.equal(a, b) for a, b in
               zip(train(loaded, more, prefetch=False), train(reference, more, prefetch=False)))
    assert_identical(snapshot(loaded), snapshot(reference))


def test_bad_options_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="local_host_for_values .* set external_storage"):
        DynamicEmbTableOptions(dim=4, max_capacity=64, local_host_for_values=1024)
    with pytest.raises(ValueError, match="NO_EVICTION never evicts"):
        DynamicEmbTableOptions(dim=4, max_capacity=64, external_storage=str(tmp_path),
                               score_strategy=DynamicEmbScoreStrategy.NO_EVICTION)
    with pytest.raises(ValueError, match="less than one bucket"):
        make_module(DynamicEmbOptimType.EXACT_SGD, LRU, str(tmp_path / "x"), host_rows=4)


def test_a_batch_larger_than_the_host_budget_fails_and_is_undone(tmp_path):
    module = make_module(DynamicEmbOptimType.EXACT_SGD, LRU, str(tmp_path / "db"), host_rows=16)
    ids = torch.arange(2000) * 7
    offsets = torch.arange(0, 2001, 1000)
    before = snapshot(module)
    with pytest.raises(ExternalStorageError, match="found no slot in the host store"):
        module(ids, offsets)
    assert_identical(snapshot(module), before)


def _fail(kind, server):
    """Makes ``server`` fail as ``kind`` says; returns the repair."""
    import redis
    client = redis.Redis(host="127.0.0.1", port=server.port)
    if kind == "killed":
        server.kill()
        return server.start  # same port and directory: the AOF brings the rows back
    if kind == "slow":
        server.pause()
        return server.resume
    used = client.info("memory")["used_memory"]  # full: no room for another row
    client.config_set("maxmemory", used + 256)
    client.config_set("maxmemory-policy", "noeviction")
    return lambda: client.config_set("maxmemory", 0)


@pytest.mark.parametrize("kind,message", [
    ("killed", "ConnectionError|Connection refused"), ("slow", "Timeout"), ("full", "OutOfMemory"),
])
def test_a_failing_redis_fails_the_step_by_name_and_training_resumes(redis_servers, kind,
                                                                     message):
    (server,) = redis_servers(1, aof=True)
    spec = RedisStorage(server.address, timeout=0.5)
    data = batches(steps=9)
    reference = make_module(DynamicEmbOptimType.ADAM, LRU)
    module = make_module(DynamicEmbOptimType.ADAM, LRU, spec)
    expected = train(reference, data, prefetch=False)
    got = train(module, data[:5], prefetch=False)
    before = snapshot(module)
    repair = _fail(kind, server)
    with pytest.raises(ExternalStorageError, match=rf"{server.address}.*\['a', 'b'\].*({message})"):
        module(*data[5])
    repair()
    assert_identical(snapshot(module), before)  # no row half-written or lost
    got += train(module, data[5:], prefetch=False)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert_identical(snapshot(module), snapshot(reference))


def test_an_unreachable_store_fails_the_construction_by_name():
    from dynamicemb_testing.redis_servers import free_port
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ExternalStorageError,
                       match=rf"redis://{address}.*failed to open.*refused.*\['a', 'b'\]"):
        make_module(DynamicEmbOptimType.EXACT_SGD, LRU, f"redis://{address}")


def test_a_stored_row_of_the_wrong_size_fails_the_step_and_undoes_it(tmp_path):
    from dynamicemb.kvstore.rocksdb import RocksDBStore
    adam = RowFormat(torch.float32, DIM, STATE_FLOATS[DynamicEmbOptimType.ADAM])
    store = RocksDBStore(str(tmp_path / "db"), adam.storage_width, adam.tag)
    module = make_module(DynamicEmbOptimType.ADAM, LRU, store)
    data = batches(steps=3)
    train(module, data[:2], prefetch=False)
    before = snapshot(module)
    ids = data[2][0]
    new = ids[~torch.isin(ids, module.export_keys_values("a").keys)][:1]
    store._put(store._pack_keys(new, torch.zeros_like(new)), [b"short"])
    with pytest.raises(ExternalStorageError, match=r"rocksdb:.*\[5\] bytes.*\['a', 'b'\]"):
        module(*data[2])
    store.delete(new, torch.zeros_like(new))
    assert_identical(snapshot(module), before)  # the step was undone in every tier
    module(*data[2])  # and goes through once the store is sound
