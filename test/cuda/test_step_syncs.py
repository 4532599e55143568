"""The CUDA backend's training step, run on CPU tensors: its results, its host
synchronizations and its kernel launches (no GPU needed; see
``dynamicemb_testing/cuda_emulation.py`` and ``sync_guard.py``); and the CPU
backend's own step, the same Python, counted the same way (``counted_cpu``: each call
of the extension is a launch).

A GPU step is host-bound when the host waits for the device. These tests pin the
synchronizations that remain on a steady-state step to the sites
``docs/ARCHITECTURE.md`` names ("Host synchronizations of a training step"): a new
one anywhere fails them, with its site in the message.
"""

import contextlib
import os
from collections import Counter

import pytest
import torch

from dynamicemb import (DynamicEmbCheckMode, DynamicEmbInitializerArgs, DynamicEmbInitializerMode,
                        DynamicEmbOptimType, DynamicEmbPoolingMode, DynamicEmbScoreStrategy)
from dynamicemb.ops.cuda import CudaKernels
from dynamicemb.ops.kernels import KernelBackend
from dynamicemb.options import FrequencyAdmissionStrategy, KVCounter
from dynamicemb_testing.cuda_emulation import emulated_cuda
from dynamicemb_testing.module_reference import (OPTIMIZER_ARGS, TableSpec, export_dict,
                                                 make_tables)
from dynamicemb_testing.sync_guard import SyncGuard, counted_cpu

BATCH, BAG = 256, 4  # 1,024 lookups
# The kernels take the optimizer's scalars as float32 where the CPU's take float64:
# Adam may differ in the last bit (as on a GPU; test_module_twins.py).
TOL = dict(rtol=1e-5, atol=1e-6)
if os.environ.get("DEMB_CUDA_EMULATION") == "simt":
    # The kernels' own source (test_simt_suites.py): a hot row's gradient is summed in
    # pieces of PIECE_ENTRIES lookups, then the pieces, where the CPU sums in rank
    # order; the sums differ by rounding (a GPU's too). Rows of fewer lookups match.
    TOL = dict(rtol=2e-3, atol=2e-4)
# A table that may still grow (``init_capacity`` below ``max_capacity``) grows ahead
# of its steps by an upper bound of its size, which the host learns from two copies
# (its size and outcome totals) that the step starts for it and a later call reads
# once they arrived (the CPU at once, for free): no sync, before or after it has grown
# to its most, for the two copies' launches. A growth reads the device once per
# doubling (``KernelBackend.grow``'s compaction of the moved rows).
GROWABLE_SYNCS = {"cuda-emulated": Counter(), "cpu": Counter()}
GROWTH_SYNCS = Counter({"grow": 1})  # per doubling
GROWABLE_COPIES = 2
# One launch each per step, new ids or not: the offsets check, the dedup (3; its
# numbering also gives the unique keys' buckets and pads), the insert, the new rows'
# initialization (by status: whether there are new rows is not read), the lookup,
# the backward (4).
STEP_KERNELS = {"demb_check_offsets", "demb_dedup_insert", "demb_dedup_first",
                "demb_dedup_number", "demb_upsert", "demb_init_rows", "demb_pooled_forward",
                "demb_place_grads", "demb_piece_counts", "demb_piece_sums", "demb_fused_update"}
# aten ops that launch a kernel on a step, the test's own loss (5) included: the
# dedup's fill, scans and sorts, the rank's arange and scatter, the copy of the
# check's word to the host; new ids add nothing (their rows are initialized by
# status in one kernel). With the 11 CuPy launches (STEP_KERNELS), 20 of the step's own: the
# issue's budget is 20. (15 and 24 with 3 syncs before the padded step.)
ATEN_LAUNCH_CEILING = 14
LOSS_LAUNCHES = 5  # _step's loss: linspace, mul, sum; its backward: ones_like, mul
STEP_LAUNCH_BUDGET = 20
# A cache step adds the promotion to the step's kernels: the host store's victims
# leave the cache (demb_erase_where), the plan (demb_cache_probe, demb_cache_rank, a
# fill and a sort), the keys in its order (demb_promotion_order), the cache's insert
# (a sort, demb_upsert) and the rows moved with the references (demb_promote_rows):
# 12 aten + 17 CuPy = 29 of its own, the loss's 5 aside (the budget is 30;
# 6 syncs and 60 + 14 launches before the padded promotion).
CACHE_KERNELS = STEP_KERNELS | {"demb_erase_where", "demb_cache_probe", "demb_cache_rank",
                                "demb_promotion_order", "demb_promote_rows"}
CACHE_LAUNCH_BUDGET = 30
# The CPU backend's own step: one extension call each for the offsets check, the
# dedup and insert, the new rows, the lookup and the backward (summed and updated in
# one pass). A cache adds the promotion (the victims' erase, the plan, the order, the
# cache's insert, the rows moved); a placement tier finds the keys it holds and hashes
# the new ones instead of the plan and the order. Their budgets are the CUDA step's.
CPU_CALLS = {
    "all-rows": {"check_offsets", "dedup_upsert", "init_rows", "pooled_forward",
                 "sum_and_update_rows"},
    "host-rows": {"check_offsets", "dedup_upsert", "init_rows", "pooled_forward",
                  "sum_and_update_rows"},
}
CPU_CALLS["cache"] = CPU_CALLS["all-rows"] | {"erase_where", "promotion_plan",
                                               "promotion_order", "upsert", "promote_rows"}
