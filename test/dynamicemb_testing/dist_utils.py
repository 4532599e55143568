"""Runs a function on N gloo ranks (CPU) in spawned processes.

Each rank leaves through a normal interpreter exit, so an abort at exit fails the
test; ``dynamicemb``'s exit hook (``dynamicemb/clean_exit.py``) is what keeps that exit
clean.

A spawn costs 5-15 s on 2 cores, nearly all of it each rank importing torch, TorchRec
and dynamicemb; ``SharedSpawns`` runs several tests' rank bodies one after another in
one spawn and lets each test check its own.
"""

import os
import re
import socket
import traceback
from typing import Callable, List, Optional, Sequence, Tuple

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


# A named rank body for SharedSpawns.run: (name, fn, args); fn(rank, world_size, *args).
Case = Tuple[str, Callable, tuple]


def _run_cases(rank: int, world_size: int, folder: str, cases: List[Case]) -> None:
    """Runs the cases in order; marks each one passed or failed on this rank. A failure
    ends the rank as ``run_distributed`` ends it (the launch then stops every rank)."""
    for name, fn, args in cases:
        try:
            fn(rank, world_size, *args)
        except BaseException:
            with open(os.path.join(folder, f"{name}.{rank}.failed"), "w") as f:
                f.write(traceback.format_exc())
            raise
        open(os.path.join(folder, f"{name}.{rank}.passed"), "w").close()


class SharedSpawns:
    """Rank bodies of several tests ("cases") run one after another in shared spawns.

    A module-scoped fixture calls ``run`` for each spawn; each test then calls
    ``check`` on its own cases. A case passes when every rank finished it; a case that
    fails fails its test with the rank's traceback, and every case after it in that
    spawn fails its test as not run (the failure ends the launch, as it ends
    ``run_distributed``).

    Args:
        directory: an empty folder for the per-case, per-rank outcome files.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._cases = {}  # name -> (world size, launch folder, launch index)
        self._launch_errors: List[Optional[str]] = []

    def run(self, world_size: int, cases: Sequence[Case]) -> None:
        """Runs ``cases`` in order on ``world_size`` ranks in one spawn; a rank failing
        is recorded for ``check``, not raised."""
        launch = len(self._launch_errors)
        folder = os.path.join(self.directory, f"launch{launch}")
        os.makedirs(folder)
        for name, _, _ in cases:
            assert re.fullmatch(r"[\w.-]+", name) and name not in self._cases, name
            self._cases[name] = (world_size, folder, launch)
        try:
            run_distributed(_run_cases, world_size, folder, list(cases))
            self._launch_errors.append(None)
        except Exception as err:  # noqa: BLE001  (reported by check, per case)
            self._launch_errors.append(f"{type(err).__name__}: {err}")

    def check(self, name: str) -> None:
        """Raises ``AssertionError`` unless every rank finished case ``name``."""
        assert name in self._cases, f"no case {name!r} was run"
        world_size, folder, launch = self._cases[name]
        failures = []  # every failed rank's traceback: a rank whose peer failed fails too
        for rank in range(world_size):
            failed = os.path.join(folder, f"{name}.{rank}.failed")
            if os.path.exists(failed):
                with open(failed) as f:
                    failures.append(f"case {name} failed on rank {rank}:\n{f.read()}")
        assert not failures, "\n".join(failures)
        unfinished = [r for r in range(world_size)
                      if not os.path.exists(os.path.join(folder, f"{name}.{r}.passed"))]
        assert not unfinished, (f"case {name} did not finish on ranks {unfinished}; the launch "
                                f"ended with: {self._launch_errors[launch]}")
