"""The CPU extension's embedding verbs take the keywords of a step counted on the
device, as the CUDA kernels do (``csrc/cuda/embedding.cu``): ``error`` (the module's
word: a refused batch reads nothing and writes what the kernels write), ``init``
(``InitRows``: a negative row reference reads its table's initializer's row,
computed where it is read) and ``schedule`` (``DeviceSchedule``: the update's
scalars from device memory, the step count advanced first).

Each call is checked against the emulated CUDA kernel (``cuda_emulation.py``) and
against the same call without the new arguments: transient rows made by
``init_rows``, or the update's scalars computed on the host as the module does.
"""

import math
from typing import NamedTuple, Optional

import pytest
import torch

from dynamicemb.ops import cpu_kernels
from dynamicemb.ops.codes import offsets_problem
from dynamicemb.ops.cpu import CpuBackend
from dynamicemb.ops.records import (DeviceSchedule, InitRows, InitSpec, OptimizerUpdate,
                                    RowFormat, RowSources)
from dynamicemb.options import DynamicEmbOptimType
from dynamicemb_testing.cuda_emulation import emulated_cuda

HOST_ROW_BIT = 1 << 62
TRANSIENT_ROW_BIT = 1 << 61
SEEDS = [0, 1, 2]
# (features, batch): no bag, one bag, several
SHAPES = [(1, 0), (1, 1), (3, 17), (4, 64)]
OPTIMIZERS = {0: 0, 1: 2, 2: 1, 3: None}  # kind -> state floats per dim (None: 1 in all)


def _cpu():
    return cpu_kernels.load()


def _state(kind: int, dim: int) -> int:
    return 1 if OPTIMIZERS[kind] is None else OPTIMIZERS[kind] * dim


class Batch(NamedTuple):
    """One group's lookups and rows, as a padded step hands them to the kernels."""

    tiers: list  # [device (C, width), host (H, width)]
    row_ref: torch.Tensor  # (U,) (padded: N), -1 where the insert failed / padding
    init: InitRows
    inverse: torch.Tensor  # (N,), -1 for another group's lookups
    offsets: torch.Tensor  # (F * B + 1,)
    weights: Optional[torch.Tensor]
    feature_col: torch.Tensor  # (F,), -1 for another group's features
    batch: int
    dim: int
    starts: torch.Tensor
    rank: torch.Tensor


