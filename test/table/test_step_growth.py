"""Growth and failed inserts on the step's call (``prepare_dedup_find_or_insert``),
where nothing is read on the host: the table grows ahead of a call
by an upper bound of its size; while it may still grow a full bucket fails its key
(counted, no eviction) and the failure makes the next call grow, after which the key
is inserted at its next lookup; WARNING logs failures when the host reads their
count (the CPU in the call, a GPU at a later call); ERROR reads them in the call,
undoes it, and grows and runs it again, or raises. The same on the CPU backend and
on the CUDA backend's code (``cuda-emulated``). docs/ARCHITECTURE.md, "Growth and
failed inserts"."""

import dataclasses
import logging

import pytest
import torch

from dynamicemb import DynamicEmbCheckMode, DynamicEmbScoreStrategy, ScoredHashTable
from dynamicemb.ops.interface import InsertStatus
from dynamicemb.table import hash_keys
from dynamicemb.table.device_counts import CountsCopy
from dynamicemb_testing.devices import EMULATED, backend_device, devices

LOGGER = "dynamicemb.table.scored_hash_table"


@pytest.fixture(params=devices() + [EMULATED])
def device(request):
    with backend_device(request.param) as d:
        yield d


def in_bucket(bucket: int, num_buckets: int, n: int) -> torch.Tensor:
    """The n smallest keys >= 0 of table 0 whose bucket is ``bucket`` of ``num_buckets``."""
    keys = torch.arange(64 * n * num_buckets)
    home = hash_keys(keys, torch.zeros_like(keys)) & (num_buckets - 1)
    return keys[home == bucket][:n]


def step_call(table: ScoredHashTable, keys: torch.Tensor) -> torch.Tensor:
    """One step call of ``keys`` (distinct); returns their statuses (on the CPU)."""
    keys = keys.to(table.device)
    unique, pending = table.prepare_dedup_find_or_insert(keys)
    status = pending.commit().status
    assert torch.equal(unique.keys.cpu(), keys.cpu())  # distinct: unique in input order
    return status.cpu()


def statuses(*pairs) -> torch.Tensor:
    return torch.cat([torch.full((n,), int(s), dtype=torch.int8) for s, n in pairs])


def two_buckets(device, **kw) -> ScoredHashTable:
    """Two buckets of 16 slots that may grow to 16 buckets; load factor 1."""
    return ScoredHashTable(capacity=32, bucket_capacity=16, max_capacity=256,
                           max_load_factor=1.0, device=device, **kw)


@pytest.mark.parametrize("strategy", [DynamicEmbScoreStrategy.LRU,
                                      DynamicEmbScoreStrategy.NO_EVICTION], ids=lambda s: s.name)
def test_a_full_bucket_fails_its_key_and_the_next_call_grows(device, strategy):
    """A bucket of 16 filled by one call; 4 more keys of it (the table's load allows
    them: no growth ahead) fail, none evicts; the next call grows once (for the
    failures alone: its load needs no growth) and inserts them."""
    table = two_buckets(device, score_strategy=strategy)
    keys = in_bucket(0, 2, 20)
    assert torch.equal(step_call(table, keys[:16]), statuses((InsertStatus.INSERTED, 16)))
    assert torch.equal(step_call(table, keys[16:]), statuses((InsertStatus.FAILED, 4)))
    assert (table.size(), table.capacity(), table.stats.growths) == (16, 32, 0)
    assert table.stats.failed_inserts == 4 and table.stats.evictions == 0
    got = step_call(table, keys[16:])  # grows first (the failures it read), then inserts
    assert torch.equal(got, statuses((InsertStatus.INSERTED, 4)))
    assert (table.size(), table.capacity(), table.stats.growths) == (20, 64, 1)
    assert table.stats.failed_inserts == 4
    assert bool((table.find(keys.to(device)) >= 0).all())


