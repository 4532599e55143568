"""Self-tests of the reference model: each checks one clause of the contract by hand.

These need neither torch nor the compiled table, so the model can be trusted before it is
used as the oracle in the comparison tests.
"""

# No device: tests the pure-Python reference model itself.

import pytest

from dynamicemb_testing.reference_table import (
    ReferenceHashTable,
    keys_in_bucket,
    ref_hash,
    rounded_num_buckets,
)


def make_ref(**kw) -> ReferenceHashTable:
    kw.setdefault("bucket_capacity", 16)
    kw.setdefault("capacity", 16)
    kw.setdefault("max_load_factor", 1.0)
    return ReferenceHashTable(**kw)


@pytest.mark.parametrize(
    "capacity, bc, nb",
    [(1, 16, 1), (16, 16, 1), (17, 16, 2), (100, 32, 4), (128, 32, 4), (129, 32, 8), (1024, 128, 8)],
)
def test_capacity_rounds_up_to_power_of_two_buckets(capacity, bc, nb):
    assert rounded_num_buckets(capacity, bc) == nb
    t = make_ref(capacity=capacity, bucket_capacity=bc)
    assert t.capacity() == nb * bc == t.max_capacity()


def test_lowest_empty_slot_and_reuse_after_erase():
    t = make_ref()
    keys = list(range(10))
    assert t.find_or_insert(keys).slots == list(range(10))
    assert t.erase([3, 7]) == [True, True]
    assert t.find_or_insert([100, 101, 102]).slots == [3, 7, 10]


def test_hit_and_duplicates_in_batch():
    t = make_ref(score_strategy="LFU")
    r = t.find_or_insert([5, 5, 6, 5])
    assert r.slots == [0, 0, 1, 0] and r.inserted == [True, False, True, False]
    assert t.export_batch().scores == [3, 1]
    assert t.stats.inserts == 2


def test_lfu_counts():
    t = make_ref(score_strategy="LFU")
    t.find_or_insert([5, 6, 5], scores=[2, 4, 3])
    t.find_or_insert([6])
    assert t.export_batch().scores == [5, 5]
    with pytest.raises(ValueError):
        t.find_or_insert([7], scores=[0])


def test_eviction_min_score_ties_lowest_slot_and_pinning():
    t = make_ref(score_strategy="CUSTOMIZED")
    t.find_or_insert(list(range(16)), scores=[5] * 16)
    t.find_or_insert([3], scores=[1])  # slot 3 now has the minimum
    r = t.insert_and_evict([100], [()], scores=[9])
    assert r.slots == [3] and r.evicted.keys == [3] and r.evicted.scores == [1]
    # ties to the lowest slot; the slot taken by 200 is pinned, so 201 takes the next one
    r = t.insert_and_evict([200, 201], [(), ()], scores=[0, 0])
    assert r.slots == [0, 1] and r.evicted.keys == [0, 1]
    assert r.evicted.slots == [0, 1]


def test_all_pinned_fails_and_error_mode_undoes():
    t = make_ref(score_strategy="LRU", check_mode="ERROR")
    keys = list(range(17))
    before = t.export_batch()
    with pytest.raises(RuntimeError):
        t.find_or_insert(keys)
    assert t.export_batch() == before and t.clock == 0
    assert t.stats.failed_inserts == 1 and t.stats.inserts == 0


def test_no_eviction_fails_when_full():
    t = make_ref(score_strategy="NO_EVICTION")
    t.find_or_insert(list(range(16)))
    r = t.find_or_insert([99, 0])
    assert r.slots == [-1, 0] and t.stats.failed_inserts == 1


def test_a_full_bucket_grows_and_keys_keep_offsets():
    t = make_ref(max_capacity=64)
    keys0 = keys_in_bucket(0, 1, 16)
    t.find_or_insert(keys0)
    before = t.export_batch()
    extra = [1000]
    r = t.find_or_insert(extra + keys0[:2])
    assert t.capacity() == 32 and t.stats.growths == 1
    after = {(k, s % 16) for k, s in zip(t.export_batch().keys, t.export_batch().slots)}
    assert {(k, s % 16) for k, s in zip(before.keys, before.slots)} <= after
    for k, s in zip(t.export_batch().keys, t.export_batch().slots):
        assert s // 16 == ref_hash(0, k) & 1
    assert r.inserted == [True, False, False]


def test_a_hit_after_a_full_bucket_gets_its_slot_after_growth():
    # the call that found the bucket full runs again after growth: the hit's slot is the grown table's
    t = make_ref(max_capacity=32, score_strategy="LFU")
    full = keys_in_bucket(0, 1, 16)
    t.find_or_insert(full)
    r = t.find_or_insert([123456, full[0]])
    assert t.capacity() == 32
    assert r.slots[1] == (ref_hash(0, full[0]) & 1) * 16 + 0


def test_load_factor_growth_before_clock():
    t = make_ref(capacity=32, max_capacity=128, max_load_factor=0.5)
    t.find_or_insert(list(range(17)))
    assert t.capacity() == 32
    t.find_or_insert([])
    assert t.capacity() == 64 and t.clock == 2


def test_values_last_row_wins_and_find_or_insert_zeroes():
    t = make_ref(value_dim=2)
    r = t.insert_or_assign([1, 2, 1], [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0)])
    assert r.evicted is None
    assert t.value_of(r.slots[0]) == (3.0, 3.0)
    t.erase([2])
    r = t.find_or_insert([2, 1])
    assert t.value_of(r.slots[0]) == (0.0, 0.0) and t.value_of(r.slots[1]) == (3.0, 3.0)


def test_error_undo_keeps_growth_and_restores_evicted():
    t = make_ref(max_capacity=32, check_mode="ERROR", value_dim=1, score_strategy="STEP")
    b0 = keys_in_bucket(0, 2, 40)
    t.insert_or_assign(b0[:16], [(float(i),) for i in range(16)])
    assert t.capacity() == 16
    before = {(k, s % 16, v) for k, s, v in zip(*[getattr(t.export_batch(), f) for f in ("keys", "slots", "values")])}
    with pytest.raises(RuntimeError):
        t.insert_and_evict(b0[16:40], [(9.0,)] * 24)  # bucket 0 of 2 overflows at max capacity
    ex = t.export_batch()
    assert {(k, s % 16, v) for k, s, v in zip(ex.keys, ex.slots, ex.values)} == before
    assert t.capacity() == 32 and t.stats.growths == 1  # the growth stays
    assert t.stats.evictions == 0 and t.stats.failed_inserts == 8 and t.stats.inserts == 16
    assert t.clock == 1
