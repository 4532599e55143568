"""Tables' arrays are zeroed and, on Linux, advised onto transparent huge pages."""

# CPU only: huge pages back host allocations (madvise on CPU tensors).

import os
import subprocess
import sys

import pytest
import torch

from dynamicemb.table import ScoredHashTable
from dynamicemb.ops import huge_pages
from dynamicemb_testing.scripts import ROOT, script_env


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
    # Turned off, torch allocates: no mapping of our own, nothing advised. (The flags of
    # the mapping torch's block lies in cannot show it: in a long test process that block
    # was once found in a mapping flagged hg.)
    mapped = []
    real = huge_pages.mmap.mmap
    monkeypatch.setattr(huge_pages.mmap, "mmap", lambda *a, **k: mapped.append(a) or real(*a, **k))
    monkeypatch.setenv("DYNAMICEMB_HUGE_PAGES", "0")
    off = huge_pages.zeros((1 << 22,), torch.int64)
    assert mapped == [] and torch.equal(off, torch.zeros(1 << 22, dtype=torch.int64))
    monkeypatch.setenv("DYNAMICEMB_HUGE_PAGES", "1")
    huge_pages.zeros((1 << 22,), torch.int64)
    assert len(mapped) == 1  # the spy sees the mapping when huge pages are on


_AFTER_A_FREED_HEAP_BLOCK = r"""
import ctypes, re, torch
libc = ctypes.CDLL("libc.so.6")
assert libc.mallopt(-4, 0) and libc.mallopt(-1, 1 << 30)  # heap only, kept: the benchmarks'
scratch = torch.ones(1 << 24)  # 64 MiB of heap, faulted in 4 KiB pages, then freed
del scratch
from dynamicemb.ops import huge_pages
from dynamicemb_testing.scripts import ROOT, script_env
t = huge_pages.zeros((1 << 22,), torch.int64)  # 32 MiB: the freed block would serve it
lo, hi, huge, inside = t.data_ptr(), t.data_ptr() + t.nbytes, 0, False
for line in open("/proc/self/smaps"):
    m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
    if m:
        inside = int(m.group(1), 16) < hi and int(m.group(2), 16) > lo
    elif inside and line.startswith("AnonHugePages:"):
        huge += int(line.split()[1])
print(huge)
"""


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") or
                    "[never]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read(),
                    reason="needs transparent huge pages on (always or madvise)")
def test_huge_pages_whatever_the_heap_held_before():
    """Advice on heap memory an earlier allocation had faulted in changes nothing: a
    table's arrays are fresh mappings, advised before their first touch, so they are
    on huge pages whatever the process allocated and freed before (a benchmark's second
    table had its keys and scores on 4 KiB pages)."""
    done = subprocess.run([sys.executable, "-c", _AFTER_A_FREED_HEAP_BLOCK], cwd=ROOT,
                          env=script_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) >= 16 * 1024  # kB: at least half of the 32 MiB


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