CPU_CALLS["placed"] = CPU_CALLS["all-rows"] | {"erase_where", "find", "hash_keys",
                                                "upsert", "promote_rows"}
CPU_BUDGET = {"all-rows": STEP_LAUNCH_BUDGET, "host-rows": STEP_LAUNCH_BUDGET,
              "cache": CACHE_LAUNCH_BUDGET, "placed": CACHE_LAUNCH_BUDGET}
# Reads of a batch's values the CPU step makes because they cost it nothing
# (``Backend.free_host_reads``; a GPU step leaves them out): per-sample weights are
# finite, frequencies are >= 1.
CPU_DATA_CHECKS = Counter({"_all_finite": 1, "check_frequencies": 1})


def _assert_cpu_eval_alike(cpu, counted, ids, offsets, got, guard) -> torch.Tensor:
    """The CPU backend's eval of (ids, offsets), counted: no sync, as the emulated
    CUDA eval (``got``, whose ``guard`` saw none either), and the same output,
    which it returns."""
    with counted_cpu(counted), SyncGuard() as cpu_guard, torch.no_grad():
        counted.guard = cpu_guard
        want = cpu(ids, offsets)
    counted.guard = None
    assert not guard.syncs, guard.report()
    assert not cpu_guard.syncs, cpu_guard.report()
    torch.testing.assert_close(got, want, **TOL)
    return want


def _batches(pool: int, count: int, seed: int, hot: bool = False):
    """(indices, offsets) batches of BATCH bags of BAG ids from [0, pool); ``hot``:
    one id fills half the batch (a row split into pieces in the backward)."""
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(0, BATCH * BAG + 1, BAG)
    out = []
    for _ in range(count):
        ids = torch.randint(0, pool, (BATCH * BAG,), generator=gen)
        if hot:
            ids[::2] = 7
        out.append((ids, offsets))
    return out


def _module(optimizer=DynamicEmbOptimType.EXACT_SGD, pooling=DynamicEmbPoolingMode.SUM,
            cache=False, capacity=1 << 13, init_capacity=None, host_rows=False, placed=False,
            check_mode=None, **kw):
    options = {}
    if cache or placed:  # 256 rows of the device's: a cache, or where new rows land
        options = dict(local_hbm_for_values=16 * 4 * 256, caching=cache)
    if host_rows:  # no device budget: every row read and updated in host memory
        options = dict(local_hbm_for_values=0, caching=False)
    if init_capacity:
        options["init_capacity"] = init_capacity
    if check_mode is not None:
        options["safe_check_mode"] = check_mode
    spec = TableSpec(dim=16, max_capacity=capacity, options=options)
    module, _ = make_tables([spec], pooling=pooling, optimizer=OPTIMIZER_ARGS[optimizer], **kw)
    return module


def _step(module, ids, offsets, weights=None):
    out = module(ids, offsets, weights)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach()


def _guarded_step(module, kernels, ids, offsets) -> SyncGuard:
    kernels.launches.clear()
    with SyncGuard() as guard:
        kernels.guard = guard
        _step(module, ids, offsets)
    kernels.guard = None
    return guard


def _sites(guard: SyncGuard) -> Counter:
    return Counter(s.where.rsplit(" ", 1)[-1] for s in guard.syncs)


OPTS = [DynamicEmbOptimType.EXACT_SGD, DynamicEmbOptimType.ADAM,
        DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD]


LAYOUTS = {"all-rows": {}, "cache": dict(cache=True), "placed": dict(placed=True),
           "host-rows": dict(host_rows=True), "growing": dict(init_capacity=1024)}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("pooling", [DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.NONE],
                         ids=["sum", "none"])
@pytest.mark.parametrize("optimizer", OPTS, ids=[o.name for o in OPTS])
def test_cuda_path_trains_as_the_cpu_backend(optimizer, pooling, layout):
    """The CUDA path's code (emulated kernels) gives the CPU backend's results:
    new ids, repeated ids, a hot row split into pieces; all rows on the device, a
    cache, a placement tier, rows in host memory (the padded step, no sync), and a
    table that grows mid-training."""
    batches = _batches(3000, 2, seed=1) + _batches(3000, 1, seed=2, hot=True)
    cpu = _module(optimizer, pooling, **LAYOUTS[layout])
    with emulated_cuda():
        emulated = _module(optimizer, pooling, **LAYOUTS[layout])
        for ids, offsets in batches:
            torch.testing.assert_close(_step(emulated, ids, offsets), _step(cpu, ids, offsets),
                                       **TOL)
        assert (emulated._groups[0].table.stats.growths > 0) == (layout == "growing")
        assert emulated._groups[0].table.stats == cpu._groups[0].table.stats
        assert emulated.cache_metrics() == cpu.cache_metrics()
        _assert_same_rows(emulated, cpu)


