"""The dedup kernel: unique (table, key) pairs in first-occurrence order, inverse,
occurrence counts and the lookups grouped by pair, the same for any thread count."""

# CPU only: tests the CPU dedup kernel's internals.

import pytest
import torch

from dynamicemb.ops import for_device

OPS = for_device(torch.device("cpu")).kernels  # the compiled functions themselves


def reference(keys, tids, freq):
    first, inverse, counts = {}, [], []
    for i, pair in enumerate(zip(keys.tolist(), tids.tolist())):
        if pair not in first:
            first[pair] = len(first)
            counts.append(0)
        inverse.append(first[pair])
        counts[first[pair]] += 1 if freq is None else int(freq[i])
    pairs = list(first)
    return ([p[0] for p in pairs], [p[1] for p in pairs], inverse, counts)


def grouped(inverse, num_unique):
    """(starts, rank): lookups in a stable sort by unique pair."""
    order = sorted(range(len(inverse)), key=lambda j: (inverse[j], j))
    rank = [0] * len(inverse)
    for r, j in enumerate(order):
        rank[j] = r
    starts = [0] * (num_unique + 1)
    for u in inverse:
        starts[u + 1] += 1
    for v in range(num_unique):
        starts[v + 1] += starts[v]
    return starts, rank


@pytest.mark.parametrize("n", [0, 5, 70_000])
@pytest.mark.parametrize("threads", [1, 2])
def test_dedup_matches_first_occurrence_order(n, threads):
    gen = torch.Generator().manual_seed(n)
    keys = torch.randint(-50, 5000, (n,), generator=gen) * (2**50 + 3)
    tids = torch.randint(0, 3, (n,), generator=gen).to(torch.int16)
    freq = torch.randint(1, 4, (n,), generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ukeys, utids, inverse, counts, starts, rank = OPS.dedup(keys, tids, None,
                                                                frequencies=freq, group=True)
        plain = OPS.dedup(keys, tids, None, frequencies=freq)
        u = len(set(zip(tids.tolist(), keys.tolist())))  # past the unique pairs: padding
        assert (counts[u:] == 0).all() and (ukeys[u:] == 0).all() and starts[u:].eq(n).all()
        ukeys, utids, counts, starts = ukeys[:u], utids[:u], counts[:u], starts[:u + 1]
    finally:
        torch.set_num_threads(before)
    want_keys, want_tids, want_inverse, want_counts = reference(keys, tids, freq)
    assert ukeys.tolist() == want_keys and utids.tolist() == want_tids
    assert inverse.tolist() == want_inverse and counts.tolist() == want_counts
    assert (starts.tolist(), rank.tolist()) == grouped(want_inverse, len(want_keys))
    for got, want in zip((plain[0][:u], plain[1][:u], plain[2], plain[3][:u]),
                         (ukeys, utids, inverse, counts)):
        assert torch.equal(got, want)
    assert plain[4].numel() == 0 and plain[5].numel() == 0  # grouping only when asked


def test_backward_refuses_a_grouping_that_does_not_fit():
    """A rank at or past starts[-1] is an error before any row moves."""
    values = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    before = values.clone()
    tiers = [values, torch.empty(0, 2)]
    no_offsets = torch.empty(0, dtype=torch.int64)
    grad = torch.ones(2, 2)
    sums = torch.empty(2, 2)
    for rank in ([0, 2], [1, 7]):
        with pytest.raises(RuntimeError, match="rank must be below"):
            OPS.sum_gradients(torch.tensor([0, 1, 2]), torch.tensor(rank), no_offsets, None,
                              no_offsets, 0, False, grad, sums)
    assert torch.equal(values, before)
    assert OPS.sum_gradients(torch.tensor([0, 1, 2]), torch.tensor([1, 0]), no_offsets, None,
                             no_offsets, 0, False, grad, sums) == 0
    OPS.update_rows(tiers, torch.tensor([0, 1]), sums, 0, 0.1, 1e-8, 0.9, 0.999, 0.0, 0.1,
                    1.0, 1.0)
    assert torch.allclose(values[:2], before[:2] - 0.1) and torch.equal(values[2:], before[2:])
