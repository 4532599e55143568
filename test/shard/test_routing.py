"""owner_rank: splitmix64's finalizer of the raw key, as unsigned, mod the shards."""

import pytest
import torch

from dynamicemb.shard import owner_rank, routing_hash

M64 = (1 << 64) - 1


def splitmix64_finalizer(key: int) -> int:
    z = key & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


KEYS = [0, 1, 5, -1, -7, 2**62 + 1, 2**63 - 1, -(2**63), 10**15, 123456789]


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_owner_rank_matches_the_reference(world_size):
    keys = torch.tensor(KEYS, dtype=torch.int64)
    expected = [splitmix64_finalizer(k) % world_size for k in KEYS]
    assert owner_rank(keys, world_size).tolist() == expected
    assert [h & M64 for h in routing_hash(keys).tolist()] == [splitmix64_finalizer(k) for k in KEYS]


def test_consecutive_keys_spread_evenly():
    ranks = owner_rank(torch.arange(1 << 16), 4)
    counts = torch.bincount(ranks, minlength=4).float()
    assert (counts / counts.mean() - 1).abs().max() < 0.05


def test_world_size_must_be_positive():
    with pytest.raises(ValueError):
        owner_rank(torch.tensor([1]), 0)