def _assert_same_rows(got_module, want_module, table: str = "t0") -> None:
    """Same keys, rows, optimizer states (to the kernels' rounding) and scores."""
    want, got = export_dict(want_module, table), export_dict(got_module, table)
    assert want.keys() == got.keys()
    for key, (row, state, score) in want.items():
        torch.testing.assert_close(got[key][0], row, **TOL)
        torch.testing.assert_close(got[key][1], state, **TOL)
        assert got[key][2] == score


@pytest.mark.parametrize("optimizer", [DynamicEmbOptimType.EXACT_SGD, DynamicEmbOptimType.ADAM],
                         ids=["sgd", "adam"])
@pytest.mark.parametrize("new_ids", [False, True], ids=["ids-present", "new-ids"])
def test_a_steady_step_makes_no_sync(new_ids, optimizer):
    """Ids present, or new ids while the table has room: no host sync at all, the
    launch budget, and the op sequence of a batch with the same lookup count but
    another number of unique ids is the same, with the same shapes."""
    with emulated_cuda() as kernels:
        module = _module(optimizer, capacity=1 << 14)
        warm = _batches(2000, 2, seed=3)
        for ids, offsets in warm + warm[:1]:  # the last one finds every id: steady
            _step(module, ids, offsets)
        ids, offsets = _batches(4000, 1, seed=4)[0] if new_ids else warm[0]
        guard = _guarded_step(module, kernels, ids, offsets)
        launches = Counter(kernels.launches)
        fewer = torch.where(ids % 3 == 0, ids, 7)  # the same lookups, far fewer unique ids
        other = _guarded_step(module, kernels, fewer, offsets)
    assert not guard.syncs, guard.report()
    assert launches == Counter(dict.fromkeys(STEP_KERNELS, 1)), launches
    assert guard.launches() <= ATEN_LAUNCH_CEILING, guard.launches()
    own = guard.launches() - LOSS_LAUNCHES + sum(launches.values())
    assert own <= STEP_LAUNCH_BUDGET, own
    assert other.ops == guard.ops, "the op sequence depends on the number of unique ids"


def _backend(name: str):
    return emulated_cuda() if name == "cuda-emulated" else counted_cpu()


@pytest.mark.parametrize("backend", ["cuda-emulated", "cpu"])
def test_a_table_that_may_grow_makes_no_sync(backend):
    """A table that may still grow: a steady step makes no sync, before and after
    the table has grown to its most, within the launch budget and with the same ops
    for another number of unique ids; a step that grows reads the device once per
    doubling, and only there."""
    with _backend(backend) as kernels:
        module = _module(capacity=1 << 13, init_capacity=1 << 10)
        table = module._groups[0].table
        ids, offsets = _batches(100, 1, seed=5)[0]
        for _ in range(2):  # grows ahead: room for the size and a batch of new ids
            _step(module, ids, offsets)
        capacity = table.capacity()
        guard = _guarded_step(module, kernels, ids, offsets)
        launches = Counter(kernels.launches)
        other = _guarded_step(module, kernels, torch.where(ids % 3 == 0, ids, 7), offsets)
        assert table.capacity() == capacity < table.max_capacity()
        growths = table.stats.growths
        _step(module, *_batches(6000, 1, seed=6)[0])  # ~900 new ids: the bound reaches
        grow = _guarded_step(module, kernels, *_batches(6000, 1, seed=7)[0])  # the limit
        doublings = table.stats.growths - growths
        assert table.capacity() == table.max_capacity() and doublings > 0
        full = _guarded_step(module, kernels, ids, offsets)
    assert _sites(guard) == GROWABLE_SYNCS[backend], guard.report()
    assert other.ops == guard.ops, "the op sequence depends on the number of unique ids"
    own = guard.launches() - LOSS_LAUNCHES + sum(launches.values())
    assert own <= STEP_LAUNCH_BUDGET + GROWABLE_COPIES, own
    want = Counter({site: n * doublings for site, n in GROWTH_SYNCS.items()})
    assert _sites(grow) == want, grow.report()
    assert not full.syncs, full.report()


@pytest.mark.parametrize("backend", ["cuda-emulated", "cpu"])
def test_check_modes_sync_only_for_error(backend):
    """WARNING reads its failure count when its copy arrived (a later call): a steady
    step makes no sync. ERROR reads the call's failures before it returns, to undo it
    and raise: one sync, the user's choice."""
    for mode, want in ((DynamicEmbCheckMode.WARNING, Counter()),
                       (DynamicEmbCheckMode.ERROR, Counter({"counts": 1}))):
        with _backend(backend) as kernels:
            module = _module(check_mode=mode)
            ids, offsets = _batches(3000, 1, seed=8)[0]
            _step(module, ids, offsets)
            guard = _guarded_step(module, kernels, ids, offsets)
        assert _sites(guard) == want, (mode, guard.report())


