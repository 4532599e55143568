"""The CPU extension's embedding verbs over 16-bit rows (``row_format``, ``rounding``).

A float16 or bfloat16 row is widened exactly and computed in float32, so each verb on
16-bit rows must give what the same verb gives on float32 rows holding the widened
values (``test_cpu_counted_embedding.py`` checks those against the CUDA kernels):
bit for bit in the forward, the weights' gradient and the optimizer states; a row an
initializer computes reads as if stored (rounded to nearest, then widened); an update
writes the float32 result back rounded to nearest, or stochastically with the bits of
``rounding_reference`` (the Python twin of ``rounding_primitives.h``).
"""

import pytest
import torch

from dynamicemb.ops import cpu_kernels, for_device
from dynamicemb.ops.cpu import CpuBackend
from dynamicemb.ops.records import InitSpec, OptimizerUpdate, Rounding, RowFormat, RowSources
from dynamicemb.options import DynamicEmbOptimType
from dynamicemb_testing.cuda_emulation import emulated_cuda
from dynamicemb_testing.rounding_reference import narrow_rn, stochastic_round
from test_cpu_counted_embedding import (GARBAGE, HOST_ROW_BIT, TRANSIENT_ROW_BIT, UPDATES,
                                        Batch, _one_pass, _two_pass, backward_batch,
                                        host_scalars, make_batch, optimizer_args,
                                        schedule_of, transient_rows)

DTYPES = [torch.float16, torch.bfloat16]
DIM = 8
# (stream, seed) of the batch's three tables
ROUNDING_SPEC = torch.tensor([[5, 1], [6, 2], [7, 3]], dtype=torch.int64)


def _cpu():
    return cpu_kernels.load()


def narrow_batch(b: Batch, dtype: torch.dtype, state_dim: int):
    """(b with float32 tiers holding the rows' 16-bit values widened, 16-bit tiers of the
    same rows, their RowFormat)."""
    fmt = RowFormat(dtype, b.dim, state_dim)
    wide, narrow = [], []
    for t in b.tiers:
        emb = narrow_rn(t[:, :b.dim], dtype)
        states = t[:, b.dim:b.dim + state_dim].contiguous() if state_dim else None
        narrow.append(fmt.pack(emb, states))
        w = t.clone()
        w[:, :b.dim] = emb.float()
        wide.append(w)
    return b._replace(tiers=wide), narrow, fmt


def computed_as_stored(b: Batch, dtype: torch.dtype):
    """(transient, row_ref) of b where each computed row (a negative reference) is a
    transient row holding what the initializer stores in a 16-bit row."""
    transient, refs = transient_rows(b)
    return narrow_rn(transient, dtype).float(), refs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mean,weighted", [(False, False), (True, False), (False, True)])
def test_pooled_and_sequence_forward(dtype, seed, mean, weighted):
    b = make_batch(seed, 4, 64, dim=DIM, width=DIM + 1, weighted=weighted)
    wide, narrow, fmt = narrow_batch(b, dtype, 1)
    transient, refs = computed_as_stored(wide, dtype)
    fmt_arg = (fmt.code, fmt.state_offset)
    width = 4 * DIM
    got, want = torch.full((b.batch, width), 7.0), torch.full((b.batch, width), 7.0)
    _cpu().pooled_forward(narrow, torch.empty(0, DIM), b.row_ref, b.inverse, b.offsets,
                          b.weights, b.feature_col, b.batch, DIM, mean, got, init=b.init,
                          row_format=fmt_arg)
    _cpu().pooled_forward(wide.tiers, transient, refs, b.inverse, b.offsets, b.weights,
                          b.feature_col, b.batch, DIM, mean, want)
    assert torch.equal(got, want)
    n = b.inverse.numel()
    got, want = torch.full((n, DIM), 7.0), torch.full((n, DIM), 7.0)
    _cpu().sequence_forward(narrow, torch.empty(0, DIM), b.row_ref, b.inverse, DIM, got,
                            init=b.init, row_format=fmt_arg)
    _cpu().sequence_forward(wide.tiers, transient, refs, b.inverse, DIM, want)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transient_rows_stay_float32(dtype):
    """Transient rows (an external tier's, read for eval) are float32 and read as such."""
    b = make_batch(3, 2, 32, dim=DIM, width=DIM, failed=0.0)
    wide, narrow, fmt = narrow_batch(b, dtype, 0)
    u = b.row_ref.numel()
    transient = torch.randn(u, DIM) / 3  # not representable in 16 bits
    refs = torch.where(torch.arange(u) % 2 == 0, TRANSIENT_ROW_BIT + torch.arange(u),
                       b.row_ref)
    n = b.inverse.numel()
    got, want = torch.zeros(n, DIM), torch.zeros(n, DIM)
    _cpu().sequence_forward(narrow, transient, refs, b.inverse, DIM, got,
                            row_format=(fmt.code, fmt.state_offset))
    _cpu().sequence_forward(wide.tiers, transient, refs, b.inverse, DIM, want)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_sample_weight_grad(dtype):
    b = make_batch(4, 3, 40, dim=DIM, width=DIM + 2 * DIM, weighted=True)
    wide, narrow, fmt = narrow_batch(b, dtype, 2 * DIM)
    transient, refs = computed_as_stored(wide, dtype)
    grad = torch.randn(b.batch, 3 * DIM, generator=torch.Generator().manual_seed(9))
    n = b.inverse.numel()
    got, want = torch.zeros(n), torch.zeros(n)
    _cpu().per_sample_weight_grad(narrow, torch.empty(0, DIM), b.row_ref, b.inverse, b.offsets,
                                  b.feature_col, b.batch, DIM, grad, got, init=b.init,
                                  row_format=(fmt.code, fmt.state_offset))
    _cpu().per_sample_weight_grad(wide.tiers, transient, refs, b.inverse, b.offsets,
                                  b.feature_col, b.batch, DIM, grad, want)
    assert torch.equal(got, want)


