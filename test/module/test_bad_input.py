"""Bad input to ``BatchedDynamicEmbeddingTables`` that used to slip through: ids and
offsets of every integer dtype, non-contiguous tensors, tensors on another device,
weights of the wrong length or not finite, NaN/inf gradients with each optimizer.
Each gets a clear error (and the tables are unchanged, compared with a twin that never
saw the call) or a documented behaviour, checked against the contiguous int64 input.
"""

import pytest
import torch

from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbInitializerArgs, DynamicEmbOptimType,
                        DynamicEmbPoolingMode,
                        DynamicEmbTableOptions)
from dynamicemb_testing.devices import reads_values_on_host
from dynamicemb_testing.module_reference import snapshot

OPTIMIZERS = [DynamicEmbOptimType.EXACT_SGD, DynamicEmbOptimType.EXACT_ADAGRAD,
              DynamicEmbOptimType.EXACT_ROWWISE_ADAGRAD, DynamicEmbOptimType.ADAM]
INTEGER_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
                  torch.uint32, torch.uint64, torch.bool]
IDS, OFFSETS = [3, 7, 3, 11, 200, 7], [0, 2, 2, 5, 6]  # F=2, B=2; bag 1 empty
WEIGHTS = [0.5, 1.0, 2.0, 1.5, 0.25, 1.0]


def tables(device, optimizer=DynamicEmbOptimType.ADAM,
           gradient_check="rows") -> BatchedDynamicEmbeddingTables:
    init = DynamicEmbInitializerArgs(mode="uniform", lower=-0.5, upper=0.5)
    return BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=4, max_capacity=256, initializer_args=init),
         DynamicEmbTableOptions(dim=4, max_capacity=256, initializer_args=init, bucket_capacity=32)],
        optimizer=optimizer, learning_rate=0.1, device=device, gradient_check=gradient_check)


def twins(device, optimizer=DynamicEmbOptimType.ADAM, gradient_check="rows"):
    """Two modules after the same first step."""
    pair = tables(device, optimizer, gradient_check), tables(device, optimizer, gradient_check)
    for m in pair:
        step(m, torch.tensor(IDS), torch.tensor(OFFSETS), torch.tensor(WEIGHTS))
    return pair


def step(module, indices, offsets, weights=None, poison=None) -> torch.Tensor:
    """Forward and backward with a fixed gradient (one entry ``poison`` if given); the output."""
    out = module(indices, offsets, weights)
    grad = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    if poison is not None:
        grad.view(-1)[1] = poison
    (out * grad).sum().backward()
    return out.detach().cpu()


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=str)
def test_ids_and_offsets_of_every_integer_dtype(dtype, device):
    """int32 and int64 (TorchRec's id dtypes) train as int64 does; every other dtype
    is a TypeError naming it, for ids and for offsets, and no table changes."""
    module, twin = twins(device)
    idx, off = torch.tensor(IDS), torch.tensor(OFFSETS)
    if dtype in (torch.int32, torch.int64):
        assert torch.equal(step(module, idx.to(dtype), off.to(dtype)), step(twin, idx, off))
    else:
        for args, name in (((idx.to(dtype), off), "indices"), ((idx, off.to(dtype)), "offsets")):
            with pytest.raises(TypeError, match=f"{name} must be int32 or int64, got {dtype}"):
                module(*args)
    assert snapshot(module) == snapshot(twin)


def test_non_contiguous_inputs_are_read_as_their_values(device):
    module, twin = twins(device)
    strided = [torch.tensor([[v, -1] for v in values]).t()[0] for values in (IDS, OFFSETS)]
    weights = torch.tensor([[w, 9.0] for w in WEIGHTS]).t()[0]
    assert not any(t.is_contiguous() for t in (*strided, weights))
    got = step(module, *strided, weights)
    assert torch.equal(got, step(twin, torch.tensor(IDS), torch.tensor(OFFSETS), torch.tensor(WEIGHTS)))
    assert snapshot(module) == snapshot(twin)


