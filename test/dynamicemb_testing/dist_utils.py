"""Runs a function on N gloo ranks (CPU) in spawned processes.

Each rank leaves through a normal interpreter exit, so an abort at exit fails the
test; ``dynamicemb``'s exit hook (``dynamicemb/clean_exit.py``) is what keeps that exit
clean.
"""

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    except BaseException:
        traceback.print_exc()
        dist.destroy_process_group()
        raise  # mp.spawn reports it
    dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args) -> None:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; ``fn`` must live in
    an importable module. Raises if any rank fails."""
    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)


def fail_on_rank(rank: int, world_size: int, failing_rank: int) -> None:
    """A rank body that fails on ``failing_rank`` after a collective (for the helper's test)."""
    dist.barrier()
    if rank == failing_rank:
        raise AssertionError(f"rank {rank} fails on purpose")
