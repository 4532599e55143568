"""The embedding verbs over 16-bit rows (``row_format``, ``rounding``): the CPU
extension's, and the CUDA kernels' emulated by the CPU verbs (``cuda-emulated``) and run
from their own source (``cuda-simt``, ``dynamicemb_testing/simt.py``).

A float16 or bfloat16 row is widened exactly and computed in float32, so each verb on
16-bit rows must give what the same backend's verb gives on float32 rows holding the
widened values: bit for bit in the forward, the weights' gradient and the optimizer
states; a row an initializer computes reads as if stored (rounded to nearest, then
widened); an update writes the float32 result back rounded to nearest, or
stochastically with the bits of ``rounding_reference`` (the Python twin of
``rounding_primitives.h``), at the step the schedule advanced to.

Each backend is checked against its own float32 verbs: the CPU build contracts some
float32 expressions into fused multiply-adds where the kernels' CPU build does not (Adam,
Adagrad, weight decay, the normal initializer) and the CPU's weights' gradient adds its
products unfused where the kernels write ``fmaf``, so float32 results of those differ
between the backends by rounding, and 16-bit results with them. Where the float32
arithmetic is the same on both, the three give the same bits
(``test_cpu_emulated_and_simt_agree_bit_for_bit``).
"""

import pytest
import torch

from dynamicemb.ops import cpu_kernels, for_device
from dynamicemb.ops.cpu import CpuBackend
from dynamicemb.ops.records import InitRows, InitSpec, OptimizerUpdate, Rounding, RowFormat, RowSources
from dynamicemb.options import DynamicEmbOptimType
from dynamicemb_testing.devices import EMULATED, SIMT, backend_device
from dynamicemb_testing.rounding_reference import narrow_rn, stochastic_round
from test_cpu_counted_embedding import (GARBAGE, HOST_ROW_BIT, TRANSIENT_ROW_BIT, UPDATES,
                                        Batch, Update, _one_pass, _two_pass, backward_batch,
                                        host_scalars, make_batch, optimizer_args, schedule_of)

DTYPES = [torch.float16, torch.bfloat16]
DIM = 8
# (stream, seed) of the batch's three tables
ROUNDING_SPEC = torch.tensor([[5, 1], [6, 2], [7, 3]], dtype=torch.int64)
BACKENDS = ["cpu", EMULATED, SIMT]


def _cpu():
    return cpu_kernels.load()


@pytest.fixture(params=BACKENDS)
def kernels(request):
    """The verbs of a backend: the CPU extension, or ``CudaKernels`` emulated or running
    the kernels' source (used within the emulation)."""
    if request.param == "cpu":
        yield _cpu()
        return
    with backend_device(request.param) as device:
        yield for_device(device).kernels


def _fused(kernels, b: Batch, grad, mean, args, schedule=None, **kw):
    """``CudaKernels.fused_backward`` as the CPU's passes are called."""
    kernels.fused_backward(b.tiers, b.row_ref, b.starts, b.rank, b.offsets, b.weights,
                           b.feature_col, b.batch, b.dim, mean, grad, *args,
                           schedule=schedule, **kw)
    return 0


@pytest.fixture(params=["cpu-one-pass", "cpu-two-passes", EMULATED, SIMT])
def update(request):
    """A backend's backward: ``update(b, grad, mean, args, schedule=None, **keywords)``
    updates b's tiers (the CPU's in one pass or two; CUDA's fused_backward)."""
    if request.param.startswith("cpu"):
        passes = _one_pass if request.param == "cpu-one-pass" else _two_pass

        def cpu_update(b, grad, mean, args, schedule=None, **kw):
            if schedule is not None:
                kw["schedule"] = tuple(schedule)
            return passes(b, grad, mean, args, **kw)

        yield cpu_update
        return
    with backend_device(request.param) as device:
        kernels = for_device(device).kernels
        yield lambda *args, **kw: _fused(kernels, *args, **kw)


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


def computed_as_stored(kernels, b: Batch, dtype: torch.dtype):
    """(transient, row_ref) of b where each computed row (a negative reference) is a
    transient row holding what the initializer stores in a 16-bit row, made by the
    backend's own ``init_rows``."""
    u = b.row_ref.numel()
    transient = torch.zeros(u, b.dim)
    kernels.init_rows(transient, torch.arange(u), None, b.init.keys.contiguous(),
                      b.init.table_ids.contiguous(), b.dim, InitSpec(*b.init.spec), 0.0)
    refs = torch.where(b.row_ref < 0, TRANSIENT_ROW_BIT + torch.arange(u), b.row_ref)
    return narrow_rn(transient, dtype).float(), refs