def test_a_cache_step_makes_no_sync():
    """A device cache of a tenth of the ids: the promotion (hits pinned first, the
    hottest misses when not all fit, victims written back) runs on the device, with
    no sync, within the launch budget, and with the same ops whatever the number of
    unique ids."""
    with emulated_cuda() as kernels:
        module = _module(cache=True)
        batches = _batches(3000, 3, seed=6)
        for ids, offsets in batches:
            _step(module, ids, offsets)
        guard = _guarded_step(module, kernels, *batches[0])
        launches = Counter(kernels.launches)
        ids, offsets = batches[1]
        other = _guarded_step(module, kernels, torch.where(ids % 5 == 0, ids, 11), offsets)
        assert module.cache_metrics()["t0"].evictions > 0  # the cache was full
    assert not guard.syncs, guard.report()
    assert set(launches) == CACHE_KERNELS, launches
    own = guard.launches() - LOSS_LAUNCHES + sum(launches.values())
    assert own <= CACHE_LAUNCH_BUDGET, own
    assert other.ops == guard.ops, "the op sequence depends on the number of unique ids"


@pytest.mark.parametrize("layout", list(CPU_CALLS))
@pytest.mark.parametrize("optimizer", [DynamicEmbOptimType.EXACT_SGD, DynamicEmbOptimType.ADAM],
                         ids=["sgd", "adam"])
def test_a_steady_cpu_step_makes_no_sync(optimizer, layout):
    """The CPU backend's own step (its extension's calls counted as launches): no
    host read, in the CUDA step's launch budget, and a batch with the same lookup
    count but other ids (new ones, far fewer unique) makes the same calls and aten
    ops with the same shapes."""
    with counted_cpu() as kernels:
        module = _module(optimizer, **LAYOUTS[layout])
        batches = _batches(3000, 3, seed=6)
        for ids, offsets in batches:
            _step(module, ids, offsets)
        kernels.calls.clear()
        guard = _guarded_step(module, kernels, *batches[0])
        launches, calls = Counter(kernels.launches), list(kernels.calls)
        ids, offsets = batches[1]
        kernels.calls.clear()
        other = _guarded_step(module, kernels, torch.where(ids % 5 == 0, ids + 10_000, 11),
                              offsets)
    assert not guard.syncs, guard.report()
    assert launches == Counter(dict.fromkeys(CPU_CALLS[layout], 1)), launches
    own = guard.launches() - LOSS_LAUNCHES + sum(launches.values())
    assert own <= CPU_BUDGET[layout], own
    assert other.ops == guard.ops, "the aten ops depend on the ids"
    assert kernels.calls == calls, "the extension's calls depend on the ids"


def test_the_cpu_step_reads_only_the_batch_checks():
    """Per-sample weights and frequencies: the CPU step reads their values (finite,
    >= 1) and nothing else (LFU scores, which count the frequencies)."""
    spec = TableSpec(dim=8, max_capacity=1 << 12,
                     options=dict(score_strategy=DynamicEmbScoreStrategy.LFU))
    gen = torch.Generator().manual_seed(17)
    ids, offsets = torch.randint(0, 500, (512,), generator=gen), torch.arange(0, 513, 4)
    weights = torch.rand(512, generator=gen)
    freq = torch.randint(1, 5, (512,), generator=gen)
    with counted_cpu() as kernels:
        module, _ = make_tables([spec], optimizer=OPTIMIZER_ARGS[DynamicEmbOptimType.EXACT_SGD])
        for _ in range(2):
            module(ids, offsets, weights, frequencies=freq).sum().backward()
        with SyncGuard() as guard:
            kernels.guard = guard
            module(ids, offsets, weights, frequencies=freq).sum().backward()
        kernels.guard = None
    assert _sites(guard) == CPU_DATA_CHECKS, guard.report()


def test_a_sync_put_back_fails_the_cpu_guard(monkeypatch):
    """The CPU step's guard is not blind: an insert that reads a count is caught."""
    real = KernelBackend.dedup_upsert

    def dedup_upsert(self, **kwargs):
        unique, upserted = real(self, **kwargs)
        int(upserted.status.sum())  # what a careless edit would add
        return unique, upserted

    monkeypatch.setattr(KernelBackend, "dedup_upsert", dedup_upsert)
    with counted_cpu() as kernels:
        module = _module()
        ids, offsets = _batches(100, 1, seed=7)[0]
        _step(module, ids, offsets)
        guard = _guarded_step(module, kernels, ids, offsets)
    assert [s.what for s in guard.syncs] == ["Tensor.__int__"], guard.report()


def test_a_sync_put_back_fails_the_guard(monkeypatch):
    """The guard is not blind: a dedup that reads its count on the host is caught."""
    real = CudaKernels._dedup

    def dedup(self, *args, **kwargs):
        unique, buckets = real(self, *args, **kwargs)
        int(unique[3].sum())  # what a careless edit would add: the summed counts
        return unique, buckets

    monkeypatch.setattr(CudaKernels, "_dedup", dedup)
    with emulated_cuda() as kernels:
        module = _module()
        ids, offsets = _batches(100, 1, seed=7)[0]
        _step(module, ids, offsets)
        guard = _guarded_step(module, kernels, ids, offsets)
    assert _sites(guard) == Counter({"dedup_upsert": 1}), guard.report()


