"""``prepare_dedup_find_or_insert`` (the step's call) against its definition: a
dedup, then ``prepare_find_or_insert`` of the unique keys (itself checked against
the reference model in test_hash_table_model.py).

Two identically built tables take the same batches, one through each path; the
dedup, every result, the exported contents and the stats must agree, over growth
mid-call (the step's table reads its failures, ``grows_for_failures``, as the
table's own verbs do), eviction, failed inserts, several tables and both thread
counts. Batches have thousands of keys so that the dedup and the insert really run
on two threads.
"""

import copy
import itertools
import random

import pytest
import torch

from dynamicemb.ops.interface import InsertStatus
from dynamicemb_testing.table_testing import as_keys, make_table, py_export, py_stats

CLOCKED = ["LRU", "STEP", "NO_EVICTION"]


def py_dedup(keys, tids, freqs=None):
    """Unique (table id, key) pairs in first-occurrence order, inverse, summed counts."""
    index, ukeys, utids, counts, inverse = {}, [], [], [], []
    for i, pair in enumerate(zip(tids, keys)):
        if pair not in index:
            index[pair] = len(ukeys)
            utids.append(pair[0])
            ukeys.append(pair[1])
            counts.append(0)
        inverse.append(index[pair])
        counts[index[pair]] += 1 if freqs is None else freqs[i]
    return ukeys, utids, inverse, counts


def skewed_batches(num_batches, n, key_range, num_tables, seed):
    """Batches with many repeats (a few hot keys) and fresh keys in every batch."""
    rng = random.Random(seed)
    batches = []
    for _ in range(num_batches):
        keys = [int(key_range * rng.random() ** 3) for _ in range(n)]
        tids = [rng.randrange(num_tables) for _ in range(n)]
        freqs = [rng.randrange(1, 4) for _ in range(n)]
        batches.append((keys, tids, freqs))
    return batches


def run_both(batches, device, with_freqs=False, **table_kw):
    """Feeds the batches to two twin tables on ``device``, one per path; returns what
    each saw."""
    kw = dict(bucket_capacity=32, max_load_factor=1.0, value_dim=1, device=device, **table_kw)
    kw["num_tables"] = max(max(b[1]) for b in batches) + 1
    plain, fused, halves = make_table(**kw), make_table(**kw), make_table(**kw)
    fused.grows_for_failures = True  # a full bucket grows and reruns, as in the table's verbs
    halves.grows_for_failures = True
    seen = {"plain": [], "fused": [], "halves": [], "fused_calls": 0}
    kernels = fused._ops.kernels  # the device's compiled functions (the CPU or CUDA backend's)

    class CountingKernels:  # counts the fused path's calls (a rerun after growth too)
        def __getattr__(self, name):
            if name == "dedup_upsert":
                seen["fused_calls"] += 1
            return getattr(kernels, name)

    # This table's own copy of its device's backend (the shared one stays as it is),
    # with the kernels behind the counter; the copy keeps any other state it holds.
    fused._ops = copy.copy(fused._ops)
    fused._ops.kernels = CountingKernels()
    for keys, tids, freqs in batches:
        k, t = as_keys(keys, device), torch.tensor(tids, dtype=torch.int16, device=device)
        f = torch.tensor(freqs, dtype=torch.int64, device=device) if with_freqs else None
        for name, table in (("fused", fused), ("plain", plain), ("halves", halves)):
            try:
                if name == "plain":
                    table.set_step(fused.step)  # a step's call advances the step too
                    unique = table._ops.dedup(keys=k, table_ids=t, error=None, frequencies=f,
                                              group=True)
                    u = int((unique.counts > 0).sum())
                    scores = unique.counts[:u] if table.score_strategy.name == "LFU" else None
                    pending = table.prepare_find_or_insert(unique.keys[:u],
                                                           unique.table_ids[:u], scores)
                elif name == "halves":  # every key admitted: the fused call in two
                    unique = table.dedup_batch(k, t, f)
                    pending = table.prepare_insert(unique, torch.ones_like(unique.keys,
                                                                           dtype=torch.bool))
                    u = int((unique.counts > 0).sum())
                else:
                    unique, pending = table.prepare_dedup_find_or_insert(k, t, f)
                    u = int((unique.counts > 0).sum())
                evicted = py_export(pending.evicted())
                result = pending.commit()
                outcome = (result.slots[:u].tolist(), result.inserted[:u].tolist(), evicted)
            except RuntimeError as err:  # ERROR mode: the call was undone
                unique, outcome = None, str(err)
            dedup = None if unique is None else (
                unique.keys[:u].tolist(), unique.table_ids[:u].tolist(),
                unique.inverse.tolist(), unique.counts[:u].tolist(),
                unique.starts[:u + 1].tolist(), unique.rank.tolist())
            seen[name].append((dedup, outcome, py_export(table.export_batch()),
                               py_stats(table.stats), table.capacity(), table.clock))
    return seen, (batches, with_freqs)


def assert_twins(seen, inputs):
    assert seen["fused"] == seen["plain"]
    assert seen["halves"] == seen["fused"]
    batches, with_freqs = inputs
    for (keys, tids, freqs), (dedup, *_rest) in zip(batches, seen["fused"]):
        if dedup is not None:
            ukeys, utids, inverse, counts, starts, rank = dedup
            assert (ukeys, utids, inverse, counts) == py_dedup(
                keys, tids, freqs if with_freqs else None)
            order = sorted(range(len(inverse)), key=lambda j: (inverse[j], j))
            assert [rank[j] for j in order] == list(range(len(inverse)))
            # starts[v + 1]: how many positions map to a unique key <= v (running sum of
            # the per-key counts; counting for each v was quadratic, 10 s per test)
            per_key = [0] * len(ukeys)
            for u in inverse:
                per_key[u] += 1
            assert starts == [0] + list(itertools.accumulate(per_key))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("strategy", CLOCKED + ["LFU"])
