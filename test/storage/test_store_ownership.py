"""Whose rows a store holds, with the real stores: a new module never inherits rows
it did not write (a reused RocksDB directory or Redis namespace is refused by name,
or taken over on request), two live modules never mix, a locked directory and a
server that lost its data fail by name, and nothing changes when they do."""

import gc
import os
import re
import shutil
from dataclasses import replace

import pytest
import torch

pytest.importorskip("rocksdict", reason="the external stores are tested against the real rocksdict (requirements.txt pins it)")
pytest.importorskip("redis", reason="the external stores are tested against the real redis (requirements.txt pins it)")

from dynamicemb import DynamicEmbDump, DynamicEmbLoad, DynamicEmbOptimType
from dynamicemb.kvstore.store import MARK, marked_format
from dynamicemb.ops.interface import RowFormat
from dynamicemb.storage.external import ExternalStorageError, RedisStorage, RocksDBStorage
from test_exactness import assert_identical, snapshot, train
from test_external_tier import LRU, batches, below, make_module

ADAM = DynamicEmbOptimType.ADAM
TABLES = r"\['a', 'b'\]"


def module_on(external):
    return make_module(ADAM, LRU, external)


def host_rows(module):
    """The host store's rows (keys, table ids, scores, values) in key order: what a
    failed step must leave as it was when the store below can no longer be read."""
    rows = module._groups[0].storage.export()
    order = torch.argsort(rows.keys * 4 + rows.table_ids)
    return [t[order] for t in (rows.keys, rows.table_ids, rows.scores, rows.values)]


def assert_same_host_rows(a, b):
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_reused_rocksdb_directory_is_refused_by_name_unless_resumed(tmp_path):
    path = str(tmp_path / "rows")
    data = batches(steps=6)
    first = module_on(path)
    train(first, data, prefetch=False)
    assert below(first)[0] > 0  # rows went down to the directory
    left_below = {t: first.table_size(t) for t in "ab"}
    DynamicEmbDump(str(tmp_path / "ck"), first)
    expected = snapshot(first)
    del first
    gc.collect()  # closes its database
    # a new module on the same directory: refused, by store, tables and the way out
    with pytest.raises(ExternalStorageError, match=rf"rocksdb:{path}.* already holds the rows of "
                       rf"another module.*resume=True.*run=.*{TABLES}"):
        module_on(path)
    # its own run name: an empty store, trained as a fresh module is
    fresh = module_on(RocksDBStorage(path, run="second"))
    assert all(fresh.table_size(t) == 0 for t in "ab")
    reference = make_module(ADAM, LRU)
    assert all(torch.equal(a, b) for a, b in zip(train(fresh, data[:3], prefetch=False),
                                                 train(reference, data[:3], prefetch=False)))
    # resume=True takes over the rows the first module left below (not its host rows)
    resumed = module_on(RocksDBStorage(path, resume=True))
    below_rows = {t: resumed.table_size(t) for t in "ab"}
    assert 0 < below_rows["a"] < left_below["a"]
    for t in "ab":
        got = resumed.export_keys_values(t)
        want = expected[t]
        at = torch.searchsorted(want[0], got.keys)
        assert torch.equal(want[0][at], got.keys) and torch.equal(want[1][at], got.embeddings)
    # and a checkpoint load rebuilds the store: the exact continuation of the run
    DynamicEmbLoad(str(tmp_path / "ck"), resumed)
    assert_identical(snapshot(resumed), expected)


def test_a_directory_open_in_another_module_is_refused_by_name(tmp_path):
    path = str(tmp_path / "rows")
    data = batches(steps=4)
    first = module_on(path)
    train(first, data[:2], prefetch=False)
    before = snapshot(first)
    for spec in (path, RocksDBStorage(path, resume=True)):
        with pytest.raises(ExternalStorageError, match=rf"rocksdb:{path}.*failed to open its "
                           rf"directory: another module or process has it open.*{TABLES}"):
            module_on(spec)
    assert_identical(snapshot(first), before)  # the open module is untouched
    reference = make_module(ADAM, LRU)
    assert all(torch.equal(a, b) for a, b in zip(train(first, data[2:], prefetch=False),
                                                 train(reference, data, prefetch=False)[2:]))


def test_a_directory_removed_while_open_fails_the_step_by_name(tmp_path):
    path = tmp_path / "rows"
    data = batches(steps=4)
    module = module_on(str(path))
    train(module, data[:3], prefetch=False)
    before = host_rows(module)
    shutil.rmtree(path)
    with pytest.raises(ExternalStorageError, match=rf"rocksdb:{path}.*no longer holds the "
                       rf"database this module opened.*changed nothing.*{TABLES}"):
        module(*data[3])
    assert_same_host_rows(host_rows(module), before)


