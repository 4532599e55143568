"""The store below host memory on a Redis Cluster (``RedisClusterStore``), against
real ``redis-server`` processes in cluster mode (3 primaries, a replica each): the
verbs against a dict, three-tier training equal to training with every row in host
memory, a primary killed during training (nothing lost), the marks and write counts
(a cluster restarted empty, lost writes, another module's namespace), and clear
errors for an unreachable cluster."""

import re
import time

import pytest
import torch

pytest.importorskip("redis", reason="the external stores are tested against the real redis (requirements.txt pins it)")

from dynamicemb import DynamicEmbOptimType, DynamicEmbScoreStrategy
from dynamicemb.kvstore.redis_cluster import COUNT, PARTITIONS, partition_of
from dynamicemb.kvstore.store import marked_format
from dynamicemb.storage.external import (ExternalStorageError, RedisClusterStorage,
                                         as_storage_spec)
from dynamicemb_testing.redis_servers import REDIS_SERVER, RedisClusterServers, free_port
from test_exactness import assert_identical, snapshot, train
from test_external_stores import (BF16, F16, FLOAT32, OLD_MARK, WIDTH, as_dict, entries,
                                  scanned, stored)
from test_external_tier import batches, below, make_module

pytestmark = pytest.mark.skipif(REDIS_SERVER is None,
                                reason="redis-server is not installed (apt-get install redis-server)")
LFU = DynamicEmbScoreStrategy.LFU


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    servers = RedisClusterServers(str(tmp_path_factory.mktemp("cluster")))
    yield servers
    servers.stop()


def _spec(cluster, run, **kw):
    return RedisClusterStorage(tuple(cluster.seeds[:2]), run=run, timeout=2.0, **kw)


def test_verbs_against_a_dict_and_scan(cluster):
    store = _spec(cluster, "verbs").open("suite", WIDTH, FLOAT32)
    keys, tids, rows, scores = entries(3000, seed=1)
    store.put(keys, tids, rows, scores)
    want = as_dict(keys, tids, rows, scores)
    found, got = store.get(keys, tids)
    assert bool(found.all()) and stored(got) == want
    gone = keys[::3]
    store.delete(gone, tids[::3])
    for k, t in zip(gone.tolist(), tids[::3].tolist()):
        del want[(k, t)]
    found, _ = store.get(keys, tids)
    assert int(found.sum()) == len(want)
    assert scanned(store, chunk=97) == want
    parts = partition_of(keys, tids, PARTITIONS)
    assert parts.unique().numel() == PARTITIONS  # every partition (and slot) used
    store.close()


def test_spec_strings_and_bad_specs():
    spec = as_storage_spec("redis+cluster://127.0.0.1:7000,localhost:7001/")
    assert spec == RedisClusterStorage(("127.0.0.1:7000", "localhost:7001"))
    for bad, says in [(dict(seeds=("nohost",)), "host:port"), (dict(seeds=()), "at least one"),
                      (dict(seeds=("a:1",), replicas_to_wait=-1), "replicas_to_wait"),
                      (dict(seeds=("a:1",), wait_timeout=0), "positive")]:
        with pytest.raises(ValueError, match=says):
            RedisClusterStorage(**bad)


def test_three_tier_training_equals_rows_in_memory(cluster):
    data = batches(steps=6)
    reference = make_module(DynamicEmbOptimType.ADAM, LFU)
    expected = train(reference, data, prefetch=False)
    module = make_module(DynamicEmbOptimType.ADAM, LFU, _spec(cluster, "train"))
    assert all(torch.equal(a, b) for a, b in zip(train(module, data, prefetch=False), expected))
    assert below(module)[0] > 0
    assert_identical(snapshot(module), snapshot(reference))


def _step_until_it_runs(module, batch, deadline: float) -> int:
    """Runs ``batch`` (forward and backward) until a call gets through; a failing
    call must name the store and change nothing. Returns the failures."""
    failures = 0
    while True:
        try:
            out = module(*batch)
        except ExternalStorageError as e:
            assert "redis+cluster://" in str(e), e
            failures += 1
            assert time.monotonic() < deadline, f"the cluster did not recover: {e}"
            time.sleep(0.2)
            continue
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
        return failures


def test_a_primary_killed_during_training_loses_nothing(tmp_path):
    """Writes wait for a replica (WAIT): the replica promoted after a SIGKILL holds
    every acknowledged row, and training resumes on it to the in-memory result."""
    servers = RedisClusterServers(str(tmp_path / "cluster"))
    try:
        data = batches(steps=10)
        reference = make_module(DynamicEmbOptimType.EXACT_SGD, LFU)
        expected = snapshot_after(reference, data)
        module = make_module(DynamicEmbOptimType.EXACT_SGD, LFU,
                             RedisClusterStorage(tuple(servers.seeds), timeout=1.0))
        for batch in data[:5]:
            _step_until_it_runs(module, batch, time.monotonic() + 30)
        victim = servers.server_on(servers.primary_ports()[0])
        victim.kill()
        deadline = time.monotonic() + 30
        for batch in data[5:]:
            _step_until_it_runs(module, batch, deadline)
        assert victim.port not in servers.primary_ports()  # its replica took over
        assert below(module)[0] > 0
        assert_identical(snapshot(module), expected)
    finally:
        servers.stop()


def snapshot_after(module, data):
    train(module, data, prefetch=False)
    return snapshot(module)


