"""The exactness invariant of the storage tiers.

Training the same batches with a device cache of 1%, 10% or 100% of the touched
keys, with rows placed in a device tier without promotion, or with every row in
host memory, gives bit-identical embeddings, optimizer states, scores and outputs
to the single-tier table: for every optimizer, LRU and LFU, pooled and sequence,
with and without prefetch, and with a host store too small for every key. Run on
each backend and on the CUDA backend's code with its kernels emulated
(``cuda-emulated``: its padded step promotes into the cache on the device).
"""

import pytest
import torch

from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbOptimType,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
)
from dynamicemb.ops.interface import RowFormat
from dynamicemb.storage.layouts import HostOnly
from dynamicemb_testing.devices import EMULATED, SIMT, backend_device, devices

DIM = 8
NUM_FEATURES = 2


@pytest.fixture(params=devices() + [EMULATED, SIMT])
def device(request):
    """A backend, or the CPU under ``emulated_cuda``."""
    with backend_device(request.param) as d:
        yield d


STEPS = 8
BATCH = 128
OPTIMIZERS = list(DynamicEmbOptimType)
STATE_FLOATS = {
    DynamicEmbOptimType.EXACT_SGD: 0,
    DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD: 1,
    DynamicEmbOptimType.EXACT_ADAGRAD: DIM,
    DynamicEmbOptimType.ADAM: 2 * DIM,
}


def power_law_batches(seed: int, steps: int = STEPS, batch: int = BATCH):
    """Batches of power-law ids over a few thousand keys, 1-3 ids per bag."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(1, 4, (NUM_FEATURES * batch,), generator=gen)
        n = int(lengths.sum())
        u = torch.rand(n, generator=gen, dtype=torch.float64)
        ids = ((4000.0 ** -0.2 - 1) * u + 1) ** (1 / -0.2)  # alpha 1.2 over [1, 4000)
        ids = ids.long() * 7919 - 10**12  # spread over int64, some negative
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        out.append((ids, offsets))
    return out


def touched_keys(batches) -> int:
    return torch.cat([ids for ids, _ in batches]).unique().numel()


def make_module(device, optimizer, strategy, pooling, caching=False, device_rows=None,
                max_capacity=8192, **options):
    row_bytes = RowFormat(options.get("embedding_dtype") or torch.float32, DIM,
                          STATE_FLOATS[optimizer]).row_bytes
    options = DynamicEmbTableOptions(
        dim=DIM,
        max_capacity=max_capacity,
        bucket_capacity=16,
        score_strategy=strategy,
        initializer_args=DynamicEmbInitializerArgs(mode="normal", std_dev=0.1, seed=11),
        caching=caching,
        local_hbm_for_values=None if device_rows is None else device_rows * row_bytes,
        **options,
    )
    return BatchedDynamicEmbeddingTables(
        [options, options], table_names=["a", "b"], pooling_mode=pooling,
        optimizer=optimizer, learning_rate=0.05, weight_decay=0.01, weight_decay_mode="l2",
        device=device,
    )


def train(module, batches, prefetch: bool):
    """Returns the outputs of every step; prefetches batch k+1 between the forward and
    the backward of batch k (the order a pipeline uses)."""
    outputs = []
    if prefetch:
        module.prefetch(*batches[0])
    for k, (ids, offsets) in enumerate(batches):
        out = module(ids, offsets)
        if prefetch and k + 1 < len(batches):
            module.prefetch(*batches[k + 1])
        grad = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
        out.backward(grad)
        outputs.append(out.detach())
    return outputs


def snapshot(module):
    state = {}
    for name in module.table_names:
        rows = module.export_keys_values(name)
        order = torch.argsort(rows.keys)
        state[name] = (rows.keys[order], rows.embeddings[order], rows.optimizer_states[order],
                       rows.scores[order])
    return state


def assert_identical(a, b):
    assert a.keys() == b.keys()
    for name in a:
        for x, y in zip(a[name], b[name]):
            assert torch.equal(x, y), name


def layouts(touched: int):
    """(caching, device rows) per layout: caches of 1%, 10% and 100% of the touched
    keys, a placement tier of 10%, and host-only."""
    return {
        "cache-1%": (True, max(16, touched // 100)),
        "cache-10%": (True, touched // 10),
        "cache-100%": (True, 2 * touched),  # rounded down to a power-of-two of buckets
        "placed-10%": (False, touched // 10),
        "host-only": (False, 0),
    }


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
@pytest.mark.parametrize("strategy", [DynamicEmbScoreStrategy.LRU, DynamicEmbScoreStrategy.LFU],
                         ids=lambda s: s.name)
@pytest.mark.parametrize("pooling", ["sum", "none"])
@pytest.mark.parametrize("prefetch", [False, True], ids=["direct", "prefetch"])
def test_any_cache_size_trains_identically(optimizer, strategy, pooling, prefetch, device):
    batches = power_law_batches(seed=3)
    touched = touched_keys(batches)
    reference = make_module(device, optimizer, strategy, pooling)
    expected_out = train(reference, batches, prefetch=False)
    expected = snapshot(reference)
    for name, (caching, rows) in layouts(touched).items():
        module = make_module(device, optimizer, strategy, pooling, caching, rows)
        outputs = train(module, batches, prefetch)
        for got, want in zip(outputs, expected_out):
            assert torch.equal(got, want), name
        assert_identical(snapshot(module), expected)
        module.flush()
        assert_identical(snapshot(module), expected)


def growing_trains_alike_in_every_layout(device, optimizer, seed: int, **options):
    """A host store that grows from 64 rows per table (load factor 1: some keys fail in
    full buckets) gets the same calls whatever the tiers above it: every layout, with
    prefetch, trains as the single tier. Returns the single tier's snapshot."""
    batches = power_law_batches(seed=seed)
    grows = dict(init_capacity=64, max_load_factor=1.0, **options)
    strategy = DynamicEmbScoreStrategy.LRU
    reference = make_module(device, optimizer, strategy, "sum", **grows)
    expected_out = train(reference, batches, prefetch=False)
    expected = snapshot(reference)
    stats = reference._groups[0].table.stats  # internal: the scenario happened
    assert stats.growths >= 3 and stats.failed_inserts > 0
    for name, (caching, rows) in layouts(touched_keys(batches)).items():
        module = make_module(device, optimizer, strategy, "sum", caching, rows, **grows)
        for got, want in zip(train(module, batches, prefetch=True), expected_out):
            assert torch.equal(got, want), name
        assert_identical(snapshot(module), expected)
    return expected


