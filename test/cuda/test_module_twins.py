"""``BatchedDynamicEmbeddingTables`` on CUDA against the same module on CPU.

Both modules start from the same imported rows and train on the same batches;
outputs, per-sample weight gradients and, at the end, every stored row, state
and score must agree (sums run in the same order on both backends, so only a
fused multiply-add's rounding may differ).
"""

from dataclasses import replace

import pytest
import torch

from dynamicemb import DynamicEmbOptimType, DynamicEmbPoolingMode
from dynamicemb_testing.module_reference import OPTIMIZER_ARGS, OPTIMIZERS, POOLINGS, TableSpec, export_dict, id_pool, make_tables, random_batch

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
TOL = dict(rtol=1e-5, atol=1e-6)
# The dense-reference suite's optimizer settings; Adam with weight decay here.
ARGS = {**OPTIMIZER_ARGS, DynamicEmbOptimType.ADAM: replace(
    OPTIMIZER_ARGS[DynamicEmbOptimType.ADAM], weight_decay=0.01)}
GRID = [(o, p, w) for o in OPTIMIZERS for p in POOLINGS
        for w in ((False, True) if p == DynamicEmbPoolingMode.SUM else (False,))]


def twin_modules(specs, ftm, pooling, args):
    cpu, _ = make_tables(specs, ftm, pooling, args)
    gpu, _ = make_tables(specs, ftm, pooling, args, device=CUDA)
    return cpu, gpu


def assert_same_tables(cpu, gpu, tol=TOL):
    for name in cpu.table_names:
        want, got = export_dict(cpu, name), export_dict(gpu, name)
        assert sorted(want) == sorted(got), f"table {name}: keys differ"
        for k in want:
            torch.testing.assert_close(got[k][0].cpu(), want[k][0], **tol)
            torch.testing.assert_close(got[k][1].cpu(), want[k][1], **tol)
            assert got[k][2] == want[k][2], f"table {name} key {k}: score"


@pytest.mark.parametrize("opt,pooling,weighted", GRID,
                         ids=[f"{o.name}-{p.name}-{'w' if w else 'nw'}" for o, p, w in GRID])
def test_training_matches_cpu(opt, pooling, weighted):
    none = pooling == DynamicEmbPoolingMode.NONE
    specs = [TableSpec(dim=4, init_value=0.25),
             TableSpec(dim=4 if none else 33, bucket_capacity=32 if none else 128),
             TableSpec(dim=4, init_value=-0.5)]
    ftm = [0, 1, 0, 2]
    cpu, gpu = twin_modules(specs, ftm, pooling, ARGS[opt])
    pools = [id_pool(300, 7 * t + 1) for t in range(len(specs))]
    gen = torch.Generator().manual_seed(3)
    for step in range(6):
        indices, offsets, weights = random_batch([pools[t] for t in ftm], 64, gen,
                                                 weighted=weighted)
        if weights is not None:
            weights.requires_grad_(True)
        gpu_weights = None if weights is None else weights.detach().to(CUDA).requires_grad_(True)
        want = cpu(indices, offsets, weights)
        got = gpu(indices.to(CUDA), offsets.to(CUDA), gpu_weights)
        torch.testing.assert_close(got.detach().cpu(), want.detach(), **TOL,
                                   msg=lambda m: f"step {step} output: {m}")
        grad = torch.randn(want.shape, generator=gen)
        (want * grad).sum().backward()
        (got * grad.to(CUDA)).sum().backward()
        if weighted:
            torch.testing.assert_close(gpu_weights.grad.cpu(), weights.grad, **TOL)
    assert_same_tables(cpu, gpu)


def test_large_batch_matches_cpu():
    """Many lookups per row and wide rows. The hottest rows have more lookups than
    one piece (``_cuda.PIECE_ENTRIES``) and are summed in two levels, a rounding
    apart from the CPU's one sequential sum: their tolerance is wider."""
    specs = [TableSpec(dim=128, max_capacity=1 << 14)]
    cpu, gpu = twin_modules(specs, [0, 0], DynamicEmbPoolingMode.MEAN,
                            ARGS[DynamicEmbOptimType.ADAM])
    pools = [id_pool(2000, 5)]
    gen = torch.Generator().manual_seed(4)
    for step in range(3):
        indices, offsets, _ = random_batch([pools[0]] * 2, 4096, gen, max_bag=8)
        want = cpu(indices, offsets)
        got = gpu(indices.to(CUDA), offsets.to(CUDA))
        torch.testing.assert_close(got.detach().cpu(), want.detach(), **TOL)
        grad = torch.randn(want.shape, generator=gen)
        (want * grad).sum().backward()
        (got * grad.to(CUDA)).sum().backward()
    assert_same_tables(cpu, gpu, tol=dict(rtol=1e-4, atol=1e-5))


def ordered_bits(rows: torch.Tensor) -> torch.Tensor:
    """16-bit floats as integers in the floats' order (sign and magnitude to a line,
    both zeros at 0): adjacent values differ by one."""
    bits = rows.view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sixteen_bit_rows_match_cpu(opt, dtype):
    """16-bit rows trained with stochastic rounding: the GPU's rows are the CPU's, the
    rounding bits following (table, key, step, column), not the backend. Each float32
    update is the same arithmetic in the same order on both, so a row differs only
    where a fused multiply-add rounded that update differently and the rounding
    crossed a 16-bit step: by one step, in a few elements at most. Dim 72: the CPU's
    blocks of 32 columns and a part, the GPU's 16-byte loads of 8 columns."""
    options = dict(embedding_dtype=dtype)
    specs = [TableSpec(dim=72, options=options), TableSpec(dim=8, init_value=-0.5, options=options)]
    ftm = [0, 1, 0]
    cpu, gpu = twin_modules(specs, ftm, DynamicEmbPoolingMode.SUM, ARGS[opt])
    pools = [id_pool(300, 7 * t + 3) for t in range(len(specs))]
    gen = torch.Generator().manual_seed(5)
    for step in range(6):
        indices, offsets, _ = random_batch([pools[t] for t in ftm], 64, gen)
        want = cpu(indices, offsets)
        got = gpu(indices.to(CUDA), offsets.to(CUDA))
        # rows read exactly, summed in float32 in the same order
        torch.testing.assert_close(got.detach().cpu(), want.detach(), **TOL,
                                   msg=lambda m: f"step {step} output: {m}")
        grad = torch.randn(want.shape, generator=gen)
        (want * grad).sum().backward()
        (got * grad.to(CUDA)).sum().backward()
    for name in cpu.table_names:
        want, got = cpu.export_keys_values(name), gpu.export_keys_values(name)
        w, g = want.keys.argsort(), got.keys.cpu().argsort()
        assert torch.equal(want.keys[w], got.keys.cpu()[g]), f"table {name}: keys differ"
        assert want.embeddings.dtype == got.embeddings.dtype == dtype
        steps = (ordered_bits(want.embeddings[w]) - ordered_bits(got.embeddings.cpu()[g])).abs()
        assert int(steps.max()) <= 1, f"table {name}: rows differ by more than one 16-bit step"
        differ = int((steps > 0).sum())
        assert differ <= steps.numel() // 100, f"table {name}: {differ} elements differ"
        torch.testing.assert_close(got.optimizer_states.cpu()[g], want.optimizer_states[w], **TOL)
