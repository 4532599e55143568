"""Dump and load throughput of a dynamic table checkpoint (rows/s and MB/s on disk).

Fills one table of ``--rows`` rows (dim ``--dim``, optimizer states of
``--optimizer``) before timing, dumps it with ``DynamicEmbDump`` (flush, chunked
writes, CRC-32, fsync, atomic switch) and loads it back with ``DynamicEmbLoad``
(verification of every file, then clear and chunked import) into the same module.

    python benchmark/benchmark_checkpoint.py                      # 4M rows, dim 128, Adam
    python benchmark/benchmark_checkpoint.py --rows 100000 --dim 16
"""

import argparse
import json
import os
import platform
import shutil
import tempfile
import time

import torch

from dynamicemb import (BatchedDynamicEmbeddingTables, DynamicEmbDump, DynamicEmbLoad,
                        DynamicEmbOptimType, DynamicEmbTableOptions)
from dynamicemb.checkpoint import current_version


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--optimizer", default="adam", choices=[o.value for o in DynamicEmbOptimType])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    return parser.parse_args()


def filled_module(rows: int, dim: int, optimizer: str) -> BatchedDynamicEmbeddingTables:
    """One table holding ``rows`` random rows (capacity twice the rows: no evictions)."""
    capacity = 1 << (2 * rows - 1).bit_length()
    module = BatchedDynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=dim, max_capacity=capacity)], table_names=["t"],
        optimizer=DynamicEmbOptimType(optimizer))
    state_dim = module.optimizer_state_dim("t")
    g = torch.Generator().manual_seed(0)
    chunk = 1 << 18
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        keys = torch.arange(start, start + n, dtype=torch.int64) * 2654435761 + 12345
        module.import_keys_values("t", keys, torch.randn(n, dim, generator=g),
                                  torch.rand(n, state_dim, generator=g),
                                  scores=torch.arange(start, start + n))
    return module


def main():
    args = parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    module = filled_module(args.rows, args.dim, args.optimizer)
    assert module.table_size("t") == args.rows
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    path = os.path.join(root, "ck")
    try:
        start = time.perf_counter()
        version = DynamicEmbDump(path, module, allow_overwrite=True)
        dump_s = time.perf_counter() - start
        size = sum(os.path.getsize(os.path.join(version, f)) for f in os.listdir(version))
        start = time.perf_counter()
        DynamicEmbLoad(path, module)
        load_s = time.perf_counter() - start
        assert module.table_size("t") == args.rows and current_version(path) == version
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    result = {
        "rows": args.rows, "dim": args.dim, "optimizer": args.optimizer, "bytes": size,
        "dump_s": dump_s, "load_s": load_s,
        "dump_rows_per_s": args.rows / dump_s, "load_rows_per_s": args.rows / load_s,
        "dump_MB_per_s": size / dump_s / 1e6, "load_MB_per_s": size / load_s / 1e6,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
    print("| rows | dim | optimizer | MB | dump s | dump rows/s | dump MB/s | load s | load rows/s | load MB/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {args.rows} | {args.dim} | {args.optimizer} | {size / 1e6:.0f} | {dump_s:.2f} | "
          f"{result['dump_rows_per_s']:.3g} | {result['dump_MB_per_s']:.0f} | {load_s:.2f} | "
          f"{result['load_rows_per_s']:.3g} | {result['load_MB_per_s']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
