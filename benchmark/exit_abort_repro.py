"""Minimal reproduction of PyTorch's abort at exit with Gloo (no dynamicemb needed).

Each rank runs a few collectives, an all-to-all last, and leaves without
``destroy_process_group()``. In 8 of 55 launches here, a rank aborted after its work
is done with "terminate called without an active exception" (SIGABRT): a Gloo worker
thread releases the finished ``AsyncAlltoallWork`` (and with it a tensor whose Python
object needs the GIL) while the main thread is in ``Py_FinalizeEx``
(docs/ARCHITECTURE.md, "A clean exit"). ``--import-dynamicemb`` imports the package
first, whose exit hook (``dynamicemb/clean_exit.py``) releases the group in time.

    for i in $(seq 30); do OMP_NUM_THREADS=1 python -m torch.distributed.run --standalone \\
        --nproc_per_node 2 benchmark/exit_abort_repro.py || echo "launch $i failed"; done
"""

import sys

import torch
import torch.distributed as dist

if "--import-dynamicemb" in sys.argv[1:]:
    import dynamicemb  # noqa: F401

dist.init_process_group("gloo")
x = torch.ones(4)
for _ in range(5):
    dist.all_reduce(x)
dist.all_to_all_single(torch.zeros(8), torch.arange(8.0))
