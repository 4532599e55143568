"""A prefetch pipeline on real CUDA streams, as TorchRec's prefetch pipelines run it:
``forward(i)`` on the training stream, ``prefetch(i + 1)`` on a side stream, then
``backward(i)`` on the training stream, the next forward after the training stream
waits for the side stream. Rows and outputs must equal training without prefetch
(the module orders its own uses across streams: ``embedding/streams.py``)."""

import pytest
import torch

from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbInitializerArgs,
                        DynamicEmbOptimType, DynamicEmbTableOptions)

pytestmark = pytest.mark.cuda

DIM = 16


def _module(cache_rows=None):
    options = DynamicEmbTableOptions(
        dim=DIM, max_capacity=1 << 14, bucket_capacity=16,
        initializer_args=DynamicEmbInitializerArgs(mode="normal", std_dev=0.1, seed=3),
        caching=cache_rows is not None,
        local_hbm_for_values=None if cache_rows is None else cache_rows * (DIM + 2 * DIM) * 4)
    return BatchedDynamicEmbeddingTables([options, options], table_names=["a", "b"],
                                         optimizer=DynamicEmbOptimType.ADAM,
                                         learning_rate=0.01, device="cuda")


def _batches(count=12, bags=2048, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(0, 4, (2 * bags,), generator=gen)
        u = torch.rand(int(lengths.sum()), generator=gen, dtype=torch.float64)
        ids = (((6000.0 ** -0.2 - 1) * u + 1) ** (1 / -0.2)).long() * 7919
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        out.append((ids.cuda(), offsets.cuda()))
    return out


def _train(module, batches, side=None):
    outputs = []
    if side is not None:
        with torch.cuda.stream(side):
            module.prefetch(*batches[0])
    for k, (ids, offsets) in enumerate(batches):
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)  # the pipeline's part
        out = module(ids, offsets)
        if side is not None and k + 1 < len(batches):
            with torch.cuda.stream(side):
                module.prefetch(*batches[k + 1])
        # dense work on the training stream the prefetch may overlap
        torch.cuda._sleep(200_000)
        out.backward(torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out))
        outputs.append(out.detach().clone())
    torch.cuda.synchronize()
    return outputs


def _rows(module):
    state = {}
    for name in module.table_names:
        rows = module.export_keys_values(name)
        order = torch.argsort(rows.keys)
        state[name] = [rows.keys[order], rows.embeddings[order], rows.optimizer_states[order]]
    return state


@pytest.mark.parametrize("cache_rows", [None, 512], ids=["all-rows", "cache-512"])
def test_prefetch_on_a_side_stream_trains_as_without(cache_rows):
    batches = _batches()
    reference = _module(cache_rows)
    expected = _train(reference, batches)
    module = _module(cache_rows)
    outputs = _train(module, batches, side=torch.cuda.Stream())
    for k, (got, want) in enumerate(zip(outputs, expected)):
        assert torch.equal(got, want), f"batch {k}"
    for name, columns in _rows(reference).items():
        for got, want in zip(_rows(module)[name], columns):
            assert torch.equal(got, want), name