def test_a_growing_host_store_trains_identically_whatever_the_cache(device):
    growing_trains_alike_in_every_layout(device, DynamicEmbOptimType.ADAM, seed=5)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sixteen_bit_rows_train_identically_whatever_the_cache(optimizer, dtype, device):
    """16-bit rows (stochastic rounding): the rounding bits follow the key and the
    update count, not where the row is."""
    expected = growing_trains_alike_in_every_layout(device, optimizer, seed=3,
                                                    embedding_dtype=dtype)
    assert expected["a"][1].dtype == dtype


@pytest.mark.parametrize("strategy", [DynamicEmbScoreStrategy.LRU, DynamicEmbScoreStrategy.LFU],
                         ids=lambda s: s.name)
def test_a_full_host_store_evicts_the_same_rows_whatever_the_cache(strategy, device):
    batches = power_law_batches(seed=5)
    touched = touched_keys(batches)
    small = 256  # per table; the group's host store holds 2 * small rows
    assert touched > 3 * small  # far below the touched keys: it evicts every step
    reference = make_module(device, DynamicEmbOptimType.ADAM, strategy, "sum", max_capacity=small)
    train(reference, batches, prefetch=False)
    expected = snapshot(reference)
    for caching, rows in [(True, 32), (True, 128), (False, 64)]:
        module = make_module(device, DynamicEmbOptimType.ADAM, strategy, "sum", caching, rows,
                             max_capacity=small)
        train(module, batches, prefetch=False)
        assert_identical(snapshot(module), expected)
        metrics = module.cache_metrics()
        assert sum(m.host_evictions for m in metrics.values()) > 0


def test_eval_through_a_cold_cache_equals_a_warm_one(device):
    batches = power_law_batches(seed=7)
    rows = touched_keys(batches) // 10
    module = make_module(device, DynamicEmbOptimType.EXACT_ADAGRAD, DynamicEmbScoreStrategy.LRU, "sum",
                         caching=True, device_rows=rows)
    reference = make_module(device, DynamicEmbOptimType.EXACT_ADAGRAD, DynamicEmbScoreStrategy.LRU, "sum")
    train(module, batches, prefetch=False)
    train(reference, batches, prefetch=False)
    module.eval()
    reference.eval()
    probe_ids, probe_offsets = power_law_batches(seed=8, steps=1)[0]
    with torch.no_grad():
        warm = module(probe_ids, probe_offsets)
        before = snapshot(module)
        module.reset_cache_states()
        cold = module(probe_ids, probe_offsets)
        plain = reference(probe_ids, probe_offsets)
    assert torch.equal(warm, cold) and torch.equal(cold, plain)
    assert_identical(snapshot(module), before)


