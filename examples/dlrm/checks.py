"""The DLRM job's data checks: every rank reaches the same verdict, so a file the job
cannot use ends every rank with one clear message instead of a traceback or a hang.

A problem seen by one rank (its share of a file has no row, its reader failed) is
shared with the others through a collective, and each rank raises the same
:class:`~data.DataError`; ``train.py`` prints it and exits with status 1.
"""

import os
from typing import Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from data import DataError

__all__ = ["agree", "check_eval_labels", "check_files", "check_rows", "in_step"]


def _device() -> torch.device:
    """Where collectives' tensors live: the GPU for NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(problem: Optional[str]) -> Optional[str]:
    """Collective: the problem of the lowest rank that has one (None if none has), the
    same on every rank. Strings travel as bytes in tensors (nothing is unpickled)."""
    text = (problem or "").encode()
    longest = torch.tensor([len(text)], device=_device())
    dist.all_reduce(longest, op=dist.ReduceOp.MAX)
    if not int(longest):
        return None
    mine = torch.zeros(int(longest), dtype=torch.uint8)
    mine[:len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    mine = mine.to(_device())
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    found = (bytes(t.tolist()).rstrip(b"\0").decode() for t in every)
    return next(p for p in found if p)


def _file_problem(path: str) -> Optional[str]:
    if not os.path.exists(path):
        return f"{path}: no such file"
    if os.path.isdir(path):
        return f"{path}: is a directory, not a data file"
    if not os.access(path, os.R_OK):
        return f"{path}: cannot be read (permission denied)"
    if os.path.getsize(path) == 0:
        return f"{path}: the file is empty"
    return None


def check_files(paths: Sequence[str], option: str) -> None:
    """Collective: raises ``DataError`` on every rank if any rank finds one of ``paths``
    missing, a directory, unreadable or empty.

    Args:
        paths: the files given to ``option``.
        option: the command-line option, for the message (``--train-files``).
    """
    problem = next((p for p in map(_file_problem, paths) if p), None)
    problem = agree(None if problem is None else f"{option} {problem}")
    if problem:
        raise DataError(problem)


def check_rows(data: Iterable, what: str) -> None:
    """Collective: raises ``DataError`` on every rank unless every rank's share of
    ``data`` holds a usable row. Reads one batch per rank (a file whose rows are all
    malformed is read to its end).

    Args:
        data: a reader or synthetic data set (a fresh pass is started and stopped).
        what: the data, for the message (``--train-files day_0.tsv``).
    """
    source, first = iter(data), None
    try:
        first = next(source, None)
    except DataError as error:
        problem = f"{what}: {error}"
    else:
        problem = None
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()  # stops a reader's thread
    # [ranks with a row, malformed rows skipped], summed over ranks
    counts = torch.tensor([0 if first is None or problem else 1, getattr(data, "malformed", 0)],
                          dtype=torch.int64, device=_device())
    dist.all_reduce(counts)
    ranks_with_rows, skipped = (int(c) for c in counts)
    world = dist.get_world_size()
    example = agree(getattr(data, "first_problem", None))  # collective: every rank calls it
    if problem is None and ranks_with_rows == 0:
        problem = f"{what}: no usable row" + (
            f": all {skipped} rows are malformed (the first: {example})" if skipped else ": no row at all")
    elif problem is None and ranks_with_rows < world:
        problem = (f"{what}: fewer usable rows than ranks: {world - ranks_with_rows} of "
                   f"{world} ranks get none (each rank needs at least one)")
    problem = agree(problem)
    if problem:
        raise DataError(problem)


def check_eval_labels(positives: int, total: int, what: str) -> None:
    """Collective: raises ``DataError`` on every rank if the eval rows of all ranks
    (``positives`` of ``total`` on this rank) hold one class only (AUC is undefined)."""
    counts = torch.tensor([positives, total], dtype=torch.int64, device=_device())
    dist.all_reduce(counts)
    positives, total = (int(c) for c in counts)
    if positives in (0, total):
        label = 1 if positives else 0
        raise DataError(f"{what}: all {total} eval rows have label {label}; the AUC needs "
                        f"both classes and is undefined")


def in_step(batches: Iterable, what: str) -> Iterator:
    """The batches while every rank still has one (ranks may hold different counts:
    a reader skips malformed lines per rank), so no rank waits alone in a collective.
    A reader error on any rank raises the same ``DataError`` on every rank.

    Args:
        batches: this rank's batches.
        what: the data, for the message.
    """
    source = iter(batches)
    while True:
        problem = None
        try:
            batch = next(source, None)
        except DataError as error:
            batch, problem = None, f"{what}: {error}"
        # [no batch here, a failure here], the maximum over ranks
        state = torch.tensor([batch is None, problem is not None], dtype=torch.int64, device=_device())
        dist.all_reduce(state, op=dist.ReduceOp.MAX)
        if int(state[1]):
            raise DataError(agree(problem))
        if int(state[0]):
            return
        yield batch