def test_two_modules_on_one_redis_server_never_mix(redis_servers):
    (server,) = redis_servers(1)
    data_one, data_two = batches(seed=3, steps=8), batches(seed=7, steps=8)
    one = module_on(RedisStorage(server.address))
    ref_one = make_module(ADAM, LRU)
    train(one, data_one[:1], prefetch=False), train(ref_one, data_one[:1], prefetch=False)
    # same table names on the same server: refused by name
    with pytest.raises(ExternalStorageError, match=rf"redis://{server.address}/a_b already holds "
                       rf"the rows of another module.*'a_b:\*'.*{TABLES}"):
        module_on(f"redis://{server.address}")
    # a run name of its own: the two train side by side, each as if alone
    two = module_on(RedisStorage(server.address, run="two"))
    ref_two = make_module(ADAM, LRU)
    for k in range(1, 8):
        a, b = train(one, data_one[k:k + 1], prefetch=False), train(two, data_two[k:k + 1],
                                                                    prefetch=False)
        assert torch.equal(a[0], train(ref_one, data_one[k:k + 1], prefetch=False)[0]), k
        assert torch.equal(b[0], train(ref_two, data_two[k:k + 1], prefetch=False)[0]), k
    assert below(one)[1] > 0 and below(two)[1] > 0  # both read rows back from the server
    assert_identical(snapshot(one), snapshot(ref_one))
    assert_identical(snapshot(two), snapshot(ref_two))
    # a module that resumes from the first one's namespace takes it over: the first
    # fails its next step by name, and changes nothing
    taker = module_on(RedisStorage(server.address, resume=True))
    before = host_rows(one)
    with pytest.raises(ExternalStorageError, match=rf"redis://{server.address}/a_b: another "
                       rf"module took server {server.address} over.*changed nothing.*{TABLES}"):
        train(one, batches(seed=5, steps=1), prefetch=False)
    assert_same_host_rows(host_rows(one), before)
    assert taker.table_size("a") > 0  # the rows the first module left below


def test_a_redis_server_restarted_without_its_data_fails_every_step_by_name(redis_servers,
                                                                           tmp_path):
    (server,) = redis_servers(1)  # no AOF, no RDB: a restart loses every row
    spec = RedisStorage(server.address, timeout=2.0)
    data = batches(steps=9)
    module = module_on(spec)
    train(module, data[:5], prefetch=False)
    assert below(module)[0] > 0
    DynamicEmbDump(str(tmp_path / "ck"), module)
    reference = make_module(ADAM, LRU)
    DynamicEmbLoad(str(tmp_path / "ck"), reference)
    server.kill()
    server.start()
    before = host_rows(module)
    lost = rf"redis://{server.address}/a_b: server {server.address} no longer holds this module's rows: it lost its data"
    for _ in range(2):  # no step goes on as if the rows were new
        with pytest.raises(ExternalStorageError, match=rf"{lost}.*changed nothing.*{TABLES}"):
            module(*data[5])
        assert_same_host_rows(host_rows(module), before)
    with pytest.raises(ExternalStorageError, match=lost):
        module.export_keys_values("a")
    import redis
    assert redis.Redis(host="127.0.0.1", port=server.port).dbsize() == 0  # nothing written
    # the way on: a new module (the server's namespace is empty) loads the checkpoint
    del module
    gc.collect()
    again = module_on(spec)
    DynamicEmbLoad(str(tmp_path / "ck"), again)
    assert all(torch.equal(a, b) for a, b in zip(train(again, data[5:], prefetch=False),
                                                 train(reference, data[5:], prefetch=False)))
    assert_identical(snapshot(again), snapshot(reference))


def test_a_redis_error_names_no_raw_key_bytes(redis_servers):
    import redis
    (server,) = redis_servers(1)
    module = module_on(RedisStorage(server.address, timeout=2.0))
    data = batches(steps=6)
    train(module, data[:4], prefetch=False)
    client = redis.Redis(host="127.0.0.1", port=server.port)
    client.config_set("maxmemory", client.info("memory")["used_memory"] + 256)
    client.config_set("maxmemory-policy", "noeviction")
    with pytest.raises(ExternalStorageError) as error:
        train(module, data[4:], prefetch=False)
    text = str(error.value)
    assert "OutOfMemory" in text and "['a', 'b']" in text
    assert "\\x" not in text and "Command #" not in text and "EVAL" not in text.upper()


