"""The table's round trips over value dtype x value dim x score strategy.

Each test is small; the grid does the covering. The bulk test runs 200k keys through the
parallel kernels and compares them with the reference model; the last ones check that
results depend neither on the thread count nor on the inputs' strides.
"""

import random

import pytest
import torch

from dynamicemb_testing.reference_table import ReferenceHashTable, ref_hash
from dynamicemb_testing.table_testing import (
    STRATEGIES,
    VALUE_DTYPES,
    Pair,
    as_keys,
    export_map,
    make_table,
    py_export,
    py_stats,
    rows_of,
)

DIMS = [0, 1, 8, 128]
GRID = pytest.mark.parametrize("strategy", STRATEGIES)
DTYPES = pytest.mark.parametrize("dtype", VALUE_DTYPES, ids=lambda d: str(d).split(".")[-1])
DIMS_P = pytest.mark.parametrize("dim", DIMS)


def distinct_keys(n: int, seed: int) -> list:
    rng = random.Random(seed)
    keys = [-(2**63), 2**63 - 1, -1, 0]
    seen = set(keys)
    while len(keys) < n:
        k = rng.randrange(-(2**63), 2**63)
        if k not in seen:
            seen.add(k)
            keys.append(k)
    return keys[:n]


def exact_values(n: int, dim: int, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    """Small integers and halves: exact in every tested float dtype, bfloat16 included.
    Drawn on the CPU, so every device gets the same values."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-64, 64, (n, dim), generator=g) / 2).to(device=device, dtype=dtype)


def scores_for(strategy: str, n: int, seed: int, device="cpu"):
    if strategy != "CUSTOMIZED":
        return None
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1000, (n,), generator=g, dtype=torch.int64).to(device)


def grid_table(strategy, dtype, dim, device, **kw):
    kw.setdefault("capacity", 256)
    kw.setdefault("bucket_capacity", 32)
    kw.setdefault("max_load_factor", 1.0)
    return make_table(score_strategy=strategy, value_dtype=dtype, value_dim=dim, num_tables=4,
                      device=device, **kw)


@GRID
@DIMS_P
@DTYPES
def test_insert_or_assign_then_find(strategy, dtype, dim, device):
    t = grid_table(strategy, dtype, dim, device)
    n = 100
    keys = as_keys(distinct_keys(n, 1), device)
    tids = torch.arange(n, device=device) % 4
    values = exact_values(n, dim, dtype, 2, device)
    res = t.insert_or_assign(keys, values, tids, scores=scores_for(strategy, n, 3, device))
    assert res.evicted is None and bool(res.inserted.all())
    slots = t.find(keys, tids)
    assert torch.equal(slots, res.slots)
    assert t.values.dtype == dtype and tuple(t.values.shape) == (t.capacity(), dim)
    assert torch.equal(t.values[slots], values)
    # overwrite half of them: the new rows replace the old ones in the same slots
    new = exact_values(n // 2, dim, dtype, 4, device)
    res2 = t.insert_or_assign(keys[::2], new, tids[::2], scores=scores_for(strategy, n // 2, 5, device))
    assert not bool(res2.inserted.any()) and torch.equal(res2.slots, slots[::2])
    assert torch.equal(t.values[slots[::2]], new) and torch.equal(t.values[slots[1::2]], values[1::2])


@GRID
@DIMS_P
@DTYPES
def test_growth_keeps_keys_values_scores(strategy, dtype, dim, device):
    bc = 16
    t = grid_table(strategy, dtype, dim, device, capacity=bc, bucket_capacity=bc, max_capacity=128 * bc,
                   max_load_factor=0.5)
    keys = distinct_keys(600, 7)
    seen = {}
    for i in range(0, 600, 75):
        if strategy == "STEP":
            t.set_step(i)
        before = export_map(py_export(t.export_batch()))
        chunk = as_keys(keys[i : i + 75], device)
        tids = torch.arange(75, device=device) % 4
        values = exact_values(75, dim, dtype, i, device)
        res = t.insert_or_assign(chunk, values, tids, scores=scores_for(strategy, 75, i, device))
        assert bool(res.inserted.all()) and t.stats.evictions == 0
        after = export_map(py_export(t.export_batch()))
        assert {k: after[k] for k in before} == before  # untouched keys keep score and row
        seen.update(zip(zip(tids.tolist(), chunk.tolist()), rows_of(values)))
    assert t.stats.growths >= 5 and t.capacity() >= 1200
    final = export_map(py_export(t.export_batch()))
    assert {k: v for k, (_, v) in final.items()} == seen
    # growth keeps the in-bucket offset and moves each key to the bucket of its hash
    ex = py_export(t.export_batch())
    nb = t.num_buckets
    assert all(s // bc == ref_hash(tid, k) & (nb - 1) for k, tid, s in zip(ex[0], ex[1], ex[3]))


@GRID
@DIMS_P
@DTYPES
def test_erase_then_find(strategy, dtype, dim, device):
    t = grid_table(strategy, dtype, dim, device)
    n = 120
    keys = as_keys(distinct_keys(n, 11), device)
    tids = torch.arange(n, device=device) % 3
    values = exact_values(n, dim, dtype, 12, device)
    res = t.insert_or_assign(keys, values, tids, scores=scores_for(strategy, n, 13, device))
    gone = torch.arange(n, device=device) % 3 == 0
    erase_keys = torch.cat([keys[gone], keys[gone][:1]])  # a key given twice is erased once
    erase_tids = torch.cat([tids[gone], tids[gone][:1]])
    erased = t.erase(erase_keys, erase_tids)
    assert erased.tolist() == [True] * int(gone.sum()) + [False]
    assert t.size() == n - int(gone.sum()) and t.stats.erases == int(gone.sum())
    slots = t.find(keys, tids)
    assert bool((slots[gone] == -1).all()) and torch.equal(slots[~gone], res.slots[~gone])
    assert torch.equal(t.values[slots[~gone]], values[~gone])
    assert not bool(t.erase(keys[gone], tids[gone]).any())


@GRID
@DIMS_P
@DTYPES
def test_export_windows_and_min_score(strategy, dtype, dim, device):
    t = grid_table(strategy, dtype, dim, device, capacity=1024)
    keys = distinct_keys(300, 21)
    for i in range(0, 300, 60):  # several calls, so LRU/STEP/LFU scores differ
        t.set_step(i)
        chunk = as_keys(keys[i : i + 60] + keys[: i // 4], device)
        n = len(chunk)
        t.insert_or_assign(chunk, exact_values(n, dim, dtype, i, device),
                           torch.zeros(n, dtype=torch.int64, device=device),
                           scores=scores_for(strategy, n, i, device))
    full = py_export(t.export_batch())
    assert len(full[0]) == t.size() == 300 and full[3] == sorted(full[3])
    assert rows_of(t.values[torch.tensor(full[3], device=device)]) == full[4]
    for window in (3, 37, 128, 1024):
        parts = [py_export(t.export_batch(s, window)) for s in range(0, t.capacity(), window)]
        assert tuple(sum((p[f] for p in parts), []) for f in range(5)) == full
    scores = sorted(set(full[2]))
    for min_score in (scores[0], scores[len(scores) // 2], scores[-1], scores[-1] + 1):
        got = py_export(t.export_batch(min_score=min_score))
        keep = [i for i, s in enumerate(full[2]) if s >= min_score]
        assert got == tuple([col[i] for i in keep] for col in full)
        part = py_export(t.export_batch(100, 200, min_score=min_score))
        keep = [i for i in keep if 100 <= full[3][i] < 300]
        assert part == tuple([col[i] for i in keep] for col in full)


@pytest.mark.parametrize("strategy", ["LRU", "CUSTOMIZED"])
def test_bulk_round_trip_matches_model(strategy, device):
    n, bc = 200_000, 128
    p = Pair(capacity=64 * bc, bucket_capacity=bc, max_capacity=4096 * bc, max_load_factor=0.75,
             score_strategy=strategy, num_tables=8, device=device)
    rng = random.Random(5)
    keys = [rng.randrange(-(2**40), 2**40) for _ in range(n)]  # some duplicates on purpose
    keys[:1000] = keys[1000:2000]
    tids = [rng.randrange(8) for _ in range(n)]
    scores = [rng.randrange(1 << 20) for _ in range(n)] if strategy == "CUSTOMIZED" else None
    out = p.check("find_or_insert", keys, tids, scores=scores)
    assert sum(out[1]) == len(set(zip(tids, keys))) == p.real.size()
    p.assert_same_state()
    # a second pass of hits (it may grow first: the load factor is now past 0.75), then find
    scores2 = [s + 1 for s in scores] if scores else None
    out2 = p.check("find_or_insert", keys[::-1], tids[::-1], scores=scores2)
    assert not any(out2[1])
    found = p.check("find", keys, tids)
    assert found == out2[0][::-1] and -1 not in found
    p.assert_same_state()


@pytest.mark.parametrize(
    "capacity, max_capacity, bc, nb, max_nb",
    [(1, None, 16, 1, 1), (16, None, 16, 1, 1), (17, None, 16, 2, 2), (100, 1000, 32, 4, 32),
     (1024, None, 128, 8, 8), (1025, 1025, 128, 16, 16), (1000, 1024, 128, 8, 8)],
)
def test_capacity_rounding(capacity, max_capacity, bc, nb, max_nb, device):
    t = make_table(capacity=capacity, max_capacity=max_capacity, bucket_capacity=bc, device=device)
    ref = ReferenceHashTable(capacity=capacity, max_capacity=max_capacity, bucket_capacity=bc)
    assert (t.num_buckets, t.capacity(), t.max_capacity()) == (nb, nb * bc, max_nb * bc)
    assert (ref.num_buckets, ref.capacity(), ref.max_capacity()) == (nb, nb * bc, max_nb * bc)
    assert t.bucket_capacity == bc and t.size() == 0 and t.load_factor() == 0.0
    assert tuple(t.values.shape) == (nb * bc, 0)


def test_timestamp_is_lru(device):
    from dynamicemb import DynamicEmbScoreStrategy

    assert DynamicEmbScoreStrategy.TIMESTAMP is DynamicEmbScoreStrategy.LRU
    t = make_table(capacity=16, bucket_capacity=16, score_strategy=DynamicEmbScoreStrategy.TIMESTAMP,
                   device=device)
    for _ in range(3):
        t.find_or_insert(as_keys([1], device))
    t.find_or_insert(as_keys([2], device))
    assert t.export_batch().scores.tolist() == [3, 4]


def run_eviction_workload(num_threads: int, contiguous: bool = True, device="cpu") -> list:
    """Two overfull insert_and_evict calls, a find and an erase; everything observable.
    ``num_threads`` is the CPU kernels' OpenMP thread count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        t = make_table(capacity=64 * 32, bucket_capacity=32, max_capacity=128 * 32, num_tables=3,
                       score_strategy="CUSTOMIZED", value_dim=4, max_load_factor=0.5, device=device)
        rng = random.Random(9)
        out = []
        for call in range(2):
            n = 6000
            keys = as_keys([rng.randrange(-5000, 5000) for _ in range(n)], device)
            tids = torch.tensor([rng.randrange(3) for _ in range(n)], device=device)
            scores = torch.tensor([rng.randrange(50) for _ in range(n)], device=device)
            values = exact_values(n, 4, torch.float32, call, device)
            if not contiguous:  # strided views of the same data
                keys, tids, scores = (torch.stack([x, x], 1)[:, 0] for x in (keys, tids, scores))
                values = torch.cat([values, values], 1)[:, :4]
            res = t.insert_and_evict(keys, values, tids, scores)
            out += [res.slots.tolist(), res.inserted.tolist(), py_export(res.evicted)]
            out += [t.find(keys, tids).tolist(), t.erase(keys[::7], tids[::7]).tolist()]
        assert t.stats.evictions > 0 and t.stats.failed_inserts > 0 and t.stats.growths > 0
        return out + [py_export(t.export_batch()), t.clock, py_stats(t.stats)]
    finally:
        torch.set_num_threads(previous)


# CPU only: OpenMP thread counts of the CPU kernels.
def test_results_do_not_depend_on_thread_count():
    one = run_eviction_workload(1)
    assert run_eviction_workload(2) == one
    assert run_eviction_workload(5) == one


def test_strided_inputs_match_contiguous(device):
    strided = run_eviction_workload(2, contiguous=False, device=device)
    assert strided == run_eviction_workload(2, device=device)


def test_lfu_scores_saturate_at_int64_max(device):
    """LFU counts never wrap into negative scores (kernel and model agree)."""
    pair = Pair(score_strategy="LFU", capacity=16, bucket_capacity=16, device=device)
    pair.check("find_or_insert", [1], scores=[2**63 - 2])
    pair.check("find_or_insert", [1, 1], scores=[5, 1])
    pair.assert_same_state()
    assert pair.real.export_batch().scores.tolist() == [2**63 - 1]
    assert pair.real.export_batch(min_score=0).keys.tolist() == [1]