def test_a_cluster_restarted_empty_and_lost_writes_fail_by_name(cluster):
    store = _spec(cluster, "lost").open("t", WIDTH, FLOAT32)
    keys, tids, rows, scores = entries(500, seed=2)
    store.put(keys, tids, rows, scores)
    import redis
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.servers[0].port)
    p = int(partition_of(keys[:1], tids[:1], PARTITIONS)[0])
    tag = f"{{lost/t.{p:02x}}}".encode()
    client.set(tag + COUNT, b"0")  # as if the writes were lost in a failover
    with pytest.raises(ExternalStorageError, match=rf"partition {p} .*lost writes"):
        store.get(keys, tids)
    for key in client.scan_iter(match=b"{lost/t.*", target_nodes=client.PRIMARIES):
        client.delete(key)  # as if the cluster restarted empty
    with pytest.raises(ExternalStorageError, match="no longer holds this module's rows"):
        store.put(keys, tids, rows, scores)
    store.close()
    client.close()


def test_a_node_that_lost_its_data_is_named_and_refuses_a_resume(cluster):
    """FLUSHALL on one primary (its replica follows): the partitions on it lost their
    mark; the calls that touch them and a resume name them."""
    store = _spec(cluster, "flushed").open("t", WIDTH, FLOAT32)
    keys, tids, rows, scores = entries(2000, seed=4)
    store.put(keys, tids, rows, scores)
    import redis
    port = cluster.primary_ports()[0]
    redis.Redis(host="127.0.0.1", port=port).flushall()
    with pytest.raises(ExternalStorageError, match=rf"node 127.0.0.1:{port}\) no longer holds"):
        store.get(keys, tids)
    with pytest.raises(ExternalStorageError, match=r"hold none of the earlier module's rows"):
        _spec(cluster, "flushed", resume=True).open("t", WIDTH, FLOAT32)
    store.close()


def test_another_module_s_namespace_is_refused_then_resumed(cluster):
    first = _spec(cluster, "owned").open("t", WIDTH, FLOAT32)
    keys, tids, rows, scores = entries(200, seed=3)
    first.put(keys, tids, rows, scores)
    with pytest.raises(ExternalStorageError, match="already holds the rows of another module"):
        _spec(cluster, "owned").open("t", WIDTH, FLOAT32)
    second = _spec(cluster, "owned", resume=True).open("t", WIDTH, FLOAT32)
    found, got = second.get(keys, tids)
    assert bool(found.all()) and stored(got) == as_dict(keys, tids, rows, scores)
    with pytest.raises(ExternalStorageError, match="another module took"):
        first.put(keys, tids, rows, scores)
    first.close()
    second.close()


def test_the_row_format_is_recorded_in_every_partition(cluster):
    """bfloat16 rows: a float16 resume (same width) is refused naming both formats and
    changes nothing; marks of an older version (no format) hold float32 rows."""
    first = _spec(cluster, "format").open("t", WIDTH, BF16)
    keys, tids, rows, scores = entries(300, seed=5)
    first.put(keys, tids, rows, scores)
    assert {marked_format(m) for _, m in first._read_marks()} == {BF16}
    with pytest.raises(ExternalStorageError, match=rf"holds rows of format {re.escape(BF16)} "
                       rf"and this module's rows are {re.escape(F16)}"):
        _spec(cluster, "format", resume=True).open("t", WIDTH, F16)
    found, got = first.get(keys, tids)  # its marks and write counts are as they were
    assert bool(found.all()) and stored(got) == as_dict(keys, tids, rows, scores)
    first.put(keys[:5], tids[:5], rows[:5], scores[:5])
    assert first._write_marks(OLD_MARK, replace=True)  # as an older version marked it
    with pytest.raises(ExternalStorageError, match=r"format float32 \(written before formats "
                       rf"were recorded\) and this module's rows are {re.escape(BF16)}"):
        _spec(cluster, "format", resume=True).open("t", WIDTH, BF16)
    resumed = _spec(cluster, "format", resume=True).open("t", WIDTH, FLOAT32)
    assert {marked_format(m) for _, m in resumed._read_marks()} == {FLOAT32}
    found, got = resumed.get(keys, tids)
    assert bool(found.all()) and stored(got) == as_dict(keys, tids, rows, scores)
    first.close()
    resumed.close()


def test_an_unreachable_cluster_fails_the_construction_by_name():
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ExternalStorageError,
                       match=rf"redis\+cluster://{address}.*failed to open"):
        make_module(DynamicEmbOptimType.EXACT_SGD, LFU, f"redis+cluster://{address}")


def test_slots_migrated_during_training_lose_nothing(cluster):
    """``redis-cli --cluster reshard`` moves slots (and the store's keys in them)
    while training runs; calls that meet a slot in flight fail by name and run again
    (MOVED/ASK are the client's), and the rows end equal to the in-memory run's."""
    data = batches(seed=5, steps=12)
    reference = make_module(DynamicEmbOptimType.EXACT_SGD, LFU)
    expected = snapshot_after(reference, data)
    module = make_module(DynamicEmbOptimType.EXACT_SGD, LFU, _spec(cluster, "reshard"))
    for batch in data[:4]:
        _step_until_it_runs(module, batch, time.monotonic() + 30)
    before = cluster.primary_ids()
    moving = cluster.reshard(4096)
    try:
        deadline = time.monotonic() + 60
        for batch in data[4:]:
            _step_until_it_runs(module, batch, deadline)
        assert moving.wait(timeout=60) == 0
    finally:
        if moving.poll() is None:
            moving.kill()
    slots = cluster.cli("cluster", "nodes")
    assert before == cluster.primary_ids() and slots  # the same primaries, slots moved
    assert_identical(snapshot(module), expected)
