"""A growth that fails in an inserting call (out of memory: the call found full
buckets, was undone, and grows to run again) leaves the table as it was before the
call: contents, scores, pins, size, clock.

Runs on the CPU backend and on the CUDA backend's code with its kernels emulated
on the CPU (``dynamicemb_testing.cuda_emulation``), by the CPU verbs and by the
kernels' own source (``simt``), since both share the passes.
"""

import contextlib

import pytest
import torch

from dynamicemb.ops.kernels import KernelBackend
from dynamicemb.table import ScoredHashTable
from dynamicemb_testing.cuda_emulation import emulated_cuda
from dynamicemb_testing.simt import SimtCudaKernels

PATHS = {"cpu": contextlib.nullcontext, "cuda-path": emulated_cuda,
         "cuda-simt": lambda: emulated_cuda(SimtCudaKernels())}


def snapshot(table: ScoredHashTable) -> dict:
    """Everything a later call can observe, and the pins."""
    entries = table.export_batch()
    order = torch.argsort(entries.slots)
    memory = table._memory
    return {
        "entries": [t[order].tolist() for t in (entries.keys, entries.table_ids, entries.scores,
                                                entries.slots, entries.values)],
        "digests": memory.meta[3].tolist(),
        "occupied": memory.meta[4].tolist(),
        "pinned": memory.meta[5].tolist(),
        "size": table.size(),
        "clock": table.clock,
    }


def fail_growth(*args, **kwargs):
    raise MemoryError("growth out of memory (injected)")


def one_bucket_table(**kw) -> ScoredHashTable:
    # One bucket of 16 slots that may grow: a call with more than 16 new keys is
    # undone, grows and runs again. Load factor 1: no growth before the call.
    return ScoredHashTable(capacity=16, max_capacity=256, bucket_capacity=16,
                           max_load_factor=1.0, value_dim=3, **kw)


CALLS = {
    "find_or_insert": lambda t, k: t.find_or_insert(k),
    "insert_or_assign": lambda t, k: t.insert_or_assign(k, torch.ones(k.numel(), 3)),
    "dedup_find_or_insert": lambda t, k: step_call(t, torch.cat([k, k])),
}


def step_call(table: ScoredHashTable, keys: torch.Tensor):
    """The step's call, growing in the call (as a table that needs every key stored)."""
    table.grows_for_failures = True
    return table.prepare_dedup_find_or_insert(keys)


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("path", PATHS)
def test_failed_growth_in_a_call_changes_nothing(path, call, monkeypatch):
    with PATHS[path]():
        table = one_bucket_table()
        present = torch.arange(100, 110)
        table.insert_or_assign(present, torch.randn(10, 3))
        before = snapshot(table)
        batch = torch.cat([present[:4], torch.arange(1000, 1020)])  # 4 hits, 20 new keys
        monkeypatch.setattr(KernelBackend, "grow", fail_growth)
        with pytest.raises(MemoryError, match="injected"):
            CALLS[call](table, batch)
        assert snapshot(table) == before
        assert table.stats.growths == 0
        monkeypatch.undo()
        # No pin is left behind: the same call now grows and lands every key.
        result = CALLS[call](table, batch)
        if call == "dedup_find_or_insert":
            result = result[1].commit()
            result = result._replace(slots=result.slots[:24])  # past the 24 unique keys: padding
        assert bool((result.slots >= 0).all())
        assert table.size() == 30 and table.stats.growths >= 1
        assert not bool(table._memory.meta[5].any()), "pins left after the call"
        assert bool((table.find(present) >= 0).all())


@pytest.mark.parametrize("path", PATHS)
def test_failed_second_growth_leaves_the_call_undone(path, monkeypatch):
    """Two growths needed; the second fails: the call is undone (after each attempt
    that found full buckets); the table stays grown once."""
    with PATHS[path]():
        table = one_bucket_table()
        present = torch.arange(100, 110)
        table.insert_or_assign(present, torch.randn(10, 3))
        before = snapshot(table)
        before_entries = {k: (s, v) for k, s, v in zip(before["entries"][0], before["entries"][2],
                                                       before["entries"][4])}
        calls = []
        real_grow = KernelBackend.grow

        def grow_once(self, **kw):
            calls.append(1)
            if len(calls) > 1:
                fail_growth()
            real_grow(self, **kw)

        monkeypatch.setattr(KernelBackend, "grow", grow_once)
        batch = torch.cat([present[:4], torch.arange(10_000, 10_060)])
        with pytest.raises(MemoryError):
            table.find_or_insert(batch)
        after = snapshot(table)
        assert len(calls) == 2 and table.capacity() == 32 and table.stats.growths == 1
        got = {k: (s, v) for k, s, v in zip(after["entries"][0], after["entries"][2],
                                            after["entries"][4])}
        assert got == before_entries
        assert after["size"] == before["size"] and after["clock"] == before["clock"]
        assert not any(any(w) for w in after["pinned"])
