"""What the TorchRec integration relies on: per-table placeholders in the optimizer's
param groups, initial rows keyed by table name, and ``frequencies`` for ids that were
deduplicated upstream."""

import pytest
import torch

from dynamicemb import (
    BatchedDynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbOptimType,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    FrequencyAdmissionStrategy,
)
from dynamicemb_testing.devices import reads_values_on_host

NORMAL = DynamicEmbInitializerArgs(mode="normal", std_dev=0.1, seed=3)


def options(dim=4, **kw):
    kw.setdefault("initializer_args", NORMAL)
    return DynamicEmbTableOptions(dim=dim, max_capacity=256, **kw)


def test_one_placeholder_per_table_in_the_optimizer_groups(device):
    m = BatchedDynamicEmbeddingTables(
        [options(4), options(8), options(4)], table_names=["a", "b", "c"], device=device)
    by_table = dict(m.named_parameters_by_table())
    assert list(by_table) == ["a", "b", "c"]
    assert all(p.numel() == 0 and p.requires_grad for p in by_table.values())
    in_groups = {id(p): g["tables"] for g in m.optimizer.param_groups for p in g["params"]}
    for name, p in by_table.items():
        assert name in in_groups[id(p)]
    assert sorted(n for g in m.optimizer.param_groups for n in g["tables"]) == ["a", "b", "c"]


def test_initial_rows_depend_on_table_name_not_position(device):
    keys = torch.tensor([5, -9, 10**15])
    first = BatchedDynamicEmbeddingTables([options(), options()], table_names=["user", "item"],
                                          device=device)
    second = BatchedDynamicEmbeddingTables([options()], table_names=["item"], device=device)
    other = BatchedDynamicEmbeddingTables([options()], table_names=["user2"], device=device)
    offsets2 = torch.tensor([0, 0, 0, 0, 1, 2, 3])  # feature 0 (user) empty, B=3
    first(keys, offsets2)
    second(keys, torch.tensor([0, 1, 2, 3]))
    other(keys, torch.tensor([0, 1, 2, 3]))
    a = first.export_keys_values("item")
    b = second.export_keys_values("item")
    c = other.export_keys_values("user2")
    assert torch.equal(a.keys, b.keys) and torch.equal(a.embeddings, b.embeddings)
    assert not torch.equal(b.embeddings, c.embeddings)


def test_frequencies_count_as_occurrences_for_lfu(device):
    m = BatchedDynamicEmbeddingTables([options(score_strategy=DynamicEmbScoreStrategy.LFU)],
                                      device=device)
    m(torch.tensor([1, 2]), torch.tensor([0, 1, 2]), frequencies=torch.tensor([3, 1]))
    m(torch.tensor([1, 1]), torch.tensor([0, 2]))
    out = m.export_keys_values("t0")
    assert dict(zip(out.keys.tolist(), out.scores.tolist())) == {1: 5, 2: 1}


def test_frequencies_reach_the_admission_threshold(device):
    m = BatchedDynamicEmbeddingTables(
        [options(admit_strategy=FrequencyAdmissionStrategy(threshold=4))], device=device)
    m(torch.tensor([7, 8]), torch.tensor([0, 2]), frequencies=torch.tensor([3, 1]))
    assert m.table_size("t0") == 0
    m(torch.tensor([7]), torch.tensor([0, 1]))
    assert m.export_keys_values("t0").keys.tolist() == [7]


def test_frequencies_do_not_change_the_math(device):
    """Frequencies are bookkeeping: outputs and updates follow the lookups only."""
    def run(freq):
        m = BatchedDynamicEmbeddingTables([options()], optimizer=DynamicEmbOptimType.EXACT_SGD,
                                          learning_rate=0.5, device=device)
        out = m(torch.tensor([1, 2, 1]), torch.tensor([0, 2, 3]), frequencies=freq)
        out.sum().backward()
        return out.detach(), m.export_keys_values("t0").embeddings

    base = run(None)
    weighted = run(torch.tensor([5, 2, 9]))
    assert torch.equal(base[0], weighted[0]) and torch.equal(base[1], weighted[1])


@pytest.mark.parametrize("bad, error", [
    (torch.tensor([1.0, 2.0]), TypeError),
    (torch.tensor([1]), ValueError),
    (torch.tensor([1, 0]), ValueError),
])
def test_bad_frequencies_are_refused_and_change_nothing(bad, error, device):
    if error is ValueError and bad.numel() == 2 and not reads_values_on_host(device):
        pytest.skip("a GPU step does not read values on the host (docs/ARCHITECTURE.md)")
    m = BatchedDynamicEmbeddingTables([options()], device=device)
    with pytest.raises(error, match="frequencies"):
        m(torch.tensor([1, 2]), torch.tensor([0, 1, 2]), frequencies=bad)
    assert m.table_size("t0") == 0


def test_recycled_outputs_never_overwrite_one_still_held(device):
    """Output buffers are reused only when nothing holds them: a kept output, a view of
    it, or a tensor autograd saved stays intact through later forwards."""
    m = BatchedDynamicEmbeddingTables([options(8)], device=device)
    m.import_keys_values("t0", torch.arange(1, 9), torch.randn(8, 8))
    m.eval()
    with torch.no_grad():
        first = m(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
        kept = first.clone()
        view = first[:, :4]
        del first
        second = m(torch.tensor([3, 4]), torch.tensor([0, 1, 2]))
        assert torch.equal(view, kept[:, :4])
        del view
        third = m(torch.tensor([5, 6]), torch.tensor([0, 1, 2]))
        assert not torch.equal(second, third)  # distinct ids: distinct rows
    m.train()
    out = m(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))
    saved = (out * out).sum()  # autograd saves `out` for the product's backward
    expected = 2 * out.detach().clone()
    m(torch.tensor([7, 8]), torch.tensor([0, 1, 2]))
    grad, = torch.autograd.grad(saved, out)
    assert torch.equal(grad, expected)
