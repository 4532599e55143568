"""The ``dist_type`` placement functions against plain-Python references, and the
option that selects them."""

import pytest
import torch

from dynamicemb import DynamicEmbDistType, DynamicEmbTableOptions
from dynamicemb.placement import fmix64, owner_rank, placement_word, splitmix64

from dynamicemb_testing.placement_reference import M64, WORDS as REFERENCES, fmix64 as fmix64_reference
from dynamicemb_testing.placement_reference import splitmix64 as splitmix64_reference

KEYS = [0, 1, 2, 3, 5, 6, 7, -1, -2, -7, 2**62 + 1, 2**63 - 1, -(2**63), 10**15, 123456789]


def test_fmix64_known_answers():
    """Literal fmix64 values (0 is its fixed point), then the plain-Python
    reference on every key."""
    assert fmix64_reference(0) == 0
    assert fmix64_reference(1) == 0xB456BCFC34C2CB2C
    assert fmix64_reference(M64) == 0x64B5720B4B825F21
    words = fmix64(torch.tensor(KEYS, dtype=torch.int64)).tolist()
    assert [w & M64 for w in words] == [fmix64_reference(k) for k in KEYS]


def test_splitmix64_matches_the_reference():
    words = splitmix64(torch.tensor(KEYS, dtype=torch.int64)).tolist()
    assert [w & M64 for w in words] == [splitmix64_reference(k) for k in KEYS]


@pytest.mark.parametrize("dist_type", list(REFERENCES))
@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 8])
def test_owner_rank_matches_the_reference(dist_type, world_size):
    keys = torch.tensor(KEYS, dtype=torch.int64)
    expected = [REFERENCES[dist_type](k) % world_size for k in KEYS]
    assert owner_rank(keys, world_size, dist_type).tolist() == expected
    assert owner_rank(keys, world_size, DynamicEmbDistType(dist_type)).tolist() == expected


def test_roundrobin_is_key_mod_world_size():
    keys = torch.arange(-20, 20)
    assert owner_rank(keys[20:], 3, "roundrobin").tolist() == [k % 3 for k in range(20)]
    # negative keys: as upstream's uint64 cast, key + 2**64 (not Python's key % W)
    assert owner_rank(torch.tensor([-1]), 3, "roundrobin").tolist() == [(2**64 - 1) % 3] == [0]
    assert placement_word(keys.to(torch.int32), "roundrobin").dtype == torch.int64


def test_default_is_the_hash():
    keys = torch.tensor(KEYS, dtype=torch.int64)
    assert torch.equal(owner_rank(keys, 5), owner_rank(keys, 5, "hash"))
    assert DynamicEmbTableOptions().dist_type == DynamicEmbDistType.HASH


@pytest.mark.parametrize("dist_type", list(REFERENCES))
def test_consecutive_keys_spread_evenly(dist_type):
    ranks = owner_rank(torch.arange(1 << 16), 4, dist_type)
    counts = torch.bincount(ranks, minlength=4).float()
    assert (counts / counts.mean() - 1).abs().max() < 0.05


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(ValueError, match="world_size"):
        owner_rank(torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="DynamicEmbDistType"):
        owner_rank(torch.tensor([1]), 2, "modulo")


def test_the_option_takes_values_and_members_and_refuses_others():
    for value in ("hash", "roundrobin", "hash_roundrobin"):
        assert DynamicEmbTableOptions(dist_type=value).dist_type == DynamicEmbDistType(value)
    with pytest.raises(ValueError, match="dist_type must be one of"):
        DynamicEmbTableOptions(dist_type="random")
    with pytest.raises(ValueError, match="dist_type='continuous'"):
        DynamicEmbTableOptions(dist_type="continuous")