def test_guard_sees_every_kind_of_sync():
    t = torch.arange(6)
    with SyncGuard() as guard:
        t.sum().item()
        t.tolist()
        bool(t[0])
        int(t[1])
        t.nonzero()
        t[t > 2]
        torch.unique(t)
        torch.bincount(t)
        torch.repeat_interleave(t, t)
        torch.repeat_interleave(t, t, output_size=15)  # sized on the host: no sync
        torch.nonzero_static(t, size=6)  # sized on the host: no sync
        t[torch.tensor([1, 2])] = 9  # the 9 is copied from host memory on a GPU
        t.index_fill_(0, torch.tensor([1, 2]), 9)  # a kernel argument: no sync
    kinds = [s.what for s in guard.syncs]
    assert kinds[:4] == ["Tensor.item", "Tensor.tolist", "Tensor.__bool__", "Tensor.__int__"]
    assert {"aten.nonzero", "aten.index", "aten.bincount", "aten.repeat_interleave"} <= set(kinds)
    assert any("unique" in k for k in kinds)
    assert kinds.count("aten.repeat_interleave") == 1
    assert kinds.count("aten.index_put_") == 1


@pytest.mark.parametrize("optimizer", [DynamicEmbOptimType.EXACT_SGD, DynamicEmbOptimType.ADAM],
                         ids=["sgd", "adam"])
def test_several_groups_make_no_sync(optimizer):
    """Four tables in two groups (two dims): each group takes its part of the whole
    batch (other groups' lookups left out), so nothing is split on the host: no
    sync on either backend, new ids or not, and the CPU backend's outputs and rows."""
    specs = [TableSpec(dim=8, max_capacity=1 << 13), TableSpec(dim=16, max_capacity=1 << 13),
             TableSpec(dim=8, max_capacity=1 << 13), TableSpec(dim=16, max_capacity=1 << 13)]
    args = OPTIMIZER_ARGS[optimizer]
    with counted_cpu() as counted:
        cpu, _ = make_tables(specs, optimizer=args)
    with emulated_cuda() as kernels:
        module, _ = make_tables(specs, optimizer=args)
        assert len(module._groups) == 2
        ids, offsets = _batches(3000, 1, seed=8)[0]  # 256 bags: 64 samples x 4 features
        for batch in (ids, ids + 5000):  # then new ids in every table
            torch.testing.assert_close(_step(module, batch, offsets), _step(cpu, batch, offsets),
                                       **TOL)
        guard = _guarded_step(module, kernels, ids + 9000, offsets)
        with counted_cpu(counted):
            cpu_guard = _guarded_step(cpu, counted, ids + 9000, offsets)
        cpu_launches = Counter(counted.launches)  # one call per group, the check aside
        for name in module.table_names:
            _assert_same_rows(module, cpu, name)
        assert module.train_steps == cpu.train_steps == 3
        assert module.cache_metrics() == cpu.cache_metrics()
    assert not guard.syncs, guard.report()
    assert not cpu_guard.syncs, cpu_guard.report()
    assert set(cpu_launches) == CPU_CALLS["all-rows"], cpu_launches


def test_cuda_path_expires_rows_as_the_cpu_backend():
    """TTL on the CUDA path's code (the sweep kernel emulated): expired rows come
    back fresh and a sweep frees the same rows as on the CPU backend."""
    batches = _batches(400, 4, seed=9)
    spec = TableSpec(dim=8, max_capacity=1 << 12,
                     options=dict(ttl=1, score_strategy=DynamicEmbScoreStrategy.STEP))
    args = OPTIMIZER_ARGS[DynamicEmbOptimType.EXACT_SGD]
    cpu, _ = make_tables([spec], optimizer=args)
    with emulated_cuda() as kernels:
        emulated, _ = make_tables([spec], optimizer=args)
        for i, (ids, offsets) in enumerate(batches):
            ids = ids + 1000 * (i % 2)  # every other batch leaves its ids to expire
            torch.testing.assert_close(_step(emulated, ids, offsets), _step(cpu, ids, offsets),
                                       **TOL)
        assert emulated.expire() == cpu.expire()
        assert kernels.launches["demb_expire"] == 1
        want, got = export_dict(cpu, "t0"), export_dict(emulated, "t0")
    assert want.keys() == got.keys()


@pytest.mark.parametrize("strategy", [DynamicEmbScoreStrategy.LFU, DynamicEmbScoreStrategy.LRU],
                         ids=["lfu", "lru"])
