"""Bad offsets on a GPU step that keeps its counts on the device (``InputErrors``): the
check is a kernel, the batch changes nothing, and the error is raised at the next
call (at once with ``sync_checks``). Run on the CUDA backend's code with its kernels
emulated on the CPU (``dynamicemb_testing/cuda_emulation.py``)."""

import pytest
import torch

from dynamicemb import DynamicEmbOptimType, DynamicEmbPoolingMode
from dynamicemb_testing.cuda_emulation import emulated_cuda
from dynamicemb_testing.module_reference import (OPTIMIZER_ARGS, TableSpec, make_tables,
                                                 snapshot)
from dynamicemb_testing.sync_guard import SyncGuard

SUM, NONE = DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.NONE
N, BAGS = 64, 16  # 2 features x 8 samples, 4 ids a bag
GOOD = torch.arange(0, N + 1, N // BAGS)
BAD = {  # offsets -> what the message says
    "decreasing": (torch.cat([GOOD[:5], GOOD[3:4], GOOD[6:]]), "non-decreasing"),
    "past-n": (torch.cat([GOOD[:-1], torch.tensor([N + 9])]), f"len\\(indices\\)={N}, got 0 and {N + 9}"),
    "not-from-0": (torch.cat([torch.tensor([2]), GOOD[1:]]), f"len\\(indices\\)={N}, got 2 and {N}"),
}


def _module(optimizer, pooling, tables=1, **kw):
    specs = [TableSpec(dim=8, max_capacity=1 << 10) for _ in range(tables)]
    return make_tables(specs, feature_table_map=[0, tables - 1], pooling=pooling,
                       optimizer=OPTIMIZER_ARGS[optimizer], **kw)[0]


def _ids(seed):
    return torch.randint(0, 300, (N,), generator=torch.Generator().manual_seed(seed))


def _step(module, ids, offsets):
    out = module(ids, offsets)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach()


def _state(module):
    clocks = [module.table_clocks(name) for name in module.table_names]
    return snapshot(module), clocks, module.train_steps, module.cache_metrics()


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("pooling", [SUM, NONE], ids=["sum", "none"])
@pytest.mark.parametrize("optimizer", [DynamicEmbOptimType.EXACT_SGD, DynamicEmbOptimType.ADAM],
                         ids=["sgd", "adam"])
def test_a_refused_batch_changes_nothing_and_raises_at_the_next_call(optimizer, pooling, bad):
    offsets, message = BAD[bad]
    with emulated_cuda() as kernels:
        module, twin = _module(optimizer, pooling), _module(optimizer, pooling)
        for m in (module, twin):
            _step(m, _ids(0), GOOD)
        with SyncGuard() as guard:  # the bad step waits for nothing either
            kernels.guard = guard
            out = _step(module, _ids(1), offsets)
        kernels.guard = None
        assert not guard.syncs, guard.report()
        assert not out.any(), "a refused batch reads zeros"
        with pytest.raises(ValueError, match=message):
            module(_ids(2), GOOD)
        assert _state(module) == _state(twin)
        assert torch.equal(_step(module, _ids(2), GOOD), _step(twin, _ids(2), GOOD))
        assert _state(module) == _state(twin)


@pytest.mark.parametrize("pooling", [SUM, NONE], ids=["sum", "none"])
def test_sync_checks_raise_in_the_call(pooling):
    with emulated_cuda():
        module = _module(DynamicEmbOptimType.ADAM, pooling, sync_checks=True)
        twin = _module(DynamicEmbOptimType.ADAM, pooling)
        for m in (module, twin):
            _step(m, _ids(0), GOOD)
        with pytest.raises(ValueError, match="non-decreasing.*no table changed"):
            module(_ids(1), BAD["decreasing"][0])
        assert _state(module) == _state(twin)
        assert torch.equal(_step(module, _ids(2), GOOD), _step(twin, _ids(2), GOOD))


def test_a_refused_batch_backward_after_the_error_updates_nothing():
    """The error is raised by the next forward before the refused batch's backward:
    that backward (its word cleared by then) still updates nothing."""
    with emulated_cuda():
        module, twin = (_module(DynamicEmbOptimType.ADAM, SUM) for _ in range(2))
        for m in (module, twin):
            _step(m, _ids(0), GOOD)
        out = module(_ids(1), BAD["past-n"][0])
        with pytest.raises(ValueError, match="len"):
            module(_ids(2), GOOD)
        (out * 3.0).sum().backward()
        assert _state(module) == _state(twin)


def test_tables_of_one_group_find_their_features_in_a_refused_batch():
    """Two tables in one group take their table ids from the offsets: bad offsets still
    give ids in range (nothing read out of bounds), and the batch is refused."""
    with emulated_cuda():
        module, twin = (_module(DynamicEmbOptimType.EXACT_SGD, SUM, tables=2) for _ in range(2))
        assert len(module._groups) == 1 and len(module._groups[0].table_indices) == 2
        for m in (module, twin):
            _step(m, _ids(0), GOOD)
        for name, (offsets, message) in BAD.items():
            assert not _step(module, _ids(1), offsets).any(), name
            with pytest.raises(ValueError, match=message):
                module(_ids(2), GOOD)
        assert _state(module) == _state(twin)


def test_a_refused_prefetch_changes_nothing_and_refuses_no_step_around_it():
    """forward(i), prefetch(i + 1) with bad offsets, backward(i): the prefetch checks
    into its own word, so backward(i) still trains; the prefetch changes nothing
    and the next call raises."""
    with emulated_cuda():
        module, twin = (_module(DynamicEmbOptimType.ADAM, SUM) for _ in range(2))
        for m in (module, twin):
            _step(m, _ids(0), GOOD)
        out = module(_ids(1), GOOD)
        module.prefetch(_ids(2), BAD["decreasing"][0])
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        _step(twin, _ids(1), GOOD)
        assert _state(module) == _state(twin)
        with pytest.raises(ValueError, match="non-decreasing"):
            module(_ids(2), BAD["decreasing"][0])
        assert _state(module) == _state(twin)
        # the refused prefetch left the queue: training goes on with other batches
        assert torch.equal(_step(module, _ids(3), GOOD), _step(twin, _ids(3), GOOD))
        assert _state(module) == _state(twin)
