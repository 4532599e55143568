"""Cost of a placement file on the routing path: ``owner_rank`` with and without a
table's placement (a binary search in its sorted ids), per batch of keys.

    PYTHONPATH=. python benchmark/benchmark_placement.py

Prints a Markdown table: microseconds per call (median of ``--repeats``) for batches
of ``--keys`` power-law keys against placements of ``--placed`` ids, half of the keys
placed.
"""

import argparse
import os
import statistics
import tempfile
import time

import torch

from dynamicemb.placement import owner_rank, table_placement, write_placement


def _median_us(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", default="8192,65536,1048576", help="keys per call")
    p.add_argument("--placed", default="10000,100000,1000000", help="ids the placement lists")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args(argv)
    g = torch.Generator().manual_seed(0)
    print("| placed ids | keys per call | hash only (us) | with placement (us) | extra (us) | ns per key |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for placed in map(int, args.placed.split(",")):
            path = os.path.join(tmp, f"p{placed}.npz")
            ids = torch.randperm(4 * placed, generator=g)[:placed] * 7919  # sparse int64 ids
            write_placement(path, args.world_size, {"t": (ids, torch.randint(
                0, args.world_size, (placed,), generator=g))})
            placement = table_placement(path, "t", args.world_size)
            universe = torch.cat([ids, ids + 1])  # half placed, half not
            for n in map(int, args.keys.split(",")):
                # power law over the universe: small ranks are hot
                rank = (torch.rand(n, generator=g) ** 3 * universe.numel()).long()
                keys = universe[rank]
                plain = _median_us(lambda: owner_rank(keys, args.world_size), args.repeats)
                placed_us = _median_us(lambda: owner_rank(keys, args.world_size, "hash", placement),
                                       args.repeats)
                print(f"| {placed:,} | {n:,} | {plain:,.0f} | {placed_us:,.0f} | "
                      f"{placed_us - plain:,.0f} | {(placed_us - plain) * 1e3 / n:.1f} |")


if __name__ == "__main__":
    main()
