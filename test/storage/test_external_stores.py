"""One suite for every external store (RocksDB, a Redis server): the batched verbs
against a dict model, namespaces, scans, clear, bad rows (a Redis Cluster:
test_redis_cluster.py)."""

import re
from dataclasses import replace

import pytest
import torch

pytest.importorskip("rocksdict", reason="the external stores are tested against the real rocksdict (requirements.txt pins it)")
pytest.importorskip("redis", reason="the external stores are tested against the real redis (requirements.txt pins it)")

from dynamicemb.ops.interface import RowFormat
from dynamicemb.storage.external import ExternalStorageError, KVStore, RedisStorage, as_storage_spec
from dynamicemb.kvstore.redis_cluster import partition_of

WIDTH = 5
FLOAT32 = RowFormat(torch.float32, WIDTH, 0).tag  # rows of WIDTH float32 words
# 16-bit rows of WIDTH words too: a dim-8 embedding and a float32 state
BF16, F16 = (RowFormat(d, 8, 1).tag for d in (torch.bfloat16, torch.float16))
#: A mark as versions before the row format was recorded wrote it.
OLD_MARK = b"opened by pid 1 on oldhost at 2024-01-01 00:00:00 UTC, owner 0123abcd"


def entries(n: int, seed: int, offset: int = 0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(-2**62, 2**62, (n,), generator=gen) + offset
    keys = keys.unique()
    n = keys.numel()
    tids = torch.randint(0, 3, (n,), generator=gen)
    rows = torch.randn(n, WIDTH, generator=gen)
    scores = torch.randint(0, 2**40, (n,), generator=gen)
    return keys, tids, rows, scores


def as_dict(keys, tids, rows, scores):
    return {(int(k), int(t)): (r.tolist(), int(s)) for k, t, r, s in zip(keys, tids, rows, scores)}


def stored(part):
    return as_dict(part.keys, part.table_ids, part.rows, part.scores)


def scanned(store: KVStore, chunk: int = 7):
    out = {}
    for part in store.scan(chunk):
        assert part.keys.numel() <= chunk
        out.update(stored(part))
    return out


@pytest.fixture
def store(store_spec):
    s = store_spec.open("suite", WIDTH, FLOAT32)
    yield s
    s.close()


def test_put_get_delete_against_a_dict(store):
    model = {}
    keys, tids, rows, scores = entries(300, seed=1)
    store.put(keys, tids, rows, scores)
    model.update(as_dict(keys, tids, rows, scores))
    # overwrite half, with other rows and scores; same key under another table id is another entry
    half = keys.numel() // 2
    rows2, scores2 = rows[:half] * 2, scores[:half] + 1
    store.put(keys[:half], tids[:half], rows2, scores2)
    model.update(as_dict(keys[:half], tids[:half], rows2, scores2))
    other = (tids[:10] + 1) % 3
    store.put(keys[:10], other, rows[:10] + 7, scores[:10])
    model.update(as_dict(keys[:10], other, rows[:10] + 7, scores[:10]))
    store.delete(keys[half:half + 20], tids[half:half + 20])
    for k, t in zip(keys[half:half + 20], tids[half:half + 20]):
        del model[(int(k), int(t))]
    probe_k = torch.cat([keys, keys[:10], torch.tensor([12345])])
    probe_t = torch.cat([tids, (tids[:10] + 1) % 3, torch.tensor([0])])
    found, got = store.get(probe_k, probe_t)
    want = [(int(k), int(t)) in model for k, t in zip(probe_k, probe_t)]
    assert found.tolist() == want
    assert stored(got) == {key: model[key] for key, w in
                             zip(zip(probe_k.tolist(), probe_t.tolist()), want) if w}
    assert scanned(store) == model
    store.flush()


def test_rows_are_bit_exact(store):
    keys = torch.tensor([0, -1, 2**63 - 1, -2**63])
    tids = torch.tensor([0, 1, 2, 32766])
    rows = torch.tensor([[float("nan"), float("inf"), -0.0, 1e-45, -3.4e38]] * 4)
    scores = torch.tensor([0, 2**63 - 1, 1, 5])
    store.put(keys, tids, rows, scores)
    found, got = store.get(keys, tids)
    assert bool(found.all())
    assert torch.equal(got.keys, keys) and torch.equal(got.scores, scores)
    assert torch.equal(got.rows.view(torch.int32), rows.view(torch.int32))


def test_namespaces_are_apart_and_clear_empties_one(store_spec):
    a, b = store_spec.open("a", WIDTH, FLOAT32), store_spec.open("b", WIDTH, FLOAT32)
    keys, tids, rows, scores = entries(50, seed=2)
    a.put(keys, tids, rows, scores)
    b.put(keys[:5], tids[:5], rows[:5], scores[:5])
    assert len(scanned(a)) == keys.numel() and len(scanned(b)) == 5
    a.clear()
    assert scanned(a) == {} and len(scanned(b)) == 5
    assert not bool(a.get(keys, tids)[0].any())
    a.close(), b.close()


def test_a_row_of_another_width_is_refused_by_name(store_spec):
    wide_format = RowFormat(torch.float32, WIDTH + 1, 0).tag
    wide = store_spec.open("w", WIDTH + 1, wide_format)
    keys, tids, rows, scores = entries(8, seed=3)
    wide.put(keys, tids, torch.cat([rows, rows[:, :1]], 1), scores)
    wide.close()  # RocksDB: one process opens a database once at a time
    # its mark names its format: a resume of another refuses by name, before any read
    with pytest.raises(ExternalStorageError, match=rf"format {re.escape(wide_format)} and "
                       rf"this module's rows are {re.escape(FLOAT32)}"):
        replace(store_spec, resume=True).open("w", WIDTH, FLOAT32)
    # a value of another size (damage: written by hand here) is refused where it is read
    narrow = replace(store_spec, run="n").open("w", WIDTH, FLOAT32)
    narrow._put(narrow._pack_keys(keys, tids), [bytes(32)] * keys.numel())
    with pytest.raises(ExternalStorageError, match=r"\[32\] bytes, expected 28"):
        narrow.get(keys, tids)
    with pytest.raises(ExternalStorageError, match=narrow.name.split("/")[0]):
        list(narrow.scan())
    with pytest.raises(ValueError, match="rows must have shape"):
        narrow.put(keys, tids, rows[:, :2], scores)
    narrow.close()


def test_empty_batches(store):
    e = torch.empty(0, dtype=torch.int64)
    store.put(e, e, torch.empty(0, WIDTH), e)
    found, got = store.get(e, e)
    assert found.numel() == 0 and got.rows.shape == (0, WIDTH)
    store.delete(e, e)
    assert scanned(store) == {}


def test_spec_strings():
    assert type(as_storage_spec("/tmp/x")).__name__ == "RocksDBStorage"
    assert as_storage_spec("redis://127.0.0.1:1/").address == "127.0.0.1:1"
    assert RedisStorage(("127.0.0.1:1",)).address == "127.0.0.1:1"
    with pytest.raises(ValueError, match="host:port"):
        as_storage_spec("redis://nohost")
    with pytest.raises(ValueError, match="external_storage must be"):
        as_storage_spec(42)
    for several in (lambda: as_storage_spec("redis://127.0.0.1:1,localhost:2"),
                    lambda: RedisStorage(("127.0.0.1:1", "localhost:2"))):
        with pytest.raises(ValueError, match=r"are a Redis Cluster now.*redis\+cluster://"):
            several()


def test_the_cluster_partition_hash_spreads_keys_evenly():
    keys = torch.arange(100_000) * 4096  # strided keys: a low-bit hash would pile them up
    counts = torch.bincount(partition_of(keys, torch.zeros_like(keys), 3), minlength=3)
    assert int(counts.min()) > 0.3 * keys.numel()
