"""The dedup kernel: unique (table, key) pairs in first-occurrence order, inverse and
occurrence counts, the same for any thread count."""

import pytest
import torch

from dynamicemb._ops import ops_for

OPS = ops_for(torch.device("cpu"))


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
        ukeys, utids, inverse, counts = OPS.dedup(keys, tids, freq)
    finally:
        torch.set_num_threads(before)
    want_keys, want_tids, want_inverse, want_counts = reference(keys, tids, freq)
    assert ukeys.tolist() == want_keys and utids.tolist() == want_tids
    assert inverse.tolist() == want_inverse and counts.tolist() == want_counts
