"""The CPU extension's promotion verbs against the CUDA kernels and a Python model.

``promotion_plan``, ``promotion_order`` and ``promote_rows`` of ``csrc/cpu/cache.cpp``
and of ``csrc/cuda/cache.cu`` (run on the CPU runtime of ``dynamicemb_testing.simt``)
loop over the same per-key procedures (``csrc/dynamicemb/cache_policy.h``). On the
same random inputs (padded batches of several sizes, 0 and 1 included, keys not
stored, keys left out, caches with free slots, full caches that must evict, one table
and several) they give equal outputs, twin tables end equal, and the plan, ranks and
order are those of ``policy``, the header's rules written again in Python. A module
trained on the CPU backend and on the emulated CUDA backend keeps the same cache,
batch by batch (that a cache of any size trains as all rows in memory:
``test_exactness.py``).
"""

import pytest
import torch

from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbInitializerArgs,
                        DynamicEmbOptimType, DynamicEmbScoreStrategy, DynamicEmbTableOptions)
from dynamicemb.ops import cpu_kernels
from dynamicemb.ops.codes import KNO_BUCKET, InsertStatus, ScoreRule
from dynamicemb.table import ScoredHashTable
from dynamicemb.table import hash_keys
from dynamicemb_testing.cuda_emulation import emulated_cuda
from dynamicemb_testing.simt import SimtCudaKernels

BC = 16
WIDTH = 5


def make_tiers(seed: int, num_tables: int, host_capacity: int, cache_capacity: int,
               cached: float):
    """A host store of random keys and rows (LRU scores from several calls) and a
    cache (GIVEN scores) holding about ``cached`` of its capacity, the host store's
    rows and scores. Deterministic in its arguments: called twice, twin tiers."""
    gen = torch.Generator().manual_seed(seed)
    host = ScoredHashTable(num_tables=num_tables, capacity=host_capacity, bucket_capacity=BC,
                           value_dim=WIDTH)
    stored = host_capacity // 2
    keys = torch.randperm(1 << 20, generator=gen)[:stored] - (1 << 19)
    tids = torch.randint(0, num_tables, (stored,), generator=gen)
    for part in torch.arange(stored).chunk(4):  # four clocks: distinct scores
        host.find_or_insert(keys[part], tids[part])
    host.values.copy_(torch.randn(host.values.shape, generator=gen))
    cache = ScoredHashTable(num_tables=num_tables, capacity=cache_capacity, bucket_capacity=BC,
                            score_strategy=DynamicEmbScoreStrategy.CUSTOMIZED, value_dim=WIDTH)
    take = torch.randperm(stored, generator=gen)[:int(cached * cache.capacity())]
    slots = host.find(keys[take], tids[take])
    cache.insert_or_assign(keys[take], host.values[slots], tids[take],
                           scores=host.scores_at(slots))
    return host, cache, keys, tids


def make_batch(seed: int, keys, tids, n: int, unique: int):
    """(keys, tids, counts) of ``unique`` distinct pairs padded to ``n`` (count 0,
    key 0, table 0): mostly stored pairs, a few never stored, a few counted 0 (left
    out) in the middle; counts from 1 to 6, most of them 1."""
    gen = torch.Generator().manual_seed(1000 + seed)
    pick = torch.randperm(keys.numel(), generator=gen)[:unique]
    k, t = keys[pick].clone(), tids[pick].clone()
    absent = torch.rand(unique, generator=gen) < 0.1
    k[absent] = (1 << 40) + torch.arange(int(absent.sum()))  # never stored
    counts = torch.where(torch.rand(unique, generator=gen) < 0.6, 1,
                         torch.randint(2, 7, (unique,), generator=gen))
    counts[torch.rand(unique, generator=gen) < 0.05] = 0
    pad = n - unique
    return (torch.cat([k, torch.zeros(pad, dtype=torch.int64)]),
            torch.cat([t, torch.zeros(pad, dtype=torch.int64)]).to(torch.int16),
            torch.cat([counts, torch.zeros(pad, dtype=torch.int64)]))


