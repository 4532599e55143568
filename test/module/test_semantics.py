"""Semantics of ``BatchedDynamicEmbeddingTables`` beyond the optimizer math.

Eval is read-only; initializers are pure functions of (seed, table, key, column);
admission counts occurrences; empty batches and bad inputs; reduced-precision outputs;
learning-rate changes; scores; eviction; rows that move between forward and backward.
Where "unchanged" is claimed, the module is compared with a twin that never saw the call.
"""

from typing import List, Optional

import pytest
import torch

from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbCheckMode,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbOptimizerArgs,
    DynamicEmbOptimType,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    FrequencyAdmissionStrategy,
)
from dynamicemb.table import hash_keys
from dynamicemb_testing.devices import expect_refused
from dynamicemb_testing.module_reference import (
    SPECIAL_IDS,
    TableSpec,
    assert_tables_match,
    export_dict,
    id_pool,
    make_tables,
    random_batch,
    snapshot,
)

SUM, MEAN, NONE = DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.MEAN, DynamicEmbPoolingMode.NONE
Init, Mode = DynamicEmbInitializerArgs, DynamicEmbInitializerMode


def options(dim=4, max_capacity=256, init_value: Optional[float] = 0.25, **kw) -> DynamicEmbTableOptions:
    """Table options; a CONSTANT training initializer unless ``initializer_args`` is given."""
    if init_value is not None and "initializer_args" not in kw:
        kw["initializer_args"] = Init(mode=Mode.CONSTANT, value=init_value)
    return DynamicEmbTableOptions(dim=dim, max_capacity=max_capacity, **kw)


def module_of(device, table_options: List[DynamicEmbTableOptions], **kw) -> BatchedDynamicEmbeddingTables:
    kw.setdefault("learning_rate", 0.1)
    return BatchedDynamicEmbeddingTables(table_options, device=device, **kw)


def ids(*keys) -> torch.Tensor:
    return torch.tensor(keys, dtype=torch.int64)


def one_bag(keys) -> tuple:
    """(indices, offsets) of one feature, one bag."""
    return torch.tensor(list(keys), dtype=torch.int64), ids(0, len(keys))


def train_step(module, indices, offsets, weights=None, seed=0):
    """One forward and backward (gradients drawn on the CPU); returns the output on the CPU."""
    out = module(indices, offsets, weights)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    (out.float() * grad.to(out.device)).sum().backward()
    return out.detach().cpu()


def rows_of(module, name, keys) -> torch.Tensor:
    got = export_dict(module, name)
    return torch.stack([got[k][0] for k in keys])


def assert_same_state(a, b) -> None:
    """Equal keys, rows, optimizer states and scores in every table."""
    assert snapshot(a) == snapshot(b)


# --------------------------------------------------------------------------- eval
SCORED = [DynamicEmbScoreStrategy.LRU, DynamicEmbScoreStrategy.LFU, DynamicEmbScoreStrategy.STEP]


@pytest.mark.parametrize("strategy", SCORED, ids=lambda s: s.name)
@pytest.mark.parametrize("opt", [DynamicEmbOptimType.EXACT_ADAGRAD, DynamicEmbOptimType.ADAM],
                         ids=lambda o: o.name)
def test_eval_never_mutates(strategy, opt, device):
    """Eval lookups (grad enabled or not) change no row, state, score, clock or step."""
    def make():
        return module_of(device,
                         [options(4, score_strategy=strategy), options(3, score_strategy=strategy)],
                         feature_table_map=[0, 1, 0], optimizer=opt)

    module, twin = make(), make()
    pools = [id_pool(10, 1), id_pool(10, 2), id_pool(10, 1)]
    gen, twin_gen = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for step in range(3):
        train_step(module, *random_batch(pools, 4, gen)[:2], seed=step)
        train_step(twin, *random_batch(pools, 4, twin_gen)[:2], seed=step)
    before = snapshot(module)
    module.eval()
    unseen = [id_pool(20, 9)[10:]] * 3
    for batch in (random_batch(pools, 4, torch.Generator().manual_seed(4)),
                  random_batch(unseen, 4, torch.Generator().manual_seed(5))):
        out = module(*batch[:2])
        assert not out.requires_grad
        with torch.no_grad():
            module(*batch[:2])
    assert snapshot(module) == before
    module.train()
    for step in range(3, 5):  # the eval calls left no trace on later training either
        got = train_step(module, *random_batch(pools, 4, gen)[:2], seed=step)
        want = train_step(twin, *random_batch(pools, 4, twin_gen)[:2], seed=step)
        assert torch.equal(got, want)
    assert_same_state(module, twin)