def test_a_step_with_frequencies_makes_no_sync(strategy):
    """Ids deduplicated upstream come with frequencies (TorchRec's input dist): LFU
    scores count them on the padded step as on the CPU, and the step reads nothing."""
    spec = TableSpec(dim=8, max_capacity=1 << 12, options=dict(score_strategy=strategy))
    args = OPTIMIZER_ARGS[DynamicEmbOptimType.EXACT_SGD]
    gen = torch.Generator().manual_seed(10)
    batches = [(torch.randint(0, 500, (512,), generator=gen), torch.arange(0, 513, 4),
                torch.randint(1, 5, (512,), generator=gen)) for _ in range(3)]
    cpu, _ = make_tables([spec], optimizer=args)
    with emulated_cuda() as kernels:
        emulated, _ = make_tables([spec], optimizer=args)
        for i, (ids, offsets, freq) in enumerate(batches):
            want = cpu(ids, offsets, frequencies=freq)
            with SyncGuard() as guard:
                kernels.guard = guard
                got = emulated(ids, offsets, frequencies=freq)
            kernels.guard = None
            assert not guard.syncs, guard.report()
            torch.testing.assert_close(got, want, **TOL)
        _assert_same_rows(emulated, cpu)


@pytest.mark.parametrize("layout", ["all-rows", "cache", "placed", "host-rows"])
def test_an_eval_step_makes_no_sync(layout):
    """Eval (no insert) finds rows and computes the eval initializer's row of unseen
    ids in the lookup kernel: no sync on either backend, the same outputs."""
    with counted_cpu() as counted:
        cpu = _module(**LAYOUTS[layout])
    with emulated_cuda() as kernels:
        emulated = _module(**LAYOUTS[layout])
        for ids, offsets in _batches(3000, 2, seed=12):
            torch.testing.assert_close(_step(emulated, ids, offsets), _step(cpu, ids, offsets),
                                       **TOL)
        ids, offsets = _batches(6000, 1, seed=13)[0]  # half of them unseen
        for m in (cpu, emulated):
            m.eval()
        with SyncGuard() as guard, torch.no_grad():
            kernels.guard = guard
            got = emulated(ids, offsets)
        kernels.guard = None
    _assert_cpu_eval_alike(cpu, counted, ids, offsets, got, guard)


def test_a_backward_after_another_forward_finds_its_rows_without_sync():
    """Two forwards (the second evicts rows of the first), one backward: the first
    lookup's rows are found again on the device (a row that left gets no update)
    with no sync, as the CPU backend trains."""
    def run(module, guarded=None):
        ids1, offsets = _batches(3000, 1, seed=14)[0]
        ids2 = _batches(3000, 1, seed=15)[0][0] + 10_000
        out1, out2 = module(ids1, offsets), module(ids2, offsets)
        loss = (out1 * torch.linspace(-1, 1, out1.numel()).view_as(out1)).sum() + out2.sum()
        if guarded is None:
            loss.backward()
            return None
        with SyncGuard() as guard:
            guarded.guard = guard
            loss.backward()
        guarded.guard = None
        return guard

    cpu = _module(capacity=1 << 10)
    run(cpu)
    with emulated_cuda() as kernels:
        emulated = _module(capacity=1 << 10)
        guard = run(emulated, kernels)
        assert emulated._groups[0].table.stats.evictions > 0
        _assert_same_rows(emulated, cpu)
    assert not guard.syncs, guard.report()


