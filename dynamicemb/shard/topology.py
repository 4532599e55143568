"""Which ranks share this machine's cores, and the threads each may use. TorchRec's nodes
(``LOCAL_WORLD_SIZE`` ranks) can differ from machines (several ``torchrun`` agents on one
host share its cores): thread counts follow the cores, sharding follows the nodes."""

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
    """The ranks of ``group`` (default: the default group) on this machine with this rank's
    cores, ascending, this rank included. One all-gather: every rank must call it; without a
    process group, ``[0]``."""
    if not dist.is_available() or not dist.is_initialized():
        return [0]
    keys: List = [None] * dist.get_world_size(group)
    mine = _host_key()
    dist.all_gather_object(keys, mine, group=group)
    return [rank for rank, key in enumerate(keys) if key == mine]


def threads_per_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    """Intra-op threads for this rank: its cores divided among the ``host_ranks`` of ``group``
    (a collective), at least 1. Not ``LOCAL_WORLD_SIZE``, which counts one agent's ranks only.

    Example::

        dist.init_process_group("gloo")
        torch.set_num_threads(threads_per_rank())
    """
    return max(1, len(os.sched_getaffinity(0)) // len(host_ranks(group)))