def make_batch(seed: int, features: int, batch: int, dim: int = 8, width: int = 8,
               weighted: bool = False, padded: bool = False, host: bool = True,
               failed: float = 0.3) -> Batch:
    """A random batch: duplicate keys, a feature of another group, rows on both tiers
    and some failed inserts, over three tables with different initializers."""
    g = torch.Generator().manual_seed(seed)
    num_bags = features * batch
    lengths = torch.randint(0, 4, (num_bags,), generator=g)
    offsets = torch.zeros(num_bags + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    n = int(offsets[-1])
    feature_col = torch.arange(features, dtype=torch.int64) * dim
    if features > 2:
        feature_col[1] = -1  # another group's feature: its lookups are not ours
    ours = torch.repeat_interleave(feature_col >= 0, lengths.view(features, batch).sum(1))
    keys = torch.randint(0, max(2, n // 2), (n,), generator=g)
    tids = torch.randint(0, 3, (n,), generator=g).to(torch.int16)
    mine = ours.nonzero().squeeze(1)
    ukeys, utids, inv, counts, starts, rank_own = _cpu().dedup(keys[mine], tids[mine], None,
                                                               group=True)
    u = int((counts > 0).sum())  # past the unique pairs: padding
    ukeys, utids, starts = ukeys[:u], utids[:u], starts[:u + 1]
    inverse = torch.full((n,), -1, dtype=torch.int64)
    inverse[mine] = inv
    rank = torch.full((n,), -1, dtype=torch.int64)
    rank[mine] = rank_own
    u = ukeys.numel()
    # each unique row: a device slot, a host slot, or no row (its insert failed)
    capacity = 2 * u + 4
    device = torch.randn(capacity, width, generator=g)
    host_rows = torch.randn(capacity if host else 0, width, generator=g)
    refs = torch.randperm(capacity, generator=g)[:u]
    on_host = torch.rand(u, generator=g) < (0.5 if host else 0.0)
    refs = torch.where(on_host, refs + HOST_ROW_BIT, refs)
    refs = torch.where(torch.rand(u, generator=g) < failed, -1, refs)
    if padded:  # unique arrays padded to N: key 0, table 0, no row, no lookup
        pad = n - u
        ukeys = torch.cat([ukeys, torch.zeros(pad, dtype=torch.int64)])
        utids = torch.cat([utids, torch.zeros(pad, dtype=torch.int16)])
        refs = torch.cat([refs, torch.full((pad,), -1, dtype=torch.int64)])
        starts = torch.cat([starts, starts[-1:].expand(pad)])
    spec = InitSpec(
        ints=torch.tensor([[5, 0, 11], [6, 2, 12], [7, 4, 13]], dtype=torch.int64),
        floats=torch.tensor([[0.5, 0.1, -1, 1, 0], [0, 1, -0.25, 0.75, 0],
                             [0, 1, 0, 0, 0]], dtype=torch.float32))
    weights = torch.rand(n, generator=g) if weighted else None
    return Batch([device, host_rows], refs, InitRows(ukeys, utids, spec), inverse, offsets,
                 weights, feature_col, batch, dim, starts.contiguous(), rank)


def transient_rows(b: Batch):
    """(transient (U, dim), row_ref): the rows ``init`` computes, made beforehand by
    ``init_rows``, referenced as transient rows (``TRANSIENT_ROW_BIT`` + u)."""
    u = b.row_ref.numel()
    transient = torch.zeros(u, b.dim)
    _cpu().init_rows(transient, torch.arange(u), None, b.init.keys.contiguous(),
                     b.init.table_ids.to(torch.int16).contiguous(), b.dim,
                     InitSpec(*b.init.spec), 0.0)
    refs = torch.where(b.row_ref < 0, TRANSIENT_ROW_BIT + torch.arange(u), b.row_ref)
    return transient, refs


def no_transient(b: Batch) -> torch.Tensor:
    return torch.empty(0, b.dim)


def error_word(set_: bool) -> torch.Tensor:
    return torch.tensor([2 if set_ else 0], dtype=torch.int64)


# ------------------------------------------------------------------- check_offsets
@pytest.mark.parametrize("seed", SEEDS)
def test_check_offsets_records_the_first_problem(seed):
    g = torch.Generator().manual_seed(seed)
    for trial in range(12):
        m = int(torch.randint(1, 40, (1,), generator=g))
        offsets = torch.sort(torch.randint(0, 30, (m,), generator=g)).values
        offsets[0] = 0
        num = int(offsets[-1])
        if trial % 4 == 1:
            offsets[0] = 3
        if trial % 4 == 2 and m > 2:
            offsets[m // 2] = -1
        if trial % 3 == 0:
            num += 1
        code = _cpu().check_offsets(offsets, num)
        for start in (0, 1, 3, 7):
            word = torch.tensor([start], dtype=torch.int64)
            want = word.clone()
            assert _cpu().check_offsets(offsets, num, error=word) is None
            with emulated_cuda() as emu:
                assert emu.check_offsets(offsets, num, error=want) is None
            assert word.tolist() == want.tolist()
            if start == 0:  # the word holds the code the plain call returns
                assert offsets_problem(int(word)) == code


def test_check_offsets_word_keeps_a_larger_value():
    word = torch.tensor([3], dtype=torch.int64)  # a first-entry problem already there
    _cpu().check_offsets(torch.tensor([0, 2, 1]), 1, error=word)
    assert int(word) == 3
    word.zero_()
    _cpu().check_offsets(torch.tensor([0, 2, 1]), 1, error=word)
    assert offsets_problem(int(word)) == 3


# ------------------------------------------------------------------------ forward
def _pooled(kernels, b: Batch, out, mean, transient=None, refs=None, **kw):
    kernels.pooled_forward(b.tiers, no_transient(b) if transient is None else transient,
                           b.row_ref if refs is None else refs, b.inverse, b.offsets,
                           b.weights, b.feature_col, b.batch, b.dim, mean, out, **kw)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("features,batch", SHAPES)
@pytest.mark.parametrize("mean,weighted", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("padded", [False, True])
def test_pooled_forward(seed, features, batch, mean, weighted, padded):
    b = make_batch(seed, features, batch, weighted=weighted, padded=padded)
    shape = (batch, features * b.dim + 3)
    for refused in (False, True):
        got, emulated = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
        _pooled(_cpu(), b, got, mean, init=b.init, error=error_word(refused))
        with emulated_cuda() as emu:
            _pooled(emu, b, emulated, mean, init=b.init, error=error_word(refused))
        torch.testing.assert_close(got, emulated, rtol=0, atol=0, equal_nan=True)
        if not refused:  # the same call with transient rows made beforehand
            plain = torch.full(shape, float("nan"))
            transient, refs = transient_rows(b)
            _pooled(_cpu(), b, plain, mean, transient, refs)
            torch.testing.assert_close(got, plain, rtol=0, atol=0, equal_nan=True)
        else:
            ours = [c for c in b.feature_col.tolist() if c >= 0]
            for c in ours:
                assert not got[:, c:c + b.dim].any()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("features,batch", SHAPES)
@pytest.mark.parametrize("padded", [False, True])
def test_sequence_forward(seed, features, batch, padded):
    b = make_batch(seed, features, batch, padded=padded)
    n = b.inverse.numel()
    for refused in (False, True):
        got, emulated = torch.full((n, b.dim), -7.0), torch.full((n, b.dim), -7.0)
        _cpu().sequence_forward(b.tiers, no_transient(b), b.row_ref, b.inverse, b.dim, got,
                                init=b.init, error=error_word(refused))
        with emulated_cuda() as emu:
            emu.sequence_forward(b.tiers, no_transient(b), b.row_ref, b.inverse, b.dim,
                                 emulated, init=b.init, error=error_word(refused))
        assert torch.equal(got, emulated)
        if refused:
            assert not got.any()
        else:
            plain = torch.full((n, b.dim), -7.0)
            transient, refs = transient_rows(b)
            _cpu().sequence_forward(b.tiers, transient, refs, b.inverse, b.dim, plain)
            assert torch.equal(got, plain)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("features,batch", SHAPES)
@pytest.mark.parametrize("padded", [False, True])
def test_per_sample_weight_grad(seed, features, batch, padded):
    b = make_batch(seed, features, batch, weighted=True, padded=padded)
    n = b.inverse.numel()
    grad = torch.randn(batch, features * b.dim, generator=torch.Generator().manual_seed(seed))
    args = lambda: (b.inverse, b.offsets, b.feature_col, b.batch, b.dim, grad)  # noqa: E731
    for refused in (False, True):
        got, emulated = torch.full((n,), 5.0), torch.full((n,), 5.0)
        _cpu().per_sample_weight_grad(b.tiers, no_transient(b), b.row_ref, *args(), got,
                                      init=b.init, error=error_word(refused))
        with emulated_cuda() as emu:
            emu.per_sample_weight_grad(b.tiers, no_transient(b), b.row_ref, *args(), emulated,
                                       init=b.init, error=error_word(refused))
        assert torch.equal(got, emulated)
        if refused:
            assert torch.equal(got, torch.full((n,), 5.0))
        else:
            plain = torch.full((n,), 5.0)
            transient, refs = transient_rows(b)
            _cpu().per_sample_weight_grad(b.tiers, transient, refs, *args(), plain)
            assert torch.equal(got, plain)


def test_computed_rows_are_the_initializers():
    """A failed insert's pooled row is its initializer's (not zeros, not a neighbour)."""
    b = make_batch(3, 2, 5, failed=1.0, host=False)
    out = torch.zeros(b.batch, 2 * b.dim)
    _pooled(_cpu(), b, out, False, init=b.init)
    assert out.abs().sum() > 0
    transient, refs = transient_rows(b)
    plain = torch.zeros_like(out)
    _pooled(_cpu(), b, plain, False, transient, refs)
    assert torch.equal(out, plain)


def test_init_must_match_the_references():
    b = make_batch(0, 2, 4)
    bad = b.init._replace(keys=b.init.keys[:-1].contiguous(),
                          table_ids=b.init.table_ids[:-1].contiguous())
    with pytest.raises(RuntimeError, match="one entry per row reference"):
        _pooled(_cpu(), b, torch.zeros(4, 2 * b.dim), False, init=bad)
    with pytest.raises(RuntimeError, match="error"):
        _pooled(_cpu(), b, torch.zeros(4, 2 * b.dim), False, init=b.init,
                error=torch.zeros(1, dtype=torch.int32))


# ----------------------------------------------------------------------- backward
class Update(NamedTuple):
    kind: int
    lr: float
    eps: float
    beta1: float
    beta2: float
    weight_decay: float  # L2
    decoupled: float


UPDATES = [Update(0, 0.1, 1e-8, 0.9, 0.999, 0.0, 0.0), Update(1, 0.01, 1e-8, 0.9, 0.999, 0.0, 0.01),
           Update(1, 0.003, 1e-6, 0.8, 0.99, 0.05, 0.0), Update(2, 0.05, 1e-8, 0.9, 0.999, 0.01, 0.0),
           Update(3, 0.05, 1e-8, 0.9, 0.999, 0.0, 0.02)]


def host_scalars(u: Update, step: int):
    """(lr, step_size, bias_correction2_sqrt, decay_scale) as the module computes them
    on the host (``TableGroup.backward``)."""
    step_size, bias2 = u.lr, 1.0
    if u.kind == 1:
        step_size = u.lr / (1 - u.beta1 ** step)
        bias2 = math.sqrt(1 - u.beta2 ** step)
    return u.lr, step_size, bias2, 1.0 - u.lr * u.decoupled


def schedule_of(u: Update, step: int) -> DeviceSchedule:
    return DeviceSchedule(torch.tensor([u.lr], dtype=torch.float64),
                          torch.tensor([step], dtype=torch.int64), advance=u.kind == 1,
                          beta1=u.beta1, beta2=u.beta2, decoupled_decay=u.decoupled)


def optimizer_args(u: Update, scalars):
    lr, step_size, bias2, decay = scalars
    return (u.kind, lr, u.eps, u.beta1, u.beta2, u.weight_decay, step_size, bias2, decay)


# what a schedule replaces: lr, step size, bias correction and decay scale
GARBAGE = (123.0, 456.0, 789.0, 0.5)


def backward_batch(seed, features, batch, u: Update, pooled: bool, padded: bool, dim: int = 8):
    b = make_batch(seed, features, batch, dim=dim, width=dim + _state(u.kind, dim),
                   weighted=pooled, padded=padded)
    for t in b.tiers:  # optimizer state starts non-negative (sums of squares)
        t[:, dim:] = t[:, dim:].abs()
    g = torch.Generator().manual_seed(seed + 100)
    n = b.inverse.numel()
    grad = (torch.randn(batch, features * dim, generator=g) if pooled
            else torch.randn(n, dim, generator=g))
    if not pooled:  # sequence lookups: every lookup its own gradient row
        b = b._replace(offsets=torch.empty(0, dtype=torch.int64), weights=None)
    return b, grad


def _one_pass(b: Batch, grad, mean, args, **kw):
    return _cpu().sum_and_update_rows(b.tiers, b.row_ref, b.starts, b.rank, b.offsets, b.weights,
                                      b.feature_col, b.batch, mean, grad, b.dim, *args, **kw)


def _two_pass(b: Batch, grad, mean, args, **kw):
    sums = torch.full((b.row_ref.numel(), b.dim), float("nan"))
    error = kw.get("error")
    non_finite = _cpu().sum_gradients(b.starts, b.rank, b.offsets, b.weights, b.feature_col,
                                      b.batch, mean, grad, sums, error=error)
    _cpu().update_rows(b.tiers, b.row_ref, sums, *args, **kw)
    return non_finite


def _clone(b: Batch) -> Batch:
    return b._replace(tiers=[t.clone() for t in b.tiers])


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("features,batch", SHAPES)
@pytest.mark.parametrize("u", UPDATES, ids=lambda u: f"kind{u.kind}-wd{u.weight_decay}-"
                         f"dd{u.decoupled}")
@pytest.mark.parametrize("pooled,mean,padded", [(True, False, False), (True, True, True),
                                                (False, False, True)])
@pytest.mark.parametrize("passes", [_one_pass, _two_pass], ids=["one_pass", "two_passes"])
def test_backward_schedule_equals_host_scalars(seed, features, batch, u, pooled, mean, padded,
                                               passes):
    b, grad = backward_batch(seed, features, batch, u, pooled, padded)
    for start in (0, 4):
        refused_word = error_word(True)
        for refused in (False, True):
            got, host, emulated = _clone(b), _clone(b), _clone(b)
            schedule = schedule_of(u, start)
            error = refused_word if refused else error_word(False)
            count = passes(got, grad, mean, optimizer_args(u, GARBAGE), error=error,
                           schedule=schedule)
            step = start + (1 if schedule.advance and not refused else 0)
            assert int(schedule.step) == step
            emulated_schedule = schedule_of(u, start)
            with emulated_cuda() as emu:
                emu.fused_backward(emulated.tiers, b.row_ref, b.starts, b.rank, b.offsets,
                                   b.weights, b.feature_col, b.batch, b.dim, mean, grad,
                                   *optimizer_args(u, GARBAGE), error=error,
                                   schedule=emulated_schedule)
            assert int(emulated_schedule.step) == step
            # The emulation sums and updates in two passes. The CPU's one pass was
            # seen, rarely and already before these keywords, to round a value 1 ulp
            # off the two passes (memory-layout dependent; not understood yet): it
            # is compared within that.
            exact = passes is _two_pass
            for mine, theirs in zip(got.tiers, emulated.tiers):
                torch.testing.assert_close(mine, theirs, rtol=0 if exact else 1e-6,
                                           atol=0 if exact else 1e-6)
            if refused:
                assert count == 0
                for mine, before in zip(got.tiers, b.tiers):
                    assert torch.equal(mine, before)
                continue
            # the same call with the step's scalars computed on the host
            assert passes(host, grad, mean, optimizer_args(u, host_scalars(u, step))
                          ) == count == 0
            for mine, theirs in zip(got.tiers, host.tiers):
                assert torch.equal(mine, theirs)


@pytest.mark.parametrize("passes", [_one_pass, _two_pass], ids=["one_pass", "two_passes"])
def test_backward_without_schedule_ignores_an_unset_word(passes):
    """error given but 0: the update is the plain call's, the scalars the arguments'."""
    u = UPDATES[2]
    b, grad = backward_batch(5, 3, 17, u, True, False)
    got, plain = _clone(b), _clone(b)
    args = optimizer_args(u, host_scalars(u, 3))
    passes(got, grad, False, args, error=error_word(False))
    passes(plain, grad, False, args)
    for mine, theirs in zip(got.tiers, plain.tiers):
        assert torch.equal(mine, theirs)
    assert any(not torch.equal(m, t) for m, t in zip(got.tiers, b.tiers))


@pytest.mark.parametrize("u", UPDATES, ids=lambda u: f"kind{u.kind}-wd{u.weight_decay}")
def test_the_one_pass_skips_rows_without_lookups_as_cuda_does(u):
    """A unique row with no lookup is padding (every unique row of a batch has one): the
    one pass leaves it as CUDA's backward does, even where a row is stored there (where
    weight decay or Adam's moments would move it by a step with a zero gradient)."""
    b, grad = backward_batch(7, 3, 17, u, True, True)
    free = sorted(set(range(b.tiers[0].shape[0])) - set(b.row_ref.tolist()))[0]
    b = b._replace(row_ref=torch.cat([b.row_ref, torch.tensor([free])]),
                   starts=torch.cat([b.starts, b.starts[-1:]]))
    got, emulated = _clone(b), _clone(b)
    args = optimizer_args(u, host_scalars(u, 3))
    assert _one_pass(got, grad, False, args) == 0
    with emulated_cuda() as emu:
        emu.fused_backward(emulated.tiers, b.row_ref, b.starts, b.rank, b.offsets, b.weights,
                           b.feature_col, b.batch, b.dim, False, grad, *args)
    for mine, theirs in zip(got.tiers, emulated.tiers):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-6)
    assert torch.equal(got.tiers[0][free], b.tiers[0][free])
    assert any(not torch.equal(m, t) for m, t in zip(got.tiers, b.tiers))  # the others moved


def test_one_pass_counts_non_finite_rows_and_still_advances():
    u = UPDATES[1]
    b, grad = backward_batch(6, 3, 17, u, True, False)
    grad[0, 0] = float("nan")
    schedule = schedule_of(u, 2)
    non_finite = _one_pass(_clone(b), grad, False, optimizer_args(u, GARBAGE),
                           error=error_word(False), schedule=schedule)
    assert non_finite > 0
    assert int(schedule.step) == 3


# -------------------------------------------------------------------- CpuBackend
def _update(u: Update, step: int) -> OptimizerUpdate:
    optimizer = {0: DynamicEmbOptimType.EXACT_SGD, 1: DynamicEmbOptimType.ADAM,
                 2: DynamicEmbOptimType.EXACT_ADAGRAD,
                 3: DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD}[u.kind]
    lr, step_size, bias2, decay = host_scalars(u, step)
    return OptimizerUpdate(optimizer=optimizer, lr=lr, eps=u.eps, beta1=u.beta1, beta2=u.beta2,
                           weight_decay=u.weight_decay, step_size=step_size,
                           bias_correction2_sqrt=bias2, decay_scale=decay)


@pytest.mark.parametrize("checked", ["row", "batch"])
def test_cpu_backend_passes_error_and_schedule(checked):
    u = UPDATES[1]
    b, grad = backward_batch(7, 3, 17, u, True, True)
    ops = CpuBackend()

    def backward(batch_: Batch, update, **kw):
        sums = None
        if checked == "batch":
            sums = torch.empty(batch_.row_ref.numel(), batch_.dim)
            assert ops.sum_gradients(starts=b.starts, rank=b.rank, offsets=b.offsets,
                                     weights=b.weights, feature_col=b.feature_col,
                                     batch=b.batch, mean=False, grad=grad, out=sums,
                                     error=kw.get("error")) == 0
        return ops.fused_backward(
            sources=RowSources(batch_.tiers[0], batch_.tiers[1], no_transient(b),
                               RowFormat(torch.float32, b.dim, batch_.tiers[0].shape[1] - b.dim)),
            row_ref=b.row_ref, starts=b.starts, rank=b.rank, offsets=b.offsets,
            weights=b.weights, feature_col=b.feature_col, batch=b.batch, dim=b.dim,
            mean=False, grad=grad, update=update, sums=sums, **kw)

    got, host, refused = _clone(b), _clone(b), _clone(b)
    schedule = schedule_of(u, 0)
    assert backward(got, _update(u, 1)._replace(lr=9.0, step_size=9.0),
                    error=error_word(False), schedule=schedule) == 0
    assert int(schedule.step) == 1
    backward(host, _update(u, 1))
    for mine, theirs in zip(got.tiers, host.tiers):
        assert torch.equal(mine, theirs)
    assert backward(refused, _update(u, 1), error=error_word(True), schedule=schedule) == 0
    assert int(schedule.step) == 1
    for mine, before in zip(refused.tiers, b.tiers):
        assert torch.equal(mine, before)