def expected_rows(wide_after, before_narrow, fmt, b: Batch, step: int, stochastic: bool):
    """The 16-bit tiers an update must leave: each updated stored row's float32 result
    narrowed (stochastically with its key's bits, or to nearest), its state the float32
    update's; every other row as it was."""
    expected = [t.clone() for t in before_narrow]
    refs = b.row_ref
    for u in range(refs.numel()):
        r = int(refs[u])
        if r < 0 or TRANSIENT_ROW_BIT <= r < HOST_ROW_BIT:
            continue
        tier, slot = (1, r - HOST_ROW_BIT) if r >= HOST_ROW_BIT else (0, r)
        row = wide_after[tier][slot:slot + 1]
        emb = row[:, :fmt.dim]
        if stochastic:
            t = int(b.init.table_ids[u])
            stream, seed = (int(x) for x in ROUNDING_SPEC[t])
            narrowed = stochastic_round(emb, b.init.keys[u:u + 1], seed, stream, step,
                                        fmt.dtype)
        else:
            narrowed = narrow_rn(emb, fmt.dtype)
        states = row[:, fmt.dim:fmt.dim + fmt.state_dim] if fmt.state_dim else None
        expected[tier][slot] = fmt.pack(narrowed, states)[0]
    return expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("u", UPDATES, ids=lambda u: f"kind{u.kind}-wd{u.weight_decay}-"
                         f"dec{u.decoupled}")
@pytest.mark.parametrize("passes", [_one_pass, _two_pass], ids=["one_pass", "two_passes"])
@pytest.mark.parametrize("stochastic", [True, False])
def test_update_rounds_the_float32_update(dtype, u, passes, stochastic):
    b, grad = backward_batch(2, 3, 48, u, pooled=True, padded=False)
    state_dim = b.tiers[0].shape[1] - DIM
    wide, narrow, fmt = narrow_batch(b, dtype, state_dim)
    before = [t.clone() for t in narrow]
    args = optimizer_args(u, host_scalars(u, 3))
    step = 41
    rounding = (b.init.keys, b.init.table_ids, ROUNDING_SPEC,
                torch.tensor([step], dtype=torch.int64), stochastic)
    got_bad = passes(b._replace(tiers=narrow), grad, False, args,
                     row_format=(fmt.code, fmt.state_offset), rounding=rounding)
    want_bad = passes(wide, grad, False, args)
    assert got_bad == want_bad
    want = expected_rows(wide.tiers, before, fmt, b, step, stochastic)
    for got_tier, want_tier in zip(narrow, want):
        assert torch.equal(got_tier, want_tier)
    changed = sum(int((g != w).any(1).sum()) for g, w in zip(narrow, before))
    assert changed > 0  # the update wrote rows


def test_stochastic_rounding_follows_the_step_and_the_key():
    """Other bits at another step: the same update rounds some elements differently."""
    u = UPDATES[0]
    b, grad = backward_batch(5, 2, 64, u, pooled=True, padded=False)
    wide, narrow, fmt = narrow_batch(b, torch.bfloat16, 0)
    results = []
    for step in (1, 2):
        tiers = [t.clone() for t in narrow]
        rounding = (b.init.keys, b.init.table_ids, ROUNDING_SPEC,
                    torch.tensor([step], dtype=torch.int64), True)
        _one_pass(b._replace(tiers=tiers), grad, False, optimizer_args(u, host_scalars(u, 1)),
                  row_format=(fmt.code, fmt.state_offset), rounding=rounding)
        results.append(tiers[0])
    assert not torch.equal(results[0], results[1])