@pytest.mark.parametrize("kind", ["rocksdb", "redis"])
def test_store_level_takeover_and_loss(kind, tmp_path, redis_servers):
    """The verbs of a store another one took over, or whose servers lost their data,
    fail by name and write nothing."""
    from test_external_stores import FLOAT32, WIDTH, entries
    if kind == "rocksdb":
        spec = RocksDBStorage(str(tmp_path / "db"))
    else:
        (server,) = redis_servers(1)
        spec = RedisStorage(server.address, timeout=2.0)
    keys, tids, rows, scores = entries(64, seed=1)
    first = spec.open("ns", WIDTH, FLOAT32)
    first.put(keys, tids, rows, scores)
    refused = ("another module or process has it open" if kind == "rocksdb"  # its lock
               else "already holds the rows of another module")  # the mark
    with pytest.raises(ExternalStorageError, match=refused):
        spec.open("ns", WIDTH, FLOAT32)
    if kind == "rocksdb":
        first.close()
        with pytest.raises(ExternalStorageError, match="already holds the rows of another"):
            spec.open("ns", WIDTH, FLOAT32)
        resumed = RocksDBStorage(spec.path, resume=True).open("ns", WIDTH, FLOAT32)
        assert bool(resumed.get(keys, tids)[0].all())
        resumed.close()
        return
    second = RedisStorage(spec.address, resume=True).open("ns", WIDTH, FLOAT32)
    for verb in (lambda: first.get(keys, tids), lambda: first.delete(keys, tids),
                 lambda: first.put(keys, tids, rows * 0, scores), lambda: list(first.scan())):
        with pytest.raises(ExternalStorageError, match="another module took server"):
            verb()
    found, got = second.get(keys, tids)
    assert bool(found.all()) and torch.equal(got.rows, rows)  # the first wrote nothing
    import redis
    redis.Redis(host="127.0.0.1", port=server.port).flushall()  # the server loses its data
    with pytest.raises(ExternalStorageError, match=f"server {server.address} no longer holds"):
        second.get(keys, tids)
    with pytest.raises(ExternalStorageError, match=f"server {server.address} no longer holds"):
        second.put(keys, tids, rows, scores)
    assert redis.Redis(host="127.0.0.1", port=server.port).dbsize() == 0


def _store_spec(kind, tmp_path, redis_servers):
    if kind == "rocksdb":
        return RocksDBStorage(str(tmp_path / "db"))
    (server,) = redis_servers(1)
    return RedisStorage(server.address, timeout=2.0)


def raw_mark(spec, namespace="ns"):
    """The mark namespace ``namespace`` of ``spec`` holds, read past the store classes."""
    if isinstance(spec, RocksDBStorage):
        import rocksdict
        db = rocksdict.Rdict(os.path.join(spec.path, namespace),
                             rocksdict.Options(raw_mode=True))
        try:
            return db.get(MARK)
        finally:
            db.close()
    import redis
    host, port = spec.address.rsplit(":", 1)
    client = redis.Redis(host=host, port=int(port))
    try:
        return client.get(namespace.encode() + b":" + MARK)
    finally:
        client.close()


def _close_if_rocksdb(store):
    if "rocksdb" in store.name:  # a directory is open once at a time
        store.close()


@pytest.mark.parametrize("kind", ["rocksdb", "redis"])
def test_the_row_format_is_recorded_and_another_is_refused_by_name(kind, tmp_path,
                                                                   redis_servers):
    """bfloat16 and float16 rows of one width (and float32 rows of it): a resume by
    another format is refused, naming both, and changes nothing."""
    from test_external_stores import BF16, F16, FLOAT32, WIDTH, entries
    spec = _store_spec(kind, tmp_path, redis_servers)
    keys, tids, rows, scores = entries(64, seed=2)
    for bad in ("bfloat16 rows", "", None):
        with pytest.raises(ValueError, match="row_format must be a RowFormat tag"):
            spec.open("ns", WIDTH, bad)
    first = spec.open("ns", WIDTH, BF16)
    first.put(keys, tids, rows, scores)
    assert [marked_format(m) for _, m in first._read_marks()] == [BF16]
    _close_if_rocksdb(first)
    mark = raw_mark(spec)
    for other in (F16, FLOAT32):
        with pytest.raises(ExternalStorageError, match=rf"{re.escape(first.name)}: resume=True, "
                           rf"but .* holds rows of format {re.escape(BF16)} and this module's "
                           rf"rows are {re.escape(other)}"):
            replace(spec, resume=True).open("ns", WIDTH, other)
        assert raw_mark(spec) == mark  # nothing changed
    if kind == "redis":  # the first store still owns its rows
        found, got = first.get(keys, tids)
        assert bool(found.all()) and torch.equal(got.rows, rows)
    resumed = replace(spec, resume=True).open("ns", WIDTH, BF16)
    found, got = resumed.get(keys, tids)
    assert bool(found.all()) and torch.equal(got.rows.view(torch.int32), rows.view(torch.int32))
    resumed.close()