@pytest.mark.parametrize("layout", ["all-rows", "cache"])
def test_a_prefetch_pipeline_makes_no_sync(layout):
    """forward(i), prefetch(i + 1), backward(i), the order of TorchRec's prefetch
    pipelines: no sync in any of them (the prefetch checks into its own word, the
    backward finds rows the prefetch moved on the device, the forward takes the
    prefetched batch given as the same tensors), the CPU backend's results."""
    batches = _batches(3000, 5, seed=16)

    def pipeline(module, guarded=None):
        outs, guards = [], []
        module.prefetch(*batches[0])
        for i, (ids, offsets) in enumerate(batches):
            with contextlib.ExitStack() as stack:
                if guarded is not None and i >= 2:  # steady: the cache is full by now
                    guard = stack.enter_context(SyncGuard())
                    guarded.guard = guard
                    guards.append(guard)
                out = module(ids, offsets)
                if i + 1 < len(batches):
                    module.prefetch(*batches[i + 1])
                (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
                outs.append(out.detach())
            if guarded is not None:
                guarded.guard = None
        return outs, guards

    cpu = _module(**LAYOUTS[layout])
    want, _ = pipeline(cpu)
    with emulated_cuda() as kernels:
        emulated = _module(**LAYOUTS[layout])
        got, guards = pipeline(emulated, kernels)
        _assert_same_rows(emulated, cpu)
        assert emulated.cache_metrics() == cpu.cache_metrics()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    for guard in guards:
        assert not guard.syncs, guard.report()


# The one layout whose step syncs: an external tier's store is reached from the host,
# so its step reads what the insert evicted and found new (``PendingInsert``'s counts
# of the step's call), stages and restores rows (``ExternalTier``), and an eval step
# reads the rows below of keys the host store lacks. Every sync is at that seam.
EXTERNAL_SEAM = {"evicted", "counts", "num_failed", "num_new", "_stage_below", "overlay",
                 "_restore_below", "stage", "restore", "_pack_keys", "_pack_values",
                 "_rows_below", "rows_below", "get", "put", "delete"}


@pytest.mark.parametrize("backend", ["cuda-emulated", "cpu"])
@pytest.mark.parametrize("cache", [False, True], ids=["host", "cache"])
def test_an_external_tier_syncs_only_at_its_seam(tmp_path, backend, cache):
    """A host store of 1,024 rows over RocksDB (and a cache of 256): the step,
    whose only host reads are the store's calls and what they need."""
    pytest.importorskip("rocksdict", reason="the external tier is tested against the real rocksdict")
    from dynamicemb.storage.external import RocksDBStorage

    options = dict(external_storage=RocksDBStorage(str(tmp_path / "db")),
                   local_host_for_values=16 * 4 * 1024)
    if cache:
        options.update(local_hbm_for_values=16 * 4 * 256, caching=True)
    with (emulated_cuda() if backend == "cuda-emulated" else counted_cpu()) as kernels:
        module, _ = make_tables([TableSpec(dim=16, max_capacity=1 << 13, options=options)],
                                optimizer=OPTIMIZER_ARGS[DynamicEmbOptimType.EXACT_SGD])
        batches = _batches(3000, 4, seed=6)
        for ids, offsets in batches[:3]:
            _step(module, ids, offsets)
        guard = _guarded_step(module, kernels, *batches[3])
        module.eval()
        with SyncGuard() as eval_guard:
            kernels.guard = eval_guard
            module(*batches[0])
        kernels.guard = None
        metrics = module.cache_metrics()["t0"]
    assert metrics.external_writes > 0 and metrics.external_reads > 0  # rows went down and up
    assert guard.syncs and set(_sites(guard)) <= EXTERNAL_SEAM, guard.report()
    assert eval_guard.syncs and set(_sites(eval_guard)) <= EXTERNAL_SEAM, eval_guard.report()


def _admission_module(counter: str):
    """A table that stores a key once it was seen twice: its counts in an LRU counter
    table or a ``KVCounter`` (lowest counts forgotten first), both smaller than the
    ids of a batch; keys not admitted read the admission's initializer."""
    strategy = FrequencyAdmissionStrategy(
        threshold=2, counter_capacity=1024,
        initializer_args=DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT,
                                                   value=-0.5))
    options = dict(admit_strategy=strategy)
    if counter == "kv":
        options["admission_counter"] = KVCounter(capacity=1024)
    module, _ = make_tables([TableSpec(dim=16, max_capacity=1 << 13, options=options)],
                            optimizer=OPTIMIZER_ARGS[DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD])
    return module


@pytest.mark.parametrize("counter", ["lru", "kv"])
def test_an_admission_step_makes_no_sync(counter):
    """Admission decides on the device: the unique keys' counts found in the counter
    table, the admitted keys inserted, the keys just stored forgotten and the others
    counted, the rows of keys not admitted computed from the admission's
    initializer. A steady step (some keys stored, some admitted now, some still
    waiting) reads nothing on either backend, a batch with the same lookup count but
    other ids makes the same ops with the same shapes, and both backends agree on
    outputs, rows and counters."""
    batches = _batches(6000, 4, seed=9)
    with counted_cpu() as counted:
        cpu = _admission_module(counter)
    with emulated_cuda() as kernels:
        module = _admission_module(counter)
        for ids, offsets in batches[:3]:
            torch.testing.assert_close(_step(module, ids, offsets), _step(cpu, ids, offsets),
                                       **TOL)
        ids, offsets = batches[3]
        guard = _guarded_step(module, kernels, ids, offsets)
        with counted_cpu(counted):
            counted.calls.clear()
            cpu_guard = _guarded_step(cpu, counted, ids, offsets)
            calls = list(counted.calls)
            counted.calls.clear()
            fewer = torch.where(ids % 5 == 0, ids + 20_000, 11)
            cpu_other = _guarded_step(cpu, counted, fewer, offsets)
            assert counted.calls == calls, "the extension's calls depend on the ids"
        other = _guarded_step(module, kernels, fewer, offsets)
        _assert_same_rows(module, cpu)
        counters = [m._groups[0].admission.export(0) for m in (module, cpu)]
        assert module._groups[0].admission.counter.clock == cpu._groups[0].admission.counter.clock
    stored = export_dict(cpu, "t0")
    assert 0 < len(stored) < 6000 and counters[1].keys.numel() > 0  # some keys still wait
    got, want = ({int(k): (int(s), float(v)) for k, s, v in zip(c.keys, c.scores, c.values[:, 0])}
                 for c in counters)
    assert got == want
    for g in (guard, other, cpu_guard, cpu_other):
        assert not g.syncs, g.report()
    assert other.ops == guard.ops, "the op sequence depends on the ids"
    assert cpu_other.ops == cpu_guard.ops, "the aten ops depend on the ids"


