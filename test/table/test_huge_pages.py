"""Tables' arrays are zeroed and, on Linux, advised onto transparent huge pages."""

# CPU only: huge pages back host allocations (madvise on CPU tensors).

import os
import sys

import pytest
import torch

from dynamicemb.table import ScoredHashTable
from dynamicemb.ops import huge_pages


# madvise(MADV_HUGEPAGE) exists where the kernel has transparent huge pages.
needs_thp = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and os.path.isdir("/sys/kernel/mm/transparent_hugepage")),
    reason="needs Linux with transparent huge pages")


def vm_flags_at(address: int) -> str:
    """VmFlags of the mapping of this process that contains ``address``."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                lo, hi = (int(x, 16) for x in first.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line
    raise AssertionError(f"no mapping contains {address:#x}")


@pytest.mark.parametrize("shape,dtype", [(5, torch.int64), ((3, 7), torch.float32),
                                         ((1 << 20, 16), torch.float32), (1 << 23, torch.int16)])
def test_zeros_are_zeros(shape, dtype):
    t = huge_pages.zeros(shape, dtype)
    expected = torch.zeros(shape, dtype=dtype)
    assert t.dtype == dtype and t.shape == expected.shape and t.is_contiguous()
    assert torch.equal(t, expected)


@needs_thp
def test_large_arrays_are_advised_unless_turned_off(monkeypatch):
    big = huge_pages.zeros((1 << 22,), torch.int64)  # 32 MiB
    aligned = (big.data_ptr() + (2 << 20) - 1) // (2 << 20) * (2 << 20)
    assert " hg" in vm_flags_at(aligned)
    # Turned off, nothing is advised. (The mapping's flags cannot show it: glibc may
    # serve the block from a heap region that an earlier allocation had advised.)
    calls = []
    monkeypatch.setattr(huge_pages, "_madvise", lambda *args: calls.append(args) or 0)
    monkeypatch.setenv("DYNAMICEMB_HUGE_PAGES", "0")
    off = huge_pages.zeros((1 << 22,), torch.int64)
    assert calls == [] and torch.equal(off, torch.zeros(1 << 22, dtype=torch.int64))
    monkeypatch.setenv("DYNAMICEMB_HUGE_PAGES", "1")
    huge_pages.zeros((1 << 22,), torch.int64)
    assert len(calls) == 1  # the spy sees the call when advice is on


@needs_thp
def test_table_values_and_keys_are_advised_and_survive_growth():
    table = ScoredHashTable(capacity=1 << 16, max_capacity=1 << 18, value_dim=64)
    keys = torch.arange(1 << 17, dtype=torch.int64)
    table.insert_or_assign(keys, torch.ones(keys.numel(), 64))  # grows past capacity
    assert table.capacity() >= 1 << 17
    for t in (table.values, table._memory.meta[0]):
        aligned = (t.data_ptr() + (2 << 20) - 1) // (2 << 20) * (2 << 20)
        assert " hg" in vm_flags_at(aligned)
    assert torch.equal(table.values[table.find(keys)], torch.ones(keys.numel(), 64))