def test_eval_unseen_ids_read_eval_initializer(device):
    """Stored ids read their row; unseen ids read the eval initializer (zeros by default)."""
    debug = Init(mode=Mode.DEBUG)
    module = module_of(device, [options(3),
                                options(3, eval_initializer_args=Init(mode=Mode.CONSTANT, value=0.7)),
                                options(3, eval_initializer_args=debug)],
                       pooling_mode=NONE, feature_table_map=[0, 1, 2])
    stored = ids(5, -(10**15))
    for name in module.table_names:
        module.import_keys_values(name, stored, torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    module.eval()
    keys = [5, 10**15, -(10**15), -3]  # per feature: two stored, two unseen
    out = module(torch.tensor(keys * 3), ids(0, 4, 8, 12))
    stored_rows = {5: [1.0, 2.0, 3.0], -(10**15): [4.0, 5.0, 6.0]}
    unseen_rows = [lambda k: [0.0] * 3, lambda k: [0.7] * 3, lambda k: [float(k % 100_000)] * 3]
    want = [stored_rows[k] if k in stored_rows else unseen_rows[f](k) for f in range(3) for k in keys]
    torch.testing.assert_close(out.cpu(), torch.tensor(want), rtol=0, atol=0)
    assert all(module.table_size(n) == 2 for n in module.table_names)


def test_eval_pooled_adds_eval_rows(device):
    module = module_of(device, [options(2, eval_initializer_args=Init(mode=Mode.CONSTANT, value=0.5))],
                       pooling_mode=MEAN)
    module.import_keys_values("t0", ids(1), torch.tensor([[2.0, 4.0]]))
    module.eval()
    out = module(ids(1, 99, 99, 1), ids(0, 3, 3, 4))  # B=3: [1, 99, 99], [], [1]
    torch.testing.assert_close(out.cpu(), torch.tensor([[1.0, 5.0 / 3], [0.0, 0.0], [2.0, 4.0]]))


# --------------------------------------------------------------------- initializers
def test_debug_initializer_is_key_mod_100000(device):
    keys = SPECIAL_IDS + [123_456_789, -123_456_789, -100_000, -99_999]
    module = module_of(device, [options(5, initializer_args=Init(mode=Mode.DEBUG))], pooling_mode=NONE)
    with torch.no_grad():  # training forward: inserts, no update
        out = module(torch.tensor(keys), ids(0, len(keys)))
    want = torch.tensor([[float(k % 100_000)] * 5 for k in keys])
    assert torch.equal(out.cpu(), want)
    assert torch.equal(rows_of(module, "t0", keys), want)
    assert (want >= 0).all()


RANDOM_MODES = [
    Init(mode=Mode.UNIFORM, seed=3),
    Init(mode=Mode.UNIFORM, lower=-2.0, upper=-1.0, seed=1),
    Init(mode=Mode.NORMAL, mean=1.0, std_dev=0.5, seed=7),
    Init(mode=Mode.TRUNCATED_NORMAL, mean=0.0, std_dev=1.0, seed=11),
]


@pytest.mark.parametrize("init", RANDOM_MODES, ids=lambda i: f"{i.mode.name}-{i.seed}")
def test_initializer_is_a_function_of_table_key_column(init, device):
    """A key's new row does not depend on its batch, its position, duplicates or threads."""
    keys = id_pool(600, 17)

    def make():
        return module_of(device, [options(8, 4096, init_value=None, initializer_args=init),
                                  options(8, 4096, init_value=None, initializer_args=init)],
                         pooling_mode=NONE)

    a, b = make(), make()
    with torch.no_grad():
        a(torch.tensor(keys + keys), ids(0, len(keys), 2 * len(keys)))
        rev = list(reversed(keys))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for part in (rev[:250] + rev[:5], rev[250:]):  # other batches, other order, duplicates
                b(torch.tensor(part + part), ids(0, len(part), 2 * len(part)))
        finally:
            torch.set_num_threads(threads)
    for name in ("t0", "t1"):
        assert torch.equal(rows_of(a, name, keys), rows_of(b, name, keys))
    t0, t1 = rows_of(a, "t0", keys), rows_of(a, "t1", keys)
    assert not torch.equal(t0, t1), "tables must draw independent rows"
    assert len({tuple(r) for r in t0.tolist()}) == len(keys), "keys must draw distinct rows"
    lower, upper = init.bounds(4096)
    if init.mode in (Mode.UNIFORM, Mode.TRUNCATED_NORMAL):
        assert lower <= float(t0.min()) and float(t0.max()) <= upper
    if init.mode == Mode.UNIFORM:
        assert abs(float(t0.mean()) - (lower + upper) / 2) < 0.03 * (upper - lower)
    if init.mode == Mode.NORMAL:
        assert abs(float(t0.mean()) - init.mean) < 0.05 and abs(float(t0.std()) - init.std_dev) < 0.05
    # eval with the same arguments reads the same rows without storing them
    c = module_of(device, [options(8, 4096, init_value=None, initializer_args=init,
                                   eval_initializer_args=init)],
                  pooling_mode=NONE)
    c.eval()
    assert torch.equal(c(torch.tensor(keys), ids(0, len(keys))).cpu(), t0)
    assert c.table_size("t0") == 0


def test_initializer_seed_changes_rows(device):
    keys = torch.tensor(id_pool(50, 3))
    rows = []
    for seed in (0, 1):
        m = module_of(device,
                      [options(4, init_value=None, initializer_args=Init(mode=Mode.NORMAL, seed=seed))],
                      pooling_mode=NONE)
        with torch.no_grad():
            rows.append(m(keys, ids(0, keys.numel())))
    assert not torch.equal(rows[0], rows[1])


# ------------------------------------------------------------------------ admission
def admission_module(device, threshold: int, **kw):
    return module_of(device, [options(2, admit_strategy=FrequencyAdmissionStrategy(threshold)),
                              options(2, admit_strategy=FrequencyAdmissionStrategy(threshold))],
                     pooling_mode=NONE, optimizer=DynamicEmbOptimType.EXACT_SGD, **kw)


def feed(module, f0, f1=(), train=True):
    """One training (or eval) step, features t0 and t1, loss = sum of outputs; returns
    the output on the CPU."""
    module.train(train)
    keys = list(f0) + list(f1)
    out = module(torch.tensor(keys, dtype=torch.int64), ids(0, len(f0), len(keys)))
    if train:
        out.sum().backward()
    return out.detach().cpu()


def test_admission_counts_occurrences_across_and_within_batches(device):
    m = admission_module(device, 3)
    init = torch.full((1, 2), 0.25)
    for seen in (1, 2):  # 10**15 seen once per batch: not stored, not updated
        out = feed(m, [10**15])
        assert torch.equal(out, init) and m.table_size("t0") == 0, f"stored after {seen} sightings"
    out = feed(m, [10**15])  # third occurrence: stored from the initializer, then updated
    assert torch.equal(out, init)
    assert torch.equal(rows_of(m, "t0", [10**15]), torch.full((1, 2), 0.25 - 0.1))
    feed(m, [-4, -4, -4])  # three occurrences in one batch: stored at once
    assert torch.allclose(rows_of(m, "t0", [-4]), torch.full((1, 2), 0.25 - 3 * 0.1))
    feed(m, [8, 8])  # two now ...
    assert 8 not in export_dict(m, "t0")
    feed(m, [8])  # ... and one later
    assert torch.allclose(rows_of(m, "t0", [8]), torch.full((1, 2), 0.25 - 0.1))


def test_admission_counts_per_table_and_not_in_eval(device):
    m = admission_module(device, 2)
    feed(m, [5], [5])  # key 5 once in each table: one occurrence each
    assert m.table_size("t0") == 0 and m.table_size("t1") == 0
    for _ in range(3):
        out = feed(m, [6, 6, 6], [], train=False)  # eval: not counted, eval rows (zeros)
        assert torch.equal(out, torch.zeros(3, 2))
    feed(m, [6])
    assert m.table_size("t0") == 0, "eval lookups must not count toward admission"
    feed(m, [5])
    assert sorted(export_dict(m, "t0")) == [5] and m.table_size("t1") == 0


def test_admission_threshold_one_admits_everything(device):
    m = admission_module(device, 1)
    feed(m, [1, 2, 3])
    assert sorted(export_dict(m, "t0")) == [1, 2, 3]


# ----------------------------------------------------------------------- empty batches
@pytest.mark.parametrize("pooling", [SUM, MEAN, NONE], ids=lambda p: p.name)
@pytest.mark.parametrize("batch", [0, 3], ids=lambda b: f"B{b}")
def test_empty_batch(pooling, batch, device):
    dims = [4, 4] if pooling == NONE else [4, 3]
    module = module_of(device, [options(dims[0]), options(dims[1])], feature_table_map=[0, 1, 0],
                       pooling_mode=pooling, optimizer=DynamicEmbOptimType.ADAM)
    module.import_keys_values("t0", ids(1, 2), torch.ones(2, dims[0]))
    before = snapshot(module)
    for dtype in (torch.int64, torch.int32):
        out = module(torch.zeros(0, dtype=dtype), torch.zeros(3 * batch + 1, dtype=dtype))
        want_shape = (0, 4) if pooling == NONE else (batch, sum(dims) + dims[0])
        assert out.shape == want_shape and out.dtype == torch.float32
        assert torch.equal(out.cpu(), torch.zeros(want_shape))
        out.sum().backward()
    assert snapshot(module) == before


def test_empty_bags_pool_to_zeros(device):
    module = module_of(device, [options(2)], pooling_mode=MEAN)
    module.import_keys_values("t0", ids(7), torch.tensor([[3.0, -1.0]]))
    out = train_step(module, ids(7, 7), ids(0, 0, 2, 2))  # B=3: [], [7, 7], []
    assert torch.equal(out, torch.tensor([[0.0, 0.0], [3.0, -1.0], [0.0, 0.0]]))


# -------------------------------------------------------------------------- bad input
def bad_inputs(pooling):
    idx, off = ids(1, 2, 3, 4), ids(0, 1, 2, 3, 4)  # F=2, B=2
    w = torch.ones(4)
    cases = [
        ("float indices", TypeError, (idx.float(), off, None)),
        ("int16 indices", TypeError, (idx.short(), off, None)),
        ("float offsets", TypeError, (idx, off.double(), None)),
        ("uint8 offsets", TypeError, (idx, off.to(torch.uint8), None)),
        ("2-D indices", ValueError, (idx.reshape(2, 2), off, None)),
        ("offsets not F*B+1", ValueError, (idx, ids(0, 2, 3, 4), None)),
        ("offsets empty", ValueError, (idx, ids(), None)),
        ("offsets not from 0", ValueError, (idx, ids(1, 1, 2, 3, 4), None)),
        ("offsets not to N", ValueError, (idx, ids(0, 1, 2, 3, 3), None)),
        ("offsets past N", ValueError, (idx, ids(0, 1, 2, 3, 5), None)),
        ("offsets decreasing", ValueError, (idx, ids(0, 3, 2, 3, 4), None)),
        ("indices but B=0", ValueError, (idx, ids(0), None)),
    ]
    if pooling == SUM:
        cases += [("weights too short", ValueError, (idx, off, torch.ones(3))),
                  ("weights 2-D", ValueError, (idx, off, torch.ones(4, 1)))]
    else:
        cases += [(f"weights with {pooling.name}", ValueError, (idx, off, w))]
    return cases


BAD = [(p, *c) for p in (SUM, MEAN, NONE) for c in bad_inputs(p)]


@pytest.mark.parametrize("at", [2, 20_000, 39_998])
def test_one_decreasing_offset_in_a_large_batch_is_found(at, device):
    # large enough for the offsets check to run on several threads (CPU) or blocks (CUDA)
    module = module_of(device, [options(4)])
    n = 40_000
    offsets = torch.arange(n + 1, dtype=torch.int64)
    offsets[at] = offsets[at + 1] = at - 1  # then offsets[at + 2] = at + 2 again
    offsets[at - 1] = at  # ... at - 2, at, at - 1, at - 1, at + 2 ...: one decrease
    good = torch.arange(n, dtype=torch.int64), torch.arange(n + 1, dtype=torch.int64)
    expect_refused(module, (torch.arange(n, dtype=torch.int64), offsets), ValueError,
                   "non-decreasing", next_call=good)
    assert module.table_size("t0") == 0
    module(*good)  # the error was raised once: the module goes on
    assert module.table_size("t0") == 256  # the capacity: the batch was taken


@pytest.mark.parametrize("pooling,what,error,args", BAD, ids=[f"{p.name}-{w}" for p, w, _, _ in BAD])
def test_bad_input_raises_and_changes_nothing(pooling, what, error, args, device):
    def make():
        return module_of(device,
                         [options(4, score_strategy=DynamicEmbScoreStrategy.STEP),
                          options(4, score_strategy=DynamicEmbScoreStrategy.LRU, bucket_capacity=32)],
                         pooling_mode=pooling, optimizer=DynamicEmbOptimType.ADAM)

    module, twin = make(), make()
    good = (ids(1, 2, 3, 4), ids(0, 1, 2, 3, 4))
    for m in (module, twin):
        train_step(m, *good)
    expect_refused(module, args, error, None, next_call=good)
    assert_same_state(module, twin)
    # and nothing hidden (step, clock, admission counters) moved either
    assert torch.equal(train_step(module, *good, seed=1), train_step(twin, *good, seed=1))
    assert_same_state(module, twin)


def two_group_overflow(device):
    """t0 (STEP, admission 2) beside t1 (16 slots, NO_EVICTION, ERROR): t1 overflows
    after t0 has already stored and counted its keys."""
    def make():
        return module_of(device, [
            options(2, score_strategy=DynamicEmbScoreStrategy.STEP,
                    admit_strategy=FrequencyAdmissionStrategy(2)),
            options(3, max_capacity=16, bucket_capacity=16,
                    score_strategy=DynamicEmbScoreStrategy.NO_EVICTION,
                    safe_check_mode=DynamicEmbCheckMode.ERROR),
        ])
    warm = (ids(50, 51, 100), ids(0, 2, 3))  # t0 sees 50 and 51 once (not admitted yet)
    overflow = (torch.cat([ids(50, 1, 1), torch.arange(100, 120)]), ids(0, 3, 23))  # t1: 20 keys
    after = (ids(50, 51, 3, 100), ids(0, 3, 4))  # second sighting of 50, 51: admitted in both
    return make, warm, overflow, after


def one_group_overflow(device):
    """One STEP table in ERROR mode; a batch of 20 new keys for its 16 slots fails."""
    def make():
        return module_of(device, [options(2, max_capacity=16, bucket_capacity=16,
                                          score_strategy=DynamicEmbScoreStrategy.STEP,
                                          safe_check_mode=DynamicEmbCheckMode.ERROR)])
    return make, one_bag([1, 2]), one_bag(range(100, 120)), one_bag([3])


@pytest.mark.parametrize("scenario", [two_group_overflow, one_group_overflow],
                         ids=lambda f: f.__name__)
def test_failed_insert_error_changes_nothing(scenario, device):
    """A RuntimeError from a full table (ERROR mode) leaves every table as it was: no
    rows stored in other tables, no admission counts, no training step counted."""
    make, warm, overflow, after = scenario(device)
    module, twin = make(), make()
    for m in (module, twin):
        train_step(m, *warm)
    with pytest.raises(RuntimeError):
        module(*overflow)
    assert_same_state(module, twin)
    assert torch.equal(train_step(module, *after, seed=2), train_step(twin, *after, seed=2))
    assert_same_state(module, twin)


# ------------------------------------------------------------------- output dtypes
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pooling", [SUM, NONE], ids=lambda p: p.name)
def test_reduced_precision_output(dtype, pooling, device):
    """The output is the float32 output cast; the updates use the same gradients."""
    def make(out_dtype):
        m = module_of(device, [options(4), options(4, bucket_capacity=32)], pooling_mode=pooling,
                      optimizer=DynamicEmbOptimType.EXACT_ADAGRAD, output_dtype=out_dtype)
        m.import_keys_values("t0", torch.tensor(SPECIAL_IDS), torch.linspace(-1, 1, 44).reshape(11, 4))
        return m

    low, full = make(dtype), make(torch.float32)
    pools = [SPECIAL_IDS, SPECIAL_IDS[:5]]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        indices, offsets, weights = random_batch(pools, 3, gen, weighted=pooling == SUM)
        out_low, out_full = low(indices, offsets, weights), full(indices, offsets, weights)
        assert out_low.dtype == dtype
        assert torch.equal(out_low.detach(), out_full.detach().to(dtype))
        grad = torch.randn(out_low.shape, generator=gen).to(device=out_low.device, dtype=dtype)
        (out_low * grad).sum().backward()
        (out_full * grad.float()).sum().backward()
    assert_same_state(low, full)


def test_output_dtype_refused(device):
    with pytest.raises(ValueError):
        module_of(device, [options(2)], output_dtype=torch.float64)


# ---------------------------------------------------------------------- learning rate
def lr_pair(device):
    specs = [TableSpec(dim=4), TableSpec(dim=3)]
    module, ref = make_tables(specs, [0, 1, 0], SUM,
                              DynamicEmbOptimizerArgs(DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD, 0.1),
                              device=device)
    pools = [id_pool(8, 1), id_pool(8, 2), id_pool(8, 1)]
    return module, ref, pools


def step_both(module, ref, pools, gen):
    indices, offsets, _ = random_batch(pools, 4, gen)
    out = module(indices, offsets)
    torch.testing.assert_close(out.detach().cpu(), ref.forward(indices, offsets), rtol=1e-6, atol=1e-6)
    grad = torch.randn(out.shape, generator=gen)
    (out * grad.to(out.device)).sum().backward()
    ref.backward(grad)


def test_set_learning_rate_takes_effect(device):
    module, ref, pools = lr_pair(device)
    gen = torch.Generator().manual_seed(0)
    step_both(module, ref, pools, gen)
    module.set_learning_rate(0.7)
    ref.set_learning_rate(0.7)
    assert all(g["lr"] == 0.7 for g in module.optimizer.param_groups)
    for _ in range(2):
        step_both(module, ref, pools, gen)
    assert_tables_match(module, ref)
    with pytest.raises(ValueError):
        module.set_learning_rate(-1.0)


def test_param_group_lr_takes_effect_per_table(device):
    module, ref, pools = lr_pair(device)
    groups = {tuple(g["tables"]): g for g in module.optimizer.param_groups}
    assert sorted(groups) == [("t0",), ("t1",)]
    groups[("t1",)]["lr"] = 0.02
    ref.set_learning_rate(0.02, table=1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        step_both(module, ref, pools, gen)
    assert_tables_match(module, ref)


def test_step_lr_scheduler_on_module_optimizer(device):
    module, ref, pools = lr_pair(device)
    scheduler = torch.optim.lr_scheduler.StepLR(module.optimizer, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(2)
    for step in range(6):
        ref.set_learning_rate(0.1 * 0.5 ** (step // 2))
        step_both(module, ref, pools, gen)
        module.optimizer.step()
        scheduler.step()
    assert module.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    assert_tables_match(module, ref)


# ----------------------------------------------------------------------------- scores
def scores_of(module, name="t0") -> dict:
    return {k: v[2] for k, v in export_dict(module, name).items()}


def test_lfu_scores_count_training_sightings(device):
    m = module_of(device, [options(2, score_strategy=DynamicEmbScoreStrategy.LFU)])
    for batch in ([1, 2], [1], [1, 3], [2]):
        train_step(m, *one_bag(batch))
    m.eval()
    m(*one_bag([1, 2, 3]))
    assert scores_of(m) == {1: 3, 2: 2, 3: 1}


def test_lru_scores_order_by_last_use(device):
    m = module_of(device, [options(2), options(2)], feature_table_map=[0, 1])  # one group, LRU
    for batch in ([1, 2], [3, 1], [4, 5]):
        train_step(m, torch.tensor(batch), ids(0, 1, 2))  # feature 0 gets batch[0], 1 gets batch[1]
    s0, s1 = scores_of(m, "t0"), scores_of(m, "t1")
    assert set(s0) == {1, 3, 4} and set(s1) == {1, 2, 5}
    assert s0[1] < s0[3] < s0[4] and s1[2] < s1[1] < s1[5]
    assert s0[4] == s1[5] and s0[3] == s1[1], "keys of one batch share its clock"


def test_step_scores_are_training_steps(device):
    m = module_of(device, [options(2, score_strategy=DynamicEmbScoreStrategy.STEP)])
    for batch in ([1, 2], [1], [3]):
        train_step(m, *one_bag(batch))
    assert scores_of(m) == {1: 2, 2: 1, 3: 3}


def test_customized_scores(device):
    m = module_of(device, [options(2, score_strategy=DynamicEmbScoreStrategy.CUSTOMIZED), options(2)])
    m.set_score({"t0": 7})
    train_step(m, ids(1, 2, 9), ids(0, 2, 3))
    m.set_score({"t0": 3})
    train_step(m, ids(2, 3, 9), ids(0, 2, 3))
    m.import_keys_values("t0", ids(4), torch.zeros(1, 2))
    assert scores_of(m) == {1: 7, 2: 3, 3: 3, 4: 3}
    with pytest.raises(ValueError):
        m.set_score({"t1": 5})  # not CUSTOMIZED
    with pytest.raises(ValueError):
        m.set_score({"t0": -1})
    with pytest.raises(KeyError):
        m.set_score({"nope": 1})


# ----------------------------------------------------------------- capacity, moving rows
def test_full_lru_table_evicts_oldest_and_keeps_working(device):
    """One bucket of 16 slots: each batch of 8 new keys evicts the batch before last."""
    m = module_of(device, [options(2, max_capacity=16, bucket_capacity=16, init_value=0.5)],
                  pooling_mode=NONE)
    batches = [list(range(100 * i, 100 * i + 8)) for i in range(6)]
    for i, keys in enumerate(batches):
        out = train_step(m, *one_bag(keys))
        assert torch.equal(out, torch.full((8, 2), 0.5)), "new (and re-inserted) keys start from init"
        want = set(keys) | (set(batches[i - 1]) if i else set())
        assert set(export_dict(m, "t0")) == want
    # an evicted key comes back from the initializer, not from its trained row
    out = train_step(m, *one_bag(batches[0][:1]))
    assert torch.equal(out, torch.full((1, 2), 0.5))


def test_batch_larger_than_capacity_reads_initializer_for_failed_inserts(device):
    m = module_of(device, [options(2, max_capacity=16, bucket_capacity=16, init_value=0.5)],
                  pooling_mode=NONE, learning_rate=1.0)
    keys = list(range(1000, 1020))  # 20 unique keys, 16 slots: 4 inserts fail (IGNORE)
    out = m(*one_bag(keys + keys[:3]))
    assert torch.equal(out.detach().cpu(), torch.full((23, 2), 0.5))
    out.sum().backward()
    stored = export_dict(m, "t0")
    assert len(stored) == 16 and set(stored) <= set(keys)
    for k, (row, _, _) in stored.items():
        count = 1 + (k in keys[:3])
        assert torch.equal(row, torch.full((2,), 0.5 - count)), k


def test_growth_between_forward_and_backward(device):
    """Two forwards (the second grows the table), one backward of the sum: right rows move."""
    m = module_of(device, [options(2, max_capacity=1024, init_capacity=16, bucket_capacity=16,
                                   init_value=0.0)])
    group = m._groups[0].table  # internal: only to confirm the scenario happened
    first = [7, -7, 10**15, 3]
    out1 = m(*one_bag(first + [7]))
    capacity = group.capacity()
    second = list(range(5000, 5100)) + [7]
    out2 = m(*one_bag(second))
    assert group.capacity() > capacity, "the second forward should have grown the table"
    (out1.sum() + 2 * out2.sum()).backward()
    got = export_dict(m, "t0")
    lr = 0.1
    want = {k: 0.0 for k in set(first) | set(second)}
    for k in first + [7]:
        want[k] -= lr * 1
    for k in second:
        want[k] -= lr * 2
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.allclose(got[k][0], torch.full((2,), v)), k


def test_a_key_that_meets_a_full_bucket_of_a_growing_table(device):
    """The one result growth ahead changes: 4 new keys of a full 16-slot bucket in a
    table that may grow (its load allows them: no growth ahead) evict nothing, read
    their initializer's row, get no update and make the next call grow, which
    inserts them (the host-counted step grew in the call and stored them)."""
    m = module_of(device, [options(2, max_capacity=256, init_capacity=32, bucket_capacity=16,
                                   max_load_factor=1.0, init_value=0.0)], pooling_mode=NONE)
    keys = torch.arange(4096)
    keys = keys[(hash_keys(keys, torch.zeros_like(keys)) & 1) == 0][:20].tolist()
    table = m._groups[0].table  # internal: only to confirm the scenario happened
    m(*one_bag(keys[:16])).sum().backward()
    out = m(*one_bag(keys[16:]))
    (2 * out).sum().backward()
    assert torch.equal(out.detach().cpu(), torch.zeros(4, 2))
    assert (table.capacity(), table.stats.failed_inserts) == (32, 4)
    assert set(export_dict(m, "t0")) == set(keys[:16])  # none evicted, none updated
    assert torch.equal(rows_of(m, "t0", keys[:16]), torch.full((16, 2), -0.1))
    m(*one_bag(keys[16:])).sum().backward()  # grows first, then inserts the 4
    assert table.capacity() == 64
    assert torch.equal(rows_of(m, "t0", keys[16:]), torch.full((4, 2), -0.1))


def test_eviction_between_forward_and_backward(device):
    """Rows evicted after the forward get no update; their slots' new keys get only theirs."""
    m = module_of(device, [options(2, max_capacity=16, bucket_capacity=16, init_value=0.0)],
                  pooling_mode=NONE)
    old, new = list(range(16)), list(range(100, 116))
    out1 = m(*one_bag(old))
    out2 = m(*one_bag(new))  # evicts every old key
    assert set(export_dict(m, "t0")) == set(new)
    (10 * out1.sum() + out2.sum()).backward()
    assert torch.equal(rows_of(m, "t0", new), torch.full((16, 2), -0.1))


def test_import_export_round_trip_and_errors(device):
    m = module_of(device, [options(3, score_strategy=DynamicEmbScoreStrategy.LFU)],
                  optimizer=DynamicEmbOptimType.ADAM)
    keys = torch.tensor(SPECIAL_IDS)
    rows = torch.randn(len(SPECIAL_IDS), 3, generator=torch.Generator().manual_seed(0))
    states = torch.rand(len(SPECIAL_IDS), 6, generator=torch.Generator().manual_seed(1))
    m.import_keys_values("t0", keys, rows, states)
    got = export_dict(m, "t0")
    assert sorted(got) == sorted(SPECIAL_IDS)
    for i, k in enumerate(SPECIAL_IDS):
        assert torch.equal(got[k][0], rows[i]) and torch.equal(got[k][1], states[i])
    before = snapshot(m)
    with pytest.raises(ValueError):
        m.import_keys_values("t0", keys, rows[:, :2])
    with pytest.raises(ValueError):
        m.import_keys_values("t0", keys, rows, states[:, :3])
    with pytest.raises(KeyError):
        m.import_keys_values("t9", keys, rows)
    with pytest.raises(KeyError):
        m.export_keys_values("t9")
    assert snapshot(m) == before


def test_inference_table_in_training_module(device):
    """A ``training=False`` table never inserts, never updates, has no optimizer state and
    reads unseen ids from its eval initializer, even in a training forward."""
    m = module_of(device,
                  [options(2), options(2, training=False, bucket_capacity=32,
                                       eval_initializer_args=Init(mode=Mode.CONSTANT, value=0.5))],
                  pooling_mode=NONE, optimizer=DynamicEmbOptimType.EXACT_ADAGRAD)
    m.import_keys_values("t1", ids(4), torch.tensor([[1.0, 2.0]]))
    out = train_step(m, ids(4, 4, 9, 4, 9), ids(0, 2, 5))
    assert torch.equal(out[2:], torch.tensor([[0.5, 0.5], [1.0, 2.0], [0.5, 0.5]]))
    got = export_dict(m, "t1")
    assert list(got) == [4] and torch.equal(got[4][0], torch.tensor([1.0, 2.0]))
    assert got[4][1].numel() == 0
    assert sorted(export_dict(m, "t0")) == [4]


def test_non_contiguous_and_mixed_dtype_inputs(device):
    def make():
        m = module_of(device, [options(3), options(2)], feature_table_map=[0, 1, 0])
        m.import_keys_values("t0", ids(1, 2, 3), torch.arange(9.0).reshape(3, 3))
        return m

    a, b = make(), make()
    indices, offsets = ids(1, 2, 3, 1, 7, 7, 2, 3), ids(0, 2, 3, 5, 6, 6, 8)
    weights = torch.linspace(0.5, 2.0, 8)
    strided = (torch.stack([indices, -indices], 1).to(torch.int32)[:, 0],
               torch.stack([offsets, offsets], 1)[:, 1],
               torch.stack([weights, weights], 1)[:, 0].double())
    assert not strided[0].is_contiguous()
    assert torch.equal(train_step(a, indices, offsets, weights), train_step(b, *strided))
    assert_same_state(a, b)
