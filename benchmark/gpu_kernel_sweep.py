"""Launches every kernel of ``csrc/cuda`` at a tiny size, for compute-sanitizer.

``make gpu-check`` runs it under ``compute-sanitizer --tool memcheck`` with
``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` (PyTorch's caching allocator would otherwise
hide a small out-of-bounds access inside a larger cached block), and under
``racecheck`` and ``synccheck``. What it runs: training steps of every layout the
step covers (all rows on the device with Adam, per-sample weights and a table that
grows ahead of its steps; a device cache; a placement tier; rows in host memory
alone), a sequence (unpooled) lookup, a prefetch pipeline over a cache, an eval step,
and what no step launches (find, erase, expiry, an undone insert, a growth between an
insert's passes, the rows of unseen keys read).

It counts every launch by kernel name and exits 1 if a kernel of ``csrc/cuda``
(``dynamicemb.ops.cuda._KERNELS``) was not launched, so the selection covers every
kernel by construction; CI runs it with ``--emulated`` (the same calls on the CPU,
the CUDA path emulated), which checks that. Prints one JSON object: the launches
per kernel and the kernels missed; ``--out`` also writes it to a file.

Example::

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        --error-exitcode 1 python benchmark/gpu_kernel_sweep.py
"""

import argparse
import json
import os
import sys

import torch

from _accelerator import accelerator

from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbCheckMode, DynamicEmbOptimType,
                        DynamicEmbPoolingMode, DynamicEmbScoreStrategy, DynamicEmbTableOptions,
                        ScoredHashTable)
from dynamicemb.ops.cuda import _KERNELS


def batch(gen: torch.Generator, num_bags: int, bag: int, pool: int, device):
    """(ids, offsets) of ``num_bags`` bags of ``bag`` ids from [0, pool), every other id
    the same (a row hot enough to be summed in pieces)."""
    ids = torch.randint(0, pool, (num_bags * bag,), generator=gen)
    ids[::2] = 7
    return ids.to(device), torch.arange(0, num_bags * bag + 1, bag).to(device)


def module(device, dim: int, capacity: int, optimizer=DynamicEmbOptimType.EXACT_SGD,
           pooling=DynamicEmbPoolingMode.SUM, **options) -> BatchedDynamicEmbeddingTables:
    return BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=dim, max_capacity=capacity, **options)],
        pooling_mode=pooling, optimizer=optimizer, learning_rate=0.1, device=device)


def train_steps(m, gen, steps: int, num_bags: int, bag: int, pool: int, device,
                weighted: bool = False) -> None:
    for _ in range(steps):
        ids, offsets = batch(gen, num_bags, bag, pool, device)
        weights = None
        if weighted:  # weights that want a gradient
            weights = torch.rand(ids.numel(), generator=gen).to(device).requires_grad_()
        m(ids, offsets, weights).sum().backward()


def sweep(device) -> None:
    """The calls that launch every kernel (see the module docstring)."""
    gen = torch.Generator().manual_seed(0)
    # Adam, per-sample weights, a table that grows (ahead of a step)
    grows = module(device, 16, 1 << 13, DynamicEmbOptimType.ADAM, init_capacity=256)
    train_steps(grows, gen, 2, 256, 4, 3000, device, weighted=True)
    grows.read_rows(grows.table_names[0], torch.arange(10**6, 10**6 + 8, device=device))
    sgd_rows = 8 * 4
    # a device cache, a placement tier, rows in host memory alone (256 device rows)
    for options in (dict(caching=True, local_hbm_for_values=sgd_rows * 256),
                    dict(caching=False, local_hbm_for_values=sgd_rows * 256),
                    dict(caching=False, local_hbm_for_values=0)):
        m = module(device, 8, 1 << 12, init_capacity=1 << 12, **options)
        train_steps(m, gen, 2, 128, 4, 3000, device)
        m.eval()
        with torch.no_grad():  # an eval step: no insert, unseen ids
            m(*batch(gen, 64, 4, 6000, device))
    # a prefetch pipeline over a cache: forward(i), prefetch(i + 1), backward(i)
    cached = module(device, 8, 1 << 12, init_capacity=1 << 12, caching=True,
                    local_hbm_for_values=sgd_rows * 256)
    batches = [batch(gen, 64, 4, 3000, device) for _ in range(3)]
    cached.prefetch(*batches[0])
    for i, (ids, offsets) in enumerate(batches):
        out = cached(ids, offsets)
        if i + 1 < len(batches):
            cached.prefetch(*batches[i + 1])
        out.sum().backward()
    sequence = module(device, 8, 1024, pooling=DynamicEmbPoolingMode.NONE)
    train_steps(sequence, gen, 1, 16, 2, 100, device)
    # the table verbs no step launches
    table = ScoredHashTable(capacity=256, bucket_capacity=16, value_dim=4, ttl=2, device=device)
    keys = torch.arange(100, device=device)
    table.find_or_insert(keys)
    table.find(keys)
    table.erase(keys[:10])
    for _ in range(4):
        table.find_or_insert(keys[50:60])
    table.expire()
    # one bucket of 16 slots for 40 keys: the insert grows between its passes
    ScoredHashTable(capacity=16, bucket_capacity=16, max_capacity=256,
                    device=device).find_or_insert(torch.arange(40, device=device))
    full = ScoredHashTable(capacity=16, bucket_capacity=16, device=device,
                           score_strategy=DynamicEmbScoreStrategy.NO_EVICTION,
                           check_mode=DynamicEmbCheckMode.ERROR)
    try:
        full.find_or_insert(torch.arange(40, device=device))
    except RuntimeError as e:  # a full table in ERROR mode undoes the call
        if "undone" not in str(e):
            raise
    else:
        raise AssertionError("a full table in ERROR mode took 40 keys into 16 slots")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--emulated", action="store_true",
                        help="on the CPU: the CUDA path emulated (checks the coverage)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    with accelerator(args.emulated) as acc:
        launches = acc.count_launches()
        sweep(acc.device)
        acc.synchronize()
        result = {"device": acc.name(), "launches": dict(sorted(launches.items())),
                  "not_launched": sorted(set(_KERNELS) - set(launches))}
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 1 if result["not_launched"] else 0


if __name__ == "__main__":
    sys.exit(main())