# TTL and CUSTOMIZED scores on the padded step: the kernels find expired rows at the
# time they keep on the device and read each table's score by table id. A cache
# adds the erase of its copies of expired rows (a second erase_where).
SCORED = {
    "lru-ttl": dict(ttl=2, score_strategy=DynamicEmbScoreStrategy.LRU),
    "step-ttl": dict(ttl=1, score_strategy=DynamicEmbScoreStrategy.STEP),
    "lru_lfu-ttl": dict(ttl=2, score_strategy=DynamicEmbScoreStrategy.LRU_LFU),
    "customized": dict(score_strategy=DynamicEmbScoreStrategy.CUSTOMIZED),
}


def _scored_module(options, cache: bool):
    options = dict(options)
    if cache:
        options.update(local_hbm_for_values=16 * 4 * 256, caching=True)
    spec = TableSpec(dim=16, max_capacity=1 << 13, options=options)
    module, _ = make_tables([spec], optimizer=OPTIMIZER_ARGS[DynamicEmbOptimType.EXACT_SGD])
    if options["score_strategy"] == DynamicEmbScoreStrategy.CUSTOMIZED:
        module.set_score({"t0": 9})
    return module


@pytest.mark.parametrize("cache", [False, True], ids=["all-rows", "cache"])
@pytest.mark.parametrize("case", list(SCORED))
def test_a_ttl_or_customized_step_makes_no_sync(case, cache):
    """A steady step with a ttl (rows of the batches before last have expired) or
    CUSTOMIZED scores runs padded: no sync on the CPU backend's own step nor the
    emulated CUDA step, the CPU backend's outputs and rows, the same calls and ops
    for a batch with the same lookup count and other ids."""
    batches = [(ids + 4000 * (i % 3), offsets)  # every third batch comes back
               for i, (ids, offsets) in enumerate(_batches(3000, 6, seed=18))]
    with counted_cpu() as counted:
        cpu = _scored_module(SCORED[case], cache)
    with emulated_cuda() as kernels:
        emulated = _scored_module(SCORED[case], cache)
        for ids, offsets in batches[:-1]:
            torch.testing.assert_close(_step(emulated, ids, offsets), _step(cpu, ids, offsets),
                                       **TOL)
        guard = _guarded_step(emulated, kernels, *batches[-1])
        launches = Counter(kernels.launches)
        ids, offsets = batches[-2]
        other = _guarded_step(emulated, kernels, torch.where(ids % 5 == 0, ids, 11), offsets)
        with counted_cpu(counted):
            counted.calls.clear()
            cpu_guard = _guarded_step(cpu, counted, *batches[-1])
            cpu_launches, calls = Counter(counted.launches), list(counted.calls)
            counted.calls.clear()
            cpu_other = _guarded_step(cpu, counted, torch.where(ids % 5 == 0, ids, 11), offsets)
            other_calls = list(counted.calls)
        _assert_same_rows(emulated, cpu)
        assert emulated.cache_metrics() == cpu.cache_metrics()
        expired = cpu.cache_metrics()["t0"].expired
    assert not guard.syncs, guard.report()
    assert not cpu_guard.syncs, cpu_guard.report()
    ttl = "ttl" in SCORED[case]
    assert (expired > 0) == ttl, "rows expired on a hit (and only with a ttl)"
    assert set(launches) == (CACHE_KERNELS if cache else STEP_KERNELS), launches
    assert set(cpu_launches) == CPU_CALLS["cache" if cache else "all-rows"], cpu_launches
    assert cpu_launches["erase_where"] == (1 + ttl if cache else 0), cpu_launches
    assert other.ops == guard.ops, "the op sequence depends on the ids"
    assert cpu_other.ops == cpu_guard.ops, "the CPU step's aten ops depend on the ids"
    assert other_calls == calls, "the extension's calls depend on the ids"


def test_a_ttl_eval_step_makes_no_sync():
    """Eval with a ttl: a row expired at the table's time (kept on the device) reads
    the eval initializer's row, with no sync, as on the CPU backend."""
    batches = [(ids + 4000 * i, offsets)  # at the end, the first batch's rows expired
               for i, (ids, offsets) in enumerate(_batches(3000, 4, seed=19))]
    with counted_cpu() as counted:
        cpu = _scored_module(SCORED["lru-ttl"], cache=False)
    with emulated_cuda() as kernels:
        emulated = _scored_module(SCORED["lru-ttl"], cache=False)
        for ids, offsets in batches:
            _step(emulated, ids, offsets), _step(cpu, ids, offsets)
        for m in (cpu, emulated):
            m.eval()
        ids = torch.cat([batches[0][0], batches[-1][0]])  # expired ids, and live ones
        offsets = torch.arange(0, ids.numel() + 1, BAG)
        with SyncGuard() as guard, torch.no_grad():
            kernels.guard = guard
            got = emulated(ids, offsets)
        kernels.guard = None
    want = _assert_cpu_eval_alike(cpu, counted, ids, offsets, got, guard)
    fresh = _scored_module(dict(SCORED["lru-ttl"], ttl=None), cache=False).eval()
    with torch.no_grad():  # the expired ids read their initial rows, the others trained ones
        initial = fresh(ids, offsets)
    half = BATCH
    torch.testing.assert_close(want[:half], initial[:half], **TOL)
    assert not torch.allclose(want[half:], initial[half:])
