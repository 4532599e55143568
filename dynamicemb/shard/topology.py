"""Which ranks of a job share this machine's cores, and the threads each may use.

TorchRec's view of the job is nodes of ``LOCAL_WORLD_SIZE`` ranks
(``torchrec.distributed.comm.get_local_size``); the planner, the sharding plans and
DMP read it from there. The machine's view can differ: several ``torchrun`` agents
on one host (``--nnodes 2`` tried on one machine) are two nodes to TorchRec, while
the ranks of both share one set of cores. Thread counts follow the cores; sharding
follows the nodes.
"""

import os
import socket
from typing import List, Optional, Tuple

import torch.distributed as dist

__all__ = ["host_ranks", "threads_per_rank"]


def _host_key() -> Tuple[str, Tuple[int, ...]]:
    """This process's machine (the kernel's boot id, else the host name) and the cores
    it may run on: ranks with equal keys compete for the same cores."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            machine = f.read().strip()
    except OSError:
        machine = socket.gethostname()
    return machine, tuple(sorted(os.sched_getaffinity(0)))


def host_ranks(group: Optional[dist.ProcessGroup] = None) -> List[int]:
    """The ranks of ``group`` that run on this machine with the same cores as this
    rank (one all-gather; every rank of ``group`` must call it).

    Args:
        group: the process group (default: the default group). Without an
            initialized process group, this process alone.

    Returns:
        Their ranks in ``group``, ascending; this rank included.
    """
    if not dist.is_available() or not dist.is_initialized():
        return [0]
    keys: List = [None] * dist.get_world_size(group)
    mine = _host_key()
    dist.all_gather_object(keys, mine, group=group)
    return [rank for rank, key in enumerate(keys) if key == mine]


def threads_per_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    """Intra-op threads for this rank: the cores it may run on divided among the
    ranks of ``group`` that share them (``host_ranks``), at least 1.

    ``LOCAL_WORLD_SIZE`` is not used: with several agents on one machine it counts
    one agent's ranks, and every agent's ranks would take all the cores.

    Args:
        group: the process group (default: the default group); collective.

    Example::

        dist.init_process_group("gloo")
        torch.set_num_threads(threads_per_rank())
    """
    return max(1, len(os.sched_getaffinity(0)) // len(host_ranks(group)))