@pytest.mark.parametrize("kind", ["rocksdb", "redis"])
def test_a_store_without_a_recorded_format_holds_float32_rows(kind, tmp_path, redis_servers):
    """A mark an older version wrote names no format: its rows are float32 ones."""
    from test_external_stores import BF16, FLOAT32, OLD_MARK, WIDTH, entries
    spec = _store_spec(kind, tmp_path, redis_servers)
    keys, tids, rows, scores = entries(64, seed=4)
    old = spec.open("ns", WIDTH, FLOAT32)
    old.put(keys, tids, rows, scores)
    assert old._write_marks(OLD_MARK, replace=True)  # as an older version marked it
    _close_if_rocksdb(old)
    assert marked_format(raw_mark(spec)) == "float32"
    with pytest.raises(ExternalStorageError, match=r"holds rows of format float32 \(written "
                       rf"before formats were recorded\) and this module's rows are "
                       rf"{re.escape(BF16)}"):
        replace(spec, resume=True).open("ns", WIDTH, BF16)
    assert raw_mark(spec) == OLD_MARK  # nothing changed
    resumed = replace(spec, resume=True).open("ns", WIDTH, FLOAT32)
    found, got = resumed.get(keys, tids)
    assert bool(found.all()) and torch.equal(got.rows, rows)
    _close_if_rocksdb(resumed)
    assert marked_format(raw_mark(spec)) == FLOAT32  # recorded from now on
    if kind == "redis":
        resumed.close()


@pytest.mark.parametrize("resumed_as,refused", [(torch.float16, True), (torch.bfloat16, False)])
def test_a_module_resumes_rows_of_its_own_format_only(tmp_path, resumed_as,
                                                      refused):
    """A bfloat16 module's rows below: a float16 module (rows of the same width) is
    refused by both formats and its tables, a bfloat16 one takes them over."""
    path = str(tmp_path / "rows")
    first = make_module(ADAM, LRU, path, dtype=torch.bfloat16)
    train(first, batches(steps=6), prefetch=False)
    assert below(first)[0] > 0
    kept = {t: first.table_size(t) for t in "ab"}
    del first
    gc.collect()  # closes its database
    spec = RocksDBStorage(path, resume=True)
    mine = RowFormat(resumed_as, 8, 16).tag
    if refused:
        with pytest.raises(ExternalStorageError, match=rf"holds rows of format "
                           rf"{re.escape(RowFormat(torch.bfloat16, 8, 16).tag)} and this "
                           rf"module's rows are {re.escape(mine)}.*{TABLES}"):
            make_module(ADAM, LRU, spec, dtype=resumed_as)
        resumed_as = torch.bfloat16  # nothing changed: the rows are there to resume
    resumed = make_module(ADAM, LRU, spec, dtype=resumed_as)
    assert all(0 < resumed.table_size(t) < kept[t] for t in "ab")  # the rows below


def test_an_open_store_of_another_format_is_refused_by_name(tmp_path):
    from dynamicemb.kvstore.rocksdb import RocksDBStore
    bf16, f16 = (RowFormat(d, 8, 16) for d in (torch.bfloat16, torch.float16))
    store = RocksDBStore(str(tmp_path / "db"), f16.storage_width, f16.tag)
    words = f16.storage_width  # = bf16's
    with pytest.raises(ValueError, match=rf"holds rows of format {re.escape(f16.tag)} \({words} "
                       rf"words\), tables {TABLES} need {re.escape(bf16.tag)} \({words} words\)"):
        make_module(ADAM, LRU, store, dtype=torch.bfloat16)
    store.close()


def test_bad_run_names_are_refused():
    for bad in ("", "a/b", "a:b", "..", 3):
        with pytest.raises(ValueError, match="run must be a name"):
            RocksDBStorage("/x", run=bad)
        with pytest.raises(ValueError, match="run must be a name"):
            RedisStorage("127.0.0.1:1", run=bad)
    with pytest.raises(ValueError, match="resume must be True or False"):
        RedisStorage("127.0.0.1:1", resume="yes")
