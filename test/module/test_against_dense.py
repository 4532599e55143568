"""``BatchedDynamicEmbeddingTables`` against the dense PyTorch reference (``dynamicemb_testing.module_reference``).

Every case imports the same initial rows into module and reference, trains ten random
batches (hot, huge, negative and duplicate ids; empty bags; a few ids left to the
initializer), compares the output of every step and, at the end, every stored row and
optimizer state.
"""

import zlib
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynamicemb import DynamicEmbOptimizerArgs, DynamicEmbOptimType, DynamicEmbPoolingMode
from dynamicemb_testing.module_reference import (
    OPTIMIZER_ARGS,
    OPTIMIZERS,
    POOLINGS,
    TableSpec,
    assert_tables_match,
    id_pool,
    make_tables,
    random_batch,
    state_dim,
)

SUM, MEAN, NONE = DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.MEAN, DynamicEmbPoolingMode.NONE
STEPS = 10
TOL = dict(rtol=1e-6, atol=1e-6)

def layout(kind: str, pooling: DynamicEmbPoolingMode):
    """(table specs, feature_table_map).

    ``single``: one table, one feature. ``mixed``: three tables, four features; feature 0
    and 2 share table 0; tables 0 and 2 have equal physical options (one hash table
    shared by two logical tables, with different initializers); table 1 has another dim
    (another bucket size under NONE, which needs one dim) and so its own group.
    """
    if kind == "single":
        return [TableSpec(dim=4)], [0]
    other = TableSpec(dim=4, bucket_capacity=32) if pooling == NONE else TableSpec(dim=3)
    return [TableSpec(dim=4, init_value=0.25), other, TableSpec(dim=4, init_value=-0.5)], [0, 1, 0, 2]