def test_growth_mid_call_matches_dedup_then_insert(strategy, threads, device):
    """A small table that grows while batches arrive: a call whose keys found full
    buckets is undone, the table grows, the call runs again."""
    if device.type != "cpu" and threads != 1:
        pytest.skip("threads is the CPU kernels' OpenMP thread count; other devices run once")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batches = skewed_batches(4, 6000, 20000, 1, seed=1)
        seen, inputs = run_both(batches, device, capacity=64, max_capacity=1 << 15,
                                score_strategy=strategy)
        assert_twins(seen, inputs)
        stats = seen["fused"][-1][3]
        assert stats["growths"] >= 3 and seen["fused_calls"] > len(batches)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("strategy", CLOCKED + ["LFU"])
def test_full_table_evicts_like_dedup_then_insert(strategy, device):
    batches = skewed_batches(5, 8000, 50000, 3, seed=2)
    seen, inputs = run_both(batches, device, with_freqs=True, capacity=2048, max_capacity=2048,
                            score_strategy=strategy, check_mode="IGNORE")
    assert_twins(seen, inputs)
    stats = seen["fused"][-1][3]
    assert stats["evictions" if strategy != "NO_EVICTION" else "failed_inserts"] > 0


def test_failed_inserts_in_error_mode_undo_both_alike(device):
    """NO_EVICTION at max capacity: the call fails, is undone, and raises."""
    batches = skewed_batches(3, 5000, 40000, 1, seed=3)
    seen, inputs = run_both(batches, device, capacity=1024, max_capacity=1024,
                            score_strategy="NO_EVICTION", check_mode="ERROR")
    assert any(isinstance(outcome, str) for _, outcome, *_ in seen["fused"])
    assert_twins(seen, inputs)


def test_small_and_empty_batches(device):
    batches = [([5, 5, 7], [0, 0, 1], [1, 2, 3]), ([], [], []), ([7, 9, 7, 5], [1, 0, 1, 0], [1, 1, 1, 1])]
    table = make_table(capacity=64, num_tables=2, value_dim=1, device=device)
    for keys, tids, freqs in batches:
        unique, pending = table.prepare_dedup_find_or_insert(
            torch.tensor(keys, dtype=torch.int64, device=device),
            torch.tensor(tids, dtype=torch.int16, device=device),
            torch.tensor(freqs, dtype=torch.int64, device=device))
        pending.commit()
        u = int((unique.counts > 0).sum())  # past the unique pairs: padding
        assert (unique.keys[:u].tolist(), unique.table_ids[:u].tolist(),
                unique.inverse.tolist(), unique.counts[:u].tolist()) == py_dedup(keys, tids, freqs)
        assert unique.starts.tolist()[-1] == len(keys) and sorted(unique.rank.tolist()) == list(
            range(len(keys)))
    assert table.size() == 3  # (0, 5), (1, 7), (0, 9)


def test_keys_not_admitted_find_no_slot_and_an_abort_takes_the_call_back(device):
    """``dedup_batch`` then ``prepare_insert``: the keys left out get slot -1 (FAILED)
    and are counted nowhere; ``abort`` takes back the call's tick and inserts."""
    table = make_table(capacity=64, num_tables=2, value_dim=1, device=device)
    keys = torch.tensor([5, 6, 5, 7, 8], dtype=torch.int64, device=device)
    tids = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int16, device=device)
    unique = table.dedup_batch(keys, tids)
    assert table.clock == 1  # the call's time, ticked by its first half
    admitted = torch.tensor([True, False, True, False, True], device=device)  # (5, 7; padding)
    pending = table.prepare_insert(unique, admitted)
    pending.abort()
    assert (table.size(), table.clock) == (0, 0)
    unique = table.dedup_batch(keys, tids)
    result = table.prepare_insert(unique, admitted).commit()
    assert unique.keys[:4].tolist() == [5, 6, 7, 8]
    assert [s >= 0 for s in result.slots[:4].tolist()] == [True, False, True, False]
    assert result.status[1] == InsertStatus.FAILED and table.stats.failed_inserts == 0
    assert (table.size(), table.stats.inserts, table.clock) == (2, 2, 1)
    assert (table.find(as_keys([5, 6], device)) >= 0).tolist() == [True, False]


def test_customized_is_refused_and_bad_frequencies_leave_the_table_alone(device):
    with pytest.raises(ValueError, match="CUSTOMIZED"):
        make_table(capacity=64, score_strategy="CUSTOMIZED", device=device).prepare_dedup_find_or_insert(
            as_keys([1, 2], device))
    table = make_table(capacity=64, device=device)
    keys = as_keys([1, 2, 1], device)
    for freqs, error in ((torch.tensor([1, 1, 1], dtype=torch.int32, device=device), TypeError),
                         (torch.tensor([1, 1], dtype=torch.int64, device=device), ValueError),
                         (torch.tensor([1, 0, 1], dtype=torch.int64, device=device), ValueError)):
        with pytest.raises(error, match="frequencies"):
            table.prepare_dedup_find_or_insert(keys, frequencies=freqs)
    assert table.size() == 0 and table.clock == 0
    unique, pending = table.prepare_dedup_find_or_insert(keys)
    with pytest.raises(RuntimeError, match="prepared insert"):
        table.find(keys)
    pending.abort()
    assert table.size() == 0 and unique.keys.tolist() == [1, 2, 0]  # (0: padding)
