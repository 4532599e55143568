"""Plan generators: HugeCTR's two notebook strategies and DLRM's greedy placement.

Lookup ``i`` is table ``i`` in all of them."""

import math
from typing import List, Sequence

from dynamicemb.plan.format import PlanFile, PlanGroup, Strategy

__all__ = ["distributed", "dp_and_localized", "greedy"]


def _check_sizes(sizes: Sequence[int], what: str) -> List[int]:
    sizes = list(sizes)
    if not sizes:
        raise ValueError(f"no tables: {what} is empty")
    for table, size in enumerate(sizes):
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"table {table}: {what} must be a positive integer, got {size!r}")
    return sizes


def _check_positive(value: int, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def dp_and_localized(table_sizes: Sequence[int], num_gpus: int, dp_threshold: int = 6000) -> PlanFile:
    """Small tables data parallel, the others whole on one GPU each, round-robin.

    HugeCTR's "data parallel + localized" strategy: the ``i``-th table of more than
    ``dp_threshold`` rows goes to GPU ``i % num_gpus`` in an ``mp`` group; the others form a
    ``dp`` group. Every GPU gets groups ``[mp, dp]``, even when one is empty. ``ValueError`` on
    a non-positive size or GPU count, or a negative threshold.

    Example::

        plan = dp_and_localized([203931, 4, 18598], num_gpus=2)
        plan.groups(0)  # (PlanGroup("mp", (0,)), PlanGroup("dp", (1,)))
    """
    sizes = _check_sizes(table_sizes, "table size")
    _check_positive(num_gpus, "num_gpus")
    if not isinstance(dp_threshold, (int, float)) or isinstance(dp_threshold, bool) or dp_threshold < 0:
        raise ValueError(f"dp_threshold must be a non-negative number, got {dp_threshold!r}")
    model_parallel = [table for table, size in enumerate(sizes) if size > dp_threshold]
    data_parallel = tuple(table for table, size in enumerate(sizes) if size <= dp_threshold)
    gpus = []
    for gpu in range(num_gpus):
        mine = tuple(table for i, table in enumerate(model_parallel) if i % num_gpus == gpu)
        gpus.append((PlanGroup(Strategy.MP.value, mine), PlanGroup(Strategy.DP.value, data_parallel)))
    return PlanFile(tuple(gpus))


def distributed(table_sizes: Sequence[int], num_gpus: int) -> PlanFile:
    """Every table row-wise over all GPUs, GPU ``g`` holding shard ``g`` (HugeCTR's
    "distributed" strategy: one ``mp`` group of ``num_gpus`` shards; with one GPU, unsharded).
    Only the number of ``table_sizes`` matters. ``ValueError`` on a non-positive size or count."""
    sizes = _check_sizes(table_sizes, "table size")
    _check_positive(num_gpus, "num_gpus")
    tables = tuple(range(len(sizes)))
    return PlanFile(tuple((PlanGroup(Strategy.MP.value, tables, gpu, num_gpus),) for gpu in range(num_gpus)))


def greedy(table_bytes: Sequence[int], num_gpus: int, memory_per_gpu: int) -> PlanFile:
    """Whole tables to GPUs, largest first, each to the GPU with the most free memory.

    NVIDIA DLRM's heuristic on ``table_bytes`` and ``memory_per_gpu`` (bytes): at most
    ``ceil(T / num_gpus)`` tables per GPU (a balanced all-to-all), ties to the lowest GPU; unlike
    DLRM, GPU 0 is not kept free for the bottom MLP. One ``mp`` group, each GPU listing its
    tables in ascending order. ``ValueError`` names a table that fits on no GPU, or a
    non-positive size, GPU count or memory.

    Example::

        greedy([50, 40, 30, 20, 10], num_gpus=2, memory_per_gpu=100)
        # GPU 0: tables 0, 3, 4; GPU 1: tables 1, 2
    """
    sizes = _check_sizes(table_bytes, "table bytes")
    _check_positive(num_gpus, "num_gpus")
    _check_positive(memory_per_gpu, "memory_per_gpu")
    max_tables = math.ceil(len(sizes) / num_gpus)
    free = [memory_per_gpu] * num_gpus
    placed: List[List[int]] = [[] for _ in range(num_gpus)]
    for table in sorted(range(len(sizes)), key=lambda t: (-sizes[t], t)):
        # ceil(T / G) * G >= T keeps at least one GPU open.
        open_gpus = [gpu for gpu in range(num_gpus) if len(placed[gpu]) < max_tables]
        gpu = max(open_gpus, key=lambda g: (free[g], -g))
        if sizes[table] > free[gpu]:
            raise ValueError(
                f"table {table} ({sizes[table]} bytes) fits on no GPU: the one with the most free "
                f"memory that may take another table, GPU {gpu}, has {free[gpu]} of "
                f"{memory_per_gpu} bytes free")
        free[gpu] -= sizes[table]
        placed[gpu].append(table)
    return PlanFile(tuple((PlanGroup(Strategy.MP.value, tuple(sorted(tables))),) for tables in placed))