def import_initial_rows(module, ref, pools, gen, with_states=False):
    """Random rows (and optionally states) for 3/4 of each table's pool, into both."""
    for t, (name, pool) in enumerate(zip(module.table_names, pools)):
        keys = torch.tensor(pool[: (3 * len(pool)) // 4], dtype=torch.int64)
        dim = ref.tables[t].dim
        rows = torch.rand(keys.numel(), dim, generator=gen) - 0.5
        states = None
        opt = ref.tables[t].optimizer.optimizer
        if with_states and state_dim(opt, dim):
            states = torch.rand(keys.numel(), state_dim(opt, dim), generator=gen)
            if opt == DynamicEmbOptimType.ADAM:  # m may be negative, v not
                states[:, :dim] -= 0.5
        module.import_keys_values(name, keys, rows, states)
        ref.import_rows(t, keys, rows, states)


def train_and_compare(module, ref, table_pools, seed, weighted=False, steps=STEPS, batch=5,
                      dtype=torch.int64):
    """Runs ``steps`` training batches through both, comparing outputs and final tables."""
    gen = torch.Generator().manual_seed(seed)
    feature_pools = [table_pools[t] for t in ref.feature_table_map]
    for step in range(steps):
        indices, offsets, weights = random_batch(feature_pools, batch, gen, weighted=weighted,
                                                 dtype=dtype)
        out = module(indices, offsets, weights)
        want = ref.forward(indices, offsets, weights)
        torch.testing.assert_close(out.detach().cpu(), want, **TOL, msg=lambda m: f"step {step}: {m}")
        grad = torch.randn(out.shape, generator=gen)
        (out * grad.to(out.device)).sum().backward()
        ref.backward(grad)
    assert_tables_match(module, ref, **TOL)


def pools_for(specs, seed):
    return [id_pool(12, seed + 7 * t) for t in range(len(specs))]


GRID = [
    (opt, pooling, kind, weighted)
    for opt in OPTIMIZERS
    for pooling in POOLINGS
    for kind in ("single", "mixed")
    for weighted in ((False, True) if pooling == SUM else (False,))
]


@pytest.mark.parametrize("opt,pooling,kind,weighted", GRID,
                         ids=[f"{o.name}-{p.name}-{k}-{'w' if w else 'nw'}" for o, p, k, w in GRID])
def test_training_matches_dense(opt, pooling, kind, weighted, device):
    specs, ftm = layout(kind, pooling)
    module, ref = make_tables(specs, ftm, pooling, OPTIMIZER_ARGS[opt], device=device)
    pools = pools_for(specs, seed=zlib.crc32(f"{opt.name}{pooling.name}{kind}".encode()) % 1000)
    import_initial_rows(module, ref, pools, torch.Generator().manual_seed(1))
    train_and_compare(module, ref, pools, seed=2, weighted=weighted)


DECAY_GRID = [(o, m) for o in OPTIMIZERS for m in ("l2", "decouple")] + [
    (DynamicEmbOptimType.ADAM, None)]  # Adam's default: decoupled, as FBGEMM's


@pytest.mark.parametrize("opt,mode", DECAY_GRID,
                         ids=[f"{o.name}-{m}" for o, m in DECAY_GRID])
def test_weight_decay_matches_dense(opt, mode, device):
    """L2 (g + wd * w) and decoupled (w * (1 - lr * wd) first, AdamW) weight decay for
    every optimizer, on weighted SUM over mixed tables."""
    args = replace(OPTIMIZER_ARGS[opt], weight_decay=0.05, weight_decay_mode=mode)
    specs, ftm = layout("mixed", SUM)
    module, ref = make_tables(specs, ftm, SUM, args, device=device)
    pools = pools_for(specs, seed=11)
    import_initial_rows(module, ref, pools, torch.Generator().manual_seed(3), with_states=True)
    train_and_compare(module, ref, pools, seed=4, weighted=True)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
def test_gradient_clipping_matches_clipped_dense(opt, device):
    """``gradient_clipping``: each table's rows get the gradient of the output clamped to
    its own ``max_gradient`` (the module's here, a table's own there, none for a third)."""
    module_args = replace(OPTIMIZER_ARGS[opt], gradient_clipping=True, max_gradient=0.3)
    specs = [TableSpec(dim=4), TableSpec(dim=3, optimizer=replace(
        OPTIMIZER_ARGS[DynamicEmbOptimType.EXACT_SGD], gradient_clipping=True, max_gradient=0.1)),
        TableSpec(dim=4, optimizer=OPTIMIZER_ARGS[DynamicEmbOptimType.EXACT_ADAGRAD])]
    module, ref = make_tables(specs, [0, 1, 0, 2], SUM, module_args, device=device)
    pools = pools_for(specs, seed=41)
    import_initial_rows(module, ref, pools, torch.Generator().manual_seed(42), with_states=True)
    train_and_compare(module, ref, pools, seed=43, weighted=True)


@pytest.mark.parametrize("pooling", [SUM, MEAN], ids=lambda p: p.name)
def test_per_table_optimizer_override(pooling, device):
    """Tables with their own optimizer and learning rate beside one using the module's."""
    specs = [
        TableSpec(dim=4, optimizer=DynamicEmbOptimizerArgs(
            DynamicEmbOptimType.ADAM, 0.02, weight_decay=0.01, beta1=0.8, beta2=0.99)),
        TableSpec(dim=3, optimizer=DynamicEmbOptimizerArgs(
            DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD, 0.1, initial_accumulator_value=0.2)),
        TableSpec(dim=4),  # the module's optimizer
        TableSpec(dim=4, optimizer=DynamicEmbOptimizerArgs(
            DynamicEmbOptimType.EXACT_ADAGRAD, 0.03, eps=1e-3)),
    ]
    module_args = DynamicEmbOptimizerArgs(DynamicEmbOptimType.EXACT_SGD, 0.3)
    module, ref = make_tables(specs, [0, 1, 2, 1, 3], pooling, module_args, device=device)
    pools = pools_for(specs, seed=21)
    import_initial_rows(module, ref, pools, torch.Generator().manual_seed(5), with_states=True)
    train_and_compare(module, ref, pools, seed=6, weighted=False)


def test_int32_inputs_match_dense(device):
    """int32 indices and offsets are the same lookups as int64 ones."""
    specs, ftm = layout("mixed", SUM)
    module, ref = make_tables(specs, ftm, SUM, OPTIMIZER_ARGS[DynamicEmbOptimType.EXACT_ADAGRAD], device=device)
    pools = [[k for k in range(-40, 40, 3)] for _ in specs]
    import_initial_rows(module, ref, pools, torch.Generator().manual_seed(7))
    train_and_compare(module, ref, pools, seed=8, dtype=torch.int32)


def test_large_batch_matches_dense(device):
    """A batch big enough that the kernels take their OpenMP paths (>= 2048 elements)."""
    specs, ftm = [TableSpec(dim=16, max_capacity=4096), TableSpec(dim=16, max_capacity=4096)], [0, 1, 0]
    module, ref = make_tables(specs, ftm, MEAN, OPTIMIZER_ARGS[DynamicEmbOptimType.ADAM], device=device)
    pools = [id_pool(300, 31), id_pool(300, 32)]
    import_initial_rows(module, ref, pools, torch.Generator().manual_seed(9))
    train_and_compare(module, ref, pools, seed=10, steps=3, batch=300)


@st.composite
def layouts(draw):
    """Random tables (dims, capacities, optimizers), feature map, pooling and batches."""
    pooling = draw(st.sampled_from(POOLINGS))
    num_tables = draw(st.integers(1, 3))
    same_dim = draw(st.integers(1, 5))
    specs = []
    for t in range(num_tables):
        dim = same_dim if pooling == NONE else draw(st.integers(1, 5))
        override = draw(st.one_of(st.none(), st.sampled_from(OPTIMIZERS)))
        specs.append(TableSpec(
            dim=dim, init_value=draw(st.floats(-1, 1, width=32)),
            bucket_capacity=draw(st.sampled_from([16, 128])),
            optimizer=None if override is None else OPTIMIZER_ARGS[override]))
    ftm = draw(st.lists(st.integers(0, num_tables - 1), min_size=1, max_size=4))
    opt = draw(st.sampled_from(OPTIMIZERS))
    wd = draw(st.sampled_from([0.0, 0.01]))
    mode = draw(st.sampled_from(["l2", "decouple"]))
    return specs, ftm, pooling, replace(OPTIMIZER_ARGS[opt], weight_decay=wd,
                                        weight_decay_mode=mode)


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(layout_=layouts(), seed=st.integers(0, 2**16), batch=st.integers(0, 4),
       weighted=st.booleans())
def test_random_layouts_match_dense(layout_, seed, batch, weighted, device):
    specs, ftm, pooling, args = layout_
    module, ref = make_tables(specs, ftm, pooling, args, device=device)
    pools = [id_pool(6, seed + t) for t in range(len(specs))]
    import_initial_rows(module, ref, pools, torch.Generator().manual_seed(seed))
    train_and_compare(module, ref, pools, seed=seed, weighted=weighted and pooling == SUM,
                      steps=4, batch=batch)


STREAMED = [(SUM, False), (SUM, True), (MEAN, False), (NONE, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("pooling,weighted", STREAMED,
                         ids=[f"{p.name}-{'w' if w else 'nw'}" for p, w in STREAMED])
def test_streamed_outputs_match_dense(pooling, weighted, dtype, device):
    """Outputs of 8 MiB and more are written with streaming stores (``kStreamMinBytes``
    in ``csrc/cpu/embedding.cpp``): columns at odd offsets (dims 7 and 33), empty bags,
    lone rows copied straight from the table (16-bit rows widened on the way), sums and
    means built in a local row. Unseen ids read the eval initializer's zeros."""
    half = {} if dtype == torch.float32 else dict(options=dict(embedding_dtype=dtype))
    if pooling == NONE:
        specs, ftm, batch = [TableSpec(dim=33, max_capacity=4096, **half)], [0, 0], 20000
    else:
        specs = [TableSpec(dim=7, max_capacity=4096, **half),
                 TableSpec(dim=33, max_capacity=4096, **half)]
        ftm, batch = [0, 1, 0], 45000
    module, ref = make_tables(specs, ftm, pooling, OPTIMIZER_ARGS[DynamicEmbOptimType.EXACT_SGD], device=device)
    pools = [id_pool(200, 41), id_pool(200, 42)][: len(specs)]
    import_initial_rows(module, ref, pools, torch.Generator().manual_seed(12))
    width = specs[0].dim if pooling == NONE else sum(specs[t].dim for t in ftm)
    rows = 2 * len(ftm) * batch if pooling == NONE else batch  # NONE: 2 lookups a bag on average
    assert rows * width * 4 >= 8 << 20
    module.eval()  # forward only: the second output reuses the first one's buffer
    gen = torch.Generator().manual_seed(13)
    for step in range(2):
        indices, offsets, weights = random_batch([pools[t] for t in ftm], batch, gen,
                                                 weighted=weighted)
        out = module(indices, offsets, weights)
        want = ref.forward(indices, offsets, weights, training=False)
        torch.testing.assert_close(out.cpu(), want, **TOL, msg=lambda m: f"step {step}: {m}")
        del out


HALF_GRID = [(opt, dtype, stochastic) for opt in OPTIMIZERS
             for dtype in (torch.bfloat16, torch.float16) for stochastic in (True, False)]


@pytest.mark.parametrize("opt,dtype,stochastic", HALF_GRID,
                         ids=[f"{o.name}-{str(d)[6:]}-{'sr' if s else 'rn'}"
                              for o, d, s in HALF_GRID])
def test_sixteen_bit_training_matches_rounded_dense(opt, dtype, stochastic, device):
    """16-bit rows train as the float32 reference whose every stored row is rounded the
    same way (to nearest when stored, then each update stochastically with the hash of
    (seed, table, key, update count, column), or to nearest): pooled and sequence
    lookups, two groups of two dtypes' tables."""
    half = dict(embedding_dtype=dtype, stochastic_rounding=stochastic, rounding_seed=7)
    for pooling in (SUM, NONE):
        specs, ftm = layout("mixed", pooling)
        specs = [replace(specs[0], options=half), specs[1], replace(specs[2], options=half)]
        module, ref = make_tables(specs, ftm, pooling, OPTIMIZER_ARGS[opt], device=device)
        assert module.table_size(module.table_names[0]) == 0
        pools = pools_for(specs, seed=zlib.crc32(f"{opt.name}{dtype}".encode()) % 1000)
        import_initial_rows(module, ref, pools, torch.Generator().manual_seed(2))
        train_and_compare(module, ref, pools, seed=3, weighted=pooling == SUM)
        exported = module.export_keys_values(module.table_names[0])
        assert exported.embeddings.dtype == dtype