def test_keys_pinned_by_their_call_fill_a_bucket(device):
    """20 new keys of one bucket of 16 in one call: 16 land, 4 fail."""
    table = two_buckets(device)
    got = step_call(table, in_bucket(0, 2, 20))
    assert torch.equal(got, statuses((InsertStatus.INSERTED, 16), (InsertStatus.FAILED, 4)))


def test_a_table_at_its_most_evicts_from_a_full_bucket(device):
    """Once it cannot grow, a full bucket evicts (the table's rule), as before."""
    table = ScoredHashTable(capacity=32, bucket_capacity=16, max_load_factor=1.0,
                            device=device)
    got = step_call(table, in_bucket(0, 2, 20))
    assert torch.equal(got, statuses((InsertStatus.INSERTED, 16), (InsertStatus.FAILED, 4)))
    got = step_call(table, in_bucket(0, 2, 24)[20:])  # 4 new keys: the bucket is unpinned now
    assert torch.equal(got, statuses((InsertStatus.EVICTED_AND_INSERTED, 4)))
    assert table.stats.growths == 0


def test_the_table_grows_ahead_of_a_call_by_its_bound(device):
    """Before a call of n keys the table doubles while the bound of its size plus n
    exceeds max_load_factor of its capacity; the bound follows what the host set."""
    table = ScoredHashTable(capacity=32, bucket_capacity=16, max_capacity=1024,
                            max_load_factor=0.5, device=device)
    keys = torch.arange(1000, 1040)
    assert bool((step_call(table, keys) == InsertStatus.INSERTED).all())
    assert (table.capacity(), table.stats.growths) == (128, 2)  # 40 keys <= 0.5 * 128
    assert step_call(table, keys[:8]).tolist() == [InsertStatus.HIT] * 8
    assert table.capacity() == 128  # 40 stored + 8 given <= 64: no growth
    table.clear()  # the host's count (0) bounds the size again
    assert bool((step_call(table, keys + 100) == InsertStatus.INSERTED).all())
    assert table.capacity() == 128
    step_call(table, torch.arange(5000, 5030))  # 40 stored + 30 given > 64
    assert (table.capacity(), table.size()) == (256, 70)


@pytest.mark.parametrize("other", [d for d in devices() if d != "cpu"] + [EMULATED])
def test_backends_agree(other):
    """The CPU backend and the other backends decide the same statuses, growths,
    failures and scores, call by call."""
    want = _run_growth(torch.device("cpu"))
    with backend_device(other) as device:
        got = _run_growth(device)
    assert got == want


def _run_growth(device) -> list:
    table = two_buckets(device, score_strategy=DynamicEmbScoreStrategy.LRU)
    out = []
    gen = torch.Generator().manual_seed(3)
    for step in range(6):  # 18 keys of one bucket, and 30 anywhere: failures, growths
        keys = torch.cat([in_bucket(step % 2, 2, 18), torch.randperm(400, generator=gen)[:30]
                          + 10_000])
        keys = keys[torch.randperm(keys.numel(), generator=gen)]
        out.append((step_call(table, keys).tolist(), table.capacity()))
    entries = table.export_batch()
    out.append(sorted(zip(entries.keys.tolist(), entries.scores.tolist())))
    out.append(dataclasses.astuple(table.stats))
    return out


def test_warning_logs_when_the_count_is_read(device, caplog):
    """WARNING: the failures of a call are logged once the host reads their count:
    in the call where that is free (the CPU), else at the next call."""
    table = ScoredHashTable(capacity=16, bucket_capacity=16, device=device,
                            score_strategy=DynamicEmbScoreStrategy.NO_EVICTION,
                            check_mode=DynamicEmbCheckMode.WARNING)
    message = "4 of 20 keys found no slot"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        step_call(table, torch.arange(20))
        at_once = message in caplog.text
        step_call(table, torch.arange(1))
    assert at_once == table._ops.free_host_reads
    assert caplog.text.count(message) == 1
    assert table.stats.failed_inserts == 4