@pytest.mark.parametrize("where", ["indices", "offsets", "per_sample_weights"])
def test_tensors_without_data_are_refused(where, device):
    """A meta tensor (no data) is a ValueError naming it; a batch on the CPU for rows
    elsewhere is moved there (docs: "each batch is moved there")."""
    module, twin = twins(device)
    args = {"indices": torch.tensor(IDS), "offsets": torch.tensor(OFFSETS),
            "per_sample_weights": torch.tensor(WEIGHTS)}
    args[where] = args[where].to("meta")
    with pytest.raises(ValueError, match=f"{where} are on the meta device"):
        module(**args)
    assert snapshot(module) == snapshot(twin)
    on_cpu = step(module, torch.tensor(IDS), torch.tensor(OFFSETS), torch.tensor(WEIGHTS))
    here = step(twin, *(torch.tensor(v, device=device) for v in (IDS, OFFSETS, WEIGHTS)))
    assert torch.equal(on_cpu, here)


@pytest.mark.parametrize("weights,message", [
    (WEIGHTS[:-1], r"shape \(6,\) like indices, got \(5,\)"),
    (WEIGHTS + [1.0], r"shape \(6,\) like indices, got \(7,\)"),
    (WEIGHTS[:2] + [float("nan")] + WEIGHTS[3:], "must be finite"),
    (WEIGHTS[:4] + [float("inf")] + WEIGHTS[5:], "must be finite"),
], ids=["short", "long", "nan", "inf"])
def test_weights_of_the_wrong_length_or_not_finite(weights, message, device):
    if not reads_values_on_host(device) and message == "must be finite":
        pytest.skip("a GPU step does not read values on the host (docs/ARCHITECTURE.md)")
    module, twin = twins(device)
    with pytest.raises(ValueError, match=message):
        module(torch.tensor(IDS), torch.tensor(OFFSETS), torch.tensor(weights))
    assert snapshot(module) == snapshot(twin)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=str)
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_a_non_finite_gradient_updates_no_row(optimizer, bad, device):
    """gradient_check='batch': the backward refuses the batch before any optimizer
    update, for every optimizer: rows and optimizer states are those of a twin that
    ran the forward only, and training goes on identically afterwards."""
    if not reads_values_on_host(device):
        pytest.skip("a GPU step does not read values on the host (docs/ARCHITECTURE.md)")
    module, twin = twins(device, optimizer, gradient_check="batch")
    idx, off = torch.tensor([3, 7, 99, 11, 200, 5]), torch.tensor(OFFSETS)
    with pytest.raises(ValueError, match="NaN or inf; this batch's update is refused"):
        step(module, idx, off, poison=bad)
    twin(idx, off)  # the same forward (new rows, scores), no backward
    assert snapshot(module) == snapshot(twin)
    assert torch.equal(step(module, idx, off), step(twin, idx, off))
    assert snapshot(module) == snapshot(twin)


def _two_groups(device, pooling, gradient_check="batch"):
    """A module of two groups (dims 4 and 8: one feature each) after the same first step."""
    init = DynamicEmbInitializerArgs(mode="uniform", lower=-0.5, upper=0.5)
    dims = [4, 8] if pooling != DynamicEmbPoolingMode.NONE else [4, 4]
    pair = []
    for _ in range(2):
        m = BatchedDynamicEmbeddingTables(
            [DynamicEmbTableOptions(dim=d, max_capacity=256, initializer_args=init)
             for d in dims], pooling_mode=pooling,
            optimizer=DynamicEmbOptimType.ADAM, learning_rate=0.1, device=device,
            gradient_check=gradient_check)
        step(m, torch.tensor(IDS), torch.tensor(OFFSETS))
        pair.append(m)
    return pair


@pytest.mark.parametrize("pooling", [DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.NONE],
                         ids=lambda p: p.name)
