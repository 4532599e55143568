"""Rank bodies of the DLRM job's data-error tests (spawned; importable, no pytest here).

Each check asserts that every rank raises the same ``DataError`` (never a hang: the
ranks agree through collectives) and that the message names the data and the reason.
"""

import os
import sys
from typing import Callable, List, Tuple

import torch
import torch.distributed as dist

from dynamicemb_testing.scripts import ROOT


def _job():
    """``examples/dlrm``'s ``checks``, ``data`` and ``train`` modules (generic names:
    only ever on a spawned rank's path)."""
    folder = os.path.join(ROOT, "examples", "dlrm")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import checks  # noqa: PLC0415
    import data  # noqa: PLC0415
    import train  # noqa: PLC0415

    return checks, data, train


def _same_error_everywhere(call: Callable, error_type, *needles: str) -> str:
    """Runs ``call`` (collective) and asserts it raised ``error_type`` with the same
    message on every rank, containing each of ``needles``."""
    try:
        call()
    except error_type as error:
        message = str(error)
    else:
        raise AssertionError(f"rank {dist.get_rank()}: no {error_type.__name__} raised")
    every: List[str] = [None] * dist.get_world_size()
    dist.all_gather_object(every, message)
    assert len(set(every)) == 1, every
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def data_errors(rank: int, world_size: int, cases: List[Tuple[List[str], List[str]]]) -> None:
    """``cases``: (train.py arguments, substrings of the message); ``datasets`` raises
    the same ``DataError`` on every rank for each. Then ``reader_failure_on_one_rank``."""
    _, data, train = _job()
    assert train.parse_args([]).pg_timeout == 300  # seconds, documented in README
    for argv, needles in cases:
        args = train.parse_args(argv)
        _same_error_everywhere(lambda: train.datasets(args, rank, world_size), data.DataError, *needles)
    reader_failure_on_one_rank(rank, world_size)


def reader_failure_on_one_rank(rank: int, world_size: int) -> None:
    """A reader that fails on the last rank mid-pass stops every rank with its error;
    a one-class eval set is refused on every rank."""
    checks, data, _ = _job()

    def batches():
        for step in range(4):
            if rank == world_size - 1 and step == 2:
                raise data.DataError("error reading day_9.tsv: CRC check failed")
            yield torch.full((2,), step)

    seen = []

    def consume():
        for batch in checks.in_step(batches(), "--train-files day_9.tsv"):
            seen.append(int(batch[0]))

    _same_error_everywhere(consume, data.DataError, "--train-files day_9.tsv", "CRC check failed")
    assert seen == [0, 1], seen  # every rank stopped at the same step
    positives = 0  # no rank holds a label-1 row
    _same_error_everywhere(lambda: checks.check_eval_labels(positives, 5 + rank, "--eval-files e.tsv"),
                           data.DataError, "--eval-files e.tsv", "all 11 eval rows have label 0",
                           "undefined")
    checks.check_eval_labels(rank, 5, "--eval-files e.tsv")  # rank 1 holds a positive: fine