def host_slots_of(host, keys, tids, counts):
    """The host store's slots of the batch: -1 for padding and keys it does not hold."""
    slots = host.find(keys, tids.long())
    return torch.where(counts > 0, slots, torch.where(torch.arange(keys.numel()) % 3 == 0,
                                                       slots, -1))


def assert_equal(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and torch.equal(a, b), i


HIT_RANK, MISS_RANK, COLD_RANK, LEFT_OUT_RANK = 2**63 - 1, 0, -1, -2


def policy(counts, host_slots, cache_slots, capacity: int, size: int):
    """The promotion's plan (hits, misses, hot misses, taken), ranks and order by the
    rules of cache_policy.h: a key takes part when it is in the batch and its row in
    the host store; hits first; every miss when the misses fit in the free slots, else
    only misses seen more than once, hottest first, as many as fit beside the hits;
    ties in batch order."""
    part = [c > 0 and h >= 0 for c, h in zip(counts, host_slots)]
    hits = sum(p and s >= 0 for p, s in zip(part, cache_slots))
    miss = [p and s < 0 for p, s in zip(part, cache_slots)]
    misses = sum(miss)
    hot = sum(m and c > 1 for m, c in zip(miss, counts))
    overflow = misses > capacity - size
    taken = hits + (min(hot, max(capacity - hits, 0)) if overflow else misses)
    rank = [LEFT_OUT_RANK if not p else HIT_RANK if s >= 0 else MISS_RANK if not overflow
            else c if c > 1 else COLD_RANK for p, s, c in zip(part, cache_slots, counts)]
    order = sorted(range(len(rank)), key=lambda i: -rank[i])  # stable
    return [hits, misses, hot, taken], rank, order


def assert_policy(cache, host, keys, tids, counts, host_slots, size, plan, ordered):
    """The kernels' plan, ranks, order and cache call inputs are ``policy``'s."""
    part = (counts > 0) & (host_slots >= 0)
    cache_slots = torch.where(part, cache.find(keys, tids.long()), -1)
    assert torch.equal(plan[0], cache_slots)
    totals, rank, order = policy(counts.tolist(), host_slots.tolist(), cache_slots.tolist(),
                                 cache.capacity(), size)
    assert plan[1].tolist() == totals and plan[2].tolist() == rank
    assert plan[3].tolist() == order
    order = torch.tensor(order, dtype=torch.int64)
    scores = torch.where(host_slots[order] >= 0,
                         host.scores_at(host_slots[order].clamp(min=0)), 0)
    buckets = torch.bitwise_and(hash_keys(keys[order], tids[order].long()),
                                cache.num_buckets - 1)
    buckets[totals[3]:] = KNO_BUCKET
    assert torch.equal(ordered[0], keys[order]) and torch.equal(ordered[1], tids[order])
    assert torch.equal(ordered[2], scores) and torch.equal(ordered[3], buckets.int())


def promote(kernels, emulated, host, cache, keys, tids, counts, host_slots):
    """A padded batch's promotion run by ``kernels`` (within ``emulated_cuda(emulated)``):
    the plan (with its stable sort of the ranks), the order, the cache's padded
    insert (``emulated``'s, for both) and the rows. Returns every output, the cache
    call's included."""
    one_table = host.num_tables == 1
    size = torch.tensor([cache.size()])
    plan = kernels.promotion_plan(cache.memory.meta, BC, keys, tids, counts, host_slots,
                                  one_table, size)
    order = plan[3]
    assert torch.equal(order, torch.sort(plan[2], descending=True, stable=True).indices)
    ordered = kernels.promotion_order(order, keys, tids, host_slots, host.memory.meta[0],
                                      plan[1], cache.num_buckets)
    ckeys, ctids, scores, buckets = ordered
    cached = emulated.upsert(
        cache.memory.meta, BC, ckeys, ctids, scores, int(ScoreRule.GIVEN), True, one_table,
        buckets, torch.zeros(5, dtype=torch.int64), size)
    refs = torch.full_like(host_slots, -7)
    kernels.promote_rows(host.memory.meta, BC, host.values, cache.values, order, host_slots,
                         cached[0], cached[1], cached[3], cached[4], refs)
    return plan, order, ordered, cached, refs


CASES = [  # (num_tables, n, unique, host capacity, cache capacity, cached fraction)
    (1, 0, 0, 256, 64, 0.5),
    (1, 1, 1, 256, 64, 0.5),
    (1, 1, 0, 256, 64, 0.5),
    (2, 50, 0, 256, 64, 0.5),     # all padding: a refused batch, another group's batch
    (2, 40, 30, 256, 64, 0.25),   # the misses fit in the free slots
    (3, 80, 60, 512, 64, 0.5),    # they do not: hot misses, hottest first
    (1, 100, 90, 512, 64, 3.0),   # a full cache: every miss taken evicts
    (2, 300, 200, 1024, 32, 4.0),  # more hits than the cache holds beside them
    (4, 6000, 4500, 16384, 2048, 0.9),  # the parallel loops
    (2, 9000, 5000, 16384, 8192, 0.1),  # in parallel, every miss fits: one class of misses
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"T{c[0]}-n{c[1]}-u{c[2]}-c{c[4]}x{c[5]}")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_cpu_promotion_equals_the_cuda_kernels(case, seed):
    num_tables, n, unique, host_capacity, cache_capacity, cached = case
    cpu = cpu_kernels.load()
    emulated = SimtCudaKernels()
    results, tables, policies = [], [], []
    for kernels in (cpu, emulated):
        host, cache, keys, tids = make_tiers(seed, num_tables, host_capacity, cache_capacity,
                                             cached)
        bkeys, btids, counts = make_batch(seed, keys, tids, n, unique)
        host_slots = host_slots_of(host, bkeys, btids, counts)
        size = cache.size()
        with emulated_cuda(emulated):
            results.append(promote(kernels, emulated, host, cache, bkeys, btids, counts,
                                   host_slots))
        tables.append((host, cache))
        policies.append((bkeys, btids, counts, host_slots, size))
    host, cache = make_tiers(seed, num_tables, host_capacity, cache_capacity, cached)[:2]
    for (bkeys, btids, counts, host_slots, size), result in zip(policies, results):
        assert_policy(cache, host, bkeys, btids, counts, host_slots, size, result[0],
                      result[2])
    (plan, order, ordered, cached, refs), want = results
    assert_equal(plan, want[0])
    assert torch.equal(order, want[1])
    assert_equal(ordered, want[2])
    assert_equal(cached[:2], want[3][:2])  # the cache calls' slots and status
    hit, evicted = cached[1] == InsertStatus.HIT, cached[1] == InsertStatus.EVICTED_AND_INSERTED
    assert torch.equal(cached[2][hit], want[3][2][hit])  # the rest is written only there
    assert_equal([x[evicted] for x in cached[3:]], [x[evicted] for x in want[3][3:]])
    assert torch.equal(refs, want[4])
    for a, b in zip(*tables):  # the twin tables (metadata and rows) end equal
        assert_equal(a.memory.meta, b.memory.meta)
        assert torch.equal(a.values, b.values)
    if n:  # padding and left-out keys are ranked last and skipped by the cache call
        hits, misses, hot, taken = plan[1].tolist()
        assert taken <= hits + misses and (ordered[3][taken:] == KNO_BUCKET).all()
        assert (refs >= -1).all()


def test_a_victim_goes_back_before_its_slot_takes_a_new_row():
    """A full cache, every miss hot: each victim's row is written back to its host
    slot, the new key's row copied in, and the references say where each row is."""
    host, cache, keys, tids = make_tiers(5, 1, 256, 32, 4.0)  # every bucket full
    cached_keys = cache.export_batch().keys
    misses = keys[~torch.isin(keys, cached_keys)][:8]
    counts = torch.full((8,), 3)
    host_slots = host.find(misses)
    victim_rows = cache.values.clone()
    cache.values.add_(1.0)  # trained in the cache: differs from the host store's copy
    victim_rows += 1.0
    emulated = SimtCudaKernels()
    with emulated_cuda(emulated):
        plan, order, ordered, cached, refs = promote(
            cpu_kernels.load(), emulated, host, cache, misses, torch.zeros(8, dtype=torch.int16),
            counts, host_slots)
    status = cached[1]
    assert plan[1].tolist() == [0, 8, 8, 8]
    assert (status == InsertStatus.EVICTED_AND_INSERTED).all()
    homes = host.find(cached[3])
    assert torch.equal(host.values[homes], victim_rows[cached[0]])
    assert torch.equal(cache.values[cached[0]], host.values[host_slots[order]])
    assert torch.equal(refs[order], cached[0])


def test_bad_arguments_are_refused_by_name():
    host, cache, keys, tids = make_tiers(0, 1, 256, 64, 0.5)
    cpu = cpu_kernels.load()
    n = 4
    bkeys, btids = keys[:n], torch.zeros(n, dtype=torch.int16)
    counts, host_slots = torch.ones(n, dtype=torch.int64), host.find(bkeys)
    size = torch.tensor([cache.size()])
    with pytest.raises(RuntimeError, match="counts"):
        cpu.promotion_plan(cache.memory.meta, BC, bkeys, btids, counts.int(), host_slots, True,
                           size)
    with pytest.raises(RuntimeError, match="host_slots must hold 4"):
        cpu.promotion_plan(cache.memory.meta, BC, bkeys, btids, counts, host_slots[:3], True,
                           size)
    order = torch.arange(n)
    with pytest.raises(RuntimeError, match="host_keys"):
        cpu.promotion_order(order, bkeys, btids, host_slots, host.memory.meta[0].clone(),
                            torch.zeros(4, dtype=torch.int64), cache.num_buckets)
    slots, status = torch.full((n,), -1), torch.full((n,), 3, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="one width"):
        cpu.promote_rows(host.memory.meta, BC, host.values[:, :2].contiguous(), cache.values,
                         order, host_slots, slots, status, bkeys, btids, torch.empty(n).long())


def options(strategy):
    return DynamicEmbTableOptions(
        dim=4, max_capacity=4096, bucket_capacity=16, score_strategy=strategy, caching=True,
        local_hbm_for_values=64 * 8 * 4,  # 64 rows of [embedding | Adagrad state]
        initializer_args=DynamicEmbInitializerArgs(mode="normal", std_dev=0.1, seed=3))


def cache_after_each_batch(strategy, batches):
    module = BatchedDynamicEmbeddingTables(
        [options(strategy)] * 2, table_names=["a", "b"], pooling_mode="sum",
        optimizer=DynamicEmbOptimType.EXACT_ADAGRAD, learning_rate=0.1)
    storage = module._groups[0].storage
    out = []
    for ids, offsets in batches:
        module(ids, offsets).sum().backward()
        rows = storage.device_tier.export_batch()
        metrics = {name: (m.hits, m.misses, m.evictions, m.host_reads, m.host_writes)
                   for name, m in module.cache_metrics().items()}
        out.append((rows.keys, rows.table_ids, rows.slots, rows.scores, metrics))
    return out


@pytest.mark.parametrize("strategy", [DynamicEmbScoreStrategy.LRU, DynamicEmbScoreStrategy.LFU],
                         ids=lambda s: s.name)
def test_the_cuda_step_keeps_the_cache_the_cpu_step_keeps(strategy):
    """The header's policy on both backends: the same keys in the same cache slots
    with the same scores, and the same traffic, after every batch."""
    gen = torch.Generator().manual_seed(4)
    batches = []
    for _ in range(6):
        lengths = torch.randint(1, 4, (2 * 64,), generator=gen)
        u = torch.rand(int(lengths.sum()), generator=gen, dtype=torch.float64)
        ids = (((400.0 ** -0.3 - 1) * u + 1) ** (1 / -0.3)).long()  # power law over 400
        batches.append((ids, torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])))
    want = cache_after_each_batch(strategy, batches)
    with emulated_cuda():
        got = cache_after_each_batch(strategy, batches)
    assert any(m[2] for m in want[-1][4].values())  # the cache evicted
    for step, (a, b) in enumerate(zip(got, want)):
        for x, y in zip(a[:4], b[:4]):
            assert torch.equal(x, y), step
        assert a[4] == b[4], step