@pytest.mark.parametrize("passes", [_one_pass, _two_pass], ids=["one_pass", "two_passes"])
def test_rounding_reads_the_step_after_the_schedule_advanced_it(passes):
    """A rounding whose step is the schedule's step tensor rounds with the advanced count,
    as the CUDA update does after ``demb_place_grads`` advanced it."""
    u = UPDATES[1]  # Adam: its schedule advances the step
    b, grad = backward_batch(3, 2, 64, u, pooled=True, padded=False)
    _, narrow, fmt = narrow_batch(b, torch.bfloat16, b.tiers[0].shape[1] - DIM)
    results = []
    for shared in (True, False):
        tiers = [t.clone() for t in narrow]
        schedule = schedule_of(u, 6)
        step = schedule.step if shared else torch.tensor([7], dtype=torch.int64)
        rounding = (b.init.keys, b.init.table_ids, ROUNDING_SPEC, step, True)
        passes(b._replace(tiers=tiers), grad, False, optimizer_args(u, GARBAGE),
               schedule=tuple(schedule), row_format=(fmt.code, fmt.state_offset),
               rounding=rounding)
        assert int(schedule.step) == 7
        results.append(tiers)
    for shared, alone in zip(*results):
        assert torch.equal(shared, alone)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("state_dim", [0, 1, 2 * DIM])
def test_init_rows_round_to_nearest(dtype, state_dim):
    fmt = RowFormat(dtype, DIM, state_dim)
    spec = InitSpec(torch.tensor([[5, 0, 11], [6, 2, 12]], dtype=torch.int64),
                    torch.tensor([[0.5, 0.1, -1, 1, 0], [0, 1, -0.25, 0.75, 0]]))
    n, capacity = 50, 64
    g = torch.Generator().manual_seed(state_dim)
    keys = torch.randint(-10**9, 10**12, (n,), generator=g)
    tids = torch.randint(0, 2, (n,), generator=g).to(torch.int16)
    slots = torch.randperm(capacity, generator=g)[:n]
    status = torch.randint(0, 4, (n,), generator=g).to(torch.int8)  # hits, inserts, ...
    wide = torch.full((capacity, DIM + state_dim), 3.0)
    _cpu().init_rows(wide, slots, status, keys, tids, DIM, spec, 0.25)
    before = fmt.pack(torch.full((capacity, DIM), 3.0),
                      torch.full((capacity, state_dim), 3.0) if state_dim else None)
    got = before.clone()
    _cpu().init_rows(got, slots, status, keys, tids, DIM, spec, 0.25,
                     row_format=(fmt.code, fmt.state_offset))
    want = fmt.pack(narrow_rn(wide[:, :DIM], dtype),
                    wide[:, DIM:].contiguous() if state_dim else None)
    assert torch.equal(got, want)
    assert not torch.equal(got, before)


def test_bad_formats_are_refused():
    b = make_batch(0, 1, 8, dim=DIM, width=DIM + 1)
    wide, narrow, fmt = narrow_batch(b, torch.bfloat16, 1)
    out = torch.zeros(b.inverse.numel(), DIM)
    with pytest.raises(RuntimeError, match="format code"):
        _cpu().sequence_forward(narrow, torch.empty(0, DIM), b.row_ref, b.inverse, DIM, out,
                                init=b.init, row_format=(3, fmt.state_offset))
    with pytest.raises(RuntimeError, match="values"):  # rows are float32 words, not bytes
        _cpu().sequence_forward([t.view(torch.uint8) for t in narrow], torch.empty(0, DIM),
                                b.row_ref, b.inverse, DIM, out, init=b.init,
                                row_format=(fmt.code, fmt.state_offset))
    with pytest.raises(RuntimeError, match="state offset"):
        _cpu().sequence_forward(narrow, torch.empty(0, DIM), b.row_ref, b.inverse, DIM, out,
                                init=b.init, row_format=(fmt.code, 2))
    u = UPDATES[0]
    sums = torch.zeros(b.row_ref.numel(), DIM)
    with pytest.raises(RuntimeError, match="rounding"):
        _cpu().update_rows(narrow, b.row_ref, sums, *optimizer_args(u, host_scalars(u, 1)),
                           row_format=(fmt.code, fmt.state_offset))