def test_metrics_add_up(device):
    batches = power_law_batches(seed=9)
    module = make_module(device, DynamicEmbOptimType.EXACT_SGD, DynamicEmbScoreStrategy.LRU, "sum",
                         caching=True, device_rows=touched_keys(batches) // 10)
    train(module, batches, prefetch=False)
    metrics = module.cache_metrics()
    for m in metrics.values():
        assert m.lookups > 0 and m.hits + m.misses == m.lookups
        assert m.evictions > 0 and m.host_writes == m.evictions
        assert 0 < m.hit_rate < 1
    module.flush()
    flushed = module.cache_metrics()
    assert sum(m.host_writes for m in flushed.values()) > sum(m.evictions for m in flushed.values())


def test_a_budget_beyond_the_table_allocates_a_cache_no_larger_than_it(device):
    """A terabyte of budget over a table of 16,384 rows (a typo, or a global budget
    split over few rows): the cache holds every row the table can, no more, and
    trains as the single tier does."""
    batches = power_law_batches(seed=10)
    module = make_module(device, DynamicEmbOptimType.ADAM, DynamicEmbScoreStrategy.LRU, "sum",
                         caching=True, device_rows=1 << 35)
    reference = make_module(device, DynamicEmbOptimType.ADAM, DynamicEmbScoreStrategy.LRU, "sum")
    storage = module._groups[0].storage
    assert storage.device_tier.capacity() == storage.host.max_capacity() == 2 * 8192
    assert_identical(snapshot(module), snapshot(reference))
    for a, b in zip(train(module, batches, prefetch=False), train(reference, batches, prefetch=False)):
        assert torch.equal(a, b)
    assert_identical(snapshot(module), snapshot(reference))


@pytest.mark.parametrize("caching", [True, False], ids=["cache", "placement"])
def test_a_device_budget_below_one_bucket_is_refused_by_name(caching):
    """1 to 15 rows (over the group's tables) cannot make a device tier of 16-row
    buckets: refused, not quietly turned into a host-only table; 0 is host-only,
    16 rows a tier of one bucket."""
    cpu = torch.device("cpu")
    sgd, lru = DynamicEmbOptimType.EXACT_SGD, DynamicEmbScoreStrategy.LRU
    with pytest.raises(ValueError, match=r"tables \['a', 'b'\]: local_hbm_for_values/"
                       r"global_hbm_for_values hold 14 rows of 32 B, less than a device tier's "
                       r"smallest bucket \(16 rows\): give them at least 512 B together, 0 for "
                       r"a host-only table"):
        make_module(cpu, sgd, lru, "sum", caching=caching, device_rows=7)
    assert isinstance(make_module(cpu, sgd, lru, "sum", caching=caching, device_rows=0)
                      ._groups[0].storage.layout, HostOnly)
    tier = make_module(cpu, sgd, lru, "sum", caching=caching, device_rows=8)._groups[0] \
        .storage.device_tier
    assert tier is not None and tier.capacity() == 16


@pytest.mark.parametrize("layout", ["one-tier", "cache-10%", "placed-10%", "host-only"])
def test_reads_of_rows_and_states_find_each_row_in_its_tier(layout, device):
    """``read_rows`` and ``read_optimizer_states`` after training: the exported
    (current) row and state of every stored key, wherever the layout keeps it, and for
    absent keys the initializer's row (training or eval) and the initial state."""
    data = power_law_batches(seed=5)
    caching, rows = (False, None) if layout == "one-tier" else layouts(touched_keys(data))[layout]
    serving = DynamicEmbInitializerArgs(mode="uniform", lower=-0.5, upper=0.5, seed=3)
    module = make_module(device, DynamicEmbOptimType.EXACT_ADAGRAD, DynamicEmbScoreStrategy.LRU,
                         "sum", caching=caching, device_rows=rows,
                         eval_initializer_args=serving)
    train(module, data, prefetch=False)
    fresh = make_module(device, DynamicEmbOptimType.EXACT_ADAGRAD, DynamicEmbScoreStrategy.LRU,
                        "sum", eval_initializer_args=serving)
    for name in module.table_names:
        stored = module.export_keys_values(name)
        absent = torch.arange(10**9, 10**9 + 5, dtype=torch.int64)
        keys = torch.cat([stored.keys.cpu(), absent])
        n = stored.keys.numel()
        got_rows = module.read_rows(name, keys).cpu()
        got_states = module.read_optimizer_states(name, keys).cpu()
        assert torch.equal(got_rows[:n], stored.embeddings.cpu())
        assert torch.equal(got_states[:n], stored.optimizer_states.cpu())
        assert torch.equal(got_states[n:], torch.zeros(5, got_states.shape[1]))
        # an absent key's row: what a training lookup would store, or an eval one read
        assert torch.equal(got_rows[n:], fresh.read_rows(name, absent).cpu())
        eval_rows = module.read_rows(name, absent, train=False).cpu()
        fresh.eval()
        each = torch.arange(6, dtype=torch.int64)  # a bag per id, in the table's feature
        offsets = (torch.cat([each, torch.full((5,), 5)]) if name == "a"
                   else torch.cat([torch.zeros(5, dtype=torch.int64), each]))
        out = fresh(absent, offsets)
        fresh.train()
        assert eval_rows.abs().sum() > 0 and not torch.equal(eval_rows, got_rows[n:])
        cols = slice(0, DIM) if name == "a" else slice(DIM, 2 * DIM)
        assert torch.equal(eval_rows, out[:, cols].cpu())
