"""The memory a growth needs beyond the old and the new table: the new slot of every
old slot (8 bytes each) and one chunk of moved rows (``GROW_CHUNK_BYTES``), not a
copy of every occupied row.

Measured as the peak resident memory of a process that grows one table, with the
peak reset just before the growth (Linux ``/proc/self/clear_refs``) and every large
allocation given back to the OS when freed, so that the peak is the growth's own.
"""

import json
import os
import sys

import pytest

from dynamicemb_testing.scripts import run_python

SCRIPT = r"""
import json, sys, torch
import dynamicemb.ops.kernels as kernels
from dynamicemb.table import ScoredHashTable

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

kernels.GROW_CHUNK_BYTES = int(sys.argv[1])
slots, dim = 1 << 17, 64
table = ScoredHashTable(capacity=slots, max_capacity=2 * slots, value_dim=dim,
                        max_load_factor=1.0)
for start in range(0, slots // 2, 4096):  # half full, in small batches
    keys = torch.arange(start, start + 4096)
    table.insert_or_assign(keys, torch.ones(4096, dim))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak restarts from here
before = status("VmRSS")
table._grow()
peak = status("VmHWM")
memory = table.memory_bytes()
print(json.dumps({"grow_peak": peak - before, "new_table": memory["metadata"] + memory["values"],
                  "old_slots": slots, "occupied_bytes": slots // 2 * dim * 4}))
"""


def _clear_refs_works() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _clear_refs_works(),
                    reason="needs Linux's /proc/self/clear_refs to reset the peak")
def test_growth_moves_rows_a_chunk_at_a_time():
    chunk = 1 << 20
    done = run_python(["-c", SCRIPT, chunk], check=True, timeout=300,
                      env={"MALLOC_MMAP_THRESHOLD_": "65536", "DYNAMICEMB_HUGE_PAGES": "0",
                           "OMP_NUM_THREADS": "1"})
    got = json.loads(done.stdout.strip().splitlines()[-1])
    temporary = got["grow_peak"] - got["new_table"]
    bound = 8 * got["old_slots"] + 3 * chunk + (4 << 20)  # moved, a chunk, slack
    assert temporary <= bound, got
    # a copy of every occupied row (what growth gathered before) would not fit
    assert got["occupied_bytes"] > bound
