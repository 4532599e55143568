"""Known answers for the table's hash (ARCHITECTURE.md, "The hash").

The constants were computed once from the formula and written down; the first two are
also splitmix64's first two outputs from seed 0 (key 0 of tables 0 and 1), a check that
does not depend on this repository at all.
"""

import random

import pytest
import torch

from dynamicemb.table import hash_keys
from dynamicemb_testing.reference_table import keys_in_bucket, ref_hash, to_int64, to_uint64
from dynamicemb_testing.table_testing import as_keys, make_table

INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)

KNOWN = [
    # (table_id, key, uint64 hash)
    (0, 0, 0xE220A8397B1DCDAF),
    (1, 0, 0x6E789E6AA1B965F4),
    (0, -1, 0xE4D971771B652C20),
    (0, 1, 0x910A2DEC89025CC1),
    (0, INT64_MAX, 0x2A67D7552E039EA7),
    (1, INT64_MIN, 0xC46FA638A6309012),
    (7, INT64_MAX, 0x8C0F2BC06B2765D6),
    (7, 12345, 0x6E7411B06820371C),
    (32766, INT64_MIN, 0x1455142E17526DB9),
]


@pytest.mark.parametrize("table_id, key, expected", KNOWN)
def test_ref_hash_known_answers(table_id, key, expected):
    assert ref_hash(table_id, key) == expected


def test_hash_keys_known_answers(device):
    keys = as_keys([k for _, k, _ in KNOWN], device)
    tids = torch.tensor([t for t, _, _ in KNOWN], dtype=torch.int64, device=device)
    got = hash_keys(keys, tids)
    assert got.dtype == torch.int64 and got.shape == keys.shape
    # the uint64 hash comes back bit-cast to int64
    assert [to_uint64(h) for h in got.tolist()] == [h for _, _, h in KNOWN]
    assert got.tolist() == [to_int64(h) for _, _, h in KNOWN]


def test_hash_keys_matches_reference_on_many_keys(device):
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(INT64_MIN, INT64_MAX, (4096,), dtype=torch.int64, generator=g)
    tids = torch.randint(0, 32767, (4096,), dtype=torch.int64, generator=g)
    got = hash_keys(keys.to(device), tids.to(device)).tolist()
    assert got == [to_int64(ref_hash(t, k)) for k, t in zip(keys.tolist(), tids.tolist())]


@pytest.mark.parametrize(
    "num_buckets, bc, num_tables", [(1, 16, 1), (8, 16, 3), (64, 32, 2), (16, 128, 8), (16, 64, 32767)]
)
def test_bucket_from_hash_predicts_slot(num_buckets, bc, num_tables, device):
    t = make_table(capacity=num_buckets * bc, bucket_capacity=bc, num_tables=num_tables, max_load_factor=1.0,
                   device=device)
    rng = random.Random(num_buckets)
    n = num_buckets * bc // 4
    keys = as_keys([INT64_MIN, INT64_MAX, -1, 0] + sorted({rng.randrange(-(2**62), 2**62) for _ in range(n - 4)}),
                   device)
    tids = torch.tensor([rng.randrange(num_tables) for _ in range(len(keys))], dtype=torch.int64, device=device)
    h = hash_keys(keys, tids)
    res = t.find_or_insert(keys, tids)
    assert bool(res.inserted.all())
    assert torch.equal(res.slots // bc, h & (num_buckets - 1))
    ex = t.export_batch()  # (table id, key) survive storage, table ids up to 32766 included
    order = torch.argsort(res.slots)
    assert torch.equal(ex.keys, keys[order]) and torch.equal(ex.table_ids, tids[order])


def test_keys_of_one_bucket_take_offsets_in_order(device):
    nb, bc = 4, 16
    t = make_table(capacity=nb * bc, bucket_capacity=bc, max_load_factor=1.0, device=device)
    keys = keys_in_bucket(2, nb, bc, start=-(2**62))
    res = t.find_or_insert(as_keys(keys, device))
    assert res.slots.tolist() == [2 * bc + j for j in range(bc)]