# ------------------------------------------------------------------ the backend seam
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_backend_passes_the_format_and_the_rounding(dtype):
    """``CpuBackend`` hands ``RowSources.format`` and ``Rounding`` to the verbs: its
    forward and backward equal the extension's own calls with the keywords."""
    u = UPDATES[4]  # row-wise Adagrad
    b, grad = backward_batch(6, 3, 48, u, pooled=True, padded=False)
    _, narrow, fmt = narrow_batch(b, dtype, b.tiers[0].shape[1] - DIM)
    keywords = {"row_format": (fmt.code, fmt.state_offset)}
    backend = CpuBackend()
    sources = RowSources(narrow[0], narrow[1], torch.empty(0, DIM), fmt, b.init)
    got, want = torch.zeros(b.batch, 3 * DIM), torch.zeros(b.batch, 3 * DIM)
    backend.pooled_forward(sources=sources, row_ref=b.row_ref, inverse=b.inverse,
                           offsets=b.offsets, weights=b.weights, feature_col=b.feature_col,
                           batch=b.batch, dim=DIM, mean=False, out=got)
    _cpu().pooled_forward(narrow, torch.empty(0, DIM), b.row_ref, b.inverse, b.offsets,
                          b.weights, b.feature_col, b.batch, DIM, False, want, init=b.init,
                          **keywords)
    assert torch.equal(got, want)
    rounding = Rounding(b.init.keys, b.init.table_ids, ROUNDING_SPEC,
                        torch.tensor([7], dtype=torch.int64), True)
    scalars = host_scalars(u, 1)
    mine = [t.clone() for t in narrow]
    backend.fused_backward(
        sources=sources._replace(device=mine[0], host=mine[1]), row_ref=b.row_ref,
        starts=b.starts, rank=b.rank, offsets=b.offsets, weights=b.weights,
        feature_col=b.feature_col, batch=b.batch, dim=DIM, mean=False, grad=grad,
        update=OptimizerUpdate(DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD, u.lr, u.eps, u.beta1,
                               u.beta2, u.weight_decay, scalars[1], scalars[2], scalars[3]),
        rounding=rounding)
    _one_pass(b._replace(tiers=narrow), grad, False, optimizer_args(u, scalars),
              rounding=tuple(rounding), **keywords)
    for got_tier, want_tier in zip(mine, narrow):
        assert torch.equal(got_tier, want_tier)
    with pytest.raises(RuntimeError, match="rounding"):  # a 16-bit update needs it
        backend.fused_backward(
            sources=sources, row_ref=b.row_ref, starts=b.starts, rank=b.rank,
            offsets=b.offsets, weights=b.weights, feature_col=b.feature_col, batch=b.batch,
            dim=DIM, mean=False, grad=grad,
            update=OptimizerUpdate(DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD, u.lr, u.eps,
                                   u.beta1, u.beta2, u.weight_decay, *scalars[1:]))


def test_a_backend_without_16_bit_kernels_refuses_the_rows():
    """The CUDA kernels read float32 rows only (for now): 16-bit sources are refused by
    name, before any kernel runs."""
    b = make_batch(0, 1, 8, dim=DIM, width=DIM)
    _, narrow, fmt = narrow_batch(b, torch.bfloat16, 0)
    with emulated_cuda():
        backend = for_device(torch.device("cpu"))  # the CUDA backend, kernels emulated
        assert type(backend).__name__ == "CudaBackend"
        with pytest.raises(ValueError, match="no kernels for torch.bfloat16 rows"):
            backend.sequence_forward(
                sources=RowSources(narrow[0], narrow[1], torch.empty(0, DIM), fmt, b.init),
                row_ref=b.row_ref, inverse=b.inverse, dim=DIM,
                out=torch.zeros(b.inverse.numel(), DIM))


def test_init_rows_of_16_bit_rows_check_the_spec():
    fmt = RowFormat(torch.bfloat16, DIM, 1)
    rows = fmt.pack(torch.zeros(4, DIM), torch.zeros(4, 1))
    keys = torch.arange(2)
    bad = InitSpec(torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 4))  # (T, 4) floats
    with pytest.raises(RuntimeError, match="InitSpec"):
        _cpu().init_rows(rows, keys, None, keys, torch.zeros(2, dtype=torch.int16), DIM, bad,
                         0.0, row_format=(fmt.code, fmt.state_offset))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_16_bit_pattern_widens_exactly(dtype):
    """A forward reads each of the 65,536 bit patterns as torch widens it (subnormals,
    infinities, both zeros; NaN as a NaN), through the vector and the scalar paths
    (dim 24: three 8-element blocks, dim 5: a tail only)."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int64).to(torch.int16).view(dtype)
    want = patterns.float()
    for dim in (24, 5):
        n = patterns.numel() // dim
        fmt = RowFormat(dtype, dim, 0)
        rows = fmt.pack(torch.zeros(n, dim, dtype=dtype))
        fmt.embeddings(rows).copy_(patterns[:n * dim].reshape(n, dim))
        out = torch.empty(n, dim)
        refs = torch.arange(n, dtype=torch.int64)
        _cpu().sequence_forward([rows, rows[:0]], torch.empty(0, dim), refs, refs, dim, out,
                                row_format=(fmt.code, fmt.state_offset))
        expected = want[:n * dim].reshape(n, dim)
        nan = expected.isnan()
        assert torch.equal(out.isnan(), nan)
        assert torch.equal(out[~nan].view(torch.int32), expected[~nan].view(torch.int32))
