"""A training step captured once and replayed, as ``torch.cuda.graph`` does, trains
exactly as eager steps do: everything that changes from step to step (ids, clocks,
step counts, counts, the learning rate) lives in device memory. Run on the CPU with
the CUDA backend's kernels emulated and a stand-in for the graph
(``dynamicemb_testing/graph_emulation.py``), against the CPU backend training the
same batches eagerly; ``make gpu-check`` captures a real graph."""

import pytest
import torch

from dynamicemb import DynamicEmbOptimType, DynamicEmbPoolingMode, DynamicEmbScoreStrategy
from dynamicemb_testing.cuda_emulation import emulated_cuda
from dynamicemb_testing.graph_emulation import EmulatedGraph
from dynamicemb_testing.module_reference import (OPTIMIZER_ARGS, TableSpec, export_dict,
                                                 make_tables)

N, BAG = 512, 4
OFFSETS = torch.arange(0, N + 1, BAG)
TOL = dict(rtol=1e-5, atol=1e-6)


def _module(optimizer, pooling, strategy, capacity=1 << 12, **options):
    spec = TableSpec(dim=8, max_capacity=capacity, bucket_capacity=32,
                     options=dict(score_strategy=strategy, **options))
    return make_tables([spec], pooling=pooling, optimizer=OPTIMIZER_ARGS[optimizer])[0]


def _ids(seed, pool=1500):
    return torch.randint(0, pool, (N,), generator=torch.Generator().manual_seed(seed))