def test_a_non_finite_gradient_of_one_group_updates_no_group(pooling, device):
    """The summed gradients of every group are checked before any group updates: a NaN
    that only the last table's rows read leaves the first table unchanged too."""
    if not reads_values_on_host(device):
        pytest.skip("a GPU step does not read values on the host (docs/ARCHITECTURE.md)")
    module, twin = _two_groups(device, pooling)
    idx, off = torch.tensor([3, 7, 99, 11, 200, 5]), torch.tensor(OFFSETS)
    out = module(idx, off)
    grad = torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)
    grad[-1, -1] = float("nan")  # the last lookup's (sequence) or sample's last column
    with pytest.raises(ValueError, match="NaN or inf; this batch's update is refused"):
        (out * grad).sum().backward()
    twin(idx, off)
    assert snapshot(module) == snapshot(twin)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=str)
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o.name)
def test_a_non_finite_gradient_leaves_the_rows_it_reaches(optimizer, bad, device):
    """gradient_check='rows' (the default): the rows whose summed gradient the poison
    reaches keep their value and state (those of a twin that ran the forward only);
    every other row is updated as by a twin whose gradient has a zero there; then
    ValueError names how many rows were left."""
    if not reads_values_on_host(device):
        pytest.skip("a GPU step does not read values on the host (docs/ARCHITECTURE.md)")
    module, forward_only = twins(device, optimizer)
    clean = tables(device, optimizer)
    step(clean, torch.tensor(IDS), torch.tensor(OFFSETS), torch.tensor(WEIGHTS))
    idx, off = torch.tensor([3, 7, 99, 11, 200, 5]), torch.tensor(OFFSETS)
    # grad entry 1 is sample 0, feature 0, column 1: bag (0, 0) = ids 3 and 7 (table 0)
    with pytest.raises(ValueError, match="of 2 rows are not finite and those rows were not updated"):
        step(module, idx, off, poison=bad)
    forward_only(idx, off)
    step(clean, idx, off, poison=0.0)
    got, left, updated = snapshot(module), snapshot(forward_only), snapshot(clean)
    reached = {3, 7}
    for name in module.table_names:
        assert sorted(got[name]) == sorted(updated[name])
        for key, value in got[name].items():
            want = left if name == "t0" and key in reached else updated
            assert value[:2] == want[name][key][:2], (name, key)
    assert got["t1"][99][:2] != left["t1"][99][:2]  # updated: the poison reached no other row


def test_both_gradient_checks_train_identically(device):
    """With finite gradients the one pass ('rows') and the checked two passes
    ('batch') give the same rows and states bit for bit, for every optimizer."""
    if not reads_values_on_host(device):
        pytest.skip("a GPU step does not read values on the host (docs/ARCHITECTURE.md)")
    for optimizer in OPTIMIZERS:
        rows, batch = tables(device, optimizer, "rows"), tables(device, optimizer, "batch")
        for i in range(3):
            idx = torch.tensor(IDS) * (i + 1)
            outs = [step(m, idx, torch.tensor(OFFSETS), torch.tensor(WEIGHTS)) for m in (rows, batch)]
            assert torch.equal(outs[0], outs[1])
        assert snapshot(rows) == snapshot(batch), optimizer


def test_gradient_check_is_validated():
    with pytest.raises(ValueError, match="gradient_check must be one of"):
        tables("cpu", gradient_check="row")


def test_a_non_finite_gradient_no_lookup_reads_is_not_refused(device):
    """The check is of what the step reads: a NaN in the gradient of an empty bag
    reaches no row, and the step updates as with a zero there."""
    if not reads_values_on_host(device):
        pytest.skip("a GPU step does not read values on the host (docs/ARCHITECTURE.md)")
    module, twin = twins(device)
    idx, off = torch.tensor(IDS), torch.tensor(OFFSETS)  # feature 0 of sample 1 is empty
    outs = [m(idx, off) for m in (module, twin)]
    grad = torch.linspace(-1, 1, outs[0].numel(), device=outs[0].device).reshape(outs[0].shape)
    grad[1, 0] = 0.0
    poisoned = grad.clone()
    poisoned[1, 0] = float("nan")
    outs[0].backward(poisoned)
    outs[1].backward(grad)
    assert snapshot(module) == snapshot(twin)