def test_warning_of_a_growing_table_says_it_grows(device, caplog):
    table = two_buckets(device, check_mode=DynamicEmbCheckMode.WARNING)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        step_call(table, in_bucket(0, 2, 20))
        step_call(table, in_bucket(0, 2, 20))
    assert "4 of 20 keys found no slot" in caplog.text
    assert "the table grows at its next call" in caplog.text


def test_error_grows_and_runs_the_call_again(device):
    """ERROR, a table that may grow: a full bucket undoes the call, the table grows
    and the call runs again: every key inserted in the call itself, nothing failed."""
    table = two_buckets(device, check_mode=DynamicEmbCheckMode.ERROR)
    keys = in_bucket(0, 2, 20)
    assert bool((step_call(table, keys) == InsertStatus.INSERTED).all())
    assert (table.size(), table.capacity(), table.clock) == (20, 64, 1)
    assert table.stats.growths == 1 and table.stats.failed_inserts == 0


def test_a_table_that_needs_every_key_stored_grows_in_the_call(device):
    """``grows_for_failures`` (an external tier's host store): as ERROR, the call is
    undone, the table grows and runs it again; at its most the failures stay (for
    the caller to read) and nothing is raised."""
    table = two_buckets(device)
    table.grows_for_failures = True
    keys = in_bucket(0, 2, 20)
    assert bool((step_call(table, keys) == InsertStatus.INSERTED).all())
    assert (table.size(), table.capacity(), table.clock) == (20, 64, 1)
    assert table.stats.growths == 1 and table.stats.failed_inserts == 0
    full = ScoredHashTable(capacity=16, bucket_capacity=16, device=device,
                           score_strategy=DynamicEmbScoreStrategy.NO_EVICTION)
    full.grows_for_failures = True
    assert int((step_call(full, torch.arange(20)) == InsertStatus.FAILED).sum()) == 4


def test_error_raises_and_changes_nothing_when_the_table_cannot_grow(device):
    table = ScoredHashTable(capacity=16, bucket_capacity=16, device=device,
                            score_strategy=DynamicEmbScoreStrategy.NO_EVICTION,
                            check_mode=DynamicEmbCheckMode.ERROR)
    step_call(table, torch.arange(4))
    before = table.export_batch()
    with pytest.raises(RuntimeError, match="4 of 20 keys found no slot.*undone"):
        step_call(table, torch.arange(20))
    assert (table.size(), table.clock, table.stats.failed_inserts) == (4, 1, 4)
    after = table.export_batch()
    for b, a in zip(before, after):
        assert torch.equal(b, a)
    assert not bool(table.memory.meta[5].any())  # no slot left pinned
    assert step_call(table, torch.arange(2)).tolist() == [InsertStatus.HIT] * 2


def test_while_the_copy_travels_the_bound_adds_every_call(device, monkeypatch):
    """A copy still on the way (a GPU behind the host) is not waited for: the bound
    adds every call's keys, and the table grows ahead on it; once the copy arrives,
    the bound is the size it read plus the keys given since."""
    travelling = [True]
    arrived = CountsCopy.arrived
    monkeypatch.setattr(CountsCopy, "arrived",
                        lambda self: None if travelling[0] else arrived(self))
    table = ScoredHashTable(capacity=64, bucket_capacity=16, max_capacity=4096,
                            max_load_factor=0.5, device=device)
    keys = torch.arange(10)
    for _ in range(3):  # bounds 10, 20, 30 of the size 10: no growth
        step_call(table, keys)
    assert table.capacity() == 64
    step_call(table, keys)  # 30 + 10 > 32: grows on the bound
    assert (table.capacity(), table._watch.bound) == (128, 40)
    travelling[0] = False
    step_call(table, keys)  # the copy of the first call: 10, plus 30 given since
    assert table.capacity() == 128
    step_call(table, keys)  # copies now arrive at once (or at the next call on a GPU)
    assert table._watch.bound in (10, 20) and table.size() == 10