def _loss(out):
    return (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum()


def _step(module, ids, offsets=OFFSETS):
    out = module(ids, offsets)
    _loss(out).backward()
    return out.detach().clone()


def _captured(module, kernels, ids):
    """A graph of one training step over static ids and offsets (after a warm-up)."""
    static_ids, static_offsets = ids.clone(), OFFSETS.clone()
    graph = EmulatedGraph(kernels)
    with graph.capture():
        out = module(static_ids, static_offsets)
        _loss(out).backward()
    return graph, static_ids, static_offsets, out


def _state(module):
    name = module.table_names[0]
    return (module.table_clocks(name), module.train_steps, module.table_size(name),
            module.cache_metrics(), module._groups[0].table.stats)


def _assert_same_tables(got, want):
    a, b = export_dict(got, "t0"), export_dict(want, "t0")
    assert a.keys() == b.keys()
    for key, (row, state, score) in b.items():
        torch.testing.assert_close(a[key][0], row, **TOL)
        torch.testing.assert_close(a[key][1], state, **TOL)
        assert a[key][2] == score, key


STRATEGIES = [DynamicEmbScoreStrategy.LRU, DynamicEmbScoreStrategy.STEP,
              DynamicEmbScoreStrategy.LFU]


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("pooling", [DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.NONE],
                         ids=["sum", "none"])
@pytest.mark.parametrize("optimizer", [DynamicEmbOptimType.EXACT_SGD, DynamicEmbOptimType.ADAM],
                         ids=["sgd", "adam"])
def test_a_captured_step_replays_as_eager_steps(optimizer, pooling, strategy):
    """New ids, hits, evictions (a table smaller than the ids), LRU/STEP/LFU scores, Adam's
    step count and a learning rate changed between replays: the replays' outputs,
    rows, states, scores, clocks, sizes and metrics equal eager training's."""
    eager = _module(optimizer, pooling, strategy, capacity=1 << 10)  # the CPU backend's
    with emulated_cuda() as kernels:
        graphed = _module(optimizer, pooling, strategy, capacity=1 << 10)
        for m in (graphed, eager):  # warm-up, as before any capture
            _step(m, _ids(0))
        graph, static_ids, _, out = _captured(graphed, kernels, _ids(1))
        torch.testing.assert_close(out.detach(), _step(eager, _ids(1)), **TOL)
        for seed in range(2, 7):
            if seed == 4:
                for m in (graphed, eager):
                    m.set_learning_rate(0.03)
            static_ids.copy_(_ids(seed))
            graph.replay()
            torch.testing.assert_close(out.detach(), _step(eager, _ids(seed)), **TOL)
        assert _state(graphed) == _state(eager)
        _assert_same_tables(graphed, eager)
        # and eager steps after the replays go on from where they left
        torch.testing.assert_close(_step(graphed, _ids(9)), _step(eager, _ids(9)), **TOL)
        _assert_same_tables(graphed, eager)


@pytest.mark.parametrize("optimizer", [DynamicEmbOptimType.EXACT_SGD, DynamicEmbOptimType.ADAM],
                         ids=["sgd", "adam"])
@pytest.mark.parametrize("layout", ["cache", "placed", "host-rows"])
def test_a_captured_step_over_host_rows_replays_as_eager_steps(optimizer, layout):
    """Rows in host memory: a device cache of 256 rows over them (promotion, eviction,
    write-back on the device), 256 rows placed in device memory (new rows land there
    while it has room), or every row read and updated there; replays equal the CPU
    backend's eager training, metrics included."""
    device_rows = {"cache": 256, "placed": 256, "host-rows": 0}[layout]
    budget = dict(caching=layout == "cache", local_hbm_for_values=device_rows * 8 * 4 * 3)
    pooling, strategy = DynamicEmbPoolingMode.SUM, DynamicEmbScoreStrategy.LRU
    eager = _module(optimizer, pooling, strategy, **budget)
    with emulated_cuda() as kernels:
        graphed = _module(optimizer, pooling, strategy, **budget)
        for m in (graphed, eager):
            _step(m, _ids(0))
        graph, static_ids, _, out = _captured(graphed, kernels, _ids(1))
        torch.testing.assert_close(out.detach(), _step(eager, _ids(1)), **TOL)
        for seed in range(2, 6):
            static_ids.copy_(_ids(seed))
            graph.replay()
            torch.testing.assert_close(out.detach(), _step(eager, _ids(seed)), **TOL)
        assert _state(graphed) == _state(eager)
        if layout == "cache":
            assert graphed.cache_metrics()["t0"].evictions > 0
        graphed.flush()
        _assert_same_tables(graphed, eager)


def test_a_refused_batch_in_a_replay_changes_nothing_until_checked():
    """Bad offsets copied into the static offsets: the replay pools zeros and changes
    nothing, so does every replay after it (the word stays set), and
    ``check_errors`` raises; then replays train again."""
    optimizer, pooling = DynamicEmbOptimType.ADAM, DynamicEmbPoolingMode.SUM
    strategy = DynamicEmbScoreStrategy.LRU
    eager = _module(optimizer, pooling, strategy)
    with emulated_cuda() as kernels:
        graphed = _module(optimizer, pooling, strategy)
        for m in (graphed, eager):
            _step(m, _ids(0))
        graph, static_ids, static_offsets, out = _captured(graphed, kernels, _ids(1))
        _step(eager, _ids(1))
        bad = OFFSETS.clone()
        bad[5] = bad[3]  # decreasing
        static_offsets.copy_(bad)
        graph.replay()
        assert not out.any()
        static_offsets.copy_(OFFSETS)
        static_ids.copy_(_ids(2))
        graph.replay()  # a good batch, but the word is still set
        assert not out.any()
        assert _state(graphed) == _state(eager)
        with pytest.raises(ValueError, match="refused on the device.*decreased"):
            graphed.check_errors()
        graphed.check_errors()  # raised once
        graph.replay()
        torch.testing.assert_close(out.detach(), _step(eager, _ids(2)), **TOL)
        _assert_same_tables(graphed, eager)


def test_batches_of_any_size_padded_to_the_captured_count_train_as_unpadded():
    """The recipe for batches of varying size: ``pad_lookups`` to the captured lookup
    count (weight 0, an id no batch uses). The replays' outputs and every row but the
    padding id's equal eager training on the unpadded batches (CPU backend)."""
    from dynamicemb import pad_lookups  # noqa: PLC0415

    optimizer, pooling = DynamicEmbOptimType.ADAM, DynamicEmbPoolingMode.SUM
    strategy = DynamicEmbScoreStrategy.LRU
    gen = torch.Generator().manual_seed(5)

    def batch(bags=64):
        lengths = torch.randint(0, 7, (bags,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        ids = torch.randint(0, 1500, (int(offsets[-1]),), generator=gen)
        return ids, offsets, torch.rand(ids.numel(), generator=gen)

    def weighted_step(module, ids, offsets, weights):
        out = module(ids, offsets, weights)
        _loss(out).backward()
        return out.detach().clone()

    size, pad = 64 * 6, -7
    eager = _module(optimizer, pooling, strategy)
    with emulated_cuda() as kernels:
        graphed = _module(optimizer, pooling, strategy)
        static = [t.clone() for t in pad_lookups(*batch(), size, pad)]
        for b in (batch(), batch()):  # warm-up
            weighted_step(eager, *b)
            weighted_step(graphed, *pad_lookups(*b, size, pad))
        graph = EmulatedGraph(kernels)
        first = batch()
        for s, t in zip(static, pad_lookups(*first, size, pad)):
            s.copy_(t)
        with graph.capture():
            out = graphed(*static)
            _loss(out).backward()
        torch.testing.assert_close(out.detach(), weighted_step(eager, *first), **TOL)
        for _ in range(4):
            b = batch()
            for s, t in zip(static, pad_lookups(*b, size, pad)):
                s.copy_(t)
            graph.replay()
            torch.testing.assert_close(out.detach(), weighted_step(eager, *b), **TOL)
        got = export_dict(graphed, "t0")
        assert got.pop(pad)[0].eq(0.25).all()  # the padding row: stored, never moved
        want = export_dict(eager, "t0")
    assert got.keys() == want.keys()
    for key, (row, state, _) in want.items():
        torch.testing.assert_close(got[key][0], row, **TOL)
        torch.testing.assert_close(got[key][1], state, **TOL)


def test_pad_lookups_refuses_a_batch_too_large():
    from dynamicemb import pad_lookups  # noqa: PLC0415

    with pytest.raises(ValueError, match="more than num_lookups=3"):
        pad_lookups(torch.arange(4), torch.tensor([0, 4]), None, 3, -1)


def test_host_writes_a_capture_would_replay_are_refused_and_eager_ones_taken():
    """A clock set or a learning rate changed through ``param_groups`` after the last
    step would be written inside the capture (and set back at every replay): the
    capture refuses it; ``set_learning_rate`` writes the device copy at once, so a
    capture after it takes the new rate."""
    optimizer, pooling = DynamicEmbOptimType.ADAM, DynamicEmbPoolingMode.SUM
    strategy = DynamicEmbScoreStrategy.LRU
    with emulated_cuda() as kernels:
        module = _module(optimizer, pooling, strategy)
        _step(module, _ids(0))
        module.set_table_clocks("t0", module.table_clocks("t0")._replace(score_clock=50))
        with pytest.raises(RuntimeError, match="outside the CUDA graph capture"):
            _captured(module, kernels, _ids(1))
        _step(module, _ids(1))  # an eager step writes the clock
        module.optimizer.param_groups[0]["lr"] = 0.5
        with pytest.raises(RuntimeError, match="set_learning_rate before the capture"):
            _captured(module, kernels, _ids(2))
        module.set_learning_rate(0.5)
        _captured(module, kernels, _ids(3))  # takes it


def test_a_table_captured_in_a_graph_refuses_to_grow_until_released():
    """Growth replaces a table's arrays, and a graph captured before replays into the
    old ones (freed: the stand-in raises where a GPU would read freed memory). So an
    eager call that would grow a captured table is refused, with the fix named, and
    changes nothing; ``release_graphs`` lets the table grow again (capture anew after)."""
    optimizer, pooling = DynamicEmbOptimType.EXACT_SGD, DynamicEmbPoolingMode.SUM
    with emulated_cuda() as kernels:
        module = _module(optimizer, pooling, DynamicEmbScoreStrategy.LRU, capacity=1 << 14,
                         init_capacity=256)
        table = module._groups[0].table
        _step(module, _ids(0, pool=200))
        graph, static_ids, static_offsets, _ = _captured(module, kernels, _ids(1, pool=200))
        graph.replay()
        capacity, rows = table.capacity(), export_dict(module, "t0")
        new_ids = _ids(2, pool=1 << 20) + 10_000  # every one new: the table must grow
        with pytest.raises(RuntimeError, match="re-capture after growth"):
            _step(module, new_ids)
        assert table.capacity() == capacity and export_dict(module, "t0").keys() == rows.keys()
        graph.replay()  # its arrays are still the table's
        module.release_graphs()
        _step(module, new_ids)
        assert table.capacity() > capacity
        with pytest.raises(RuntimeError, match="freed memory"):
            graph.replay()  # what the refusal kept from happening