def format_arg(fmt: RowFormat):
    return (fmt.code, fmt.state_offset)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("mean,weighted", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("state_dim", [1, 0], ids=["20-byte-rows", "16-byte-rows"])
def test_pooled_and_sequence_forward(kernels, dtype, seed, mean, weighted, state_dim):
    """16-byte rows are read a uint4 at a time by the CUDA pooled forward, 20-byte rows
    an element at a time; the output's odd width leaves every other bag's columns off
    16 bytes (written a float at a time, the others a uint4 at a time)."""
    b = make_batch(seed, 4, 64, dim=DIM, width=DIM + 1, weighted=weighted)
    wide, narrow, fmt = narrow_batch(b, dtype, state_dim)
    transient, refs = computed_as_stored(kernels, wide, dtype)
    width = 4 * DIM + 1
    got, want = torch.full((b.batch, width), 7.0), torch.full((b.batch, width), 7.0)
    kernels.pooled_forward(narrow, torch.empty(0, DIM), b.row_ref, b.inverse, b.offsets,
                           b.weights, b.feature_col, b.batch, DIM, mean, got, init=b.init,
                           row_format=format_arg(fmt))
    kernels.pooled_forward(wide.tiers, transient, refs, b.inverse, b.offsets, b.weights,
                           b.feature_col, b.batch, DIM, mean, want)
    assert torch.equal(got, want)
    n = b.inverse.numel()
    got, want = torch.full((n, DIM), 7.0), torch.full((n, DIM), 7.0)
    kernels.sequence_forward(narrow, torch.empty(0, DIM), b.row_ref, b.inverse, DIM, got,
                             init=b.init, row_format=format_arg(fmt))
    kernels.sequence_forward(wide.tiers, transient, refs, b.inverse, DIM, want)
    assert torch.equal(got, want)


@pytest.mark.parametrize("mean,weighted", [(False, False), (True, False), (False, True)])
def test_float32_rows_pool_alike_in_chunks_and_columns(kernels, mean, weighted):
    """float32 rows of 8 columns (32 bytes: the CUDA pooled forward reads them a uint4 at a
    time) pool as the same rows in tiers 9 columns wide (read a float at a time)."""
    b = make_batch(3, 4, 64, dim=DIM, width=DIM + 1, weighted=weighted)
    narrow = [t[:, :DIM].contiguous() for t in b.tiers]
    got, want = torch.full((b.batch, 4 * DIM), 7.0), torch.full((b.batch, 4 * DIM), 7.0)
    for tiers, out in ((narrow, got), (b.tiers, want)):
        kernels.pooled_forward(tiers, torch.empty(0, DIM), b.row_ref, b.inverse, b.offsets,
                               b.weights, b.feature_col, b.batch, DIM, mean, out, init=b.init)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transient_rows_stay_float32(kernels, dtype):
    """Transient rows (an external tier's, read for eval) are float32 and read as such."""
    b = make_batch(3, 2, 32, dim=DIM, width=DIM, failed=0.0)
    wide, narrow, fmt = narrow_batch(b, dtype, 0)
    u = b.row_ref.numel()
    transient = torch.randn(u, DIM) / 3  # not representable in 16 bits
    refs = torch.where(torch.arange(u) % 2 == 0, TRANSIENT_ROW_BIT + torch.arange(u),
                       b.row_ref)
    n = b.inverse.numel()
    got, want = torch.zeros(n, DIM), torch.zeros(n, DIM)
    kernels.sequence_forward(narrow, transient, refs, b.inverse, DIM, got,
                             row_format=format_arg(fmt))
    kernels.sequence_forward(wide.tiers, transient, refs, b.inverse, DIM, want)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_sample_weight_grad(kernels, dtype):
    b = make_batch(4, 3, 40, dim=DIM, width=DIM + 2 * DIM, weighted=True)
    wide, narrow, fmt = narrow_batch(b, dtype, 2 * DIM)
    transient, refs = computed_as_stored(kernels, wide, dtype)
    grad = torch.randn(b.batch, 3 * DIM, generator=torch.Generator().manual_seed(9))
    n = b.inverse.numel()
    got, want = torch.zeros(n), torch.zeros(n)
    kernels.per_sample_weight_grad(narrow, torch.empty(0, DIM), b.row_ref, b.inverse,
                                   b.offsets, b.feature_col, b.batch, DIM, grad, got,
                                   init=b.init, row_format=format_arg(fmt))
    kernels.per_sample_weight_grad(wide.tiers, transient, refs, b.inverse, b.offsets,
                                   b.feature_col, b.batch, DIM, grad, want)
    assert torch.equal(got, want)
    assert got.any()


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


def rounding_at(b: Batch, step, stochastic: bool):
    """The batch's rounding (``Rounding`` as a tuple) at ``step``, an int or a (1,) tensor."""
    if not isinstance(step, torch.Tensor):
        step = torch.tensor([step], dtype=torch.int64)
    return (b.init.keys, b.init.table_ids, ROUNDING_SPEC, step, stochastic)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("u", UPDATES, ids=lambda u: f"kind{u.kind}-wd{u.weight_decay}-"
                         f"dec{u.decoupled}")
@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("dim", [DIM, 72], ids=["dim8", "dim72"])
def test_update_rounds_the_float32_update(update, dtype, u, stochastic, dim):
    """Dim 72: rows the CPU steps in blocks of 32 columns (two whole blocks and a part),
    each block rounded with its own columns' bits."""
    b, grad = backward_batch(2, 3, 48, u, pooled=True, padded=False, dim=dim)
    state_dim = b.tiers[0].shape[1] - dim
    wide, narrow, fmt = narrow_batch(b, dtype, state_dim)
    before = [t.clone() for t in narrow]
    args = optimizer_args(u, host_scalars(u, 3))
    step = 41
    got_bad = update(b._replace(tiers=narrow), grad, False, args, row_format=format_arg(fmt),
                     rounding=rounding_at(b, step, stochastic))
    want_bad = update(wide, grad, False, args)
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
        _one_pass(b._replace(tiers=tiers), grad, False, optimizer_args(u, host_scalars(u, 1)),
                  row_format=format_arg(fmt), rounding=rounding_at(b, step, True))
        results.append(tiers[0])
    assert not torch.equal(results[0], results[1])


def test_rounding_reads_the_step_after_the_schedule_advanced_it(update):
    """A rounding whose step is the schedule's step tensor rounds with the advanced count
    (on CUDA ``demb_place_grads`` advances it, then ``demb_fused_update`` reads it)."""
    u = UPDATES[1]  # Adam: its schedule advances the step
    b, grad = backward_batch(3, 2, 64, u, pooled=True, padded=False)
    _, narrow, fmt = narrow_batch(b, torch.bfloat16, b.tiers[0].shape[1] - DIM)
    results = []
    for shared in (True, False):
        tiers = [t.clone() for t in narrow]
        schedule = schedule_of(u, 6)
        step = schedule.step if shared else torch.tensor([7], dtype=torch.int64)
        update(b._replace(tiers=tiers), grad, False, optimizer_args(u, GARBAGE),
               schedule=schedule, row_format=format_arg(fmt),
               rounding=rounding_at(b, step, True))
        assert int(schedule.step) == 7
        results.append(tiers)
    for shared, alone in zip(*results):
        assert torch.equal(shared, alone)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("state_dim", [0, 1, 2 * DIM])
def test_init_rows_round_to_nearest(kernels, dtype, state_dim):
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
    kernels.init_rows(wide, slots, status, keys, tids, DIM, spec, 0.25)
    before = fmt.pack(torch.full((capacity, DIM), 3.0),
                      torch.full((capacity, state_dim), 3.0) if state_dim else None)
    got = before.clone()
    kernels.init_rows(got, slots, status, keys, tids, DIM, spec, 0.25,
                      row_format=format_arg(fmt))
    want = fmt.pack(narrow_rn(wide[:, :DIM], dtype),
                    wide[:, DIM:].contiguous() if state_dim else None)
    assert torch.equal(got, want)
    assert not torch.equal(got, before)


# --------------------------------------------------------- the backends side by side
# Initializers whose float32 arithmetic is the same on every backend (uniform: one
# fmaf; constant; debug), unlike the normal's mean + std * z.
EXACT_SPEC = InitSpec(torch.tensor([[5, 2, 11], [6, 3, 12], [7, 4, 13]], dtype=torch.int64),
                      torch.tensor([[0, 1, -0.5, 0.75, 0], [0, 1, 0, 0, 0.3],
                                    [0, 1, 0, 0, 0]]))
# SGD and row-wise Adagrad without weight decay: float32 updates the same on every backend.
EXACT_UPDATES = [UPDATES[0], Update(3, 0.05, 1e-8, 0.9, 0.999, 0.0, 0.0)]


def _each_backend(run):
    """[run(name, kernels) for the CPU, emulated and SIMT kernels]."""
    results = [run("cpu", _cpu())]
    for name in (EMULATED, SIMT):
        with backend_device(name) as device:
            results.append(run(name, for_device(device).kernels))
    return results


def _same(results) -> bool:
    first = results[0]
    return all(all(torch.equal(x, y) for x, y in zip(first, other)) for other in results[1:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_emulated_and_simt_agree_bit_for_bit(dtype):
    """The forward, init_rows and the updates (stochastic and to nearest, padded unique
    rows) on 16-bit rows give the same bits on the three backends."""
    b, grad = backward_batch(8, 3, 48, EXACT_UPDATES[1], pooled=True, padded=True)
    b = b._replace(init=b.init._replace(spec=EXACT_SPEC))
    _, narrow, fmt = narrow_batch(b, dtype, 1)
    row_format = format_arg(fmt)
    n = b.inverse.numel()

    def forward(_, kernels):
        pooled = torch.full((b.batch, 3 * DIM), 7.0)
        kernels.pooled_forward(narrow, torch.empty(0, DIM), b.row_ref, b.inverse, b.offsets,
                               b.weights, b.feature_col, b.batch, DIM, True, pooled,
                               init=b.init, row_format=row_format)
        sequence = torch.full((n, DIM), 7.0)
        kernels.sequence_forward(narrow, torch.empty(0, DIM), b.row_ref, b.inverse, DIM,
                                 sequence, init=b.init, row_format=row_format)
        rows = [t.clone() for t in narrow]
        kernels.init_rows(rows[0], torch.arange(12), None, b.init.keys[:12].contiguous(),
                          b.init.table_ids[:12].contiguous(), DIM, EXACT_SPEC, 0.5,
                          row_format=row_format)
        return pooled, sequence, rows[0]

    assert _same(_each_backend(forward))
    for u in EXACT_UPDATES:
        state_dim = 1 if u.kind == 3 else 0
        b_u = b._replace(tiers=[t[:, :DIM + state_dim].contiguous() for t in b.tiers])
        _, narrow_u, fmt_u = narrow_batch(b_u, dtype, state_dim)
        for stochastic in (True, False):
            def step(name, kernels):
                tiers = [t.clone() for t in narrow_u]
                batch = b_u._replace(tiers=tiers)
                args = optimizer_args(u, host_scalars(u, 2))
                keywords = {"row_format": format_arg(fmt_u),
                            "rounding": rounding_at(b_u, 2, stochastic)}
                if name == "cpu":
                    _one_pass(batch, grad, False, args, **keywords)
                else:
                    _fused(kernels, batch, grad, False, args, **keywords)
                return tiers

            results = _each_backend(step)
            assert _same(results), (u, stochastic)
            assert not torch.equal(results[0][0], narrow_u[0])


# every initializer: uniform, constant and debug exactly; normal and truncated normal
# (mean + std * Box-Muller with the host's logf, sqrtf, cosf) within float32 rounding
ALL_MODES_SPEC = InitSpec(
    torch.tensor([[5, 2, 11], [6, 3, 12], [7, 4, 13], [8, 0, 14], [9, 1, 15]], dtype=torch.int64),
    torch.tensor([[0, 1, -0.5, 0.75, 0], [0, 1, 0, 0, 0.3], [0, 1, 0, 0, 0],
                  [0.1, 0.5, 0, 0, 0], [0, 0.2, -0.1, 0.3, 0]]))


@pytest.mark.parametrize("dim", [DIM, 72, 5])
def test_float32_init_rows_are_the_cuda_sources_on_every_backend(dim):
    """init_rows and a forward's computed rows (failed inserts) of float32 rows: the CPU's
    whole-row initializer (its row's bits hashed once, its columns vectorized) gives the
    per-element values of the CUDA source run on the CPU, for every initializer mode, the
    state columns state_value."""
    n, width = 400, dim + 2
    keys = torch.randint(-2**62, 2**62, (n,), generator=torch.Generator().manual_seed(4))
    tids = (torch.arange(n) % 5).to(torch.int16)
    refs = -1 - torch.arange(n)  # every row computed, none stored

    def init(_, kernels):
        values = torch.full((n + 3, width), 9.0)
        kernels.init_rows(values, torch.arange(n) + 3, None, keys, tids, dim, ALL_MODES_SPEC,
                          0.25)
        out = torch.full((n, dim), 7.0)
        kernels.sequence_forward([values, values[:0]], torch.empty(0, dim), refs,
                                 torch.arange(n), dim, out,
                                 init=InitRows(keys, tids, ALL_MODES_SPEC))
        return values, out

    results = _each_backend(init)
    normal = (tids == 3) | (tids == 4)
    for values, out in results:
        assert torch.equal(values[:3], torch.full((3, width), 9.0))
        assert torch.equal(values[3:, dim:], torch.full((n, 2), 0.25))
        assert torch.equal(out, values[3:, :dim])
    (want, _), others = results[0], results[1:]
    for got, _ in others:
        assert torch.equal(got[3:][~normal], want[3:][~normal])
        torch.testing.assert_close(got[3:][normal], want[3:][normal], rtol=1e-6, atol=1e-6)
    assert want[3:][tids == 0, :dim].abs().max() > 0.1  # uniform rows in [-0.5, 0.75)
    truncated = want[3:][tids == 4, :dim]
    assert truncated.min() >= -0.1 and truncated.max() <= 0.3


# ------------------------------------------------------------------ argument checks
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
                                row_format=format_arg(fmt))
    with pytest.raises(RuntimeError, match="state offset"):
        _cpu().sequence_forward(narrow, torch.empty(0, DIM), b.row_ref, b.inverse, DIM, out,
                                init=b.init, row_format=(fmt.code, 2))
    u = UPDATES[0]
    sums = torch.zeros(b.row_ref.numel(), DIM)
    with pytest.raises(RuntimeError, match="rounding"):
        _cpu().update_rows(narrow, b.row_ref, sums, *optimizer_args(u, host_scalars(u, 1)),
                           row_format=format_arg(fmt))


def test_cuda_kernels_refuse_bad_formats_before_a_launch():
    """The launches check a format as the CPU verbs do, and a 16-bit update's rounding."""
    b, grad = backward_batch(0, 1, 8, UPDATES[0], pooled=True, padded=False)
    _, narrow, fmt = narrow_batch(b, torch.bfloat16, 0)
    out = torch.zeros(b.inverse.numel(), DIM)
    with backend_device(EMULATED) as device:
        kernels = for_device(device).kernels
        with pytest.raises(ValueError, match="format code"):
            kernels.sequence_forward(narrow, torch.empty(0, DIM), b.row_ref, b.inverse, DIM,
                                     out, init=b.init, row_format=(3, fmt.state_offset))
        with pytest.raises(ValueError, match="state offset"):
            kernels.sequence_forward(narrow, torch.empty(0, DIM), b.row_ref, b.inverse, DIM,
                                     out, init=b.init, row_format=(fmt.code, 6))
        with pytest.raises(ValueError, match="needs its rounding"):
            _fused(kernels, b._replace(tiers=narrow), grad, False,
                   optimizer_args(UPDATES[0], host_scalars(UPDATES[0], 1)),
                   row_format=format_arg(fmt))
        assert not kernels.launches  # refused before any kernel ran


# ------------------------------------------------------------------ the backend seam
@pytest.mark.parametrize("device_name", ["cpu", EMULATED])
@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_passes_the_format_and_the_rounding(device_name, dtype):
    """``KernelBackend`` (the CPU's and the CUDA one) hands ``RowSources.format`` and
    ``Rounding`` to the verbs: its forward and backward equal the CPU extension's own
    calls with the keywords."""
    u = UPDATES[4]  # row-wise Adagrad
    b, grad = backward_batch(6, 3, 48, u, pooled=True, padded=False)
    _, narrow, fmt = narrow_batch(b, dtype, b.tiers[0].shape[1] - DIM)
    keywords = {"row_format": format_arg(fmt)}
    sources = RowSources(narrow[0], narrow[1], torch.empty(0, DIM), fmt, b.init)
    got, want = torch.zeros(b.batch, 3 * DIM), torch.zeros(b.batch, 3 * DIM)
    rounding = Rounding(b.init.keys, b.init.table_ids, ROUNDING_SPEC,
                        torch.tensor([7], dtype=torch.int64), True)
    scalars = host_scalars(u, 1)
    update = OptimizerUpdate(DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD, u.lr, u.eps, u.beta1,
                             u.beta2, u.weight_decay, scalars[1], scalars[2], scalars[3])
    mine = [t.clone() for t in narrow]
    with backend_device(device_name) as device:
        backend = for_device(device)
        assert dtype in backend.row_dtypes
        backend.pooled_forward(sources=sources, row_ref=b.row_ref, inverse=b.inverse,
                               offsets=b.offsets, weights=b.weights, feature_col=b.feature_col,
                               batch=b.batch, dim=DIM, mean=False, out=got)
        backend.fused_backward(
            sources=sources._replace(device=mine[0], host=mine[1]), row_ref=b.row_ref,
            starts=b.starts, rank=b.rank, offsets=b.offsets, weights=b.weights,
            feature_col=b.feature_col, batch=b.batch, dim=DIM, mean=False, grad=grad,
            update=update, rounding=rounding)
        with pytest.raises((RuntimeError, ValueError), match="rounding"):  # 16-bit needs it
            backend.fused_backward(
                sources=sources, row_ref=b.row_ref, starts=b.starts, rank=b.rank,
                offsets=b.offsets, weights=b.weights, feature_col=b.feature_col,
                batch=b.batch, dim=DIM, mean=False, grad=grad, update=update)
    _cpu().pooled_forward(narrow, torch.empty(0, DIM), b.row_ref, b.inverse, b.offsets,
                          b.weights, b.feature_col, b.batch, DIM, False, want, init=b.init,
                          **keywords)
    assert torch.equal(got, want)
    _two_pass(b._replace(tiers=narrow), grad, False, optimizer_args(u, scalars),
              rounding=tuple(rounding), **keywords)
    for got_tier, want_tier in zip(mine, narrow):
        assert torch.equal(got_tier, want_tier)


def test_a_backend_without_16_bit_kernels_refuses_the_rows():
    """A backend whose ``row_dtypes`` lack a dtype refuses its rows by name, before any
    kernel runs."""
    b = make_batch(0, 1, 8, dim=DIM, width=DIM)
    _, narrow, fmt = narrow_batch(b, torch.bfloat16, 0)
    float32_only = type("Float32Backend", (CpuBackend,), {"row_dtypes": (torch.float32,)})()
    with pytest.raises(ValueError, match="no kernels for torch.bfloat16 rows"):
        float32_only.sequence_forward(
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
    (dim 24: a 16-element block where AVX-512 is built in, then 8-element blocks;
    dim 5: a tail only)."""
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stochastic", [False, True])
def test_updates_narrow_every_kind_of_float_as_the_reference(dtype, stochastic):
    """An SGD step at lr 1 from zero rows writes -sum narrowed: random float bits (NaN,
    infinities, subnormals of both dtypes, overflow, ties) through the vector and the
    scalar paths (dim 24 and 5; dim 72 in blocks of 32 columns and a part) round as
    ``rounding_reference`` says."""
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(-2**31, 2**31, (6000,), generator=g, dtype=torch.int64)
    ties = (torch.randint(0, 2**15, (2000,), generator=g) << 16) | 0x8000  # bf16 ties
    halves = (torch.randint(0, 2**18, (2000,), generator=g) << 13) | 0x1000  # f16 ties
    x = torch.cat([bits, ties, halves]).to(torch.int32).view(torch.float32)
    x = torch.cat([x, x * 2.0**-20, x * 2.0**-120, torch.tensor([0.0, -0.0, 65520.0, 7e4])])
    for dim in (72, 24, 5):
        n = x.numel() // dim
        want_rows = x[:n * dim].reshape(n, dim)
        fmt = RowFormat(dtype, dim, 0)
        rows = fmt.pack(torch.zeros(n, dim))
        refs = torch.arange(n, dtype=torch.int64)
        keys = refs * 7919 - 5
        rounding = (keys, torch.zeros(n, dtype=torch.int16), ROUNDING_SPEC, torch.tensor([9]),
                    stochastic)
        sums = -want_rows.contiguous()
        _cpu().update_rows([rows, rows[:0]], refs, sums, 0, 1.0, 1e-8, 0.9, 0.999, 0.0, 1.0,
                           1.0, 1.0, row_format=(fmt.code, fmt.state_offset), rounding=rounding)
        updated = torch.zeros(n, dim) - sums  # the float32 step (-0.0 becomes +0.0)
        if stochastic:
            want = stochastic_round(updated, keys, 1, 5, 9, dtype)
        else:
            want = narrow_rn(updated, dtype)
        assert torch.equal(fmt.embeddings(rows).view(torch.int16), want.view(torch.int16))
