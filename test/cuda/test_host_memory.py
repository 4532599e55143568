"""Under a device budget, the host store's value rows live in host memory that the
kernels read and write in place (on a GPU: pinned and mapped into its address
space), while its index and the device tier stay in device memory; so a table's
rows may exceed the GPU's memory.

On CPU the CUDA backend's path runs under the emulation, which records each
host-memory allocation in place of the mapped memory; on a GPU (``cuda`` mark) the
real mapped memory is used and the rows are checked against the CPU backend.
"""

import pytest
import torch

from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbInitializerArgs,
                        DynamicEmbOptimType, DynamicEmbTableOptions)
from dynamicemb_testing.cuda_emulation import emulated_cuda

DIM = 16
WIDTH = DIM + 2 * DIM  # Adam's two states
ROW_BYTES = WIDTH * 4
ROWS = 1 << 12
# Adam's scalars are float32 in the kernels, float64 on CPU (test_module_twins.py)
TOL = dict(rtol=1e-5, atol=1e-6)
# layout -> (caching, device rows or None, host store rows in host memory)
LAYOUTS = {
    "cache-10%": (True, ROWS // 10, True),
    "placed-10%": (False, ROWS // 10, True),
    "host-only": (False, 0, True),
    "placed-all": (False, 2 * ROWS, False),  # the budget holds every row: one tier
    "no-budget": (False, None, False),
}


def _module(caching, device_rows, device="cpu", init_capacity=None):
    options = DynamicEmbTableOptions(
        dim=DIM, max_capacity=ROWS, init_capacity=init_capacity, bucket_capacity=16,
        initializer_args=DynamicEmbInitializerArgs(mode="normal", std_dev=0.1, seed=5),
        caching=caching,
        local_hbm_for_values=None if device_rows is None else device_rows * ROW_BYTES)
    return BatchedDynamicEmbeddingTables([options], optimizer=DynamicEmbOptimType.ADAM,
                                         learning_rate=0.01, device=device)


def _batches(count, pool, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, pool, (512,), generator=gen) * 7919 - 10**9
        offsets = torch.arange(0, 513, 2)
        out.append((ids.to(device), offsets.to(device)))
    return out


def _train(module, batches):
    outputs = []
    for ids, offsets in batches:
        out = module(ids, offsets)
        out.backward(torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out))
        outputs.append(out.detach().cpu())
    return outputs


def _rows(module):
    rows = module.export_keys_values("t0")
    order = torch.argsort(rows.keys.cpu())
    return [rows.keys.cpu()[order], rows.embeddings.cpu()[order],
            rows.optimizer_states.cpu()[order]]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_device_budget_puts_the_host_stores_rows_in_host_memory(layout):
    caching, device_rows, in_host = LAYOUTS[layout]
    with emulated_cuda() as kernels:
        module = _module(caching, device_rows)
    group = module._groups[0]
    assert group.table.values_in_host_memory == in_host
    want = [((group.table.capacity(), WIDTH), torch.float32)] if in_host else []
    assert kernels.host_allocations == want
    tier = group.storage.device_tier
    assert tier is None or not tier.values_in_host_memory  # the cache is device memory
    assert ("in host memory" in group.storage.describe()) == in_host


def test_growth_keeps_the_rows_in_host_memory_and_training_is_exact():
    """A host store that doubles twice is allocated in host memory each time; the
    rows trained through the CUDA path equal the CPU backend's."""
    batches = _batches(6, pool=ROWS // 2, seed=1)
    with emulated_cuda() as kernels:
        module = _module(True, ROWS // 10, init_capacity=256)
        outputs = _train(module, batches)
        rows = _rows(module)
    table = module._groups[0].table
    assert table.capacity() >= 1024 and table.values_in_host_memory
    shapes = [shape for shape, _ in kernels.host_allocations]
    assert shapes[0] == (256, WIDTH) and shapes[-1] == (table.capacity(), WIDTH)
    assert len(shapes) >= 3  # the first table and at least two growths
    reference = _module(True, ROWS // 10, init_capacity=256)  # the CPU backend
    expected = _train(reference, batches)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, **TOL)
    for got, want in zip(rows, _rows(reference)):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.cuda
def test_on_a_gpu_the_host_store_takes_no_gpu_memory_and_trains_as_the_cpu():
    rows = 1 << 16
    before = torch.cuda.memory_allocated()
    options = DynamicEmbTableOptions(
        dim=DIM, max_capacity=rows, bucket_capacity=16, caching=True,
        initializer_args=DynamicEmbInitializerArgs(mode="normal", std_dev=0.1, seed=5),
        local_hbm_for_values=(rows // 16) * ROW_BYTES)
    module = BatchedDynamicEmbeddingTables([options], optimizer=DynamicEmbOptimType.ADAM,
                                           learning_rate=0.01, device="cuda")
    table = module._groups[0].table
    values_bytes = table.values.numel() * table.values.element_size()
    assert table.values_in_host_memory and table.values.is_cuda
    # the GPU holds the index (about 19 B a slot) and the cache, not the rows
    assert torch.cuda.memory_allocated() - before < values_bytes // 2
    cpu = BatchedDynamicEmbeddingTables([options], optimizer=DynamicEmbOptimType.ADAM,
                                        learning_rate=0.01)
    batches = _batches(8, pool=rows // 4, seed=2)
    got = _train(module, [(i.cuda(), o.cuda()) for i, o in batches])
    want = _train(cpu, batches)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)
    for g, w in zip(_rows(module), _rows(cpu)):
        torch.testing.assert_close(g, w, **TOL)
